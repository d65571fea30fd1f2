"""Tokenize rendered examples and build labels from character spans, through the fast tokenizer's alignments."""

from dataclasses import dataclass

from tokenizers import Encoding as TokenAlignment
from transformers import PreTrainedTokenizerBase

from sft.data.formats import Rendered

IGNORE_INDEX = -100
MARKED = ("reasoning", "channel", "tool_call")  # chat pieces whose tokens are counted and shown apart


@dataclass
class Encoding:
    """Settings that turn Rendered rows into input_ids and labels."""

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    truncation_side: str = "right"

    def __post_init__(self) -> None:
        # A tokenizer.json saved after a padded call keeps that padding and truncation (TinyLlama-Chat's pads every
        # row to 2048 with </s>); transformers resets them on each call, but encode() calls the backend directly, so
        # rows came back padded with EOS, the appended EOS fell past max_length and was never trained.
        if self.tokenizer.is_fast:
            self.tokenizer.backend_tokenizer.no_padding()
            self.tokenizer.backend_tokenizer.no_truncation()

    def encode(self, rows: list[Rendered]) -> dict[str, list]:
        """Tokenize a batch; per row: input_ids, labels, length, truncated, trained and reasoning (token counts),
        split (an extra example of a chat row), kinds (token runs [first, last) of the MARKED chat pieces) and
        answer_offset."""
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": [], "trained": [],
                                "answer_offset": [], "reasoning": [], "split": [], "kinds": []}
        encoded: list = [None] * len(rows)
        for flag in (True, False):  # one batched call with the tokenizer's BOS/EOS template, one without
            picked = [i for i, r in enumerate(rows) if r.add_special_tokens is flag]
            if picked:
                batch = self.tokenizer.backend_tokenizer.encode_batch([rows[i].text for i in picked],
                                                                      add_special_tokens=flag)
                for i, alignment in zip(picked, batch):
                    encoded[i] = alignment
        for row, alignment in zip(rows, encoded):
            self._add_row(row, alignment, out)
        return out

    def _add_row(self, row: Rendered, alignment: TokenAlignment, out: dict[str, list]) -> None:
        head, tail = added_twice(alignment) if row.add_special_tokens else (0, 0)
        ids = alignment.ids[head:len(alignment.ids) - tail]
        labels = trained_labels(alignment, row.spans)[head:len(alignment.ids) - tail]
        if head and labels:
            labels[0] = IGNORE_INDEX  # the text's own BOS, now the first token
        eos = self.tokenizer.eos_token_id
        if row.append_eos and eos is not None:
            if not ids or ids[-1] != eos:  # not already appended by the tokenizer (add_eos_token) or the text
                ids.append(eos)
                labels.append(IGNORE_INDEX)
            if row.spans:  # trained once, whoever appended it: the tokenizer's EOS has no characters in any span
                labels[-1] = eos
        kinds = [(a - head, b - head, kind) for start, end, kind in row.kinds if kind in MARKED
                 for a, b in [_token_run(alignment, start, end)]]
        shift = max(len(ids) - self.max_length, 0) if self.truncation_side == "left" else 0
        ids, labels, cut = self._truncate(ids, labels)
        kinds = [(max(a - shift, 0), min(b - shift, len(ids)), kind) for a, b, kind in kinds if b - shift > 0]
        out["reasoning"].append(sum(b - a - labels[a:b].count(IGNORE_INDEX) for a, b, kind in kinds
                                    if kind == "reasoning" and b > a))
        out["split"].append(int(row.split))
        out["kinds"].append([k for k in kinds if k[1] > k[0]])
        out["input_ids"].append(ids)
        out["labels"].append(labels)
        out["length"].append(len(ids))
        out["truncated"].append(cut)
        out["trained"].append(len(labels) - labels.count(IGNORE_INDEX))
        out["answer_offset"].append(0 if cut else answer_offset(alignment, row.spans))

    def _truncate(self, ids: list[int], labels: list[int]) -> tuple[list[int], list[int], bool]:
        """Cut to max_length from `truncation_side`; the new first token is never trained."""
        if len(ids) <= self.max_length:
            return ids, labels, False
        keep = slice(-self.max_length, None) if self.truncation_side == "left" else slice(0, self.max_length)
        ids, labels = ids[keep], labels[keep]
        labels[0] = IGNORE_INDEX
        return ids, labels, True


def added_twice(alignment: TokenAlignment) -> tuple[int, int]:
    """How many tokens the tokenizer added at the start and at the end that the text already has there: 1 each where
    a text row holds an already rendered chat template (`<s>[INST] ... </s>` with Mistral's or Llama-2's tokenizer,
    which add BOS, and add EOS too with add_eos_token). The model never sees two BOS at inference (apply_chat_template
    tokenizes without adding special tokens), and an EOS twice would train the second after the model has stopped."""
    ids, added = alignment.ids, alignment.special_tokens_mask
    if len(ids) < 2:
        return 0, 0
    head = int(ids[0] == ids[1] and added[0] == 1 and added[1] == 0)
    tail = int(ids[-1] == ids[-2] and added[-1] == 1 and added[-2] == 0)
    return head, tail


def trained_labels(alignment: TokenAlignment, spans: list[tuple[int, int]]) -> list[int]:
    """labels = ids of every token whose characters overlap a trained span, else -100; the first label is -100.

    A token overlapping a span boundary (one that merges the prompt's last characters with the answer's first) is
    trained: leaving it out would drop the start of the answer from the loss. Tokens are located with the
    tokenizer's own character-to-token map, so no per-token Python work is done.
    """
    ids = alignment.ids
    labels = [IGNORE_INDEX] * len(ids)
    for start, end in spans:
        first, stop = _token_run(alignment, start, end)
        labels[first:stop] = ids[first:stop]
    if labels:
        labels[0] = IGNORE_INDEX
    return labels


def answer_offset(alignment: TokenAlignment, spans: list[tuple[int, int]]) -> int:
    """How many characters of the prompt the first trained token holds (a token merging the prompt's end, e.g. the
    colon of `### Response:`, with the answer's start); generation eval cuts that token at this point."""
    if not spans:
        return 0
    start, end = spans[0]
    token = _token_at(alignment, range(start, end))
    return 0 if token is None else max(0, start - alignment.offsets[token][0])


def _token_at(alignment: TokenAlignment, chars: range) -> int | None:
    """The token covering the first character of `chars` that any token covers (some, e.g. trimmed spaces, aren't)."""
    for char in chars:
        token = alignment.char_to_token(char)
        if token is not None:
            return token
    return None


def _token_run(alignment: TokenAlignment, start: int, end: int) -> tuple[int, int]:
    """Tokens [first, last + 1) overlapping characters [start, end); (0, 0) when none does. One character can take
    several tokens (byte fallback, byte-level BPE: an emoji or a rare CJK character), and char_to_token names the
    first: the run goes on through every later token that starts inside the span."""
    first, last = _token_at(alignment, range(start, end)), _token_at(alignment, range(end - 1, start - 1, -1))
    if first is None or last is None:
        return 0, 0
    offsets = alignment.offsets
    while last + 1 < len(offsets) and offsets[last + 1][0] < end and offsets[last + 1][1] > offsets[last + 1][0]:
        last += 1
    return first, last + 1
