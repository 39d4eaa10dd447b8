"""Render a conversation with the GGUF's own chat template (jinja2, sandboxed), as HF tokenizers do.

The environment mirrors what Hugging Face templates expect: `trim_blocks`/`lstrip_blocks`, the `loopcontrols`
extension, HF's `{% generation %}` tag (a no-op outside training), a `raise_exception` helper, `tojson`, and
`strftime_now`; and what llama-server adds for templates that read them: `date_string` (today, for Llama 3.x),
`datetime` and an empty `functions` (FireFunction), `thinking` beside `enable_thinking` (DeepSeek-V3.1,
Granite). Like llama-server (its minja templates' capabilities), a template is probed once at load: one that
drops or refuses a system message gets its system text merged into the next user message, and one that
renders only typed content parts gets `[{"type": "text", ...}]` content. Files without a template get ChatML.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from pantheon.errors import ApiError

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class TemplateRenderError(Exception):
    pass


def _raise_exception(message: str) -> None:
    raise TemplateRenderError(message)


def _tojson(value: Any, indent: int | None = None, ensure_ascii: bool = False, sort_keys: bool = False) -> str:
    # HF's tojson is json.dumps with its default ", " / ": " separators; rendered prompts depend on them.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


class _GenerationTag(jinja2.ext.Extension):
    """HF's `{% generation %}...{% endgeneration %}` (it marks the assistant's tokens for training masks):
    renders its body, as HF, llama.cpp and llama-cpp-python do when serving."""

    tags = {"generation"}

    def parse(self, parser: Any) -> list[nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


# What the load-time probes look for in a render (`_probe`).
_SYSTEM_NEEDLE, _USER_NEEDLE = "<System Needle 7f3a>", "<User Needle 7f3a>"


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        self.is_fallback = source is None
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols", _GenerationTag]
        )
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(self.source)
        except jinja2.TemplateSyntaxError as exc:
            raise TemplateRenderError(f"chat template does not compile: {exc}") from None
        # Think-style templates (Qwen3, DeepSeek-R1 ...) open or consume <think> blocks.
        self.is_think_style = "<think>" in self.source
        user = {"role": "user", "content": _USER_NEEDLE}
        typed_user = {"role": "user", "content": [{"type": "text", "text": _USER_NEEDLE}]}
        self.requires_typed_content = (not self._probe([user], _USER_NEEDLE)
                                       and self._probe([typed_user], _USER_NEEDLE))
        system = {"role": "system", "content": _SYSTEM_NEEDLE}
        if self.requires_typed_content:
            system, user = {**system, "content": [{"type": "text", "text": _SYSTEM_NEEDLE}]}, typed_user
        self.supports_system_role = self._probe([system, user], _SYSTEM_NEEDLE)

    def _probe(self, messages: list[dict[str, Any]], needle: str) -> bool:
        """Whether the template renders `messages` (as they would go in, content parts included) with `needle`
        in its output; False where it raises."""
        try:
            return needle in self._render(messages, add_generation_prompt=False)
        except ApiError:  # render's refusals: whatever a template raises
            return False

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        return self._render(self._fitted([dict(m) for m in messages]), add_generation_prompt=add_generation_prompt,
                            tools=tools, extra=extra)

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool,
                tools: Sequence[Mapping[str, Any]] | None = None, extra: Mapping[str, Any] | None = None) -> str:
        """`messages` rendered as they are (`render` first fits them to the template)."""
        now = datetime.datetime.now()
        variables: dict[str, Any] = {
            "messages": messages,
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
            "date_string": now.strftime("%d %b %Y"),
            "datetime": now.strftime("%b %d %Y %H:%M:%S GMT"),
            "functions": "",
        }
        if tools:
            variables["tools"] = list(tools)
        if extra:
            variables.update(extra)
            if "enable_thinking" in extra and "thinking" not in extra:
                variables["thinking"] = extra["enable_thinking"]
        try:
            return self._template.render(**variables)
        except TemplateRenderError as exc:
            raise ApiError(400, "invalid_request_error", f"chat template rejected the conversation: {exc}") from None
        except Exception as exc:  # noqa: BLE001 - a template's own errors (a bad index, a recursion) are the request's
            raise ApiError(400, "invalid_request_error", f"chat template failed to render: "
                           f"{type(exc).__name__}: {exc}") from None

    def _fitted(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The messages as this template can take them (see the module's docstring): system text merged into
        the next user message (or a user message of its own before another role, or at the end) where the
        template has no system role; string content as one text part where it renders parts only."""
        if not self.supports_system_role:
            merged: list[dict[str, Any]] = []
            pending = ""
            for message in messages:
                content = message.get("content") or ""
                if message.get("role") == "system":
                    pending = f"{pending}\n{content}" if pending else content
                    continue
                if pending and message.get("role") == "user":
                    message = {**message, "content": f"{pending}\n{content}" if content else pending}
                elif pending:
                    merged.append({"role": "user", "content": pending})
                pending = ""
                merged.append(message)
            if pending:
                merged.append({"role": "user", "content": pending})
            messages = merged
        if self.requires_typed_content:
            messages = [{**m, "content": [{"type": "text", "text": m["content"]}]} if isinstance(m.get("content"), str)
                        else m for m in messages]
        return messages
