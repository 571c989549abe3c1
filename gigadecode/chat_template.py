"""Chat templates: which Jinja template a chat renders with, compiled and rendered as transformers does.

A checkpoint names its template in `tokenizer_config.json` (`chat_template`: one string, or named templates
as a list of {"name", "template"} or a dict), or in files beside it (`chat_template.jinja`, and
`additional_chat_templates/NAME.jinja`), which win, as in transformers. `--chat-template` (vLLM's flag)
replaces all of them with one template: a file, or the template itself on the command line
(`load_chat_template_arg`).

`ChatTemplates` compiles each template once, in a sandbox, with the helpers transformers gives templates
(`tojson`, `raise_exception`, `strftime_now`; the real GPT-OSS template uses them), and picks "tool_use" for
a request with tools where the checkpoint has one, "default" otherwise.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

JINJA_MARKS = ("{{", "{%", "{#")     # a --chat-template value holding one of these is a template, not a path


class ChatTemplateError(ValueError):
    """The chat template cannot be used: it does not compile, or names no default template."""


def load_chat_template_arg(value: str) -> str:
    """The Jinja source a `--chat-template` value stands for: the text of the file it names, or the value
    itself when it holds Jinja markup. A value that is neither (a path to nothing) is an error that says so,
    rather than a template that would render the path as the prompt."""
    if any(mark in value for mark in JINJA_MARKS):
        return value
    path = Path(value).expanduser()
    if not path.is_file():
        raise ChatTemplateError(f"{value!r}: no such file, and not a Jinja template (no "
                                f"{{{{ ... }}}} or {{% ... %}} in it)")
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ChatTemplateError(f"{value!r}: cannot read it: {e}") from None


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ValueError(f"chat template: {message}")


def _strftime_now(fmt: str) -> str:
    import datetime

    return datetime.datetime.now().strftime(fmt)


class ChatTemplates:
    """One checkpoint's chat template(s) (`source`: a string, named templates, or None for none), compiled
    on first use and kept. `origin` names where they came from in error messages."""

    def __init__(self, source: Any, origin: str = "the checkpoint's") -> None:
        self.source = source or None
        self.origin = origin
        self._compiled: dict[str | None, Any] = {}

    def select(self, tools: Any) -> tuple[str | None, str]:
        """(name, Jinja source) of the template to render, chosen as transformers chooses: one template (a
        string), or named ones (a list of {"name", "template"}, or a dict of name -> template): "tool_use"
        when the request has tools and the checkpoint has it, else "default"."""
        t = self.source
        if isinstance(t, str):
            return None, t
        if isinstance(t, list) and all(isinstance(x, dict) and isinstance(x.get("name"), str) for x in t):
            t = {x["name"]: x.get("template") for x in t}
        if not isinstance(t, dict):
            raise ChatTemplateError(f"{self.origin} chat_template must be a string or a list of named "
                                    f"templates (got {type(t).__name__})")
        name = "tool_use" if tools is not None and "tool_use" in t else "default"
        if name not in t:
            raise ChatTemplateError(f"{self.origin} chat templates are named {sorted(t)}, but none 'default'")
        if not isinstance(t[name], str):
            raise ChatTemplateError(f"{self.origin} chat template {name!r} is not a string")
        return name, t[name]

    def compiled(self, tools: Any = None) -> Any:
        """The compiled template a chat with (or without) tools renders with."""
        name, source = self.select(tools)
        if name not in self._compiled:
            from jinja2 import TemplateError
            from jinja2.ext import loopcontrols
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now)
            try:
                self._compiled[name] = env.from_string(source)
            except TemplateError as e:
                raise ChatTemplateError(f"{self.origin} chat template{'' if name is None else f' {name!r}'} "
                                        f"does not compile: {type(e).__name__}: {e}") from None
        return self._compiled[name]

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool,
               tools: Sequence[Mapping[str, Any]] | None, variables: Mapping[str, Any]) -> str:
        """The chat rendered: `variables` (the tokenizer's named tokens, then the caller's keywords) and
        `tools` (OpenAI function-tool dicts) as template variables, as transformers passes them."""
        context = dict(variables)
        if tools is not None:
            context["tools"] = [dict(t) for t in tools]
        return self.compiled(tools).render(messages=[dict(m) for m in messages],
                                           add_generation_prompt=add_generation_prompt, **context)
