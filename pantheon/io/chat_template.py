"""Render a conversation with the GGUF's own chat template (jinja2, sandboxed), as HF tokenizers do.

The environment mirrors what Hugging Face templates expect: `trim_blocks`/`lstrip_blocks`, the `loopcontrols`
extension, a `raise_exception` helper, `tojson`, and `strftime_now`. Files without a template get ChatML.
"""

from __future__ import annotations

import datetime
import json
from collections.abc import Mapping, Sequence
from typing import Any

import jinja2
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


class ChatTemplate:
    def __init__(self, source: str | None, *, bos_token: str = "", eos_token: str = "") -> None:
        self.source = source or CHATML_TEMPLATE
        self.is_fallback = source is None
        self.bos_token = bos_token
        self.eos_token = eos_token
        env = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
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

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tools: Sequence[Mapping[str, Any]] | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        variables: dict[str, Any] = {
            "messages": [dict(m) for m in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token,
            "eos_token": self.eos_token,
        }
        if tools:
            variables["tools"] = list(tools)
        if extra:
            variables.update(extra)
        try:
            return self._template.render(**variables)
        except TemplateRenderError as exc:
            raise ApiError(400, "invalid_request_error", f"chat template rejected the conversation: {exc}") from None
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, AttributeError) as exc:
            raise ApiError(400, "invalid_request_error", f"chat template failed to render: {exc}") from None
