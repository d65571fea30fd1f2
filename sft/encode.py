"""Tokenize rendered examples and build labels from character spans via the fast tokenizer's offsets."""

from dataclasses import dataclass

import numpy as np
from transformers import PreTrainedTokenizerBase

from sft.formats import Rendered

IGNORE_INDEX = -100


@dataclass
class Encoding:
    """Settings that turn Rendered rows into input_ids and labels."""

    tokenizer: PreTrainedTokenizerBase
    max_length: int
    truncation_side: str = "right"

    def encode(self, rows: list[Rendered]) -> dict[str, list]:
        """Tokenize a batch; returns input_ids, labels, length, truncated and trained (token count) per row."""
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": [], "trained": [], "_index": []}
        for flag in (True, False):  # tokenize with and without BOS in two batched calls
            picked = [i for i, r in enumerate(rows) if r.add_special_tokens is flag]
            if picked:
                self._encode_group([rows[i] for i in picked], flag, picked, out)
        order = np.argsort(out.pop("_index"), kind="stable")
        return {key: [values[i] for i in order] for key, values in out.items()}

    def _encode_group(self, rows: list[Rendered], add_special: bool, index: list[int], out: dict) -> None:
        enc = self.tokenizer([r.text for r in rows], add_special_tokens=add_special,
                             return_offsets_mapping=True, return_attention_mask=False)
        eos = self.tokenizer.eos_token_id
        for row, ids, offsets, i in zip(rows, enc["input_ids"], enc["offset_mapping"], index):
            ids, labels = np.asarray(ids, dtype=np.int64), trained_labels(ids, offsets, row.spans)
            if row.append_eos and eos is not None and (ids.size == 0 or ids[-1] != eos):
                ids, labels = np.append(ids, eos), np.append(labels, eos if row.spans else IGNORE_INDEX)
            ids, labels, cut = self._truncate(ids, labels)
            out["input_ids"].append(ids.tolist())
            out["labels"].append(labels.tolist())
            out["length"].append(int(ids.size))
            out["truncated"].append(cut)
            out["trained"].append(int((labels != IGNORE_INDEX).sum()))
            out["_index"].append(i)

    def _truncate(self, ids: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray, bool]:
        """Cut to max_length from `truncation_side`; the new first token is never trained."""
        if ids.size <= self.max_length:
            return ids, labels, False
        keep = slice(-self.max_length, None) if self.truncation_side == "left" else slice(0, self.max_length)
        ids, labels = ids[keep], labels[keep].copy()
        labels[0] = IGNORE_INDEX
        return ids, labels, True


def trained_labels(ids: list[int], offsets: list[tuple[int, int]], spans: list[tuple[int, int]]) -> np.ndarray:
    """labels = ids where a token's characters overlap a trained span, else -100; the first label is -100.

    A token overlapping a span boundary (e.g. one that merges the prompt's last character with the answer's
    first) is trained: leaving it out would drop the start of the answer from the loss.
    """
    ids_arr = np.asarray(ids, dtype=np.int64)
    if not spans or ids_arr.size == 0:
        return np.full(ids_arr.size, IGNORE_INDEX, dtype=np.int64)
    off = np.asarray(offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = np.asarray(spans, dtype=np.int64).T
    # A zero-width token (e.g. a BOS the tokenizer adds) at position p is treated as covering [p, p + 1).
    tok_end = np.maximum(off[:, 1], off[:, 0] + 1)
    hit = ((off[:, 0, None] < ends) & (tok_end[:, None] > starts)).any(axis=1)
    labels = np.where(hit, ids_arr, IGNORE_INDEX)
    labels[0] = IGNORE_INDEX
    return labels
