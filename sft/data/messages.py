"""Chat rows -> normalised messages: the row's chat column read, validated and worded for errors.

Formats: OpenAI-style `messages` (role/content, tool_calls, tool_call_id, reasoning_content / thinking; an optional
`tools` column), ShareGPT `conversations` (from/value), and conversational prompt/completion (`prompt` and
`completion` are message lists; only completion turns are trained). A message with `train: false` (or `weight: 0`)
is context, not target. sft.data.chat renders the messages and marks the turns to train.
"""

import difflib
import json
from dataclasses import dataclass
from typing import Any

from sft.config.validate import template_kwargs_problem
from sft.errors import SFTError

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
}
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names reasoning traces come under


@dataclass(frozen=True)
class Row:
    """Where a row comes from, to word errors: what is wrong, where, how to fix."""

    where: str
    number: int

    def error(self, what: str, fix: str, label: str | None = None) -> SFTError:
        """An SFTError naming this row (and the message `label`), what is wrong and how to fix it."""
        at = f", {label}" if label else ""
        return SFTError(f"Dataset {self.where}, row {self.number}{at}: {what}. {fix}")


@dataclass
class Message:
    """A normalised message: what the template sees, whether it is trained, its name in the row, and the answer
    and reasoning text that must appear in what the template renders for it."""

    data: dict
    trained: bool
    label: str
    answer: str = ""
    reasoning: str = ""

    @property
    def role(self) -> str:
        return self.data["role"]


def conversation(row: dict, ctx: Row) -> tuple[list[Message], list[dict] | None]:
    """The row's messages (normalised and validated, its `system` column first) and its tool list."""
    messages = _row_messages(row, ctx)
    system = _system_column(row.get("system"), messages, ctx)
    if system:
        messages.insert(0, Message({"role": "system", "content": system}, False, "system"))
    _validate(messages, ctx)
    return messages, _tools(row.get("tools"), ctx)


def _system_column(value: Any, messages: list[Message], ctx: Row) -> str | None:
    """The `system` column's text to open the conversation with; None when unset, or when the messages open with the
    same system prompt. One that differs from theirs is refused: a template renders one system prompt, and the
    column used to be dropped without a word."""
    if value is None or value == "":
        return None
    if not isinstance(value, str):
        raise ctx.error(f"`system` is a {type(value).__name__}, not a string", "Store the system prompt as text.",
                        "system")
    if not value.strip():
        return None
    given = next((m for m in messages if m.role == "system"), None)
    if given is None:
        return value
    fix = ("Keep one of them: remove the row's system message, or train without the column: `columns: {system: "
           "unused_system}` in the source.")
    if given is not messages[0]:  # put first, the column would be a second system prompt
        raise ctx.error(f"the `system` column would open a conversation that has a system message later "
                        f"({given.label}): two system prompts, and a conversation has one", fix, "system")
    if given.data["content"].strip() != value.strip():
        raise ctx.error(f"the `system` column and {given.label}, a system message, give two different system "
                        "prompts, and a conversation has one", fix, "system")
    return None


def _row_messages(row: dict, ctx: Row) -> list[Message]:
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


def _as_list(row: dict, key: str, ctx: Row) -> list:
    """A non-empty list column, or an error."""
    value = row[key]
    if not isinstance(value, list) or not value:
        kind = "empty" if isinstance(value, list) else f"a {type(value).__name__}, not a list of messages"
        # Every row of a CSV/TSV file is text: "Fix or remove the row" sent users row by row.
        fix = (f'A CSV or TSV cell holds text, not a list: save chat data as JSON Lines (one {{"{key}": [...]}} per '
               "line) or Parquet.") if isinstance(value, str) else "Fix or remove the row."
        raise ctx.error(f"`{key}` is {kind}", fix)
    return value


def _openai_message(raw: Any, label: str, trainable: bool, ctx: Row) -> Message:
    """One role/content message, normalised: null fields dropped, content a string, tool calls OpenAI-shaped."""
    if not isinstance(raw, dict):
        raise ctx.error(f"a message must be an object with role and content, got {type(raw).__name__}",
                        "Fix or remove the row.", label)
    role = raw.get("role")
    if "role" not in raw:  # was "unknown role None" with advice for ShareGPT data, for {"Role": ..., "Content": ...}
        raise ctx.error(f"a message has no `role` key (its keys: {', '.join(map(str, raw))})",
                        "Name the keys role and content (lowercase).", label)
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
    reasoning = next((raw[k] for k in REASONING_FIELDS if isinstance(raw.get(k), str) and raw[k].strip()), None)
    if reasoning is not None and role == "assistant":
        data["reasoning_content"] = reasoning
    return Message(data, trainable and _wants_training(raw, label, ctx), label)


def _content(value: Any, label: str, ctx: Row) -> str:
    """Message content as a string: null is empty, a list of text parts is joined."""
    if value is None:
        return ""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and isinstance(p.get("text"), str) for p in value):
        return "".join(p["text"] for p in value)
    raise ctx.error(f"content is a {type(value).__name__}, not a string", "Store message content as text.", label)


def _wants_training(raw: dict, label: str, ctx: Row) -> bool:
    """False for a message marked `train: false` or `weight: 0`. Other values are refused: a string "false" or a
    weight of 0.5 would otherwise be trained in full without a word."""
    train, weight = raw.get("train"), raw.get("weight")
    if train is not None and not isinstance(train, bool):
        raise ctx.error(f"`train` is {train!r}, not a boolean", "Write train: true or false (JSON true/false, no "
                        "quotes).", label)
    if weight is not None and (isinstance(weight, bool) or weight not in (0, 1)):
        raise ctx.error(f"`weight` is {weight!r}; a message's weight is 0 (context) or 1 (trained)",
                        "Write weight: 0 or 1, or train: false.", label)
    return train is not False and weight != 0


def _tool_call(raw: Any, label: str, ctx: Row) -> dict:
    """An OpenAI-shaped tool call {type, function: {name, arguments}, id?}, its arguments as given (_arguments)."""
    fn = raw.get("function", raw) if isinstance(raw, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ctx.error("a tool call needs a function name ({\"function\": {\"name\": ..., \"arguments\": ...}})",
                        "Fix the tool call.", label)
    call = {"type": "function", "function": {"name": fn["name"], "arguments": _arguments(fn.get("arguments"))}}
    if isinstance(raw.get("id"), str):
        call["id"] = raw["id"]
    return call


def template_kwargs(row: dict, ctx: Row, recipe: dict | None) -> dict:
    """The chat template variables for `row` (the one place that decides them): the recipe's chat_template_kwargs
    with the row's own `chat_template_kwargs` column (TRL's) over them. Arrow fills keys absent from a row with
    null, so a null value leaves the recipe's in place; a row without the column (or null) gets the recipe's."""
    value = row.get("chat_template_kwargs")
    problem = template_kwargs_problem(value) if value is not None else None
    if problem:
        raise ctx.error(f"bad value: {problem}", "Fix the row's value, or leave it null to use the recipe's "
                        "chat_template_kwargs.", "chat_template_kwargs")
    return {**(recipe or {}), **(_drop_nulls(value) if isinstance(value, dict) else {})}


def _arguments(value: Any) -> Any:
    """Tool-call arguments as the data gives them: a JSON string kept verbatim (a template that concatenates it,
    DeepSeek-V3's, renders that text), a mapping without Arrow's nulls; ChatRenderer adapts them to its template."""
    if isinstance(value, str):
        return value
    return _drop_nulls(value) if value is not None else {}


def _drop_nulls(value: Any) -> Any:
    """Remove null entries from dicts: Arrow fills keys absent from a row with null when it unifies structs."""
    if isinstance(value, dict):
        return {k: _drop_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_nulls(v) for v in value]
    return value


def _sharegpt_messages(turns: list, ctx: Row) -> list[Message]:
    """ShareGPT from/value turns as messages; function_call -> assistant tool call, observation -> tool result."""
    messages: list[Message] = []
    pending: list[str] = []  # ids of tool calls awaiting their result
    for k, turn in enumerate(turns):
        label = f"conversations[{k}]"
        speaker = turn.get("from") if isinstance(turn, dict) else None
        if isinstance(turn, dict) and "from" not in turn:  # was "unknown `from` value None"
            raise ctx.error(f"a turn has no `from` key (its keys: {', '.join(map(str, turn))})",
                            "Name the keys from and value (lowercase), or use `messages` with role and content.", label)
        if speaker not in SHAREGPT_ROLES:
            raise ctx.error(f"unknown `from` value {speaker!r}; expected one of {', '.join(SHAREGPT_ROLES)}",
                            "Fix the turn or map it to one of these names.", label)
        role, value = SHAREGPT_ROLES[speaker], turn.get("value")
        raw: dict[str, Any] = {"role": role, "content": value, "train": turn.get("train"), "weight": turn.get("weight"),
                               **{key: turn[key] for key in REASONING_FIELDS if key in turn}}
        if speaker == "function_call":
            call = _sharegpt_call(value, f"call{k:05d}", label, ctx)  # 9-character ids, as Mistral v0.3 needs
            raw.update(content=None, tool_calls=[call])
            pending.append(call["id"])
        elif role == "tool" and pending:
            raw["tool_call_id"] = pending.pop(0)
        messages.append(_openai_message(raw, label, True, ctx))
    return messages


def _sharegpt_call(value: Any, call_id: str, label: str, ctx: Row) -> dict:
    """A function_call turn's JSON {"name": ..., "arguments": ...} as an OpenAI tool call."""
    try:
        parsed = json.loads(value) if isinstance(value, str) else value
    except json.JSONDecodeError:
        parsed = None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("name"), str):
        raise ctx.error("a function_call value must be JSON {\"name\": ..., \"arguments\": {...}}",
                        "Fix the turn, or use `from: gpt` for a plain answer.", label)
    return {"id": call_id, "function": {"name": parsed["name"], "arguments": parsed.get("arguments", {})}}


def _tools(value: Any, ctx: Row) -> list[dict] | None:
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


def _validate(messages: list[Message], ctx: Row) -> None:
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
