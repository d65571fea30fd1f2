"""Proof 1, masks: on sampled rows, the trained tokens are exactly the assistant output, each trained turn through
the token generation stops on.

The expected mask is derived here, not read back from the encoder. Chat rows: from the chat template's own
renderings, answer i starts where P = `render(messages[:i], add_generation_prompt=True)` and
F = `render(messages[:i + 1])` first differ (the end of P for prefix-preserving templates; never inside an added
token of P, sft.data.turns) and runs through the
first token generation stops on (`sft.data.stops.stop_token_ids`: the tokenizer's EOS, the generation
config's EOS ids, the template's end of turn); where F writes none after the answer starts (GLM-4.5), through the
stop token the template writes when the conversation goes on (a user message, a tool result after a call). Each
example the encoder makes of a row (the whole conversation, or one answer in its own context under
`history: split`) is located among these renderings and compared token by token: no trained token outside the
answers the policy trains, and each such answer fully trained in some example.
The row is read into messages as sft reads it (sft.data.messages.conversation: ShareGPT `function_call` turns
become tool calls): parsing is shared, the mask is not.
Plain formats: the decoded trained tokens are the row's answer column, ending in EOS.
"""
import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from jinja2 import TemplateError
from transformers import PreTrainedTokenizerBase

from sft.check.prove.bench import Bench
from sft.check.prove.result import Proof
from sft.data.chat import THINK, complement
from sft.data.encode import IGNORE_INDEX
from sft.data.formats import CHAT_FORMATS
from sft.data.messages import Row, template_kwargs
from sft.data.messages import conversation as read_conversation
from sft.data.show import show_examples
from sft.data.stops import stop_token_ids
from sft.data.turns import common_prefix, turn_text
from sft.models.loading import generation_eos

ANSWER = {"alpaca": "output", "prompt_completion": "completion", "seq2seq": "target", "text": "text"}


@dataclass
class Coverage:
    """Per conversation: answers found in some example, fully trained in one, cut by truncation, without stop."""

    placed: set[int] = field(default_factory=set)
    covered: set[int] = field(default_factory=set)
    cut: set[int] = field(default_factory=set)
    stopless: set[int] = field(default_factory=set)
    extra: int = 0  # trained tokens outside the trained answers
    untrained: dict[int, str] = field(default_factory=dict)  # text an answer leaves untrained


@dataclass
class Turn:
    """Assistant message i: its generation prompt P = render(messages[:i], add_generation_prompt=True), its
    rendering F = render(messages[:i + 1]) (continued through the stop token the template writes next where F
    ends no turn), whether the recipe's policy trains it, and the answer [start, end) in `text`, None without a
    stop token."""

    index: int
    prompt: str
    text: str
    trained: bool
    answer: tuple[int, int] | None

    def opens(self, text: str) -> bool:
        """Whether `text` holds this turn's answer: it starts with the turn's rendering through the answer."""
        return text.startswith(self.text[:self.answer[1]] if self.answer else self.text)


def prove_masks(bench: Bench, rows: int, encode_row: Callable[[dict, int], list[dict]] | None = None) -> Proof:
    """Check sft's row encoder (`encode_row`: row -> examples, default the recipe's) on `rows` sampled rows."""
    raw, decided = bench.raw
    fmt = decided.format
    encode_row = encode_row or bench.row_encoder()
    stops = stop_ids(bench)
    tally: Counter = Counter()
    evidence, reads = "", None  # reads: how the template renders reasoning, probed at the first chat row
    for index in sorted(random.Random(0).sample(range(len(raw)), min(rows, len(raw)))):
        examples = encode_row(raw[index], index + 1)
        if not examples:
            tally["dropped"] += 1
            continue
        if chat_row(raw[index], fmt):
            reads = reads_reasoning(bench.tokenizer, bench.base.chat_template_kwargs) if reads is None else reads
            problems, shown = check_chat_row(bench, raw[index], fmt, examples, stops, tally, reads)
        else:
            problems, shown = check_plain_row(bench, raw[index], fmt, examples, stops, tally)
        tally["rows"] += 1
        tally["examples"] += len(examples)
        if problems and not evidence:
            view = show_examples([shown], bench.tokenizer, 1, color=False, encoder_decoder=bench.encoder_decoder)
            evidence = f"row {index + 1}: " + "; ".join(problems) + "\n" + view
    figure = (f"{tally['rows']} rows, {tally['turns']} trained answers: {tally['extra']} non-answer tokens trained, "
              f"{tally['missing']} answers not fully trained, {tally['no_stop']} answers without a stop token; "
              f"{tally['cut']} answers cut by truncation")
    figure += f", {tally['examples'] - tally['rows']} split examples" if tally["examples"] > tally["rows"] else ""
    figure += f", {tally['unplaced']} answers rendered differently in context (untrained)" if tally["unplaced"] else ""
    passed = not evidence and tally["turns"] > 0
    return Proof("masks", passed, figure, evidence or ("" if passed else "no trained answer was checked"))


def stop_ids(bench: Bench) -> set[int]:
    """The ids generation stops on: tokenizer EOS, the recipe model's generation config, the template's end."""
    names = (bench.recipe.model_name_or_path, bench.base.model_name_or_path)
    eos = next((ids for ids in map(generation_eos, names) if ids is not None), None)
    return stop_token_ids(bench.tokenizer, eos)


def chat_row(row: dict, fmt: str) -> bool:
    return fmt in CHAT_FORMATS or (fmt == "prompt_completion" and isinstance(row.get("prompt"), list))


# ---------------------------------------------------------------------------------------------------------------
# Chat rows: the expected mask from the template's renderings
# ---------------------------------------------------------------------------------------------------------------

def check_chat_row(bench: Bench, row: dict, fmt: str, examples: list[dict], stops: set[int],
                   tally: Counter, reads: str | None = None) -> tuple[list[str], dict]:
    """Each example must be a rendering of the conversation (whole, or up to one answer: `history: split`) whose
    trained tokens lie in the answers the policy trains; each such answer must be fully trained in one of them.
    `reads`: how the template renders reasoning (`reads_reasoning`; probed here when None)."""
    messages, trained, tools = conversation(row, bench.base.train_on_last_turn_only)
    variables = template_kwargs(row, Row("(the masks proof)", 0), bench.base.chat_template_kwargs)
    render = lambda msgs, prompt: bench.tokenizer.apply_chat_template(  # noqa: E731
        msgs, tools=tools, add_generation_prompt=prompt, tokenize=False, **variables)
    reads = reads_reasoning(bench.tokenizer, bench.base.chat_template_kwargs) if reads is None else reads
    messages = template_form(render, thinking_read(reads, messages))
    if reads == "parts":  # Magistral, Ministral-3 Reasoning render reasoning only from a thinking content part
        messages = [thinking_part(m) for m in messages]
    turns = [expected_turn(render, messages, i, i in trained, bench.tokenizer, stops)
             for i, m in enumerate(messages) if m["role"] == "assistant"]
    candidates = [render(messages, False)] + [t.text for t in turns]
    problems, shown, seen = [], examples[0], Coverage()
    for example in examples:
        found = locate(example, candidates, bench.tokenizer)
        if found is None:
            problems.append("the encoder's tokens are not the template's rendering of this conversation")
            shown = example
            continue
        text, tokens, shift = found
        regions = {t.index: t.answer for t in turns if t.opens(text)}
        example_problems = check_example(bench, example, turns, regions, tokens, shift, len(text), seen)
        problems, shown = problems + example_problems, example if example_problems else shown
    missing = [t.index for t in turns if t.trained and t.index in seen.placed - seen.covered - seen.cut - seen.stopless]
    tally.update(turns=sum(t.trained for t in turns), missing=len(missing), cut=len(seen.cut), extra=seen.extra,
                 no_stop=len(seen.stopless), unplaced=sum(t.trained and t.index not in seen.placed for t in turns))
    problems += [f"answer messages[{i}] is never fully trained through its stop token (untrained: "
                 f"{seen.untrained.get(i, '')!r})" for i in missing]
    return problems, shown


def expected_turn(render: Callable, messages: list[dict], i: int, trained: bool,
                  tokenizer: PreTrainedTokenizerBase, stops: set[int]) -> Turn:
    """Turn i as the rule defines it: F, or, where F writes no stop token after the answer starts (GLM ends no
    turn), F through the first stop token the template writes when the conversation goes on."""
    prompt, text = render(messages[:i], True), render(messages[:i + 1], False)
    previous = messages[i - 1]["content"] if i else None
    previous = previous.strip() if isinstance(previous, str) else ""
    text, start = turn_text(prompt, text, previous, lambda: render(messages[:i], False), tokenizer)
    if stop_span(text, start, tokenizer, stops) is None:
        text = continued(render, messages, i, text, tokenizer, stops)
    stop = stop_span(text, start, tokenizer, stops)
    return Turn(i, prompt, text, trained, (start, stop[1]) if stop else None)


def template_form(render: Callable, messages: list[dict]) -> list[dict]:
    """The messages as the template reads them: as written, with content as typed text parts (Idefics3 and
    LLaVA-Next read only parts), or with tool-call arguments as a JSON string (DeepSeek-V3 concatenates them):
    the first form whose rendering holds every message's content."""
    parts = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in messages]
    strings = [{**m, "tool_calls": [string_arguments(c) for c in m["tool_calls"]]} if m.get("tool_calls") else m
               for m in messages]
    for form in (messages, parts, strings):
        try:
            whole = render(form, False)
        except (TemplateError, TypeError):  # TypeError: a template adding a mapping to a string
            continue
        if all(m["content"].strip() in whole for m in messages):
            return form
    return messages


def reads_reasoning(tokenizer: PreTrainedTokenizerBase, variables: dict | None = None) -> str:
    """How the template renders an answer's reasoning: "fields" (GPT-OSS, Nemotron-3), "parts" (only from a thinking
    content part: Magistral, Ministral-3 Reasoning) or "" (not at all); probed once per proof. The mark's NULs come
    out escaped where a template prints a content list as it is (its repr), which reads no parts."""
    mark = "\x00PROBE\x00"
    answer = {"role": "assistant", "content": "hi", "reasoning_content": mark, "thinking": mark}
    for form, message in (("fields", answer), ("parts", thinking_part(answer))):
        try:
            if mark in tokenizer.apply_chat_template([{"role": "user", "content": "hi"}, message],
                                                     add_generation_prompt=False, tokenize=False, **(variables or {})):
                return form
        except (TemplateError, TypeError):
            continue
    return ""


def thinking_part(message: dict) -> dict:
    """The message with its reasoning as a {"type": "thinking"} content part, its answer a text part after it."""
    if not message.get("reasoning_content"):
        return message
    answer = [{"type": "text", "text": message["content"]}] if message["content"] else []
    rest = {k: v for k, v in message.items() if k not in ("reasoning_content", "thinking")}
    return {**rest, "content": [{"type": "thinking", "thinking": message["reasoning_content"]}] + answer}


def thinking_read(reads: str, messages: list[dict]) -> list[dict]:
    """A <think> block opening an answer's content is its reasoning for a template that renders reasoning fields
    (`reads`: GPT-OSS, Nemotron-3 would otherwise show the block as answer text) or a thinking part; others render
    it verbatim."""
    out = []
    for m in messages:
        think = THINK.match(m["content"]) if reads and m["role"] == "assistant" else None
        reasoning = think.group(1).strip("\n") if think and "reasoning_content" not in m else None
        out.append({**m, "content": m["content"][think.end():], "reasoning_content": reasoning,
                    "thinking": reasoning} if reasoning is not None else m)
    return out


def string_arguments(call: dict) -> dict:
    arguments = call["function"]["arguments"]  # a string where the row's is not a JSON object: kept as written
    return {**call, "function": {**call["function"],
                                 "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}}


def continued(render: Callable, messages: list[dict], i: int, text: str, tokenizer: PreTrainedTokenizerBase,
              stops: set[int]) -> str:
    """F (`text`) followed by the first stop token the template writes when a user message follows turn i (a
    tool result after a tool call); F when it writes none. The rendering through that token where it extends
    F; else F and the token alone (GLM drops a think block once the turn is history)."""
    follower = {"role": "tool" if messages[i].get("tool_calls") else "user", "content": "…"}
    try:
        longer = render(messages[:i + 1] + [follower], False)
    except (TemplateError, TypeError):
        return text
    at = common_prefix(text, longer)
    stop = stop_span(longer, at, tokenizer, stops)
    if stop is None:
        return text
    return longer[:stop[1]] if at == len(text) else text + longer[stop[0]:stop[1]]


def stop_span(text: str, start: int, tokenizer: PreTrainedTokenizerBase, stops: set[int]) -> tuple[int, int] | None:
    """[start, end) of the first stop token in `text` that starts at or after `start`."""
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return next(((a, b) for token, (a, b) in zip(tokens["input_ids"], tokens["offset_mapping"])
                 if a >= start and token in stops), None)


def locate(example: dict, candidates: list[str], tokenizer: PreTrainedTokenizerBase) -> tuple[str, Any, int] | None:
    """(text, its tokens with offsets, position of the example's first token in them) of the candidate rendering
    the example's tokens are (whole, or cut by truncation on either side)."""
    ids = list(example["input_ids"])
    for text in candidates:
        tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        mine = tokens["input_ids"]
        for shift in (0, len(mine) - len(ids)):
            if shift >= 0 and mine[shift:shift + len(ids)] == ids:
                return text, tokens, shift
    return None


def check_example(bench: Bench, example: dict, turns: list[Turn], regions: dict, tokens: Any, shift: int,
                  length: int, seen: Coverage) -> list[str]:
    """Trained tokens outside the policy's answers are problems; answers fully trained or cut are recorded."""
    labels, offsets = list(example["labels"]), tokens["offset_mapping"]
    kept = set(range(shift + 1, shift + len(labels)))  # the first kept token is never trained: nothing predicts it
    overlapping = lambda region: {p for p, (a, b) in enumerate(offsets) if a < region[1] and b > region[0]}  # noqa
    trained = {t.index: t.trained for t in turns}
    stopless = [i for i, region in regions.items() if region is None and trained[i]]
    problems = [f"answer messages[{i}] ends {turn_tail(turns, i)!r} without a token generation stops on"
                for i in stopless if i not in seen.stopless]
    seen.placed |= set(regions)
    seen.stopless |= set(stopless)
    wanted = [r for i, r in regions.items() if r and trained[i] == bench.base.assistant_only_loss]
    if not bench.base.assistant_only_loss:  # everything but the excluded answers is trained
        wanted = complement(wanted, length)
    allowed = set().union(*map(overlapping, wanted))
    got = {shift + p for p, label in enumerate(labels) if label != IGNORE_INDEX}
    extra = sorted(got - allowed)
    if extra:
        problems.append(f"{len(extra)} tokens outside the trained answers are trained: "
                        f"{bench.tokenizer.decode([tokens['input_ids'][p] for p in extra])!r}")
    for i, region in regions.items():
        positions = overlapping(region) if region and trained[i] else set()
        if positions and not positions <= kept:
            seen.cut.add(i)
        elif positions and positions <= got:
            seen.covered.add(i)
        elif positions:
            seen.untrained[i] = bench.tokenizer.decode([tokens["input_ids"][p] for p in sorted(positions - got)])
    seen.extra += len(extra)
    return problems


def turn_tail(turns: list[Turn], index: int) -> str:
    return next(t.text[-30:] for t in turns if t.index == index)


def conversation(row: dict, last_only: bool) -> tuple[list[dict], set[int], list | None]:
    """The row's messages as sft reads them (sft.data.messages), reasoning also under `thinking` (GPT-OSS reads
    it), the indices of trained answers (only the last answer under `train_on_last_turn_only`), and its tools."""
    messages, tools = read_conversation(row, Row("(the masks proof)", 0))
    trained = {i for i, m in enumerate(messages) if m.role == "assistant" and m.trained}
    if last_only and trained:
        trained = {max(i for i, m in enumerate(messages) if m.role == "assistant")} & trained
    aliased = [{**m.data, "thinking": m.data["reasoning_content"]} if "reasoning_content" in m.data else m.data
               for m in messages]
    return aliased, trained, tools


# ---------------------------------------------------------------------------------------------------------------
# Plain formats: the trained tokens are the row's answer column plus EOS
# ---------------------------------------------------------------------------------------------------------------

def check_plain_row(bench: Bench, row: dict, fmt: str, examples: list[dict], stops: set[int],
                    tally: Counter) -> tuple[list[str], dict]:
    """The trained tokens decode to the row's answer (one boundary token may start in the prompt) and end in EOS."""
    encoded = examples[0]
    return plain_problems(bench, row, fmt, encoded, stops, tally), encoded


def plain_problems(bench: Bench, row: dict, fmt: str, encoded: dict, stops: set[int], tally: Counter) -> list[str]:
    ids, labels = list(encoded["input_ids"]), list(encoded["labels"])
    completion_only = bench.raw[1].completion_only_loss and fmt != "text"
    answer = str(row[ANSWER[fmt]]).strip() if completion_only else None
    trained = [p for p, label in enumerate(labels) if label != IGNORE_INDEX]
    target = labels if bench.encoder_decoder else ids
    tally["turns"] += 1
    if not trained:
        tally["missing" if not encoded.get("truncated") else "cut"] += 1
        return [] if encoded.get("truncated") else ["nothing is trained"]
    problems = []
    first = 0 if bench.encoder_decoder else (1 if answer is None else trained[0])
    if trained != list(range(first, len(labels))):
        problems.append(f"trained positions {trained[0]}..{trained[-1]} are not one run ending at the last token")
    if target[trained[-1]] not in stops and not encoded.get("truncated"):
        tally["no_stop"] += 1
        problems.append("the last trained token is not a token generation stops on")
    if encoded.get("truncated") and target[trained[-1]] not in stops:
        tally["cut"] += 1
    if answer is not None and not encoded.get("truncated"):
        decode = lambda span: bench.tokenizer.decode([target[p] for p in span], skip_special_tokens=True)  # noqa: E731
        whole, inner = decode(trained).strip(), decode(trained[1:]).strip()
        if answer not in whole or inner not in answer:
            tally["extra" if answer in whole else "missing"] += 1
            problems.append(f"trained text {whole[:80]!r} is not the answer {answer[:80]!r}")
    return problems
