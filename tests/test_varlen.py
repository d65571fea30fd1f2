"""attn_implementation varlen on CPU: torch's varlen_attn (CUDA only) replaced by a per-example sdpa reference in
both of its signature styles, through sft's own collators, trainer and loader. The real kernel runs in
tests/test_gpu.py."""

import itertools

import datasets
import pytest
import torch
import torch.nn.functional as F
from test_packing import LENGTHS, packed_rows, tiny_model, toy_examples
from test_trainer import toy_dataset
from transformers import AttentionInterface
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from sft import SFTConfig, SFTTrainer
from sft.cli.main import main
from sft.data.boundaries import spans
from sft.data.collators import PackedCollator, PaddingFreeCollator, default_collator
from sft.data.packing import pack_dataset
from sft.errors import SFTError
from sft.models import attention
from sft.models.families import VARLEN, check_packing_supported, flattened_batches
from sft.models.loading import load_model

from conftest import REPO, make_llama

TOLERANCE = 1e-5  # fp32


def segment_attention(query, key, value, cu_seq, scale, left, causal, leak=False):
    """The reference: sdpa inside each [cu_seq[i], cu_seq[i+1]) span of [T, H, D] states (one span if `leak`)."""
    if key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    bounds = [0, query.shape[0]] if leak else cu_seq.tolist()
    out = []
    for a, b in itertools.pairwise(bounds):
        i, j = torch.arange(b - a)[:, None], torch.arange(b - a)[None, :]
        allowed = (j <= i if causal else torch.ones_like(i == j)) & ((j >= i - left) if left >= 0 else True)
        q, k, v = (t[a:b].transpose(0, 1) for t in (query, key, value))
        out.append(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale).transpose(0, 1))
    return torch.cat(out)


class Reference:
    """A CPU stand-in for varlen_attn in the newer (window_size, enable_gqa, scale) or older (is_causal) style;
    `calls` counts its calls; leak=True ignores cu_seq (the negative control)."""

    def __init__(self, style: str, leak: bool = False) -> None:
        self.calls, self.leak = 0, leak
        self.kernel = self.new if style == "new" else self.old

    def new(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
            window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
        assert enable_gqa or key.shape[1] == query.shape[1]
        assert cu_seq_q.dtype == torch.int32 and torch.equal(cu_seq_q, cu_seq_k) and max_q == max_k
        assert max_q == int((cu_seq_q[1:] - cu_seq_q[:-1]).max())
        self.calls += 1
        return segment_attention(query, key, value, cu_seq_q, scale, window_size[0], window_size[1] == 0, self.leak)

    def old(self, query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        assert key.shape[1] == query.shape[1]  # no GQA in this style: sft repeats the kv heads
        self.calls += 1
        return segment_attention(query, key, value, cu_seq_q, None, -1, is_causal, self.leak)


@pytest.fixture(params=["new", "old"])
def kernel(request, monkeypatch):
    """varlen registered, its kernel replaced by a Reference of each style; also records the masks the attention
    function gets."""
    ref = Reference(request.param)
    monkeypatch.setattr(attention, "varlen_attn", ref.kernel)
    attention.register()
    ref.masks = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        ref.masks.append(attention_mask)
        return attention.varlen_attention_forward(module, query, key, value, attention_mask, **kwargs)

    AttentionInterface.register(VARLEN, spy)
    yield ref
    attention.register()


def eval_loss(tmp_path, tokenizer, attn: str, data: datasets.Dataset, **flags) -> float:
    """SFTTrainer.evaluate() on a 2-layer Llama with peaked attention (a leak changes the loss a lot)."""
    model = make_llama(len(tokenizer), seed=1, attn_implementation=attn, initializer_range=0.3)
    args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none", use_cpu=True,
                     attn_implementation=attn, **flags)
    return SFTTrainer(model=model, args=args, processing_class=tokenizer, eval_dataset=data).evaluate()["eval_loss"]


def test_packed_eval_loss_through_sft_equals_unpacked_sdpa(tmp_path, tokenizer, kernel):
    unpacked = eval_loss(tmp_path, tokenizer, "sdpa", toy_dataset())
    packed = eval_loss(tmp_path, tokenizer, VARLEN, pack_dataset(toy_dataset(), 64), eval_packing=True)
    assert kernel.calls == 2  # one flattened batch (default_collator), two layers: the kernel really ran
    assert kernel.masks == [None, None]  # no [L, L] (or any) mask was built for it
    assert packed == pytest.approx(unpacked, abs=TOLERANCE)
    kernel.leak = True  # negative control: the same rows with boundaries ignored by the kernel
    leaky = eval_loss(tmp_path, tokenizer, VARLEN, pack_dataset(toy_dataset(), 64), eval_packing=True)
    assert abs(leaky - unpacked) > 100 * TOLERANCE


@pytest.mark.parametrize("family", ["llama", "qwen2"])  # qwen2: a 16-token window on layer 2, longer examples
def test_packed_losses_and_gradients_equal_unpacked(family, kernel):
    if family == "qwen2" and kernel.kernel == kernel.old:
        pytest.skip("the older kernel has no window: refused, see test_a_window_the_old_kernel_lacks_is_refused")
    varlen, sdpa = tiny_model(family, VARLEN), tiny_model(family, "sdpa")
    examples = toy_examples(LENGTHS, seed=1)
    trained = sum(sum(lab != -100 for lab in e["labels"][1:]) for e in examples)
    reference = sum(sdpa(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]])).loss
                    * (sum(lab != -100 for lab in e["labels"][1:])) for e in examples) / trained
    reference.backward()
    for features in (examples, packed_rows(examples)):
        batch = PaddingFreeCollator()(features)
        out = varlen(**batch, use_cache=False)
        torch.testing.assert_close(out.loss, reference.detach(), rtol=0, atol=TOLERANCE)
        out.loss.backward()
        for (name, got), want in zip(varlen.named_parameters(), sdpa.parameters()):
            torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=TOLERANCE, msg=name)
        varlen.zero_grad()
    assert kernel.calls == 2 * 2 and kernel.masks == [None] * 4


def test_position_ids_alone_give_the_boundaries(kernel):
    """[B, L] packed rows (PackedCollator: restarting position_ids, no cu_seq_lens) are split the same way."""
    varlen, sdpa = tiny_model("llama", VARLEN), tiny_model("llama", "sdpa")
    batch = PackedCollator()(packed_rows(toy_examples(LENGTHS)))
    with torch.no_grad():
        torch.testing.assert_close(varlen(**batch).logits, sdpa(**batch).logits, rtol=0, atol=TOLERANCE)
    assert kernel.calls == 2


def test_boundaries_follow_sft_data_boundaries():
    g = torch.Generator().manual_seed(0)
    for rows in ([[0, 1, 2, 0, 1, 5, 6, 0, 0, 3]], [[0, 1, 2, 3]] * 2, torch.randint(0, 3, (3, 17), generator=g)):
        pos = torch.as_tensor(rows)
        cu_seq, longest = attention.boundaries({"position_ids": pos}, *pos.shape, torch.device("cpu"))
        offsets = [r * pos.shape[1] for r in range(pos.shape[0])]
        want = [off + a for off, row in zip(offsets, pos) for a, _ in spans(row)] + [pos.numel()]
        assert cu_seq.tolist() == want and cu_seq.dtype == torch.int32
        assert longest == max(b - a for row in pos for a, b in spans(row))
    cu_seq, longest = attention.boundaries({"position_ids": torch.arange(5)[None]}, 3, 5, torch.device("cpu"))
    assert cu_seq.tolist() == [0, 5, 10, 15] and longest == 5  # unsqueezed, not expanded: one example per row


@pytest.mark.parametrize("scaling", [None, 0.5])
def test_scaling_and_gqa_match_sdpa(kernel, scaling):
    g = torch.Generator().manual_seed(0)
    query, key, value = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True
    got, _ = attention.varlen_attention_forward(module, query, key, value, None, scaling=scaling)
    want = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=True)
    torch.testing.assert_close(got, want.transpose(1, 2), rtol=0, atol=TOLERANCE)
    assert kernel.calls == 1


def test_generation_with_padding_and_a_cache_matches_sdpa(kernel, tokenizer):
    """generate() sends left-padded prompts (a 2D mask) and one-token cache steps: sdpa with the mask, not unmasked."""
    varlen, sdpa = (make_llama(len(tokenizer), seed=1, attn_implementation=a) for a in (VARLEN, "sdpa"))
    tokenizer.padding_side = "left"
    prompts = tokenizer(["Hello, how are you", "The capital of France is Paris. The quick"], return_tensors="pt",
                        padding=True)
    tokenizer.padding_side = "right"
    kwargs = {"max_new_tokens": 6, "do_sample": False, "use_cache": True, "output_scores": True,
              "return_dict_in_generate": True}
    with torch.no_grad():
        got, want = varlen.generate(**prompts, **kwargs), sdpa.generate(**prompts, **kwargs)
        assert torch.equal(got.sequences, want.sequences)
        torch.testing.assert_close(torch.stack(got.scores), torch.stack(want.scores), rtol=0, atol=1e-4)
        assert kernel.calls == 0 and all(m is not None for m in kernel.masks)  # padded: the kernel never ran
        one = {k: v[1:] for k, v in prompts.items()}  # the longer prompt: no padding, the prefill runs the kernel
        got, want = varlen.generate(**one, **kwargs), sdpa.generate(**one, **kwargs)
        assert torch.equal(got.sequences, want.sequences) and kernel.calls == 2


def test_a_window_the_old_kernel_lacks_is_refused(monkeypatch):
    monkeypatch.setattr(attention, "varlen_attn", Reference("old").kernel)
    q = torch.randn(20, 2, 8)
    cu_seq = torch.tensor([0, 20], dtype=torch.int32)
    with pytest.raises(SFTError, match="sliding window of 16 tokens.*has no window_size"):
        attention.call_kernel(q, q, q, cu_seq, 20, 8 ** -0.5, 16)
    assert attention.call_kernel(q, q, q, cu_seq, 20, 8 ** -0.5, 32).shape == q.shape  # a window never reached


def test_refusals(monkeypatch):
    module = torch.nn.Module()
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(SFTError, match="no attention dropout"):
        attention.varlen_attention_forward(module, q, q, q, None, dropout=0.1)
    with pytest.raises(SFTError, match="soft-cap"):
        attention.varlen_attention_forward(module, q, q, q, None, softcap=50.0)
    if attention.TORCH_VARLEN is not None:  # the real kernel on CPU: a clear error, not aten's dispatch failure
        with pytest.raises(SFTError, match="needs a CUDA GPU and bf16"):
            attention.varlen_attention_forward(module, q, q, q, None)
    monkeypatch.setattr(attention, "TORCH_VARLEN", None)
    with pytest.raises(SFTError, match="needs torch.nn.attention.varlen"):
        attention.register()


@pytest.mark.parametrize("name, cuda, installed, problem", [
    ("flash_attention_2", True, False, "its package is not installed"),
    ("flash_attention_3", False, True, "this run has no CUDA GPU"),
    ("flash_attention_2", True, True, None),
    (VARLEN, True, False, None),
    ("sdpa", False, False, None),
])
def test_attention_a_run_cannot_use_is_named_before_loading(monkeypatch, name, cuda, installed, problem):
    """Flash attention without its package failed with transformers' ImportError traceback while loading the model."""
    for flash in attention.FLASH_AVAILABLE:
        monkeypatch.setitem(attention.FLASH_AVAILABLE, flash, lambda kernels_fallback_ok: installed)
    found = attention.attention_problem(name, cuda=cuda, cpu_training=False)
    assert found is None if problem is None else problem in found


def test_recipe_loads_varlen_and_packs_flattened(tiny_model_dir, tokenizer, tmp_path):
    config = SFTConfig(output_dir=str(tmp_path), model_name_or_path=str(tiny_model_dir), attn_implementation=VARLEN,
                       packing=True, use_cpu=True, report_to="none")
    model = load_model(config, tokenizer)
    assert model.config._attn_implementation == VARLEN
    assert ALL_ATTENTION_FUNCTIONS[VARLEN] is attention.varlen_attention_forward
    assert isinstance(default_collator(tokenizer, config), PaddingFreeCollator)
    assert flattened_batches(VARLEN, False, True) and not flattened_batches("sdpa", False, True)
    check_packing_supported(model.config, VARLEN, flattened=True)
    with pytest.raises(ValueError, match="single flattened row"):
        check_packing_supported(model.config, VARLEN, flattened=False)
    from sft.training.flows import check_packing_model

    check_packing_model(config)  # the flow's check: packed varlen batches are flattened, so accepted


def test_autocast_casts_what_the_rotary_embedding_left_in_fp32(monkeypatch):
    """bf16: true keeps fp32 weights: queries and keys leave the rotary embedding in fp32, values in bf16. The
    kernel (no autocast of its own) must get all three in bf16, as transformers' flash path does."""
    seen = []

    def kernel(query, key, value, *args, **kwargs):
        seen.append((query.dtype, key.dtype, value.dtype))
        return torch.zeros_like(query)

    monkeypatch.setattr(attention, "varlen_attn", kernel)
    monkeypatch.setattr(attention, "kernel_style", lambda _: (True, True, True))
    q = torch.randn(1, 2, 4, 8)
    attention.varlen_attention_forward(torch.nn.Module(), q, q, q.bfloat16(), None)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        attention.varlen_attention_forward(torch.nn.Module(), q, q, q.bfloat16(), None)
    assert seen == [(torch.float32, torch.float32, torch.bfloat16), (torch.bfloat16,) * 3]


def test_saved_model_and_sft_check_do_not_need_the_kernel(tiny_model_dir, tokenizer, tmp_path):
    """A model saved from a varlen run loads anywhere (sft generate / chat get the default sdpa: the config does not
    keep the attention), and sft check's fp32 smoke run swaps varlen for sdpa, saying so."""
    from sft.check.smoke import CheckReport, cpu_overrides

    config = SFTConfig(output_dir=str(tmp_path), model_name_or_path=str(tiny_model_dir), attn_implementation=VARLEN,
                       packing=True, use_cpu=True, report_to="none")
    load_model(config, tokenizer).save_pretrained(tmp_path / "saved")
    assert VARLEN not in (tmp_path / "saved" / "config.json").read_text()
    report = CheckReport(recipe="r.yaml")
    assert cpu_overrides(config, report, tmp_path)["attn_implementation"] == "sdpa"
    assert f"attn_implementation={VARLEN}" in report.skipped


def test_sft_check_accepts_a_packed_varlen_recipe(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart names data/ paths relative to the repository
    recipe = tmp_path / "varlen.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text()
    recipe.write_text("\n".join(line for line in text.splitlines() if not line.startswith(("packing:", "attn_")))
                      + f"\nattn_implementation: {VARLEN}\npacking: true\n")
    assert main(["check", str(recipe)]) == 0, capsys.readouterr().err[-2000:]
    out = capsys.readouterr().out
    assert "OK: the recipe is sound." in out and f"attn_implementation={VARLEN}" in out


@torch.library.custom_op("sft_test::varlen_attn", mutates_args={})
def traceable_varlen(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, cu_seq: torch.Tensor,
                     scale: float, left: int) -> torch.Tensor:
    """segment_attention as an opaque custom op, as torch's varlen_attn is: dynamo records a call, never traces in."""
    return segment_attention(query, key, value, cu_seq, scale, left, True).contiguous()


@traceable_varlen.register_fake
def _(query, key, value, cu_seq, scale, left):
    return torch.empty_like(query)


def _traceable_varlen_backward(ctx, grad):
    states = [t.detach().requires_grad_() for t in ctx.saved_tensors[:3]]
    with torch.enable_grad():
        out = segment_attention(*states, ctx.saved_tensors[3], ctx.scale, ctx.left, True)
    return (*torch.autograd.grad(out, states, grad), None, None, None)


def _traceable_varlen_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:4])
    ctx.scale, ctx.left = inputs[4], inputs[5]


traceable_varlen.register_autograd(_traceable_varlen_backward, setup_context=_traceable_varlen_context)


def traceable_kernel(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                     window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
    """The newer varlen_attn signature around the custom op."""
    return traceable_varlen(query, key, value, cu_seq_q, scale, window_size[0])


def test_varlen_under_torch_compile_trains_as_eager_without_graph_breaks(tmp_path, tokenizer, monkeypatch):
    """sft-varlen-compile's path (packing + varlen + torch_compile): sft's attention function is traced into each
    compiled block with no graph break and no dynamo warning, batches of other sizes and example counts recompile
    once (dynamic shapes) and never again, and the losses are eager varlen's."""
    import warnings

    from torch._dynamo.utils import counters

    monkeypatch.setattr(attention, "varlen_attn", traceable_kernel)
    attention.register()
    rows = datasets.Dataset.from_list([{"input_ids": list(range(5, 5 + n)), "labels": list(range(5, 5 + n))}
                                       for n in (5, 9, 7, 12, 3, 20, 6, 6, 11, 2, 8, 4)])

    def losses(folder: str, **flags) -> list[float]:
        model = make_llama(len(tokenizer), seed=1, attn_implementation=VARLEN)
        args = SFTConfig(output_dir=str(tmp_path / folder), per_device_train_batch_size=3, max_steps=4,
                         report_to="none", save_strategy="no", logging_steps=1, attn_implementation=VARLEN,
                         padding_free=True, **flags)
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=rows)
        trainer.train()
        return [e["loss"] for e in trainer.state.log_history if "loss" in e]

    def compiled(folder: str) -> tuple[list[float], int, int, list[str]]:
        torch._dynamo.reset()
        counters.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            result = losses(folder, torch_compile=True, torch_compile_backend="eager")
        graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
        torch._dynamo.reset()
        return result, graphs, breaks, [str(w.message) for w in caught if "Dynamo" in str(w.message)]

    eager = losses("eager")
    result, graphs, breaks, dynamo_warnings = compiled("compiled")
    assert breaks == 0 and graphs == 2  # 4 batches of other token counts: one static graph, one dynamic
    assert not dynamo_warnings, dynamo_warnings
    assert result == pytest.approx(eager, abs=1e-6)
    # negative control: the signature check traced through its lru_cache (as before) warns on every compile
    monkeypatch.setattr(attention, "kernel_style", attention._kernel_style)
    assert compiled("traced")[3]
