"""A model's chat template, rendered the way transformers renders it (and so vLLM, which calls it).

The template is untrusted Jinja from a model's `tokenizer_config.json`: it runs in Jinja's
immutable sandbox with the environment transformers gives it (trim_blocks, lstrip_blocks,
`loopcontrols`, a `{% generation %}` tag, `raise_exception`, `strftime_now`, a `tojson` that does
not HTML-escape, and a `namespace` that refuses underscore names), the tokenizer's named special
tokens (`bos_token`, `eos_token`, ...) as variables, and messages as plain JSON data with `None`
values dropped. Same inputs, same text: tests/unit/test_tokenizer_fidelity.py holds it to that.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

# The names a message's reasoning may come under; templates read the first, gpt-oss's `thinking`.
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
# What render passes itself: a request's template kwargs cannot replace them.
_RESERVED = frozenset({"messages", "tools", "documents", "add_generation_prompt"})
# The named special tokens a template sees, as transformers passes them.
SPECIAL_TOKEN_NAMES = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)


class ChatTemplateError(ValueError):
    """A template that does not compile, or that refused the conversation (`raise_exception`)."""


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}` (assistant-mask templates): renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        call = self.call_method("_body")
        return jinja2.nodes.CallBlock(call, [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return str(caller())


class _Namespace(jinja2.utils.Namespace):
    """Jinja's `namespace`, refusing underscore-prefixed names (no reach into internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)


def _check_name(name: object) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} is not allowed")


class _DictFactory:
    """`dict(...)` inside a template, without exposing the type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    # Local wall time, as transformers gives templates (Llama 3's "Today Date").
    return datetime.now().strftime(fmt)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _DictFactory()
    env.globals["namespace"] = _Namespace
    return env


def select_template(value: str | Sequence[Mapping[str, str]], *, tools: bool) -> str:
    """The template to use from a `chat_template` value: a string, or named templates (`default`,
    and `tool_use` for requests with tools)."""
    if isinstance(value, str):
        return value
    named = {str(t.get("name")): str(t.get("template")) for t in value}
    if tools and "tool_use" in named:
        return named["tool_use"]
    if "default" in named:
        return named["default"]
    raise ChatTemplateError(f"no default among the named chat templates {sorted(named)}")


def _plain(value: Any) -> Any:
    """JSON data only (a request body's), so the sandbox sees no foreign methods."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return str(value)


def _message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A message as templates expect it: no `None` values, reasoning under each of its names."""
    plain = {k: _plain(v) for k, v in message.items() if v is not None}
    reasoning = next((plain[k] for k in _REASONING_FIELDS if plain.get(k) is not None), None)
    if reasoning is not None:
        plain = {"thinking": reasoning, **plain, "reasoning_content": reasoning}
    return plain


class ChatTemplate:
    """One compiled template and the special tokens it is rendered with."""

    def __init__(self, source: str, special_tokens: Mapping[str, str]) -> None:
        try:
            self._template = _environment().from_string(source)
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template does not compile: {exc}") from None
        self.source = source
        self._special = dict(special_tokens)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        documents: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> str:
        """The prompt text for a conversation; `template_kwargs` are a request's
        `chat_template_kwargs` (they override the special tokens, as in transformers)."""
        extra = {k: v for k, v in (template_kwargs or {}).items() if k not in _RESERVED}
        variables = {**self._special, **_plain(extra)}
        try:
            return self._template.render(
                messages=[_message(m) for m in messages],
                tools=_plain(tools),
                documents=_plain(documents),
                add_generation_prompt=add_generation_prompt,
                **variables,
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"the chat template refused the conversation: {exc}") from None
