"""What a chat template reads from a message, found once per template by rendering probes: content as typed parts
(LLaVA-Next, Idefics3), tool-call arguments as a JSON string (DeepSeek-V3), null content on a call-only message
(DeepSeek-R1-Distill) and reasoning, as fields (Qwen3, GPT-OSS) or as a thinking content part (Magistral,
Ministral-3 Reasoning)."""

import json
import re
from dataclasses import dataclass
from typing import Any

from jinja2 import Template

from sft.data.chat_templates import REPLY_MARK, TEMPLATE_ERRORS

REASONING_MARK = "\x00reasoning\x00"  # stands in for an answer's reasoning in the probes

READS_REASONING = re.compile(r"reasoning_content|\.thinking\b|\[['\"]thinking['\"]\]")  # a template reading it


@dataclass(frozen=True)
class TemplateInputs:
    """How messages must be shaped for one chat template."""

    parts: bool  # content only as a list of typed text parts
    string_arguments: bool  # tool-call arguments concatenated as a JSON string, not serialised with tojson
    reads_reasoning: bool  # reads reasoning_content / thinking: a <think> block in the content moves there
    null_call_content: bool  # renders a message's tool calls only when its content is null, not ""
    thinking_parts: bool  # reads reasoning only as a {"type": "thinking"} content part, not from the fields

    @classmethod
    def probe(cls, template: str, compiled: Template, variables: dict) -> "TemplateInputs":
        string_arguments, null_call_content = _call_form(compiled, variables)
        thinking_parts = _reads_thinking_parts(compiled, variables)
        return cls(_needs_text_parts(compiled, variables), string_arguments,
                   thinking_parts or bool(READS_REASONING.search(template)), null_call_content, thinking_parts)

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


def _reads_thinking_parts(compiled: Template, variables: dict) -> bool:
    """True for templates that render an answer's reasoning from a {"type": "thinking"} content part but not from
    the reasoning fields: Mistral's Magistral and Ministral-3 Reasoning write the part as [THINK]...[/THINK] and
    ignore reasoning_content. A template printing the list as it is (repr, tojson) escapes the mark's NULs: no."""
    user = {"role": "user", "content": "hi"}
    fields = {"role": "assistant", "content": REPLY_MARK, "reasoning_content": REASONING_MARK,
              "thinking": REASONING_MARK}
    parts = {"role": "assistant", "content": [{"type": "thinking", "thinking": REASONING_MARK},
                                              {"type": "text", "text": REPLY_MARK}]}
    for message, reads_parts in ((fields, False), (parts, True)):
        try:
            text = compiled.render(messages=[user, message], **variables)
        except TEMPLATE_ERRORS:
            continue
        if REASONING_MARK in text:
            return reads_parts
    return False


def _call_form(compiled: Template, variables: dict) -> tuple[bool, bool]:
    """How a call-only assistant message must reach the template for its tool calls to render: (arguments as a JSON
    string, content null). DeepSeek-V3 concatenates argument strings and fails on the mapping the others serialise
    with tojson; DeepSeek-R1-Distill also renders calls only when the content is null (OpenAI's form), dropping them
    for "", the text rows reach the template with. Neither found (no tool-call format): the usual form."""
    for content in ("", None):
        for arguments in ({"x": 1}, '{"x": 1}'):
            call = {"type": "function", "function": {"name": "sft_probe", "arguments": arguments}}
            probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": content, "tool_calls": [call]}]
            try:
                if "sft_probe" in compiled.render(messages=probe, **variables):
                    return isinstance(arguments, str), content is None
            except TEMPLATE_ERRORS:
                continue
    return False, False
