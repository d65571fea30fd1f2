"""Chat rows -> Rendered examples: the chat template's text plus the character spans of the assistant turns to train.

Formats: OpenAI-style `messages` (role/content, tool_calls, tool_call_id, reasoning_content / thinking; an optional
`tools` column), ShareGPT `conversations` (from/value), and conversational prompt/completion (`prompt` and
`completion` are message lists; only completion turns are trained). A message with `train: false` (or `weight: 0`)
is context, not target.

The rule, for every template: a trained assistant turn i is exactly what the model must generate after the
generation prompt. Its text is the rendering F of messages[:i+1]; it starts where P = render(messages[:i],
add_generation_prompt=True) ends (where P is not a prefix of F, where the two first differ) and runs through the
first stop token after that (sft.data.chat_templates.stop_tokens: the tokenizer's EOS and the generation config's EOS
list). Role headers inside P are context; think blocks, channel headers and tool-call markup after it are trained.
When F ends the turn without a stop token (GLM ends turns with the next role tag), the stop token the template
writes when the conversation goes on is appended. Where the turn renders the same inside the whole conversation,
it is trained there; otherwise (the template renders history differently) the `history` policy decides: split
(the turn becomes its own example, F), last (only the final turn is trained) or error. A turn whose content,
reasoning or tool calls the template does not render raises SFTError naming the row.
"""

import difflib
import json
import logging
import re
from dataclasses import dataclass
from typing import Any

import jinja2
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from sft.data.chat_templates import PRESETS, REPLY_MARK, resolve_chat_template, stop_tokens
from sft.errors import SFTError
from sft.data.formats import Rendered

ROLES = ("system", "user", "assistant", "tool")
SHAREGPT_ROLES = {
    "system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
    "function_call": "assistant", "observation": "tool", "tool": "tool", "function": "tool",
}
NO_ASSISTANT_TURN = ("error", "drop")
HISTORY = ("split", "last", "error")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the names reasoning traces come under
THINK = re.compile(r"\s*<think>(.*?)</think>\s*", re.S)  # a reasoning block written inside the content
EMPTY_THINK = re.compile(r"<think>\s*</think>")  # what reasoning templates write for a turn without reasoning
READS_REASONING = re.compile(r"reasoning_content|\.thinking\b|\[['\"]thinking['\"]\]")  # a template reading it
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


@dataclass
class _Turn:
    """One assistant turn as its own rendering: text, trained [start, end) and the kinds of its pieces."""

    text: str
    start: int
    end: int
    kinds: list[tuple[int, int, str]]


class ChatRenderer:
    """Renders chat rows with a chat template and marks what the model generates in each assistant turn.

    Args:
        tokenizer: supplies the template (when chat_template is None), bos/eos and the special tokens.
        chat_template: None (the tokenizer's), a preset name, a .jinja path or an inline Jinja string.
        assistant_only_loss: train the assistant turns only; when false the whole text is trained, minus the
            assistant turns excluded below.
        train_on_last_turn_only: only the last assistant message is trained; earlier answers are context.
        no_assistant_turn: "error" or "drop" (render_row returns []) for a row without an assistant message.
        history: split, last or error, for turns the template renders differently once later turns follow.
        generation_eos: the model generation config's eos_token_id (an id or a list): more tokens that end turns.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 assistant_only_loss: bool = True, train_on_last_turn_only: bool = False,
                 no_assistant_turn: str = "error", history: str = "split",
                 generation_eos: int | list[int] | None = None) -> None:
        if no_assistant_turn not in NO_ASSISTANT_TURN:
            raise SFTError(f"no_assistant_turn: {no_assistant_turn!r} is not one of {', '.join(NO_ASSISTANT_TURN)}.")
        if history not in HISTORY:
            raise SFTError(f"history: {history!r} is not one of {', '.join(HISTORY)}.")
        self.tokenizer = tokenizer
        self.template = resolve_chat_template(chat_template, tokenizer)
        self.assistant_only_loss = assistant_only_loss
        self.train_on_last_turn_only = train_on_last_turn_only
        self.no_assistant_turn = no_assistant_turn
        self.history = history
        self._compiled = _compile_jinja_template(self.template)
        self._variables = dict(tokenizer.special_tokens_map)
        if chat_template in PRESETS:
            _warn_split_tokens(tokenizer, chat_template)
        self.stops = stop_tokens(tokenizer, self.template, generation_eos)
        self._stop = _alternation(self.stops)
        self._parts = self._needs_text_parts()
        self._string_arguments = self._needs_string_arguments()
        self._reads_reasoning = bool(READS_REASONING.search(self.template))

    def render_row(self, row: dict, where: str, row_number: int) -> list[Rendered]:
        """The row's examples: usually one; one per trained turn the template renders differently in history
        (history: split); none when the row has no assistant turn and no_assistant_turn is drop."""
        ctx = _Row(where, row_number)
        messages, tools = self._conversation(row, ctx)
        if not any(m.role == "assistant" for m in messages):
            if self.no_assistant_turn == "drop":
                return []
            raise ctx.error("the conversation has no assistant message, so nothing would be trained",
                            "Add the assistant's answer, remove the row, or set `no_assistant_turn: drop`.")
        text = self._render([m.data for m in messages], tools, False, ctx)
        trained = self._trained_turns(messages)
        if not self.assistant_only_loss:
            return [self._whole_text(messages, tools, text, trained, ctx)]
        turns = {i: self._turn(messages, tools, i, text, ctx) for i in sorted(trained)}
        return self._examples(messages, turns, text, ctx)

    def _examples(self, messages: list[_Message], turns: dict[int, _Turn], text: str, ctx: _Row) -> list[Rendered]:
        """Turns that render inside the whole conversation share one example; the others follow `history`."""
        if turns and turns[max(turns)].text.startswith(text):
            text = turns[max(turns)].text  # the final turn, completed with the stop token the template omits
        inside = {i: t for i, t in turns.items() if text.startswith(t.text[:t.end])}
        outside = [i for i in turns if i not in inside]
        if outside and self.history == "error":
            raise ctx.error("the chat template renders this assistant turn differently once later messages follow "
                            "it, so it would be trained in a context the model never sees (history: error)",
                            "Set `history: split` (one example per turn) or `history: last`.",
                            messages[outside[0]].label)
        if outside and self.history == "last":
            inside, outside = {max(turns): turns[max(turns)]}, []
            text = turns[max(turns)].text
        examples = [_example(turns[i].text, [turns[i]]) for i in outside]  # earlier turns first: turn order
        examples += [_example(text, list(inside.values()))] if inside else []
        for extra in examples[1:]:
            extra.split = True  # the row's examples beyond the first, counted by `sft data`
        return examples

    def _turn(self, messages: list[_Message], tools: list[dict] | None, i: int, text: str, ctx: _Row) -> _Turn:
        """Assistant turn i rendered as the last message: what the model generates after the generation prompt."""
        data = [m.data for m in messages]
        prompt = self._render(data[:i], tools, True, ctx)
        final = text if i == len(messages) - 1 else self._render(data[:i + 1], tools, False, ctx)
        final, start = self._align(prompt, final, messages, i, ctx)
        stop = self._stop.search(final, start)
        if stop is None:
            final = self._with_stop(data, tools, i, final, ctx)
            stop = self._stop.search(final, start)
        if stop is None:
            raise ctx.error(f"no stop token ({', '.join(self.stops) or 'none known'}) ends this assistant turn in the "
                            "rendered text, so the model would never learn to stop", "Use a chat_template that ends "
                            "assistant turns with the tokenizer's EOS, or give the model's generation_config.json "
                            "its eos_token_id list.", messages[i].label)
        self._check_rendered(final[start:stop.start()], messages[i], ctx)
        return _Turn(final, start, stop.end(), _kinds(final, start, stop.start(), stop.end(), messages[i]))

    def _align(self, prompt: str, final: str, messages: list[_Message], i: int, ctx: _Row) -> tuple[str, int]:
        """The turn's example text and where the generated part starts in it.

        The prompt is a prefix of the turn's rendering (the usual case): the answer starts where it ends. Where
        only earlier text differs (Mistral v0.3 writes the system prompt before the last user message only), the
        example is the prompt as the model sees it plus what follows the same generation prompt in the turn's
        rendering. Otherwise (DeepSeek-R1 / Nemotron-3 open a think block in the prompt alone) the turn starts
        where prompt and rendering first differ.
        """
        if final.startswith(prompt):
            return final, len(prompt)
        previous = messages[i - 1].data.get("content") if i else None
        previous = previous.strip() if isinstance(previous, str) else ""
        at = prompt.rfind(previous) if previous else -1
        if at >= 0:
            opening = prompt[at:]  # the previous message's end and the generation prompt
            found = final.rfind(opening)
            if found >= 0 and len(opening) > len(previous):
                return prompt + final[found + len(opening):], len(prompt)
        start = _common_prefix(prompt, final)
        if previous and previous in prompt[start:]:
            raise ctx.error("the chat template renders the conversation before this assistant turn differently "
                            "once the turn is added, so where the answer starts is unknown",
                            "Use a chat_template whose generation prompt is a prefix of the rendered turn "
                            "(e.g. a preset), or set `assistant_only_loss: false`.", messages[i].label)
        return final, start

    def _with_stop(self, data: list[dict], tools: list[dict] | None, i: int, final: str, ctx: _Row) -> str:
        """`final` plus the stop token the template writes after turn i when the conversation goes on (GLM: the
        next role tag, <|user|> or <|observation|>); unchanged when it writes none."""
        follower = ({"role": "tool", "content": "…"} if data[i].get("tool_calls") else {"role": "user", "content": "…"})
        try:
            longer = self._compiled.render(messages=data[:i + 1] + [follower], tools=tools, documents=None,
                                           add_generation_prompt=False, **self._variables)
        except TEMPLATE_ERRORS:
            return final
        at = _common_prefix(final, longer)
        stop = self._stop.search(longer, at)
        if stop is None:
            return final
        between = longer[len(final):stop.start()] if at == len(final) else ""
        return final + (between if not between.strip() else "") + stop.group()

    def _check_rendered(self, generated: str, message: _Message, ctx: _Row) -> None:
        """The answer, reasoning and tool calls of the message must all be in what the template renders for it."""
        dropped = [what for what, text in (("content", message.answer), ("reasoning", message.reasoning))
                   if text.strip() and text.strip() not in generated]
        calls = [c["function"]["name"] for c in message.data.get("tool_calls") or []]
        dropped += ["tool_calls"] if any(name not in generated for name in calls) else []
        if dropped:
            raise ctx.error(f"the chat template does not render this assistant message's {' and '.join(dropped)} "
                            "in the turn the model generates, so it cannot be trained", "Use a chat_template that "
                            "supports it, or remove it from the data.", message.label)

    def _whole_text(self, messages: list[_Message], tools: list[dict] | None, text: str, trained: set[int],
                    ctx: _Row) -> Rendered:
        """assistant_only_loss: false: the whole rendering, minus the assistant turns that are not trained."""
        untrained = [i for i, m in enumerate(messages) if m.role == "assistant" and i not in trained]
        spans = []
        for i in untrained:
            prompt = self._render([m.data for m in messages[:i]], tools, True, ctx)
            start = _common_prefix(prompt, text)  # the whole text is trained here, so a rough start is enough
            stop = self._stop.search(text, start)
            spans.append((start, stop.end() if stop else len(text)))
        return Rendered(text, _complement(spans, len(text)), append_eos=False, add_special_tokens=False)

    def _conversation(self, row: dict, ctx: _Row) -> tuple[list[_Message], list[dict] | None]:
        """The row's messages (normalised and validated) and its tool list."""
        messages = _row_messages(row, ctx)
        system = row.get("system")
        if isinstance(system, str) and system.strip() and not (messages and messages[0].role == "system"):
            messages.insert(0, _Message({"role": "system", "content": system}, False, "system"))
        _validate(messages, ctx)
        for message in messages:
            self._prepare(message)
        return messages, _tools(row.get("tools"), ctx)

    def _prepare(self, message: _Message) -> None:
        """Reasoning under the names templates read; a <think> block in the content moves there when the template
        reads reasoning fields (others render the content verbatim, think block included)."""
        data = message.data
        content = data["content"]
        message.answer = content
        think = THINK.match(content) if message.role == "assistant" else None
        if think and self._reads_reasoning and not data.get("reasoning_content"):
            data["reasoning_content"], data["content"] = think.group(1).strip("\n"), content[think.end():]
            message.answer = data["content"]
        if data.get("reasoning_content"):
            data["thinking"] = message.reasoning = data["reasoning_content"]  # GPT-OSS reads `thinking`
        elif think and not self._reads_reasoning:
            message.answer = content[think.end():]  # rendered verbatim; a template that drops it is refused
            message.reasoning = think.group(1)
        if self._parts:
            data["content"] = [{"type": "text", "text": data["content"]}]
        if self._string_arguments:
            for call in data.get("tool_calls") or []:
                arguments = call["function"]["arguments"]
                call["function"]["arguments"] = arguments if isinstance(arguments, str) else json.dumps(arguments)

    def _trained_turns(self, messages: list[_Message]) -> set[int]:
        """Indices of the assistant messages whose tokens are trained."""
        trained = [i for i, m in enumerate(messages) if m.role == "assistant" and m.trained]
        if self.train_on_last_turn_only:
            last = max(i for i, m in enumerate(messages) if m.role == "assistant")
            trained = [i for i in trained if i == last]
        return set(trained)

    def _needs_text_parts(self) -> bool:
        """True for templates that only read content as a list of typed parts (LLaVA-Next, Idefics3)."""
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": REPLY_MARK}]
        try:
            if REPLY_MARK in self._compiled.render(messages=probe, **self._variables):
                return False
        except TEMPLATE_ERRORS:
            pass
        parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in probe]
        try:
            return REPLY_MARK in self._compiled.render(messages=parts, **self._variables)
        except TEMPLATE_ERRORS:
            return False

    def _needs_string_arguments(self) -> bool:
        """True for templates that concatenate tool-call arguments as a JSON string (DeepSeek-V3) and fail on the
        mapping the others serialise with tojson."""
        def probe(arguments: Any) -> list[dict]:
            call = {"type": "function", "function": {"name": "sft_probe", "arguments": arguments}}
            return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            self._compiled.render(messages=probe({"x": 1}), **self._variables)
            return False
        except TEMPLATE_ERRORS:
            pass
        try:
            return "sft_probe" in self._compiled.render(messages=probe('{"x": 1}'), **self._variables)
        except TEMPLATE_ERRORS:
            return False

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, ctx: _Row) -> str:
        """The template's text for `messages`; template errors become SFTError naming the row.

        The compiled template is called directly with what apply_chat_template passes (the special tokens): the
        same text at about half the cost, which matters because each trained turn renders twice.
        """
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=generation_prompt, **self._variables)
        except TEMPLATE_ERRORS as exc:
            # The template's own words say what it wants; only an alternation complaint gets that hint.
            hint = ("Alternate user and assistant turns in the row" if "alternate" in str(exc)
                    else "Fix the row's messages to fit the template")
            raise ctx.error(f"the chat template rejected the conversation ({type(exc).__name__}: {exc})",
                            f"{hint}, or choose another chat_template.") from None


def _example(text: str, turns: list[_Turn]) -> Rendered:
    """One tokenizable example: the template's `text` with the turns' spans and kinds."""
    return Rendered(text, [(t.start, t.end) for t in turns], append_eos=False, add_special_tokens=False,
                    kinds=[k for t in turns for k in t.kinds])


def _kinds(text: str, start: int, stop: int, end: int, message: _Message) -> list[tuple[int, int, str]]:
    """Labelled pieces of a trained turn [start, end): reasoning, answer, tool_call, channel (other markup the
    model writes: <|channel|>final<|message|>, <|END_RESPONSE|>, ...) and end (the stop token)."""
    marks = [(stop, end, "end")]
    answer = message.answer.strip()
    generated = text[start:stop]
    if answer and generated.strip() == answer and not message.reasoning and not message.data.get("tool_calls"):
        at = text.find(answer, start, stop)  # the common turn: its answer and the stop token, nothing else
        return [(at, at + len(answer), "answer")] + marks
    cursor = start
    reasoning = _reasoning_span(text, start, stop, message.reasoning.strip())
    if reasoning:
        marks.append((*reasoning, "reasoning"))
        cursor = reasoning[1]
    at = text.find(answer, cursor, stop) if answer else -1
    if at >= 0:
        marks.append((at, at + len(answer), "answer"))
        cursor = at + len(answer)
    if message.data.get("tool_calls"):
        marks.append((_skip_space(text, cursor), stop, "tool_call"))
    covered = sorted(m[:2] for m in marks)
    pos = start
    for lo, hi in covered + [(stop, stop)]:
        if text[pos:lo].strip():
            marks.append((_skip_space(text, pos), lo, "channel"))
        pos = max(pos, hi)
    return sorted(m for m in marks if m[1] > m[0])


def _reasoning_span(text: str, start: int, stop: int, reasoning: str) -> tuple[int, int] | None:
    """The reasoning of a turn with its <think> tags, or an empty think block the template writes anyway."""
    if reasoning:
        at = text.find(reasoning, start, stop)
        if at < 0:
            return None
        opening = text.rfind("<think>", start, at)
        closing = text.find("</think>", at + len(reasoning), stop)
        return (opening if opening >= 0 else at,
                closing + len("</think>") if closing >= 0 else at + len(reasoning))
    block = EMPTY_THINK.search(text, start, stop)
    return block.span() if block else None


def _warn_split_tokens(tokenizer: PreTrainedTokenizerBase, preset: str) -> None:
    """Warn when the preset's special tokens are not single tokens of this tokenizer (a base model's)."""
    vocab = tokenizer.get_vocab()
    split = [t for t in PRESETS[preset].special_tokens if t not in vocab]
    if split:
        log.warning("chat_template %s writes %s, which this tokenizer splits into pieces (the trained end of a turn "
                    "may then merge with the newline after it). Add them with "
                    "sft.data.chat_templates.prepare_tokenizer_for_template and resize the embeddings.",
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
    reasoning = next((raw[k] for k in REASONING_FIELDS if isinstance(raw.get(k), str) and raw[k].strip()), None)
    if reasoning is not None and role == "assistant":
        data["reasoning_content"] = reasoning
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
