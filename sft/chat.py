"""Chat rows -> Rendered: the chat template's text plus the character spans of the assistant turns to train.

Formats: OpenAI-style `messages` (role/content, tool_calls, tool_call_id; an optional `tools` column),
ShareGPT `conversations` (from/value), and conversational prompt/completion (`prompt` and `completion` are message
lists; only completion turns are trained). A message with `train: false` (or `weight: 0`) is context, not target.

Assistant spans come from the rendering itself, so they work for any template, with or without {% generation %}:
for assistant message i, messages[:i] is rendered with add_generation_prompt=True; where that is a prefix of the
full text (the usual case) the answer starts right after it. The assistant content is then found by a forward
search from there (or, for templates that reorder earlier text, from the longest common prefix and the previous
message), and the span runs from its first non-space character through the end-of-turn token that directly
follows it (<|im_end|>, <|eot_id|>, </s>, <|end|>, ...): not the newline or header after it. A turn the template
rewrites or drops raises SFTError naming the row, instead of training a wrong mask.
"""

import difflib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase

from sft.chat_templates import PRESETS, preset_end_of_turn, resolve_chat_template
from sft.errors import SFTError
from sft.formats import Rendered

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
}
# End-of-turn tokens of common templates, recognised even where a tokenizer does not register them as added tokens.
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
                     "<|endoftext|>", "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>")
NO_ASSISTANT_TURN = ("error", "drop")
# What rendering odd data can raise: raise_exception / undefined names (jinja2), str + None, a missing index, ...
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Row:
    """Where a row comes from, to word errors: what is wrong, where, how to fix."""

    where: str
    number: int

    def error(self, what: str, fix: str, label: str | None = None) -> SFTError:
        at = f", {label}" if label else ""
        return SFTError(f"Dataset {self.where}, row {self.number}{at}: {what}. {fix}")


@dataclass
class _Message:
    """A normalised message: what the template sees, whether it is trained, and its name in the row."""

    data: dict
    trained: bool
    label: str

    @property
    def role(self) -> str:
        return self.data["role"]


class ChatRenderer:
    """Renders chat rows with a chat template and marks the assistant turns (plus end-of-turn) to train.

    Args:
        tokenizer: supplies the template (when chat_template is None), bos/eos and the special tokens.
        chat_template: None (the tokenizer's), a preset name, a .jinja path or an inline Jinja string.
        assistant_only_loss: train the assistant turns only; when false the whole text is trained, minus the
            assistant turns excluded below.
        train_on_last_turn_only: only the last assistant message is trained; earlier answers are context.
        no_assistant_turn: "error" or "drop" (render_row returns None) for a row without an assistant message.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 assistant_only_loss: bool = True, train_on_last_turn_only: bool = False,
                 no_assistant_turn: str = "error") -> None:
        if no_assistant_turn not in NO_ASSISTANT_TURN:
            raise SFTError(f"no_assistant_turn: {no_assistant_turn!r} is not one of {', '.join(NO_ASSISTANT_TURN)}.")
        self.tokenizer = tokenizer
        self.template = resolve_chat_template(chat_template, tokenizer)
        self.assistant_only_loss = assistant_only_loss
        self.train_on_last_turn_only = train_on_last_turn_only
        self.no_assistant_turn = no_assistant_turn
        if chat_template in PRESETS:  # the preset knows its end-of-turn token; accept nothing else
            markers = [preset_end_of_turn(chat_template, tokenizer)]
            self._turn_end = _alternation(markers)
            _warn_split_tokens(tokenizer, chat_template)
        else:
            markers = sorted({*KNOWN_END_OF_TURN, *(t.content for t in tokenizer.added_tokens_decoder.values()),
                              *tokenizer.all_special_tokens})
            self._turn_end = _alternation([*KNOWN_END_OF_TURN, tokenizer.eos_token or "</s>", *self._probe_end()])
        self._after_content = _alternation(markers)

    def render_row(self, row: dict, where: str, row_number: int) -> Rendered | None:
        """The row's text and trained spans; None when it has no assistant turn and no_assistant_turn is drop."""
        ctx = _Row(where, row_number)
        messages, tools = self._conversation(row, ctx)
        if not any(m.role == "assistant" for m in messages):
            if self.no_assistant_turn == "drop":
                return None
            raise ctx.error("the conversation has no assistant message, so nothing would be trained",
                            "Add the assistant's answer, remove the row, or set `no_assistant_turn: drop`.")
        text = self._render([m.data for m in messages], tools, False, ctx)
        trained = self._trained_turns(messages)
        untrained = [i for i, m in enumerate(messages) if m.role == "assistant" and i not in trained]
        if not self.assistant_only_loss and not untrained:
            return Rendered(text, [(0, len(text))], append_eos=False, add_special_tokens=False)
        turns = self._assistant_spans(messages, tools, text, ctx)
        if self.assistant_only_loss:
            spans = [turns[i] for i in sorted(trained)]
        else:
            spans = _complement([turns[i] for i in untrained], len(text))
        return Rendered(text, spans, append_eos=False, add_special_tokens=False)

    def _conversation(self, row: dict, ctx: _Row) -> tuple[list[_Message], list[dict] | None]:
        """The row's messages (normalised and validated) and its tool list."""
        messages = _row_messages(row, ctx)
        system = row.get("system")
        if isinstance(system, str) and system.strip() and not (messages and messages[0].role == "system"):
            messages.insert(0, _Message({"role": "system", "content": system}, False, "system"))
        _validate(messages, ctx)
        return messages, _tools(row.get("tools"), ctx)

    def _trained_turns(self, messages: list[_Message]) -> set[int]:
        """Indices of the assistant messages whose tokens are trained."""
        trained = [i for i, m in enumerate(messages) if m.role == "assistant" and m.trained]
        if self.train_on_last_turn_only:
            last = max(i for i, m in enumerate(messages) if m.role == "assistant")
            trained = [i for i in trained if i == last]
        return set(trained)

    def _assistant_spans(self, messages: list[_Message], tools: list[dict] | None, text: str,
                        ctx: _Row) -> dict[int, tuple[int, int]]:
        """Character span [start, end) in `text` of every assistant turn: its content through its end-of-turn."""
        spans: dict[int, tuple[int, int]] = {}
        cursor, previous_end = 0, None  # messages appear in order: each is searched for after the previous one
        for i, message in enumerate(messages):
            if message.role != "assistant":
                found = _find_content(text, message.data["content"], cursor)
                cursor, previous_end = (found[1], found[1]) if found else (cursor, None)
                continue
            prefix = self._render([m.data for m in messages[:i]], tools, True, ctx)
            aligned = _common_prefix(prefix, text)
            turn_start = aligned if aligned == len(prefix) else _local_start(prefix, messages[i - 1], text,
                                                                             previous_end)
            spans[i] = self._locate_turn(text, message, max(cursor, aligned), turn_start, ctx)
            cursor, previous_end = spans[i][1], None
        return spans

    def _locate_turn(self, text: str, message: _Message, lo: int, turn_start: int | None,
                     ctx: _Row) -> tuple[int, int]:
        """The span of one assistant turn at or after `lo`; turn_start is where the answer begins, when known."""
        if message.data.get("tool_calls"):
            return self._locate_tool_call_turn(text, message, turn_start, ctx)
        found = _find_content(text, message.data["content"], max(lo, turn_start or 0))
        if found and turn_start is not None and self._turn_end.search(text, turn_start, found[0]):
            found = None  # the content only appears after this turn ended: the template dropped or rewrote it
        if not found:
            raise ctx.error("the chat template rewrites or drops this assistant message, so its tokens cannot be "
                            "located in the rendered text", "Use a chat_template that writes assistant content "
                            "verbatim (e.g. a preset), or set `assistant_only_loss: false`.", message.label)
        end = self._end_of_turn_after(text, found[1])
        if end is None:
            raise ctx.error(f"no end-of-turn token follows this assistant message in the rendered text "
                            f"({text[found[1]:found[1] + 30]!r}), so the model would never learn to stop",
                            "Use a chat_template that ends assistant turns with a special token such as "
                            "eos_token (the presets do).", message.label)
        return found[0], end

    def _locate_tool_call_turn(self, text: str, message: _Message, turn_start: int | None,
                               ctx: _Row) -> tuple[int, int]:
        """A turn with tool calls: from the end of the generation prompt through the first end-of-turn token."""
        if turn_start is None:
            raise ctx.error("cannot locate this tool-call turn: the chat template renders the conversation before "
                            "it differently depending on later messages", "Use a preset chat_template (chatml, "
                            "llama3, mistral_v3), or set `assistant_only_loss: false`.", message.label)
        start = _skip_space(text, turn_start)
        end = self._turn_end.search(text, start)
        body = text[start:end.start()] if end else ""
        names = [call["function"]["name"] for call in message.data["tool_calls"]]
        if not end or not body.strip() or not all(name in body for name in names):
            raise ctx.error("the chat template does not render this message's tool_calls (or ends the turn "
                            "without an end-of-turn token)", "Use a chat_template with tool support "
                            "(chatml, llama3, mistral_v3) or drop tool calls from the data.", message.label)
        return start, end.end()

    def _end_of_turn_after(self, text: str, pos: int) -> int | None:
        """End of the end-of-turn token at `pos` (after optional spaces), or None when there is none."""
        match = self._after_content.match(text, _skip_space(text, pos))
        return match.end() if match else None

    def _probe_end(self) -> list[str]:
        """The token this template writes right after an assistant answer, found on a probe conversation."""
        answer = "SFT probe answer."
        probe = [{"role": "user", "content": "SFT probe question?"}, {"role": "assistant", "content": answer}]
        try:
            text = self.tokenizer.apply_chat_template(probe, chat_template=self.template, tokenize=False)
        except TEMPLATE_ERRORS:  # a template that rejects the probe just gets no learned marker
            return []
        pos = text.find(answer)
        rest = text[_skip_space(text, pos + len(answer)):] if pos >= 0 else ""
        return [t for t in self.tokenizer.all_special_tokens + [t.content for t in
                self.tokenizer.added_tokens_decoder.values()] if rest.startswith(t)][:1]

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, ctx: _Row) -> str:
        """The template's text for `messages`; template errors become SFTError naming the row."""
        try:
            return self.tokenizer.apply_chat_template(messages, tools=tools, chat_template=self.template,
                                                      add_generation_prompt=generation_prompt, tokenize=False)
        except TEMPLATE_ERRORS as exc:
            # The template's own words say what it wants; only an alternation complaint gets that hint.
            hint = ("Alternate user and assistant turns in the row" if "alternate" in str(exc)
                    else "Fix the row's messages to fit the template")
            raise ctx.error(f"the chat template rejected the conversation ({type(exc).__name__}: {exc})",
                            f"{hint}, or choose another chat_template.") from None


def _warn_split_tokens(tokenizer: PreTrainedTokenizerBase, preset: str) -> None:
    """Warn when the preset's special tokens are not single tokens of this tokenizer (a base model's)."""
    vocab = tokenizer.get_vocab()
    split = [t for t in PRESETS[preset].special_tokens if t not in vocab]
    if split:
        log.warning("chat_template %s writes %s, which this tokenizer splits into pieces (the trained end of a turn "
                    "may then merge with the newline after it). Add them with "
                    "sft.chat_templates.prepare_tokenizer_for_template and resize the embeddings.",
                    preset, ", ".join(split))


def _row_messages(row: dict, ctx: _Row) -> list[_Message]:
    """The row's messages from whichever chat column it has."""
    if row.get("messages") is not None:
        return [_openai_message(m, f"messages[{k}]", True, ctx) for k, m in enumerate(_as_list(row, "messages", ctx))]
    if row.get("conversations") is not None:
        turns = _as_list(row, "conversations", ctx)
        if all(isinstance(t, dict) and "role" in t and "from" not in t for t in turns):  # role/content under this name
            return [_openai_message(m, f"conversations[{k}]", True, ctx) for k, m in enumerate(turns)]
        return _sharegpt_messages(turns, ctx)
    if isinstance(row.get("prompt"), list) and isinstance(row.get("completion"), list):
        prompt = [_openai_message(m, f"prompt[{k}]", False, ctx) for k, m in enumerate(row["prompt"])]
        return prompt + [_openai_message(m, f"completion[{k}]", True, ctx) for k, m in enumerate(row["completion"])]
    raise ctx.error("no chat column: expected `messages` (role/content), `conversations` (ShareGPT from/value) "
                    "or `prompt` and `completion` message lists", "Map your column with `columns:` or set "
                    "`dataset_format`.")


def _as_list(row: dict, key: str, ctx: _Row) -> list:
    """A non-empty list column, or an error."""
    value = row[key]
    if not isinstance(value, list) or not value:
        kind = "empty" if isinstance(value, list) else f"a {type(value).__name__}, not a list of messages"
        raise ctx.error(f"`{key}` is {kind}", "Fix or remove the row.")
    return value


def _openai_message(raw: Any, label: str, trainable: bool, ctx: _Row) -> _Message:
    """One role/content message, normalised: null fields dropped, content a string, tool calls OpenAI-shaped."""
    if not isinstance(raw, dict):
        raise ctx.error(f"a message must be an object with role and content, got {type(raw).__name__}",
                        "Fix or remove the row.", label)
    role = raw.get("role")
    if role not in ROLES:
        close = difflib.get_close_matches(str(role), ROLES, n=1)
        hint = f" (did you mean `{close[0]}`?)" if close else ""
        raise ctx.error(f"unknown role {role!r}{hint}; roles are {', '.join(ROLES)}",
                        "Fix the role, or map ShareGPT data with `dataset_format: sharegpt`.", label)
    data: dict[str, Any] = {"role": role, "content": _content(raw.get("content"), label, ctx)}
    if raw.get("tool_calls"):
        data["tool_calls"] = [_tool_call(c, label, ctx) for c in raw["tool_calls"]]
    for key in ("tool_call_id", "name"):
        if isinstance(raw.get(key), str):
            data[key] = raw[key]
    return _Message(data, trainable and _wants_training(raw), label)


def _content(value: Any, label: str, ctx: _Row) -> str:
    """Message content as a string: null is empty, a list of text parts is joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ctx.error(f"content is a {type(value).__name__}, not a string", "Store message content as text.", label)


def _wants_training(raw: dict) -> bool:
    """False for a message marked `train: false` or `weight: 0`."""
    return raw.get("train") is not False and raw.get("weight") not in (0, 0.0)


def _tool_call(raw: Any, label: str, ctx: _Row) -> dict:
    """An OpenAI-shaped tool call {type, function: {name, arguments}, id?}; JSON-string arguments are parsed."""
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ctx.error("a tool call needs a function name ({\"function\": {\"name\": ..., \"arguments\": ...}})",
                        "Fix the tool call.", label)
    call = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}}
    if isinstance(raw.get("id"), str):
        call["id"] = raw["id"]
    return call


def _arguments(value: Any) -> Any:
    """Tool-call arguments as a dict where possible (templates serialise them with tojson)."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            return value
        return parsed if isinstance(parsed, dict) else value
    return _drop_nulls(value) if value is not None else {}


def _drop_nulls(value: Any) -> Any:
    """Remove null entries from dicts: Arrow fills keys absent from a row with null when it unifies structs."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _sharegpt_messages(turns: list, ctx: _Row) -> list[_Message]:
    """ShareGPT from/value turns as messages; function_call -> assistant tool call, observation -> tool result."""
    messages: list[_Message] = []
    pending: list[str] = []  # ids of tool calls awaiting their result
    for k, turn in enumerate(turns):
        label = f"conversations[{k}]"
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if speaker not in SHAREGPT_ROLES:
            raise ctx.error(f"unknown `from` value {speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}",
                            "Fix the turn or map it to one of these names.", label)
        role, value = SHAREGPT_ROLES[speaker], turn.get("value")
        raw: dict[str, Any] = {"role": role, "content": value, "train": turn.get("train"), "weight": turn.get("weight")}
        if speaker == "function_call":
            call = _sharegpt_call(value, f"call{k:05d}", label, ctx)  # 9-character ids, as Mistral v0.3 needs
            raw.update(content=None, tool_calls=[call])
            pending.append(call["id"])
        elif role == "tool" and pending:
            raw["tool_call_id"] = pending.pop(0)
        messages.append(_openai_message(raw, label, True, ctx))
    return messages


def _sharegpt_call(value: Any, call_id: str, label: str, ctx: _Row) -> dict:
    """A function_call turn's JSON {"name": ..., "arguments": ...} as an OpenAI tool call."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ctx.error("a function_call value must be JSON {\"name\": ..., \"arguments\": {...}}",
                        "Fix the turn, or use `from: gpt` for a plain answer.", label)
    return {"id": call_id, "function": {"name": parsed["name"], "arguments": parsed.get("arguments", {})}}


def _tools(value: Any, ctx: _Row) -> list[dict] | None:
    """The row's tool schemas (a list or a JSON string), each wrapped as {"type": "function", "function": ...}."""
    if value is None or value == "" or value == []:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ctx.error(f"`tools` is not valid JSON ({exc})", "Fix the tools column.", "tools") from None
    else:
        value = _drop_nulls(value)
    if not isinstance(value, list) or not all(isinstance(t, dict) for t in value):
        raise ctx.error("`tools` must be a list of function schemas", "Fix the tools column.", "tools")
    return [t if "function" in t else {"type": "function", "function": t} for t in value] or None


def _validate(messages: list[_Message], ctx: _Row) -> None:
    """Empty content, a conversation that does not open with a user message, tool results after a user turn.

    A tool result may follow an assistant message without structured tool_calls: Hermes-style data writes the
    call as text (<tool_call>...</tool_call>) in the content.
    """
    for k, message in enumerate(messages):
        has_calls = bool(message.data.get("tool_calls"))
        if not message.data["content"].strip() and not has_calls:
            raise ctx.error(f"{message.role} message has empty content", "Fix or remove the row.", message.label)
        if message.role == "tool" and (k == 0 or messages[k - 1].role not in ("assistant", "tool")):
            raise ctx.error("a tool result must follow the assistant message that called the tool (or another "
                            "tool result)", "Add the tool call or remove the tool message.", message.label)
    first = next((m for m in messages if m.role != "system"), None)
    if first is not None and first.role != "user":
        raise ctx.error(f"the first message after the system prompt is from the {first.role}; a conversation "
                        "must open with a user message", "Remove the leading message or add the user's "
                        "prompt before it.", first.label)


def _local_start(prefix: str, previous: _Message, text: str, previous_end: int | None) -> int | None:
    """Where the answer starts when only the text right before it renders the same in `prefix` and `text`.

    Some templates rewrite earlier turns depending on later ones (Mistral v0.3 puts the system prompt and the tool
    list before the last user message), so the prefix property fails; the generation prompt that follows the
    previous message's content in `prefix` (e.g. "[/INST]") must then follow it in `text` too.
    """
    if previous_end is None:
        return None
    content = previous.data["content"]
    for candidate in (content, content.strip()):
        pos = prefix.rfind(candidate) if candidate.strip() else -1
        if pos >= 0:
            tail = prefix[pos + len(candidate):]
            return previous_end + len(tail) if text.startswith(tail, previous_end) else None
    return None


def _find_content(text: str, content: str, start: int) -> tuple[int, int] | None:
    """(first non-space character, end) of `content` in `text` at or after `start`; tries it trimmed too."""
    for candidate in (content, content.strip()):
        if candidate.strip():
            pos = text.find(candidate, start)
            if pos >= 0:
                return _skip_space(text, pos), pos + len(candidate)
    return None


def _skip_space(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: fast on long conversations
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _alternation(tokens: list[str]) -> re.Pattern:
    """A regex matching any of `tokens`, longest first (so <|end|> never shadows <|endoftext|>)."""
    unique = sorted({t for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, unique)) or "(?!)")


def _complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """[0, length) minus `spans`."""
    out, pos = [], 0
    for start, end in sorted(spans):
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    return out + ([(pos, length)] if pos < length else [])
