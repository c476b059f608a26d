"""The base of pdkv's pydantic schemas and the one way their errors are worded.

`StrictModel` is what every schema that crosses a process boundary (the
deploy YAML, the router <-> worker messages) derives from:
- unknown keys are refused (they are almost always typos or a peer of
  another version);
- types are strict: `1` is not a bool, `True` is not an int, `"3"` is not a
  number (an int is still a float); enums and literals accept their values;
- instances are frozen.

- floats are finite: `.inf` and `.nan` are refused (a timeout of `.inf` would
  otherwise pass here and fail every request later).

`describe(error)` turns a `ValidationError` into one line per problem that
names the field by its dotted path (`router.port: ...`,
`sampling.ignore_eos: ...`), so a bad value is found without reading a
traceback. Values and unknown keys are quoted through `clip`, which never
builds a text longer than it prints (a 1 MB key or a 5,000-digit integer
costs what its first characters cost).
"""
from __future__ import annotations


from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

_EXPECTED = {
    "int_type": "int", "int_from_float": "int", "int_parsing": "int", "float_type": "float",
    "float_parsing": "float", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str",
    "dict_type": "mapping", "model_type": "mapping", "model_attributes_type": "mapping",
    "list_type": "list", "tuple_type": "list",
}
CLIP_CHARS = 60  # a quoted value in a message
MAX_UNKNOWN_LISTED = 8  # unknown keys named per mapping (the rest are counted)
_BIG_INT_BITS = 256  # above this an integer is described by its size, not spelled out


def clip(value: Any, limit: int = CLIP_CHARS) -> str:
    """A repr of `value` at most about `limit` characters long, built without ever making a
    longer one: strings and bytes are cut before they are quoted, huge integers are described
    by their size, containers by their type and length (their first items when short)."""
    if isinstance(value, (str, bytes, bytearray)):
        text = repr(value[:limit])
        return text + f"... ({len(value)} {'chars' if isinstance(value, str) else 'bytes'})" \
            if len(value) > limit else text
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return repr(value)
    if isinstance(value, int):
        bits = abs(value).bit_length()
        return repr(value)[:limit] if bits <= _BIG_INT_BITS else f"<an integer of about {int(bits * 0.30103)} digits>"
    if isinstance(value, dict):
        if len(value) > 4 or limit < CLIP_CHARS:  # (nested: described, never walked)
            return f"<a mapping of {len(value)} keys>"
        return ("{" + ", ".join(f"{clip(k, 20)}: {clip(v, 20)}" for k, v in value.items()) + "}")[:limit * 2]
    if isinstance(value, (list, tuple, set, frozenset)):
        if len(value) > 4 or limit < CLIP_CHARS:
            return f"<a {type(value).__name__} of {len(value)} items>"
        return ("[" + ", ".join(clip(item, 20) for item in value) + "]")[:limit * 2]
    return f"<{type(value).__name__}>"


class StrictModel(BaseModel):
    """Frozen, strict, closed (extra keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True, allow_inf_nan=False)


class FieldError(ValueError):
    """Raised by a model validator to blame one field of that model (not the model as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def describe(error: ValidationError, root: type[BaseModel] | None = None, where: str = "body") -> str:
    """One `path: problem` line per error, unknown keys grouped per mapping (with the known
    ones listed when `root`, the validated model class, is given)."""
    lines: list[str] = []
    unknown: dict[tuple, list[Any]] = {}
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(loc[-1])
            continue
        cause = (err.get("ctx") or {}).get("error")
        if isinstance(cause, FieldError):
            loc += (cause.field,)
            message = str(cause)
        else:
            message = _message(err)
        lines.append(f"{_path(loc, where)}: {message}")
    for loc, keys in unknown.items():
        known = _known_keys(root, loc)
        hint = f"; known: {known}" if known else ""
        named = ", ".join(clip(key, 40) for key in sorted(keys, key=lambda k: clip(k, 40))[:MAX_UNKNOWN_LISTED])
        more = f" and {len(keys) - MAX_UNKNOWN_LISTED} more" if len(keys) > MAX_UNKNOWN_LISTED else ""
        lines.append(f"{_path(loc, where)}: unknown key(s) [{named}]{more}{hint}")
    return "; ".join(lines)


def _path(loc: tuple, where: str) -> str:
    return ".".join(part if isinstance(part, str) and len(part) <= 64 else clip(part, 40) for part in loc) \
        if loc else where


def _message(err: ErrorDetails) -> str:
    kind, value = err["type"], err.get("input")
    if kind in ("enum", "literal_error"):
        return f"must be one of {err['ctx']['expected']}, got {clip(value)}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {type(value).__name__} {clip(value)}"
    if kind == "value_error":
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "missing":
        return "is required"
    message = err["msg"]
    message = message[0].lower() + message[1:] if message else message
    return f"{message}, got {clip(value)}" if "input" in err and not isinstance(value, dict) else message


def _known_keys(root: type[BaseModel] | None, loc: tuple) -> list[str] | None:
    """The field names of the model found at `loc` below `root` (None if it is not a model)."""
    model = root
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(model.model_fields) if model is not None else None
