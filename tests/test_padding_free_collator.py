"""PaddingFreeCollator builds its batch with tensor ops; the output must be byte-identical to transformers'
DataCollatorWithFlattening on the same examples (the library collator stays the reference)."""

import datasets
import pytest
import torch
from transformers import DataCollatorWithFlattening

from sft.data.boundaries import spans
from sft.data.collators import PaddingFreeCollator, example_row
from sft.data.packing import pack_dataset

OPTIONS = [{}, {"return_seq_idx": True}, {"return_flash_attn_kwargs": False}, {"position_ids_start": 2},
           {"separator_id": 7}, {"return_position_ids": False}]


def rows(n: int = 40, seed: int = 0, labels: bool = True) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(1, 40, (1,), generator=g))
        ids = torch.randint(5, 300, (length,), generator=g).tolist()
        trained = int(torch.randint(0, length + 1, (1,), generator=g))
        out.append({"input_ids": ids, **({"labels": [-100] * (length - trained) + ids[length - trained:]}
                                         if labels else {})})
    return out


def library_batch(features: list[dict], options: dict) -> dict:
    """What the collator did before: split rows into examples, then transformers' collator."""
    examples = []
    for feature in features:
        ids, labels, pos = example_row(feature)
        examples += [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in spans(pos)]
    return DataCollatorWithFlattening(**{"return_flash_attn_kwargs": True, **options})(examples)


def assert_identical(mine: dict, reference: dict) -> None:
    assert list(mine) == list(reference)
    for key, value in reference.items():
        if isinstance(value, torch.Tensor):
            assert mine[key].dtype == value.dtype and mine[key].shape == value.shape, key
            assert torch.equal(mine[key], value), key
        else:
            assert type(mine[key]) is type(value) and mine[key] == value, key


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()) or "default")
def test_packed_rows_collate_byte_identical_to_the_library(options):
    packed = list(pack_dataset(datasets.Dataset.from_list(rows(120)), 64))
    assert len(packed) > 8 and any(len(r["seq_lengths"]) > 2 for r in packed)
    for start in range(0, len(packed) - 4, 4):
        features = [{k: r[k] for k in ("input_ids", "labels", "position_ids")} for r in packed[start:start + 4]]
        assert_identical(PaddingFreeCollator(**options)(features), library_batch(features, options))
        by_lengths = [{k: r[k] for k in ("input_ids", "labels", "seq_lengths")} for r in packed[start:start + 4]]
        assert_identical(PaddingFreeCollator(**options)(by_lengths), library_batch(by_lengths, options))


@pytest.mark.parametrize("labels", [True, False])
def test_plain_rows_collate_byte_identical_to_the_library(labels):
    for start in range(0, 40, 8):
        features = rows(labels=labels)[start:start + 8]
        assert_identical(PaddingFreeCollator()(features), library_batch(features, {}))


def test_negative_control_a_shifted_position_is_caught():
    features = rows()[:8]
    mine = PaddingFreeCollator()(features)
    mine["position_ids"] = mine["position_ids"].clone()
    mine["position_ids"][0, -1] += 1
    with pytest.raises(AssertionError):
        assert_identical(mine, library_batch(features, {}))


def test_numpy_tensors_still_come_from_the_library():
    features = rows()[:4]
    out = PaddingFreeCollator()(features, return_tensors="np")
    assert type(out["input_ids"]).__module__ == "numpy"
    assert out["input_ids"].tolist() == library_batch(features, {})["input_ids"].tolist()
