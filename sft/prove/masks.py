"""Proof 1, masks: on sampled rows, the trained tokens are exactly the assistant output, each trained turn through
the token generation stops on.

The expected mask is derived here, not read back from the encoder: for chat rows, from the chat template's own
renderings (answer i starts where `render(messages[:i], add_generation_prompt=True)` ends and runs through the first
stop token, i.e. the tokenizer's EOS, the generation config's EOS ids and the template's end-of-turn token, as
`sft.generation` stops on them); for plain formats, from the row's answer column and EOS. The encoder's labels are
then compared with it token by token.
"""

import json
import random
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from transformers import GenerationConfig, PreTrainedTokenizerBase

from sft.chat import SHAREGPT_ROLES
from sft.encode import IGNORE_INDEX
from sft.formats import CHAT_FORMATS
from sft.generation import stop_token_ids
from sft.masks import show_examples
from sft.prove.bench import Bench
from sft.prove.result import Proof

ANSWER = {"alpaca": "output", "prompt_completion": "completion", "seq2seq": "target", "text": "text"}


@dataclass
class Expected:
    """The characters of `text` that must be trained, and turns this proof could not place."""

    text: str
    regions: list[tuple[int, int]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # turns that end without a stop token
    unplaced: int = 0  # turns of templates that re-render earlier text (not prefix-preserving)


def prove_masks(bench: Bench, rows: int, encode_row: Callable[[dict, int], dict | None] | None = None) -> Proof:
    """Check sft's row encoder (`encode_row`, default the recipe's) on `rows` sampled rows."""
    raw, fmt, _ = bench.raw
    encode_row = encode_row or bench.row_encoder()
    stops = stop_ids(bench)
    tally: Counter = Counter()
    evidence = ""
    for index in sorted(random.Random(0).sample(range(len(raw)), min(rows, len(raw)))):
        encoded = encode_row(raw[index], index + 1)
        if encoded is None:
            tally["dropped"] += 1
            continue
        check = check_chat_row if chat_row(raw[index], fmt) else check_plain_row
        problems = check(bench, raw[index], fmt, encoded, stops, tally)
        tally["rows"] += 1
        if problems and not evidence:
            view = show_examples([encoded], bench.tokenizer, 1, color=False, encoder_decoder=bench.encoder_decoder)
            evidence = f"row {index + 1}: " + "; ".join(problems) + "\n" + view
    figure = (f"{tally['rows']} rows, {tally['turns']} trained answers: {tally['extra']} non-answer tokens trained, "
              f"{tally['missing']} answer tokens untrained, {tally['no_stop']} answers without a stop token; "
              f"{tally['cut']} answers cut by truncation")
    figure += f", {tally['unplaced']} turns not prefix-rendered (unchecked)" if tally["unplaced"] else ""
    passed = not evidence and tally["turns"] > 0
    return Proof("masks", passed, figure, evidence or ("" if passed else "no trained answer was checked"))


def stop_ids(bench: Bench) -> set[int]:
    """The ids generation stops on: tokenizer EOS, the recipe model's generation config, the template's end."""
    config = GenerationConfig()
    for name in (bench.recipe.model_name_or_path, bench.base.model_name_or_path):
        try:
            config = GenerationConfig.from_pretrained(name)
            break
        except (OSError, ValueError):
            continue
    return stop_token_ids(bench.tokenizer, config)


def chat_row(row: dict, fmt: str) -> bool:
    return fmt in CHAT_FORMATS or (fmt == "prompt_completion" and isinstance(row.get("prompt"), list))


# ---------------------------------------------------------------------------------------------------------------
# Chat rows: the expected mask from the template's renderings
# ---------------------------------------------------------------------------------------------------------------

def check_chat_row(bench: Bench, row: dict, fmt: str, encoded: dict, stops: set[int], tally: Counter) -> list[str]:
    """Compare the encoder's labels with the answers located in the template's renderings."""
    tokenizer = bench.tokenizer
    messages, trained, tools = conversation(row, bench.base.train_on_last_turn_only)
    render = lambda msgs, prompt: tokenizer.apply_chat_template(  # noqa: E731
        msgs, tools=tools, add_generation_prompt=prompt, tokenize=False)
    text = render(messages, False)
    tokens = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    expected = Expected(text)
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    for i in turns:
        region = answer_region(render, messages, i, text, tokens, stops, expected)
        if region and (i in trained) == bench.base.assistant_only_loss:
            expected.regions.append(region)
    if not bench.base.assistant_only_loss:  # everything but the excluded answers is trained
        expected.regions = complement(expected.regions, len(text))
    tally["turns"] += sum(1 for i in turns if i in trained)
    tally["unplaced"] += expected.unplaced
    tally["no_stop"] += len(expected.problems)
    return expected.problems + compare(tokens, encoded, expected, tokenizer, tally)


def answer_region(render: Callable, messages: list[dict], i: int, text: str, tokens: Any, stops: set[int],
                  expected: Expected) -> tuple[int, int] | None:
    """[end of the generation prompt, end of the first stop token) of assistant turn i, or None if unplaceable."""
    prompt, through = render(messages[:i], True), render(messages[:i + 1], False)
    if not (text.startswith(prompt) and text.startswith(through)):
        expected.unplaced += 1
        return None
    start, bound = len(prompt), len(through)
    for token_id, (a, b) in zip(tokens["input_ids"], tokens["offset_mapping"]):
        if a >= start and b <= bound and token_id in stops:
            return start, b
        if a >= bound:
            break
    tail = text[start:bound][-30:]
    expected.problems.append(f"answer {i} ends ...{tail!r} without a token generation stops on")
    return start, bound


def conversation(row: dict, last_only: bool) -> tuple[list[dict], set[int], list | None]:
    """The row's messages as the template sees them, the indices of trained answers, and its tools."""
    if row.get("messages") is not None:
        turns, trainable = list(row["messages"]), None
    elif row.get("conversations") is not None:
        turns, trainable = [sharegpt(t) for t in row["conversations"]], None
    else:
        turns, trainable = list(row["prompt"]) + list(row["completion"]), len(row["prompt"])
    messages = [message(t) for t in turns]
    if isinstance(row.get("system"), str) and row["system"].strip() and messages[0]["role"] != "system":
        messages.insert(0, {"role": "system", "content": row["system"]})
        turns, trainable = [None, *turns], trainable + 1 if trainable is not None else None
    trained = {i for i, (m, t) in enumerate(zip(messages, turns))
               if m["role"] == "assistant" and wants_training(t) and (trainable is None or i >= trainable)}
    if last_only and trained:
        trained = {max(i for i, m in enumerate(messages) if m["role"] == "assistant")} & trained
    tools = row.get("tools")
    tools = json.loads(tools) if isinstance(tools, str) and tools else drop_nulls(tools) or None
    return messages, trained, [t if "function" in t else {"type": "function", "function": t} for t in tools or []] or None


def message(raw: dict) -> dict:
    """role/content (text parts joined), tool calls with parsed arguments, tool_call_id and name."""
    content = raw.get("content")
    if isinstance(content, list):
        content = "".join(part["text"] for part in content)
    out = {"role": raw["role"], "content": content or ""}
    if raw.get("tool_calls"):
        out["tool_calls"] = [tool_call(call) for call in raw["tool_calls"]]
    out.update({k: raw[k] for k in ("tool_call_id", "name") if isinstance(raw.get(k), str)})
    return out


def tool_call(call: dict) -> dict:
    call = drop_nulls(call)
    function = call.get("function", call)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        arguments = json.loads(arguments)
    return {**{k: v for k, v in call.items() if k != "function"}, "type": "function",
            "function": {"name": function["name"], "arguments": arguments}}


def sharegpt(turn: dict) -> dict:
    role = SHAREGPT_ROLES[turn["from"]]
    return {"role": role, "content": turn["value"], "train": turn.get("train"), "weight": turn.get("weight")}


def wants_training(raw: Any) -> bool:
    return not isinstance(raw, dict) or (raw.get("train") is not False and raw.get("weight") not in (0, 0.0))


def drop_nulls(value: Any) -> Any:
    """Arrow fills keys absent from a row with null when it unifies structs; templates must not see them."""
    if isinstance(value, dict):
        return {k: drop_nulls(v) for k, v in value.items() if v is not None}
    return [drop_nulls(v) for v in value] if isinstance(value, list) else value


def complement(regions: list[tuple[int, int]], length: int) -> list[tuple[int, int]]:
    out, pos = [], 0
    for a, b in sorted(regions):
        out += [(pos, a)] if a > pos else []
        pos = max(pos, b)
    return out + ([(pos, length)] if pos < length else [])


def compare(tokens: Any, encoded: dict, expected: Expected, tokenizer: PreTrainedTokenizerBase,
            tally: Counter) -> list[str]:
    """Token-level comparison of the encoder's labels with the expected regions (truncation aware)."""
    ids, labels, mine = list(encoded["input_ids"]), list(encoded["labels"]), tokens["input_ids"]
    shift = len(mine) - len(ids) if encoded.get("truncated") and mine[-len(ids):] == ids else 0
    if mine[shift:shift + len(ids)] != ids:
        return ["the encoder's tokens are not the template's rendering of this conversation"]
    kept = range(shift + 1, shift + len(ids))  # the first kept token is never trained: nothing predicts it
    want = {p for p, (a, b) in enumerate(tokens["offset_mapping"])
            if any(a < end and b > start for start, end in expected.regions)}
    tally["cut"] += sum(1 for start, end in expected.regions
                        if any(p not in kept for p, (a, b) in enumerate(tokens["offset_mapping"]) if a < end and b > start))
    got = {shift + p for p, label in enumerate(labels) if label != IGNORE_INDEX}
    extra, missing = sorted(got - want), sorted(p for p in want - got if p in kept)
    tally["extra"] += len(extra)
    tally["missing"] += len(missing)
    problems = [f"{len(extra)} tokens outside the answers are trained: {tokenizer.decode([mine[p] for p in extra])!r}"
                ] if extra else []
    if missing:
        problems.append(f"{len(missing)} answer tokens are untrained: {tokenizer.decode([mine[p] for p in missing])!r}")
    return problems


# ---------------------------------------------------------------------------------------------------------------
# Plain formats: the trained tokens are the row's answer column plus EOS
# ---------------------------------------------------------------------------------------------------------------

def check_plain_row(bench: Bench, row: dict, fmt: str, encoded: dict, stops: set[int], tally: Counter) -> list[str]:
    """The trained tokens decode to the row's answer (one boundary token may start in the prompt) and end in EOS."""
    ids, labels = list(encoded["input_ids"]), list(encoded["labels"])
    completion_only = bool(bench.base.completion_only_loss) and fmt != "text"
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
