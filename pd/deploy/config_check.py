"""What `python -m pd.launch` checks before Ray starts: the config file, then the model it names.

`load_checked_config` is the one function the launcher (and `--check-config`) calls: it reads
and validates the file (`pd.cluster.config.load_deploy_config`, bounded in size, depth and
aliases), applies the command line's overrides, then checks the model:
- random weights: `model.architecture` was validated with the engine's own shape rules (heads
  divide the hidden size, kv heads divide the heads, sizes positive and bounded) and the byte
  tokenizer's vocabulary (`pd.cluster.architecture_config`);
- a checkpoint directory readable here: its config.json is read the way the workers read it
  (shape, supported architecture, vocabulary against its tokenizer);
- a `model.path` that does not exist is an error when the workers run on this machine (an
  embedded Ray), a warning when they run on a cluster (the path may exist only there).
A `.gguf` file is converted here (once, into the cache the workers then read) when the workers
run on this machine, so a full disk or a file pdkv cannot serve is one line here, not a Ray
traceback; with a cluster address it is only checked to exist.

Guarantee: every problem raises `ConfigError` whose text is one line of at most
`MAX_MESSAGE_CHARS` characters (`error_line` is what the CLI prints, exit status 2).
"""
from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from pd.cluster.config import MAX_MESSAGE_CHARS, ConfigError, DeployConfig, load_deploy_config
from pd.cluster.config_file import one_line
from pd.deploy.one_box import one_box_notice, usable_cores

logger = logging.getLogger(__name__)


def load_checked_config(path: str | Path, port: int | None = None, host: str | None = None,
                        workers_here: bool = True) -> DeployConfig:
    """The validated config of `path` with `router.port`/`router.host` overridden when given;
    raises ConfigError (one line) for the file, a value, or the model (see the module docstring)."""
    try:
        config = load_deploy_config(path)
        overrides = {k: v for k, v in (("router__port", port), ("router__host", host)) if v is not None}
        if overrides:
            config = config.replace(**overrides)
        check_model(config, workers_here)
    except ConfigError as exc:
        raise ConfigError(one_line(str(exc), MAX_MESSAGE_CHARS)) from None
    return config


def check_model(config: DeployConfig, workers_here: bool) -> None:
    """Raises ConfigError when the model the workers would build is refused (see the module docstring)."""
    from pd.engine.model.gguf import locate_model  # (the engine's public model-files entry; raises ModelFileError)
    from pd.engine.text.vocab import VocabularyMismatch

    named = config.model.path
    if named is None:
        # random weights: ArchitectureSection already holds the engine's shape rules and the byte
        # vocabulary rule (tests/cluster check it refuses what ModelConfig refuses), so no torch here
        return
    if named is not None:
        try:
            where = locate_model(named)
            exists = where.exists()
        except (OSError, ValueError) as exc:  # ModelFileError is a FileNotFoundError
            raise ConfigError(f"model.path: {_exc_text(exc)}") from None
        if not exists:
            if workers_here:
                raise ConfigError(f"model.path: {_short(named)}: no such file or directory")
            logger.warning("model.path %s does not exist here; the workers check it where they run", _short(named))
            return
        if where.is_file() and where.suffix.lower() == ".gguf" and not workers_here:
            return  # converted (once) where the workers run
    from pd.worker.wiring import check_model_vocabulary  # torch: imported only for a checkpoint read here

    try:
        check_model_vocabulary(config)
    except VocabularyMismatch as exc:
        raise ConfigError(_exc_text(exc)) from None
    except (ValueError, TypeError, OSError, RecursionError) as exc:  # a config.json / tokenizer the workers refuse
        raise ConfigError(f"model.path {_short(named)}: {_exc_text(exc)}") from None


def main(argv: list[str]) -> int:
    """`python -m pd.launch --config X --check-config` without importing Ray or torch (unless the config
    names a checkpoint directory to read): the launcher's own options are accepted and ignored."""
    parser = argparse.ArgumentParser(prog="python -m pd.launch", add_help=False)
    parser.add_argument("--config")
    parser.add_argument("--port", type=int, default=None)
    parser.add_argument("--host", default=None)
    parser.add_argument("--address", default=None)
    parser.add_argument("--log-level", default="WARNING")
    args, _ = parser.parse_known_args(argv)
    if not args.config:
        print("error: --check-config needs --config", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    workers_here = not (args.address or os.environ.get("RAY_ADDRESS"))
    try:
        config = load_checked_config(args.config, args.port, args.host, workers_here=workers_here)
    except ConfigError as exc:
        print(error_line(exc), file=sys.stderr)
        return 2
    notice = one_box_notice(config, usable_cores(), workers_here)
    if notice is not None:  # the line the launcher prints too
        print(notice, file=sys.stderr, flush=True)
    print(f"{args.config}: valid", flush=True)
    return 0


def error_line(exc: BaseException) -> str:
    """The one `error: ...` line the CLI prints for a config problem."""
    return "error: " + one_line(str(exc), MAX_MESSAGE_CHARS)


def _exc_text(exc: BaseException) -> str:
    return one_line(str(exc) or type(exc).__name__, 600)


def _short(path: str) -> str:
    return repr(path[:200] + ("..." if len(path) > 200 else ""))
