"""The base of pdkv's pydantic schemas and the one way their errors are worded.

`StrictModel` is what every schema that crosses a process boundary (the
deploy YAML, the router <-> worker messages) derives from:
- unknown keys are refused (they are almost always typos or a peer of
  another version);
- types are strict: `1` is not a bool, `True` is not an int, `"3"` is not a
  number (an int is still a float); enums and literals accept their values;
- instances are frozen.

`describe(error)` turns a `ValidationError` into one line per problem that
names the field by its dotted path (`router.port: ...`,
`sampling.ignore_eos: ...`), so a bad value is found without reading a
traceback.
"""
from __future__ import annotations


from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic_core import ErrorDetails

_EXPECTED = {
    "int_type": "int", "int_from_float": "int", "int_parsing": "int", "float_type": "float",
    "float_parsing": "float", "bool_type": "bool", "bool_parsing": "bool", "string_type": "str",
    "dict_type": "mapping", "model_type": "mapping", "model_attributes_type": "mapping",
    "list_type": "list", "tuple_type": "list",
}


class StrictModel(BaseModel):
    """Frozen, strict, closed (extra keys refused)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, validate_default=True)


class FieldError(ValueError):
    """Raised by a model validator to blame one field of that model (not the model as a whole)."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def describe(error: ValidationError, root: type[BaseModel] | None = None, where: str = "body") -> str:
    """One `path: problem` line per error, unknown keys grouped per mapping (with the known
    ones listed when `root`, the validated model class, is given)."""
    lines: list[str] = []
    unknown: dict[tuple, list[str]] = {}
    for err in error.errors(include_url=False):
        loc = tuple(err["loc"])
        if err["type"] == "extra_forbidden":
            unknown.setdefault(loc[:-1], []).append(str(loc[-1]))
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
        lines.append(f"{_path(loc, where)}: unknown key(s) {sorted(keys)}{hint}")
    return "; ".join(lines)


def _path(loc: tuple, where: str) -> str:
    return ".".join(str(part) for part in loc) or where


def _message(err: ErrorDetails) -> str:
    kind, value = err["type"], err.get("input")
    if kind in ("enum", "literal_error"):
        return f"must be one of {err['ctx']['expected']}, got {value!r}"
    if kind in _EXPECTED:
        return f"expected {_EXPECTED[kind]}, got {type(value).__name__} {value!r:.60}"
    if kind == "value_error":
        return str(err["ctx"]["error"]) if "ctx" in err else err["msg"]
    if kind == "missing":
        return "is required"
    message = err["msg"]
    message = message[0].lower() + message[1:] if message else message
    return f"{message}, got {value!r:.60}" if "input" in err and not isinstance(value, dict) else message


def _known_keys(root: type[BaseModel] | None, loc: tuple) -> list[str] | None:
    """The field names of the model found at `loc` below `root` (None if it is not a model)."""
    model = root
    for part in loc:
        field = model.model_fields.get(str(part)) if model is not None else None
        annotation = field.annotation if field is not None else None
        model = annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None
    return sorted(model.model_fields) if model is not None else None
