"""Show tokenized examples with their trained tokens marked, for `sft data --show N`."""

from typing import Any

from transformers import PreTrainedTokenizerBase

from sft.data.encode import IGNORE_INDEX

GREEN, RESET = "\033[1;32m", "\033[0m"  # bold green for trained text; plain for context
OPEN, CLOSE = "[[", "]]"  # the same marks for log files and pipes
# Trained chat pieces shown apart from the answer: colour on a terminal, a named mark elsewhere.
KIND_COLORS = {"reasoning": "\033[1;35m", "channel": "\033[1;36m", "tool_call": "\033[1;33m"}


def show_examples(dataset: Any, tokenizer: PreTrainedTokenizerBase, n: int, color: bool,
                  encoder_decoder: bool = False) -> str:
    """The first n examples (input_ids + labels) as text, trained tokens highlighted, with per-run token counts."""
    count = min(n, len(dataset))
    show = _show_pair if encoder_decoder else _show_one
    blocks = [show(dataset[i], tokenizer, i + 1, count, color) for i in range(count)]
    return "\n\n".join(blocks)


def _show_pair(example: dict, tokenizer: PreTrainedTokenizerBase, number: int, count: int, color: bool) -> str:
    """An encoder-decoder example: the encoder input, then its labels (the target, all trained)."""
    ids, labels = example["input_ids"], [t for t in example["labels"] if t != IGNORE_INDEX]
    header = f"=== example {number}/{count}: {len(ids)} source tokens, {len(labels)} target tokens (all trained) ==="
    source, target = (tokenizer.decode(t, skip_special_tokens=False) for t in (ids, labels))
    return f"{header}\n{source}\n--- target:\n{_mark(target, color)}"


def _show_one(example: dict, tokenizer: PreTrainedTokenizerBase, number: int, count: int, color: bool) -> str:
    """One example: a header with counts, the marked text, and the size of each trained run."""
    ids, labels = list(example["input_ids"]), list(example["labels"])
    marks = _token_marks(labels, example.get("kinds") or [])
    runs = _runs(marks)
    pieces = _run_texts(ids, runs, tokenizer)
    trained_runs = _run_sizes(marks)
    trained = sum(trained_runs)
    share = f"{100 * trained / len(ids):.1f}%" if ids else "0%"
    header = f"=== example {number}/{count}: {len(ids)} tokens, {trained} trained ({share}) ==="
    body = "".join(_mark(text, color, run[2]) if run[2] else text for run, text in zip(runs, pieces))
    legend = "trained tokens per turn: " + (", ".join(f"#{k} {size}" for k, size in enumerate(trained_runs, 1))
                                            if trained_runs else "none")
    kinds = sorted({m for m in marks if m in KIND_COLORS})
    key = f" (marked apart: {', '.join(kinds)})" if kinds else ""
    return f"{header}\n{body}\n--- {legend}{key}"


def _token_marks(labels: list[int], kinds: list) -> list[str]:
    """Per token: "" (context), "trained", or the kind of a trained chat piece (reasoning, channel, tool_call)."""
    marks = ["trained" if label != IGNORE_INDEX else "" for label in labels]
    for first, end, kind in kinds:
        if kind in KIND_COLORS:
            for i in range(first, min(end, len(marks))):
                marks[i] = kind if marks[i] else ""
    return marks


def _run_sizes(marks: list[str]) -> list[int]:
    """Sizes of the maximal runs of trained tokens, whatever their kind (each run is one turn or completion)."""
    return [end - start for start, end, trained in _runs([bool(m) for m in marks]) if trained]


def _runs(flags: list) -> list[tuple[int, int, Any]]:
    """Maximal runs [start, end) of equal flags."""
    runs: list[tuple[int, int, Any]] = []
    for i, flag in enumerate(flags):
        if runs and runs[-1][2] == flag:
            runs[-1] = (runs[-1][0], i + 1, flag)
        else:
            runs.append((i, i + 1, flag))
    return runs


def _run_texts(ids: list[int], runs: list[tuple[int, int, bool]], tokenizer: PreTrainedTokenizerBase) -> list[str]:
    """The text of each run, cut from decodes of growing prefixes so spaces at run boundaries are kept."""
    texts, previous = [], ""
    for start, end, _ in runs:
        decoded = tokenizer.decode(ids[:end], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        if decoded.startswith(previous):
            texts.append(decoded[len(previous):])
        else:  # a decoder that rewrites earlier text (rare): fall back to decoding the run alone
            texts.append(tokenizer.decode(ids[start:end], skip_special_tokens=False))
        previous = decoded
    return texts


def _mark(text: str, color: bool, kind: str = "trained") -> str:
    """Highlight trained text (a named mark for reasoning, channel and tool-call pieces); colour is reset before
    each newline so a terminal does not bleed it."""
    if color:
        start = KIND_COLORS.get(kind, GREEN)
        return start + text.replace("\n", f"{RESET}\n{start}") + RESET
    return OPEN + (f"{kind}: " if kind in KIND_COLORS else "") + text + CLOSE
