"""Example boundaries are decided once (sft.data.boundaries): on the same packed data the collators' label masking,
flash attention's cu_seq_lens, NEFTune's per-example lengths, the eval prompt cutting and `sft check`'s packing
proof find the same examples as transformers' packed-sequence detection."""

import datasets
import pytest
import torch
from transformers.masking_utils import find_packed_sequence_indices

from sft.check.prove.batches import split_rows
from sft.data.boundaries import positions, row_positions, spans, starts, token_lengths
from sft.data.collators import PackedCollator, PaddingFreeCollator
from sft.data.packing import pack_dataset
from sft.evaluation.predict import causal_examples
from sft.training.neftune import token_example_lengths

LENGTHS = [5, 3, 7, 2, 6, 4, 9, 3]  # 39 tokens: rows of 12 end with a shorter one
PAD = 0


def toy_examples() -> list[dict]:
    """Examples with distinct tokens (never PAD) whose first token is the prompt and the rest is trained."""
    out, token = [], 1
    for n in LENGTHS:
        ids = list(range(token, token + n))
        out.append({"input_ids": ids, "labels": [-100] + ids[1:]})
        token += n
    return out


def packed_rows() -> list[dict]:
    rows = list(pack_dataset(datasets.Dataset.from_list(toy_examples()), 12))
    assert len(rows) > 1 and len({len(r["input_ids"]) for r in rows}) > 1  # several rows of different lengths
    return rows


def padded_batch(examples: list[dict]) -> dict[str, torch.Tensor]:
    """A plain right-padded batch with an attention_mask (no position_ids)."""
    width = max(len(e["input_ids"]) for e in examples)
    pad = [width - len(e["input_ids"]) for e in examples]
    return {"input_ids": torch.tensor([e["input_ids"] + [PAD] * p for e, p in zip(examples, pad)]),
            "labels": torch.tensor([e["labels"] + [-100] * p for e, p in zip(examples, pad)]),
            "attention_mask": torch.tensor([[1] * len(e["input_ids"]) + [0] * p for e, p in zip(examples, pad)])}


BATCHES = {
    "packed rows, padded": lambda: PackedCollator(pad_token_id=PAD)(packed_rows()),
    "packed rows, flattened": lambda: PaddingFreeCollator()(packed_rows()),
    "plain rows, flattened": lambda: PaddingFreeCollator()(toy_examples()),
}


def found(batch: dict) -> list[tuple]:
    """Token ids of every example sft.data.boundaries finds in a collated batch, padding dropped."""
    ids = batch["input_ids"]
    pieces = [tuple(ids[r, a:b].tolist()) for r in range(ids.shape[0]) for a, b in spans(batch["position_ids"][r])]
    return sorted(p for p in pieces if set(p) != {PAD})


@pytest.mark.parametrize("name", list(BATCHES))
def test_every_reader_finds_the_same_examples(name):
    batch = BATCHES[name]()
    pos, labels = batch["position_ids"], batch["labels"]
    want = sorted(tuple(e["input_ids"]) for e in toy_examples())
    assert found(batch) == want
    # transformers' mask builders see the same starts
    sequence = find_packed_sequence_indices(pos)
    assert torch.equal(torch.diff(sequence, prepend=sequence[:, :1] - 1, dim=-1) != 0, starts(pos))
    assert (labels[starts(pos)] == -100).all()  # no label is predicted across a boundary
    lengths = token_lengths(pos)
    for r in range(pos.shape[0]):
        for a, b in spans(pos[r]):
            assert (lengths[r, a:b] == b - a).all()
    assert torch.equal(token_example_lengths(batch), lengths.float())  # NEFTune
    examples = [e for row in causal_examples(batch) for e in row]  # eval prompt cutting
    assert sorted(tuple(e.prompt + e.reference) for e in examples) == want
    keys = split_rows(batch, torch.zeros(labels.shape), encoder_decoder=False)  # sft check's packing proof
    assert sorted(k for k in keys if set(k) != {PAD}) == want
    if "cu_seq_lens_q" in batch:  # flash attention's varlen boundaries
        cu = torch.tensor([0] + [b for _, b in spans(pos[0])], dtype=torch.int32)
        assert torch.equal(batch["cu_seq_lens_q"], cu) and torch.equal(batch["cu_seq_lens_k"], cu)
        assert batch["max_length_q"] == max(LENGTHS)


def test_padded_rows_agree_through_the_attention_mask():
    batch = padded_batch(toy_examples())
    lengths = token_example_lengths(batch)
    assert lengths.sum(dim=1).tolist() == [n * n for n in LENGTHS] and (lengths[batch["attention_mask"] == 0] == 0).all()
    examples = [e for row in causal_examples(batch) for e in row]
    assert [tuple(e.prompt + e.reference) for e in examples] == [tuple(e["input_ids"]) for e in toy_examples()]


def test_packed_positions_are_the_ones_boundaries_derives_from_seq_lengths():
    for row in packed_rows():
        assert row["position_ids"] == positions(row["seq_lengths"]).tolist()
        assert row_positions({"seq_lengths": row["seq_lengths"]}, len(row["input_ids"])).tolist() == row["position_ids"]
        assert [b - a for a, b in spans(torch.tensor(row["position_ids"]))] == row["seq_lengths"]
