"""Chat templates: a checkpoint's Jinja template turned into the prompt text.

`ChatTemplate` compiles the template once (a syntax error is reported when the
checkpoint is loaded, not on the first request) in a sandboxed Jinja
environment set up the way Hugging Face checkpoints expect: `trim_blocks` and
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter that keeps
non-ASCII text as is, and the `raise_exception` and `strftime_now` helpers.
The special-token strings (`bos_token`, `eos_token`, ...) are template
variables.
"""
from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment


class ChatTemplateError(ValueError):
    """A chat template that does not compile, or that refuses the messages it is given."""


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; serving renders the body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _render_body(caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(f"the chat template refused the messages: {message}")


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationBlock, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def validate_messages(messages: Any) -> list[dict]:
    """Chat messages as the template sees them: a non-empty list of dicts, each with a string `role`."""
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)):
        raise ChatTemplateError("messages: expected a list of message objects")
    if not messages:
        raise ChatTemplateError("messages: must not be empty")
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, Mapping):
            raise ChatTemplateError(f"messages[{i}]: expected an object with 'role' and 'content'")
        if not isinstance(message.get("role"), str):
            raise ChatTemplateError(f"messages[{i}].role: expected a string")
        out.append(dict(message))
    return out


class ChatTemplate:
    """One compiled chat template.

    Guarantees: `render` is deterministic for given messages and variables
    (except templates that call `strftime_now`), never reads files or
    attributes outside the sandbox, and raises `ChatTemplateError` (a
    `ValueError`) for a template that rejects the messages.
    """

    def __init__(self, source: str, special_tokens: Mapping[str, str | None], origin: str = "chat template"):
        if not isinstance(source, str) or not source.strip():
            raise ChatTemplateError(f"{origin}: empty chat template")
        self.source = source
        self.origin = origin
        self._special_tokens = dict(special_tokens)
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(f"{origin}: chat template does not compile (line {exc.lineno}): "
                                    f"{exc.message}") from exc

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               **variables: Any) -> str:
        """The prompt text for `messages`; `variables` (e.g. `tools`) are passed to the template as is."""
        context = {**self._special_tokens, **variables}
        context.update(messages=validate_messages(messages), add_generation_prompt=bool(add_generation_prompt))
        try:
            return self._template.render(**context)
        except ChatTemplateError:
            raise
        except Exception as exc:  # a template error, or messages of a shape the template cannot handle
            raise ChatTemplateError(f"{self.origin}: rendering failed: {type(exc).__name__}: {exc}") from exc
