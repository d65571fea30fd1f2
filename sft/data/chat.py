"""Chat rows -> Rendered examples: the chat template's text plus the character spans of the assistant turns to train.

The row's messages come from sft.data.messages (OpenAI `messages`, ShareGPT `conversations`, conversational
prompt/completion; `train: false` or `weight: 0` marks context).

The rule, for every template: a trained assistant turn i is exactly what the model must generate after the
generation prompt. Its text is the rendering F of messages[:i+1]; it starts where P = render(messages[:i],
add_generation_prompt=True) ends (where P is not a prefix of F, where the two first differ, never inside an added
token of P: sft.data.turns) and runs through the
first stop token after that (sft.data.stops.stop_tokens: the tokenizer's EOS and the generation config's EOS
list). Role headers inside P are context; think blocks, channel headers and tool-call markup after it are trained.
When F ends the turn without a stop token (GLM ends turns with the next role tag), the stop token the template
writes when the conversation goes on is appended. Where the turn renders the same inside the whole conversation,
it is trained there; otherwise (the template renders history differently) the `history` policy decides: split
(the turn becomes its own example, F), last (only the final turn is trained) or error. A turn whose content,
reasoning or tool calls the template does not render raises SFTError naming the row.
"""

import copy
import json
import logging
import re
from dataclasses import dataclass

from jinja2.exceptions import SecurityError
from transformers import PreTrainedTokenizerBase
from transformers.utils.chat_template_utils import _compile_jinja_template

from sft.config.names import HISTORY, NO_ASSISTANT_TURN
from sft.data.chat_templates import PRESETS, REASONING_TAGS, TEMPLATE_ERRORS, resolve_chat_template, tokens_not_in_vocab
from sft.data.formats import Rendered
from sft.data.messages import Message, Row, conversation, template_kwargs
from sft.data.stops import message_delimiters, stop_tokens
from sft.data.template_inputs import TemplateInputs
from sft.data.turns import common_prefix, turn_text
from sft.errors import SFTError

THINK = re.compile(r"\s*{}(.*?){}\s*".format(*REASONING_TAGS), re.S)  # a reasoning block inside the content
# The tags a template wraps a turn's reasoning in: <think>, [THINK] (Magistral), <seed:think> (Seed-OSS), ◁think▷
_TAG = r"(?:<|\[|◁){}(?:\w+:)?think(?:>|\]|▷)"
THINK_OPEN, THINK_CLOSE = re.compile(_TAG.format(""), re.I), re.compile(_TAG.format("/"), re.I)
EMPTY_THINK = re.compile(THINK_OPEN.pattern + r"\s*" + THINK_CLOSE.pattern, re.I)  # a turn without reasoning

log = logging.getLogger(__name__)


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
        template_kwargs: the recipe's chat_template_kwargs, variables of every rendering (a row's column goes over).
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, chat_template: str | None = None,
                 assistant_only_loss: bool = True, train_on_last_turn_only: bool = False,
                 no_assistant_turn: str = "error", history: str = "split",
                 generation_eos: int | list[int] | None = None, template_kwargs: dict | None = None) -> None:
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
        self.template_kwargs = dict(template_kwargs or {})
        # what apply_chat_template passes every template, then the recipe's variables; render_row sets each row's
        self._specials = dict(tokenizer.special_tokens_map)
        self._variables = {**self._specials, **self.template_kwargs}
        if chat_template in PRESETS:
            _warn_split_tokens(tokenizer, chat_template)
        self.stops = stop_tokens(tokenizer, self.template, generation_eos)
        self._stop = _alternation(self.stops)
        # what no message may write: it would end the turn or fake a message boundary (see _check_text)
        self._markup = _alternation([*self.stops, *message_delimiters(tokenizer, self.template)])
        self._inputs = TemplateInputs.probe(self.template, self._compiled, self._variables)

    def __getstate__(self) -> dict:
        """`dataset_num_proc` workers get the renderer pickled; a compiled Jinja template cannot be (it holds a
        ContextVar), so each worker compiles it again."""
        return {key: value for key, value in self.__dict__.items() if key != "_compiled"}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._compiled = _compile_jinja_template(self.template)

    def render_row(self, row: dict, where: str, row_number: int) -> list[Rendered]:
        """The row's examples: usually one; one per trained turn the template renders differently in history
        (history: split); none when the row has no assistant turn and no_assistant_turn is drop."""
        ctx = Row(where, row_number)
        self._variables = {**self._specials, **template_kwargs(row, ctx, self.template_kwargs)}
        messages, tools = self._conversation(row, ctx)
        if not any(m.role == "assistant" for m in messages):
            if self.no_assistant_turn == "drop":
                return []
            raise ctx.error("the conversation has no assistant message, so nothing would be trained",
                            "Add the assistant's answer, remove the row, or set `no_assistant_turn: drop`.")
        text = self._render([m.data for m in messages], tools, False, ctx)
        trained = self._trained_turns(messages)
        if not self.assistant_only_loss:
            examples = [self._whole_text(messages, tools, text, trained, ctx)]
        else:
            turns = {i: self._turn(messages, tools, i, text, ctx) for i in sorted(trained)}
            examples = self._examples(messages, turns, text, ctx)
        # After the turns, whose tool-call check names the message. Zephyr's template (TinyLlama's) ignores `tools`:
        # a row's answers ("I can only create calendar events") trained without the tool list it is given.
        unseen = [t["function"].get("name") for t in tools or [] if str(t["function"].get("name")) not in text]
        if unseen:
            raise ctx.error(f"the chat template does not render the row's `tools` (no {unseen[0]!r} in its text), so "
                            "the model would learn these answers without the tool list it is given", "Use a template "
                            "with a tool format (the model's own, if it has one), or drop the `tools` column.", "tools")
        return examples

    def render_messages(self, messages: list[dict], generation_prompt: bool = True) -> str:
        """A conversation with the model (`sft chat`, `sft generate`) in the text this template gives it in training:
        each message prepared as a row's (a reply's think block in the reasoning fields a template reads, reasoning as
        a thinking part), not checked as data is (a reply may be empty). Template errors propagate."""
        prepared = [Message(copy.deepcopy(m), False, f"messages[{i}]") for i, m in enumerate(messages)]
        for message in prepared:
            self._prepare(message)
        return self._compiled.render(messages=[m.data for m in prepared], tools=None, documents=None,
                                     add_generation_prompt=generation_prompt, **self._variables)

    def _examples(self, messages: list[Message], turns: dict[int, _Turn], text: str, ctx: Row) -> list[Rendered]:
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

    def _turn(self, messages: list[Message], tools: list[dict] | None, i: int, text: str, ctx: Row) -> _Turn:
        """Assistant turn i rendered as the last message: what the model generates after the generation prompt."""
        data = [m.data for m in messages]
        prompt = self._render(data[:i], tools, True, ctx)
        final = text if i == len(messages) - 1 else self._render(data[:i + 1], tools, False, ctx)
        final, start = self._align(prompt, final, messages, tools, i, ctx)
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

    def _align(self, prompt: str, final: str, messages: list[Message], tools: list[dict] | None, i: int,
               ctx: Row) -> tuple[str, int]:
        """The turn's example text and where the generated part starts in it (turn_text); an error where the
        rendering rewrites the previous message itself, so where the answer starts is unknown."""
        previous = messages[i - 1].data.get("content") if i else None
        previous = previous.strip() if isinstance(previous, str) else ""
        history = lambda: self._render([m.data for m in messages[:i]], tools, False, ctx)
        text, start = turn_text(prompt, final, previous, history, self.tokenizer)
        if text is final and previous and previous in prompt[start:]:
            raise ctx.error("the chat template renders the conversation before this assistant turn differently "
                            "once the turn is added, so where the answer starts is unknown",
                            "Use a chat_template whose generation prompt is a prefix of the rendered turn "
                            "(e.g. a preset), or set `assistant_only_loss: false`.", messages[i].label)
        return text, start

    def _with_stop(self, data: list[dict], tools: list[dict] | None, i: int, final: str, ctx: Row) -> str:
        """`final` plus the stop token the template writes after turn i when the conversation goes on (GLM: the
        next role tag, <|user|> or <|observation|>); unchanged when it writes none."""
        follower = ({"role": "tool", "content": "…"} if data[i].get("tool_calls") else {"role": "user", "content": "…"})
        try:
            longer = self._compiled.render(messages=data[:i + 1] + [follower], tools=tools, documents=None,
                                           add_generation_prompt=False, **self._variables)
        except TEMPLATE_ERRORS:
            return final
        at = common_prefix(final, longer)
        stop = self._stop.search(longer, at)
        if stop is None:
            return final
        between = longer[len(final):stop.start()] if at == len(final) else ""
        return final + (between if not between.strip() else "") + stop.group()

    def _check_rendered(self, generated: str, message: Message, ctx: Row) -> None:
        """The answer, reasoning and tool calls of the message must all be in what the template renders for it."""
        dropped = [what for what, text in (("content", message.answer), ("reasoning", message.reasoning))
                   if text.strip() and text.strip() not in generated]
        calls = [c["function"]["name"] for c in message.data.get("tool_calls") or []]
        dropped += ["tool_calls"] if any(name not in generated for name in calls) else []
        if dropped:
            # What it renders instead shows why (Kimi-K2-Thinking writes the call's id, not the function's name).
            shown = generated if len(generated) <= 160 else generated[:160] + "…"
            raise ctx.error(f"the chat template does not render this assistant message's {' and '.join(dropped)} "
                            f"in the turn the model generates (it renders {shown!r}), so it cannot be trained",
                            "Use a chat_template that supports it, or remove it from the data.", message.label)

    def _whole_text(self, messages: list[Message], tools: list[dict] | None, text: str, trained: set[int],
                    ctx: Row) -> Rendered:
        """assistant_only_loss: false: the whole rendering, minus the assistant turns that are not trained."""
        untrained = [i for i, m in enumerate(messages) if m.role == "assistant" and i not in trained]
        spans = []
        for i in untrained:
            prompt = self._render([m.data for m in messages[:i]], tools, True, ctx)
            start = common_prefix(prompt, text)  # the whole text is trained here, so a rough start is enough
            stop = self._stop.search(text, start)
            spans.append((start, stop.end() if stop else len(text)))
        return Rendered(text, complement(spans, len(text)), append_eos=False, add_special_tokens=False)

    def _conversation(self, row: dict, ctx: Row) -> tuple[list[Message], list[dict] | None]:
        """The row's messages, prepared for this template, and its tool list."""
        messages, tools = conversation(row, ctx)
        for message in messages:
            self._check_text(message, ctx)
            self._prepare(message)
        return messages, tools

    def _check_text(self, message: Message, ctx: Row) -> None:
        """A message's text holds no stop token and no token the template writes between messages: the tokenizer
        would encode it as that token, not as the text the data wrote. A stop token cuts the turn there; a message
        boundary (<|im_start|>, [INST], <s>) teaches the model to fake one. Other added tokens are kept."""
        calls = [call["function"]["arguments"] for call in message.data.get("tool_calls") or []]
        texts = [message.data["content"], message.data.get("reasoning_content") or "",
                 *(text if isinstance(text, str) else json.dumps(text, ensure_ascii=False) for text in calls)]
        found = next((match.group() for text in texts if (match := self._markup.search(text))), None)
        if found is None:
            return
        what = ("a token generation stops on, so the turn would end there" if found in self.stops else
                "a token the chat template writes between messages: it would be encoded as that token, not as the "
                "text written, and the model would learn to fake a message boundary")
        raise ctx.error(f"this {message.role} message contains {found!r}, {what}", f"Remove {found!r} from the "
                        "message, or write it so that it is not that token (e.g. with a space inside).", message.label)

    def _prepare(self, message: Message) -> None:
        """Reasoning under the names templates read; a <think> block in the content moves there when the template
        reads reasoning fields (others render the content verbatim, think block included)."""
        data = message.data
        content = data["content"]
        message.answer = content
        think = THINK.match(content) if message.role == "assistant" else None
        if think and self._inputs.reads_reasoning and not data.get("reasoning_content"):
            data["reasoning_content"], data["content"] = think.group(1).strip("\n"), content[think.end():]
            message.answer = data["content"]
        if data.get("reasoning_content"):
            data["thinking"] = message.reasoning = data["reasoning_content"]  # GPT-OSS reads `thinking`
        elif think and not self._inputs.reads_reasoning:
            message.answer = content[think.end():]  # rendered verbatim; a template that drops it is refused
            message.reasoning = think.group(1)
        if self._inputs.thinking_parts and data.get("reasoning_content"):
            # the only form these templates render reasoning in; an empty answer (a call) gets no text part
            answer = [{"type": "text", "text": data["content"]}] if data["content"] else []
            data["content"] = [{"type": "thinking", "thinking": data.pop("reasoning_content")}] + answer
            del data["thinking"]
        elif self._inputs.parts:
            data["content"] = [{"type": "text", "text": data["content"]}]
        for call in data.get("tool_calls") or []:
            call["function"]["arguments"] = self._inputs.arguments(call["function"]["arguments"])
        if data.get("tool_calls") and not data["content"] and self._inputs.null_call_content:
            data["content"] = None  # a call-only message as OpenAI writes it, the only form this template renders

    def _trained_turns(self, messages: list[Message]) -> set[int]:
        """Indices of the assistant messages whose tokens are trained."""
        trained = [i for i, m in enumerate(messages) if m.role == "assistant" and m.trained]
        if self.train_on_last_turn_only:
            last = max(i for i, m in enumerate(messages) if m.role == "assistant")
            trained = [i for i in trained if i == last]
        return set(trained)

    def _render(self, messages: list[dict], tools: list[dict] | None, generation_prompt: bool, ctx: Row) -> str:
        """The template's text for `messages`; template errors become SFTError naming the row.

        The compiled template is called directly with what apply_chat_template passes (the special tokens): the
        same text at about half the cost, which matters because each trained turn renders twice.
        """
        try:
            return self._compiled.render(messages=messages, tools=tools, documents=None,
                                         add_generation_prompt=generation_prompt, **self._variables)
        except TEMPLATE_ERRORS as exc:
            # The template's own words say what it wants; only an alternation complaint gets that hint. A sandbox
            # refusal is the template's, not the row's: it fails on every row, in apply_chat_template too.
            hint = ("Alternate user and assistant turns in the row" if "alternate" in str(exc)
                    else "The template changes a list or dict in place, which transformers' sandboxed Jinja refuses "
                    "(`.append(...)`, `.update(...)`) on every row; write it as `{% set x = x + [item] %}`"
                    if isinstance(exc, SecurityError) else "Fix the row's messages to fit the template")
            raise ctx.error(f"the chat template rejected the conversation ({type(exc).__name__}: {exc})",
                            f"{hint}, or choose another chat_template.") from None


def _example(text: str, turns: list[_Turn]) -> Rendered:
    """One tokenizable example: the template's `text` with the turns' spans and kinds."""
    return Rendered(text, [(t.start, t.end) for t in turns], append_eos=False, add_special_tokens=False,
                    kinds=[k for t in turns for k in t.kinds])


def _kinds(text: str, start: int, stop: int, end: int, message: Message) -> list[tuple[int, int, str]]:
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
    """The reasoning of a turn with its think tags, or an empty think block the template writes anyway."""
    if reasoning:
        at = text.find(reasoning, start, stop)
        if at < 0:
            return None
        opening = [tag.start() for tag in THINK_OPEN.finditer(text, start, at)]
        closing = THINK_CLOSE.search(text, at + len(reasoning), stop)
        return opening[-1] if opening else at, closing.end() if closing else at + len(reasoning)
    block = EMPTY_THINK.search(text, start, stop)
    return block.span() if block else None


def _warn_split_tokens(tokenizer: PreTrainedTokenizerBase, preset: str) -> None:
    """Warn when the preset's special tokens are not single tokens of this tokenizer (a base model's)."""
    split = tokens_not_in_vocab(tokenizer, preset)
    if split:
        log.warning("chat_template %s writes %s, which this tokenizer splits into pieces (the trained end of a turn "
                    "may then merge with the newline after it). Add them with "
                    "sft.data.chat_templates.prepare_tokenizer_for_template and resize the embeddings.",
                    preset, ", ".join(split))


def _skip_space(text: str, pos: int) -> int:
    """The first index at or after `pos` that is not whitespace."""
    while pos < len(text) and text[pos].isspace():
        pos += 1
    return pos


def _alternation(tokens: list[str]) -> re.Pattern:
    """A regex matching any of `tokens`, longest first (so <|end|> never shadows <|endoftext|>)."""
    unique = sorted({t for t in tokens if t}, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, unique)) or "(?!)")


def complement(spans: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    """[0, length) minus `spans`."""
    out, pos = [], 0
    for start, end in sorted(spans):
        if start > pos:
            out.append((pos, start))
        pos = max(pos, end)
    return out + ([(pos, length)] if pos < length else [])
