"""Packing: the packer against a slow best-fit-decreasing reference, packed datasets, collators, and exactness of
packed / padding-free losses and gradients on tiny models (eager and sdpa)."""

import json

import datasets
import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, DataCollatorWithFlattening

from sft.data.bins import best_fit_decreasing, exact_fit_decreasing, n_bins, pack_bins
from sft.data.collators import PackedCollator, PaddingFreeCollator
from sft.data.packing import estimate_packing, pack_dataset, pack_dataset_with_stats
from sft.models.families import check_packing_supported, packing_families

from conftest import FIXTURES, make_gemma3

VOCAB = 128


# ---------------------------------------------------------------------------------------------------------------
# The packer
# ---------------------------------------------------------------------------------------------------------------

def slow_bfd(lengths: np.ndarray, capacity: int) -> np.ndarray:
    """Textbook best-fit-decreasing: each item, longest first, into the fullest bin it fits; a new bin if none."""
    free: list[int] = []
    bin_of = np.empty(len(lengths), dtype=np.int64)
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        fits = [b for b, f in enumerate(free) if f >= lengths[i]]
        if fits:
            b = min(fits, key=lambda b: free[b])
        else:
            b = len(free)
            free.append(capacity)
        free[b] -= int(lengths[i])
        bin_of[i] = b
    return bin_of


def bin_members(bin_of: np.ndarray) -> list[np.ndarray]:
    """Item indices of each bin, grouped from a bin-id-per-item assignment."""
    order = np.argsort(bin_of, kind="stable")
    return np.split(order, np.cumsum(np.bincount(bin_of))[:-1]) if bin_of.size else []


def residuals(lengths: np.ndarray, bin_of: np.ndarray, capacity: int) -> list[int]:
    """Sorted free space of every bin: BFD's result up to swapping bins of equal free space."""
    return sorted((capacity - np.bincount(bin_of, weights=lengths)).astype(int).tolist())


def random_lengths(seed: int, n: int, capacity: int) -> np.ndarray:
    """Uniform, skewed-short, or few-distinct lengths (the latter exercises ties and whole groups of equal items)."""
    rng = np.random.default_rng(seed)
    kind = seed % 3
    if kind == 0:
        return rng.integers(1, capacity + 1, n)
    if kind == 1:
        return np.clip(rng.geometric(4 / capacity, n), 1, capacity)
    return rng.choice(rng.integers(1, capacity + 1, 5), n)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("capacity", [7, 64, 512])
def test_bfd_matches_the_slow_reference(seed, capacity):
    lengths = random_lengths(seed, [1, 40, 300, 900][seed % 4], capacity)
    fast, slow = best_fit_decreasing(lengths, capacity), slow_bfd(lengths, capacity)
    assert n_bins(fast) == n_bins(slow)
    assert residuals(lengths, fast, capacity) == residuals(lengths, slow, capacity)


@pytest.mark.parametrize("packer", [best_fit_decreasing, exact_fit_decreasing, pack_bins])
@pytest.mark.parametrize("seed", range(6))
def test_packers_place_every_item_once_within_capacity(packer, seed):
    capacity = [16, 128, 512][seed % 3]
    lengths = random_lengths(seed, 500, capacity)
    bin_of = packer(lengths, capacity)
    assert bin_of.shape == lengths.shape
    assert sorted(set(bin_of.tolist())) == list(range(n_bins(bin_of)))  # bins numbered densely, none empty
    assert np.bincount(bin_of, weights=lengths).max() <= capacity
    bins = bin_members(bin_of)
    assert sorted(np.concatenate(bins).tolist()) == list(range(len(lengths)))
    assert max(int(lengths[b].sum()) for b in bins) <= capacity


@pytest.mark.parametrize("seed", range(6))
def test_pack_bins_is_never_worse_than_bfd(seed):
    lengths = random_lengths(seed, 2000, 256)
    assert n_bins(pack_bins(lengths, 256)) <= n_bins(best_fit_decreasing(lengths, 256))
    assert n_bins(pack_bins(lengths, 256)) >= -(-lengths.sum() // 256)


def test_packer_edge_cases():
    assert bin_members(pack_bins(np.array([], dtype=np.int64), 8)) == []
    assert n_bins(pack_bins(np.full(10, 8), 8)) == 10
    assert n_bins(pack_bins(np.ones(17, dtype=np.int64), 8)) == 3
    with pytest.raises(ValueError, match="lengths must lie in"):
        pack_bins(np.array([3, 9]), 8)
    with pytest.raises(ValueError, match="lengths must lie in"):
        pack_bins(np.array([0, 3]), 8)


def alpaca_lengths() -> np.ndarray:
    """Token lengths of the 1k Alpaca fixture rendered with the Stanford template (Mistral v0.3 tokenizer)."""
    data = FIXTURES / "alpaca" / "alpaca_data_1k.json"
    tok_dir = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.3"
    if not (data.exists() and tok_dir.exists()):
        pytest.skip("Alpaca / tokenizer fixtures are absent")
    from transformers import AutoTokenizer

    from sft.data.formats import ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT
    rows = json.loads(data.read_text())
    texts = [(ALPACA_PROMPT_INPUT if r["input"].strip() else ALPACA_PROMPT_NO_INPUT).format(**r) + r["output"]
             for r in rows]
    return np.array([len(ids) + 1 for ids in AutoTokenizer.from_pretrained(tok_dir)(texts)["input_ids"]])  # + EOS


def test_alpaca_like_lengths_pack_above_99_5_percent():
    stats = estimate_packing(np.tile(alpaca_lengths(), 20), 512)
    bfd_rows = n_bins(best_fit_decreasing(np.minimum(np.tile(alpaca_lengths(), 20), 512), 512))
    assert stats.packing_efficiency >= 0.995
    assert stats.packed_rows < bfd_rows  # the exact-fit pass is what gets there


# ---------------------------------------------------------------------------------------------------------------
# Packed datasets
# ---------------------------------------------------------------------------------------------------------------

def toy_examples(lengths: list[int], seed: int = 0) -> list[dict]:
    """Examples with distinct token ids per example and a random trained mask (first label -100)."""
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, VOCAB, n)
        labels = np.where(rng.random(n) < 0.6, ids, -100)
        labels[0] = -100
        out.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return out


def toy_dataset(lengths: list[int], seed: int = 0) -> datasets.Dataset:
    rows = toy_examples(lengths, seed)
    return datasets.Dataset.from_dict({k: [r[k] for r in rows] for k in ("input_ids", "labels")})


def unpack(ds: datasets.Dataset) -> list[tuple[list[int], list[int], list[int]]]:
    """(input_ids, labels, position_ids) of every example inside the packed rows, checking row invariants."""
    out = []
    for row in ds:
        assert sum(row["seq_lengths"]) == len(row["input_ids"]) == len(row["labels"]) == len(row["position_ids"])
        start = 0
        for n in row["seq_lengths"]:
            end = start + n
            out.append((row["input_ids"][start:end], row["labels"][start:end], row["position_ids"][start:end]))
            start = end
    return out


def test_pack_dataset_bfd_keeps_every_example_truncated():
    lengths = [5, 30, 12, 3, 17, 9, 25, 1, 16, 40]
    ds = toy_dataset(lengths)
    packed, stats = pack_dataset_with_stats(ds, 16, "bfd")
    assert set(packed.column_names) == {"input_ids", "labels", "position_ids", "seq_lengths"}
    assert max(len(r) for r in packed["input_ids"]) <= 16
    got = sorted((tuple(i), tuple(lab)) for i, lab, _ in unpack(packed))
    want = []
    for ex in ds:
        labels = ex["labels"][:16]
        want.append((tuple(ex["input_ids"][:16]), tuple([-100] + labels[1:])))
    assert got == sorted(want)
    for ids, labels, pos in unpack(packed):
        assert pos == list(range(len(ids))) and labels[0] == -100
    tokens = sum(min(n, 16) for n in lengths)
    assert (stats.rows, stats.examples, stats.truncated_rows, stats.split_rows) == (10, 10, 4, 0)
    assert (stats.tokens, stats.dropped_tokens, stats.packed_rows) == (tokens, sum(lengths) - tokens, len(packed))
    assert stats.packing_efficiency == pytest.approx(tokens / (len(packed) * 16))
    assert estimate_packing(np.array(lengths), 16).as_dict() == stats.as_dict()


def test_pack_dataset_bfd_split_chunks_long_examples():
    lengths = [5, 30, 12, 3, 33]
    ds = toy_dataset(lengths)
    packed, stats = pack_dataset_with_stats(ds, 16, "bfd_split")
    chunks = []
    for ex in ds:
        for s in range(0, len(ex["input_ids"]), 16):
            labels = ex["labels"][s:s + 16]
            chunks.append((tuple(ex["input_ids"][s:s + 16]), tuple([-100] + labels[1:])))
    assert sorted((tuple(i), tuple(lab)) for i, lab, _ in unpack(packed)) == sorted(chunks)
    assert (stats.examples, stats.split_rows, stats.dropped_tokens, stats.tokens) == (8, 2, 0, sum(lengths))


def test_pack_dataset_shuffles_rows_with_the_seed_and_honours_selections():
    ds = toy_dataset([int(n) for n in np.random.default_rng(1).integers(1, 33, 200)])
    a, b, c = pack_dataset(ds, 32, seed=0), pack_dataset(ds, 32, seed=0), pack_dataset(ds, 32, seed=1)
    assert a["input_ids"] == b["input_ids"] and a["input_ids"] != c["input_ids"]
    first_tokens = sorted(len(r) for r in a["seq_lengths"])
    assert first_tokens != [len(r) for r in a["seq_lengths"]]  # not left in packing (size) order
    picked = ds.shuffle(seed=3).select(range(50))
    got = sorted(tuple(ids) for ids, _, _ in unpack(pack_dataset(picked, 32)))
    assert got == sorted(tuple(r) for r in picked["input_ids"])


def test_pack_dataset_rejects_unknown_strategy():
    with pytest.raises(ValueError, match="strategy"):
        pack_dataset(toy_dataset([3]), 8, strategy="wrapped")


# ---------------------------------------------------------------------------------------------------------------
# Collators
# ---------------------------------------------------------------------------------------------------------------

def test_packed_collator_pads_as_a_separate_segment():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "position_ids": [0, 1, 2, 0, 1]},
            {"input_ids": [4, 3], "labels": [4, 3], "seq_lengths": [2]},
            {"input_ids": [9, 9, 9], "labels": [-100, 9, 9]}]
    batch = PackedCollator(pad_token_id=1, pad_to_multiple_of=8)(rows)
    assert set(batch) == {"input_ids", "labels", "position_ids"}  # no attention_mask
    assert batch["input_ids"].tolist() == [[5, 6, 7, 8, 9, 1, 1, 1], [4, 3, 1, 1, 1, 1, 1, 1],
                                           [9, 9, 9, 1, 1, 1, 1, 1]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100, -100], [-100, 3] + [-100] * 6,
                                        [-100, 9, 9] + [-100] * 5]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 1, 0, 1, 2, 3, 4, 5],
                                              [0, 1, 2, 0, 1, 2, 3, 4]]


def test_padding_free_collator_matches_transformers_flattening():
    rows = toy_examples([4, 9, 1, 6])
    ours = PaddingFreeCollator()(rows)
    theirs = DataCollatorWithFlattening(return_flash_attn_kwargs=True)(rows)
    assert set(ours) == set(theirs) - {"attention_mask"}
    for key, value in theirs.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(ours[key], value) and ours[key].dtype == value.dtype, key
        else:
            assert ours[key] == value, key


def test_padding_free_collator_splits_packed_rows_at_examples():
    rows = [{"input_ids": [5, 6, 7, 8, 9], "labels": [5, 6, 7, 8, 9], "seq_lengths": [3, 2]},
            {"input_ids": [4, 3], "labels": [4, 3], "position_ids": [0, 0]}]
    batch = PaddingFreeCollator()(rows)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 0, 0]]
    assert batch["labels"].tolist() == [[-100, 6, 7, -100, 9, -100, -100]]
    assert batch["cu_seq_lens_q"].tolist() == [0, 3, 5, 6, 7] and batch["cu_seq_lens_q"].dtype == torch.int32
    assert batch["max_length_q"] == batch["max_length_k"] == 3


# ---------------------------------------------------------------------------------------------------------------
# Exactness on tiny models
# ---------------------------------------------------------------------------------------------------------------

TINY = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256, use_cache=False, tie_word_embeddings=False)
FAMILIES = {
    "llama": dict(),
    "mistral": dict(sliding_window=16),  # shorter than the examples: the window must restart per example
    "qwen2": dict(use_sliding_window=True, sliding_window=16, max_window_layers=1),  # full + sliding layers
}
LENGTHS = [9, 37, 4, 22, 30]  # packed into rows of 64 -> several rows of different lengths, so padding too


def tiny_model(model_type: str, attn: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **TINY, **FAMILIES.get(model_type, {}), **extra)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=torch.float32).eval()


def token_losses(model, batch: dict) -> torch.Tensor:
    """Per-token next-token loss on the labels (-100 ignored, zero there), shape like labels: [B, L]."""
    kwargs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**kwargs, use_cache=False).logits
    labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]  # the model's own shift
    return F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")


def alone(model, examples: list[dict]) -> list[torch.Tensor]:
    """Per-token losses of each example run by itself (batch of one, no padding)."""
    return [token_losses(model, {"input_ids": torch.tensor([e["input_ids"]]),
                                 "labels": torch.tensor([e["labels"]])})[0] for e in examples]


def split_examples(losses: torch.Tensor, position_ids: torch.Tensor, ids: torch.Tensor) -> dict[tuple, torch.Tensor]:
    """Per-example loss vectors inside collated rows, keyed by their token ids (padding segments included)."""
    out = {}
    for row_loss, row_pos, row_ids in zip(losses, position_ids, ids):
        starts = torch.nonzero(torch.diff(row_pos, prepend=row_pos[:1]) != 1).flatten().tolist() + [len(row_pos)]
        for s, e in zip(starts, starts[1:]):
            out[tuple(row_ids[s:e].tolist())] = row_loss[s:e]
    return out


def assert_same_losses(reference: list[torch.Tensor], examples: list[dict], batch: dict, losses: torch.Tensor):
    got = split_examples(losses, batch["position_ids"], batch["input_ids"])
    for ex, ref in zip(examples, reference):
        torch.testing.assert_close(got[tuple(ex["input_ids"])], ref, rtol=0, atol=1e-5)


def packed_rows(examples: list[dict], max_length: int = 64) -> list[dict]:
    ds = datasets.Dataset.from_list(examples)
    return list(pack_dataset(ds, max_length))


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_losses_equal_unpacked_losses(family, attn):
    model, examples = tiny_model(family, attn), toy_examples(LENGTHS)
    check_packing_supported(model.config, attn)
    rows = packed_rows(examples)
    assert 1 < len(rows) < len(examples) and len({len(r["input_ids"]) for r in rows}) > 1  # packing + padding
    with torch.no_grad():
        reference = alone(model, examples)
        for collate, features in [(PackedCollator(pad_token_id=0), rows), (PaddingFreeCollator(), examples),
                                  (PaddingFreeCollator(), rows)]:
            batch = collate(features)
            assert_same_losses(reference, examples, batch, token_losses(model, batch))


def grads(model) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_packed_gradients_equal_unpacked_gradients(family, attn):
    model, examples = tiny_model(family, attn), toy_examples(LENGTHS, seed=1)
    trained = sum(sum(lab != -100 for lab in e["labels"][1:]) for e in examples)
    loss = sum(losses.sum() for losses in alone(model, examples)) / trained  # token-normalised over the batch
    loss.backward()
    reference = grads(model)
    for collate, features in [(PackedCollator(), packed_rows(examples)), (PaddingFreeCollator(), examples)]:
        out = model(**collate(features), use_cache=False)  # the model's loss: mean over trained tokens
        torch.testing.assert_close(out.loss, loss.detach(), rtol=0, atol=1e-6)
        out.loss.backward()
        for got, want in zip(grads(model), reference):
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_negative_controls_show_cross_contamination(attn):
    """The exactness tests can fail: an attention_mask or a KV cache switches packed-sequence detection off."""
    model, examples = tiny_model("llama", attn), toy_examples(LENGTHS)
    batch = PackedCollator()(packed_rows(examples))
    with torch.no_grad():
        reference = alone(model, examples)
        for extra in [{"attention_mask": torch.ones_like(batch["input_ids"])}, {"use_cache": True}]:
            kwargs = {k: v for k, v in batch.items() if k != "labels"} | extra
            kwargs.setdefault("use_cache", False)
            logits = model(**kwargs).logits
            labels = F.pad(batch["labels"], (0, 1), value=-100)[:, 1:]
            losses = F.cross_entropy(logits.transpose(1, 2), labels, ignore_index=-100, reduction="none")
            with pytest.raises(AssertionError):
                assert_same_losses(reference, examples, batch, losses)


@pytest.mark.slow  # flex_attention compiles its kernel with inductor on CPU: about 15 s per family
@pytest.mark.parametrize("family", list(FAMILIES))
def test_flex_attention_packed_rows_equal_alone(family):
    """flex_attention packs through default_collator's [B, L] rows (and padding_free's flattened row): transformers
    builds a BlockMask from the restarting position_ids (no dense mask)."""
    from types import SimpleNamespace

    # Static shapes: inductor's CPU flex kernel for dynamic shapes, which dynamo switches to on the second shape
    # it sees, does not compile in torch 2.13 (C++ error: `cur_kvSplitSize2` was not declared).
    static = torch._dynamo.config.patch(automatic_dynamic_shapes=False)

    from sft.data.collators import default_collator

    args = SimpleNamespace(
        packing=True, eval_packing=None, padding_free=False, attn_implementation="flex_attention", torch_compile=False
    )
    collate = default_collator(SimpleNamespace(pad_token_id=0), args)
    assert isinstance(collate, PackedCollator)
    model, examples = tiny_model(family, "flex_attention"), toy_examples(LENGTHS)
    batch = collate(packed_rows(examples))
    leaky = dict(batch, position_ids=torch.arange(batch["input_ids"].shape[1]).expand_as(batch["input_ids"]))
    with torch.no_grad(), static:
        reference = alone(model, examples)
        assert_same_losses(reference, examples, batch, token_losses(model, batch))
        flat = PaddingFreeCollator()(examples)
        assert_same_losses(reference, examples, flat, token_losses(model, flat))
        with pytest.raises(AssertionError):  # negative control: boundaries erased, the same rows leak
            assert_same_losses(reference, examples, batch, token_losses(model, leaky))


# ---------------------------------------------------------------------------------------------------------------
# Which families isolate packed examples
# ---------------------------------------------------------------------------------------------------------------

def family_config(model_type: str):
    """A tiny config of any family: TINY's keys that the family knows, plus the ones some families need."""
    if model_type == "gemma3":  # multimodal: a tiny text model and vision tower, sliding windows of 8 tokens
        config = make_gemma3(VOCAB - 8).config
        config.text_config.sliding_window = 8
        return config
    known = AutoConfig.for_model(model_type).to_dict()
    extra = dict(head_dim=8, sliding_window=8, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                 n_embd=32, n_layer=2, n_head=4, n_positions=256, n_inner=64, ffn_dim=64, word_embed_proj_dim=32,
                 rotary_dim=4, use_sliding_window=True, max_window_layers=1, d_model=32, n_heads=4, n_layers=2,
                 num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=32)
    skip = {"head_dim"} if model_type == "falcon" else set()  # falcon derives head_dim (read-only property)
    kwargs = {k: v for k, v in (TINY | extra).items() if k in known and k not in skip}
    return AutoConfig.for_model(model_type, **kwargs)


def leak(model_type: str, **overrides) -> float:
    """Largest logit difference between three examples packed in one row and each run alone (sdpa, else eager);
    `overrides` set config fields (a variant of the family)."""
    config = family_config(model_type)
    for name, value in overrides.items():
        setattr(config, name, value)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    except ValueError:  # e.g. gemma2, gptj and codegen have no sdpa path in transformers
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager", dtype=torch.float32)
    model.eval()
    seqs = [torch.randint(3, VOCAB, (1, n)) for n in (5, 12, 9)]
    with torch.no_grad():
        ref = torch.cat([model(input_ids=s, use_cache=False).logits for s in seqs], 1)
        pos = torch.cat([torch.arange(s.shape[1]) for s in seqs])[None]
        packed = model(input_ids=torch.cat(seqs, 1), position_ids=pos, use_cache=False).logits
    return (packed - ref).abs().max().item()


@pytest.mark.parametrize("model_type", packing_families(True))
def test_supported_families_isolate_packed_examples(model_type):
    # sdpa where the family has it, else eager (both go through the same sdpa_mask builder)
    check_packing_supported(family_config(model_type), "sdpa")
    assert leak(model_type) < 1e-5


def test_falcon_alibi_variant_isolates_packed_examples():
    """falcon's table row covers its ALiBi variant (falcon-rw): the bias is slope x absolute key position, the same
    shift for every key of a query within one example, so the block-diagonal mask from position_ids suffices."""
    assert leak("falcon", alibi=True) < 1e-5
    assert leak("falcon", alibi=True, new_decoder_architecture=True, num_kv_heads=2) < 1e-5


@pytest.mark.parametrize("model_type", packing_families(False))
def test_rejected_families_really_leak(model_type):
    with pytest.raises(ValueError, match="not supported"):
        check_packing_supported(family_config(model_type), "eager")
    assert leak(model_type) > 1e-3


def test_check_packing_supported_attention_rules():
    config = AutoConfig.for_model("llama", **TINY)
    for attn in ("eager", "sdpa", "flex_attention"):
        check_packing_supported(config, attn)
    check_packing_supported(config, "flash_attention_2", flattened=True)
    with pytest.raises(ValueError, match="single flattened row"):
        check_packing_supported(config, "flash_attention_2")
    with pytest.raises(ValueError, match="cannot isolate"):
        check_packing_supported(config, "paged|sdpa")
    with pytest.raises(ValueError, match="not verified"):
        check_packing_supported(AutoConfig.for_model("qwen2_vl"), "sdpa")
    with pytest.raises(ValueError, match="need a decoder-only model; t5 is an encoder-decoder"):
        check_packing_supported(AutoConfig.for_model("t5"), "sdpa")
