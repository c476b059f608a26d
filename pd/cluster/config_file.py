"""Reading a deploy YAML file into plain data, with bounded cost whatever the file holds.

Guarantees (each refusal is a `ConfigFileError` of one line that names the file):
- a file larger than `MAX_FILE_BYTES` is refused before a byte of it is parsed;
- the text must be UTF-8 (a UTF-8 byte-order mark is allowed): UTF-16, Latin-1 or binary
  files are refused, naming the offset of the first bad byte;
- YAML aliases (`*name`) are refused: a deploy file has no need of them, and expanding them is
  how an "anchor bomb" turns a few hundred bytes into gigabytes (anchors alone are harmless);
- nesting deeper than `MAX_DEPTH` and integers longer than `MAX_INT_DIGITS` digits are refused
  while the file is composed (no recursion limit, no multi-thousand-digit number is ever built);
- a string longer than `MAX_STRING_CHARS` anywhere is refused, naming its key path;
- the top level must be a mapping (an empty file is the empty mapping: every default).
The values are then validated by `pd.cluster.config.DeployConfig`.
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from yaml.composer import ComposerError
from yaml.constructor import ConstructorError

MAX_FILE_BYTES = 1 << 20  # 1 MiB: the largest deploy file shipped is about 3 KB
MAX_DEPTH = 32  # the deepest config path is 4 levels
MAX_INT_DIGITS = 40  # a uint128 has 39 digits; no setting needs more
MAX_STRING_CHARS = 8192  # a model path, a fault plan, a key: far below
_ERROR_CHARS = 300  # a parser's message, cut to one line of at most this


class ConfigFileError(ValueError):
    """The file cannot be read as a deploy config; the message is one line naming the file."""


def one_line(text: str, limit: int = _ERROR_CHARS) -> str:
    """`text` with every run of whitespace made one space, cut to `limit` characters."""
    flat = re.sub(r"\s+", " ", text[: limit * 4]).strip()
    return flat if len(flat) <= limit else flat[: limit - 3] + "..."


class _BoundedLoader(yaml.SafeLoader):
    """A SafeLoader that refuses aliases, deep nesting and huge integers while composing."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._depth = 0

    def compose_node(self, parent, index):  # type: ignore[no-untyped-def]
        if self.check_event(yaml.AliasEvent):
            event = self.peek_event()
            raise ComposerError(None, None, f"alias *{event.anchor[:40]} refused: a deploy file takes no YAML "
                                "aliases (write the value out)", event.start_mark)
        self._depth += 1
        try:
            if self._depth > MAX_DEPTH:
                raise ComposerError(None, None, f"nested deeper than {MAX_DEPTH} levels", self.peek_event().start_mark)
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_yaml_int(self, node):  # type: ignore[no-untyped-def]
        digits = sum(ch.isdigit() for ch in node.value)
        if digits > MAX_INT_DIGITS:
            raise ConstructorError(None, None, f"an integer of {digits} digits (at most {MAX_INT_DIGITS})",
                                   node.start_mark)
        return super().construct_yaml_int(node)


_BoundedLoader.add_constructor("tag:yaml.org,2002:int", _BoundedLoader.construct_yaml_int)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The mapping a deploy file holds; raises ConfigFileError (see the module docstring)."""
    path = Path(path)
    where = _clip_path(path)
    if not path.exists():
        raise ConfigFileError(f"config file {where} not found")
    if not path.is_file():
        raise ConfigFileError(f"config file {where} is not a regular file")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigFileError(f"config file {where}: cannot be read: {one_line(exc.strerror or str(exc))}") from None
    if len(raw) > MAX_FILE_BYTES:
        raise ConfigFileError(f"{where}: larger than {MAX_FILE_BYTES // 1024} KiB: not a deploy config")
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise ConfigFileError(f"{where}: not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
                              "save the file as UTF-8") from None
    data = parse_config_text(text, where)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{where}: config: must be a mapping of sections, got {_kind(data)}")
    return data


def parse_config_text(text: str, where: str = "config") -> Any:
    """The YAML value of `text` under the bounds above; raises ConfigFileError."""
    loader = None
    try:
        loader = _BoundedLoader(text)  # (its reader already refuses non-printable characters)
        loader.name = where  # (the parser's marks say "in <file>, line L, column C")
        data = loader.get_single_data()
    except yaml.YAMLError as exc:
        raise ConfigFileError(f"{where}: not valid YAML: {one_line(str(exc))}") from None
    except (RecursionError, MemoryError, ValueError, OverflowError) as exc:  # belt and braces: a parser limit
        raise ConfigFileError(f"{where}: cannot be parsed: {type(exc).__name__}: {one_line(str(exc))}") from None
    finally:
        if loader is not None:
            loader.dispose()
    long_string = _first_long_string(data, ())
    if long_string is not None:
        raise ConfigFileError(f"{where}: {long_string}")
    return data


def _first_long_string(value: Any, path: tuple) -> str | None:
    """Where a string (key or value) longer than MAX_STRING_CHARS is, or None."""
    if isinstance(value, str):
        return None if len(value) <= MAX_STRING_CHARS else \
            f"{_dotted(path)}: a string of {len(value)} characters (at most {MAX_STRING_CHARS})"
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(key, str) and len(key) > MAX_STRING_CHARS:
                return f"{_dotted(path) or 'config'}: a key of {len(key)} characters (at most {MAX_STRING_CHARS})"
            found = _first_long_string(item, path + (key,))
            if found:
                return found
    if isinstance(value, list):
        for index, item in enumerate(value):
            found = _first_long_string(item, path + (index,))
            if found:
                return found
    return None


def _dotted(path: tuple) -> str:
    return ".".join(str(part)[:64] for part in path)


def _kind(value: Any) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)} items"
    return f"{type(value).__name__} {str(value)[:40]!r}" if isinstance(value, (str, bool, int, float)) \
        else type(value).__name__


def _clip_path(path: Path) -> str:
    text = str(path)
    return text if len(text) <= 200 else text[:200] + "..."
