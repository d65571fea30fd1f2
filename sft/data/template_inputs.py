"""What a chat template reads from a message, found once per template by rendering probes: content as typed parts
(LLaVA-Next, Idefics3), tool-call arguments as a JSON string (DeepSeek-V3) and reasoning fields (Qwen3, GPT-OSS)."""

import json
import re
from dataclasses import dataclass
from typing import Any

from jinja2 import Template

from sft.data.chat_templates import REPLY_MARK, TEMPLATE_ERRORS

READS_REASONING = re.compile(r"reasoning_content|\.thinking\b|\[['\"]thinking['\"]\]")  # a template reading it


@dataclass(frozen=True)
class TemplateInputs:
    """How messages must be shaped for one chat template."""

    parts: bool  # content only as a list of typed text parts
    string_arguments: bool  # tool-call arguments concatenated as a JSON string, not serialised with tojson
    reads_reasoning: bool  # reads reasoning_content / thinking: a <think> block in the content moves there

    @classmethod
    def probe(cls, template: str, compiled: Template, variables: dict) -> "TemplateInputs":
        return cls(_needs_text_parts(compiled, variables), _needs_string_arguments(compiled, variables),
                   bool(READS_REASONING.search(template)))

    def arguments(self, arguments: Any) -> Any:
        """Tool-call arguments as the template takes them: a mapping for tojson, or a JSON string for a template
        that concatenates it: the data's own text where it gave one, else serialised as transformers' tojson does
        (non-ASCII kept: ensure_ascii would train `M\\u00fcnchen` for `München`)."""
        if not self.string_arguments:
            return parsed_arguments(arguments)
        return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def parsed_arguments(value: Any) -> Any:
    """Tool-call arguments as a mapping where a JSON string holds one (templates serialise them with tojson)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return value


def _needs_text_parts(compiled: Template, variables: dict) -> bool:
    """True for templates that only read content as a list of typed parts."""
    probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": REPLY_MARK}]
    try:
        if REPLY_MARK in compiled.render(messages=probe, **variables):
            return False
    except TEMPLATE_ERRORS:
        pass
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in probe]
    try:
        return REPLY_MARK in compiled.render(messages=parts, **variables)
    except TEMPLATE_ERRORS:
        return False


def _needs_string_arguments(compiled: Template, variables: dict) -> bool:
    """True for templates that concatenate tool-call arguments as a JSON string and fail on the mapping the others
    serialise with tojson."""
    def probe(arguments: Any) -> list[dict]:
        call = {"type": "function", "function": {"name": "sft_probe", "arguments": arguments}}
        return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
    try:
        compiled.render(messages=probe({"x": 1}), **variables)
        return False
    except TEMPLATE_ERRORS:
        pass
    try:
        return "sft_probe" in compiled.render(messages=probe('{"x": 1}'), **variables)
    except TEMPLATE_ERRORS:
        return False
