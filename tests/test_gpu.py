"""What only a GPU proves: bf16 end to end, packed == unpacked with sdpa, flash and torch varlen kernels (sft's
attn_implementation varlen), QLoRA, FSDP2 with the chunked loss on one GPU, inductor compile and Liger's fused
linear cross-entropy. Skipped without CUDA; run with `pytest -m gpu` on the lent machine (BENCHMARKS.md, "GPU")."""

import functools
import importlib.util
import json
import sys

import pytest
import torch
from test_compile import count_chunked, losses  # noqa: F401  (count_chunked is a fixture)
from test_ddp import PROBE, STEPS, max_weight_difference, one_process, run, write_recipe
from test_mixed_precision import train_step
from test_trainer import toy_dataset

from sft import SFTConfig, SFTTrainer
from sft.data.packing import pack_dataset
from sft.models import attention

from conftest import make_llama

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_bf16_end_to_end_on_gpu(tmp_path, tokenizer):
    loss32, seen32, _, _ = train_step(tmp_path, tokenizer, use_cpu=False, tf32=False)
    loss16, seen16, model, _ = train_step(tmp_path, tokenizer, use_cpu=False, bf16=True)
    assert seen32 == {torch.float32} and seen16 == {torch.bfloat16}
    assert {p.device.type for p in model.parameters()} == {"cuda"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # fp32 master weights
    assert loss16 == pytest.approx(loss32, rel=0.02)


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_packed_eval_loss_equals_unpacked_on_gpu(tmp_path, tokenizer, attn):
    flash = attn.startswith("flash")
    if flash and importlib.util.find_spec("flash_attn") is None:
        pytest.skip("flash-attn is not installed")
    dtype = torch.bfloat16 if flash else torch.float32  # flash kernels take half precision only

    tolerance = 2e-2 if flash else 1e-5

    def eval_loss(data, **flags) -> float:
        # peaked attention (initializer_range 0.3): attending across packed examples changes the loss measurably
        model = make_llama(len(tokenizer), seed=1, attn_implementation=attn, initializer_range=0.3).to("cuda", dtype)
        args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=2, report_to="none", tf32=False,
                         attn_implementation=attn, **flags)
        return SFTTrainer(model=model, args=args, processing_class=tokenizer, eval_dataset=data).evaluate()["eval_loss"]

    packed_rows = pack_dataset(toy_dataset(), 64)
    # The negative control: the same packed rows and trained tokens with their example boundaries erased
    # (position_ids 0..n-1 along each row, so one sequence and one cu_seq_lens span per row): attention leaks.
    leaky_rows = packed_rows.map(lambda row: {"position_ids": list(range(len(row["input_ids"]))),
                                              "seq_lengths": [len(row["input_ids"])]})
    unpacked = eval_loss(toy_dataset())
    packed = eval_loss(packed_rows, eval_packing=True)  # flash: flattened with cu_seq_lens
    leaky = eval_loss(leaky_rows, eval_packing=True)
    print(f"{attn}: unpacked {unpacked:.5f}, packed {packed:.5f}, leaky {leaky:.5f}")
    assert abs(leaky - unpacked) > 2 * tolerance  # a leak is caught: the comparison below can fail
    assert packed == pytest.approx(unpacked, abs=tolerance)


def bf16_model(tokenizer, family: str, attn: str) -> torch.nn.Module:
    """A 2-layer bf16 model with peaked attention (initializer_range 0.3); qwen2's second layer attends within a
    4-token window, shorter than most toy examples."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if attn == attention.VARLEN:
        attention.register()
    if family == "llama":
        model = make_llama(len(tokenizer), seed=1, attn_implementation=attn, initializer_range=0.3)
        return model.to("cuda", torch.bfloat16)
    torch.manual_seed(1)
    config = AutoConfig.for_model("qwen2", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  initializer_range=0.3, use_sliding_window=True, sliding_window=4, max_window_layers=1,
                                  tie_word_embeddings=False, use_cache=False)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn).to("cuda", torch.bfloat16)


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("attn", ["sdpa", attention.VARLEN])
def test_packed_bf16_eval_loss_equals_unpacked_on_gpu(tmp_path, tokenizer, monkeypatch, attn, family):
    """Packed rows through sft (varlen: one flattened row, torch's varlen_attn) against each example alone through
    the same attention (batch 1, no padding: varlen runs its kernel on one span), bf16."""
    if attn == attention.VARLEN and attention.TORCH_VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    if attn == attention.VARLEN and family == "qwen2" and not attention.kernel_style(attention.TORCH_VARLEN)[0]:
        pytest.skip("this torch's varlen_attn has no window_size: sft refuses the window (tests/test_varlen.py)")
    calls = []

    @functools.wraps(attention.TORCH_VARLEN)  # its signature: sft picks the kernel's style from it
    def counted(*args, **kwargs):
        calls.append(kwargs)
        return attention.TORCH_VARLEN(*args, **kwargs)

    monkeypatch.setattr(attention, "varlen_attn", counted)
    # varlen: the same kernel on one span or several. sdpa: a masked kernel packed, an is_causal one alone, whose
    # bf16 roundings differ (CPU bf16 proxy: up to 3e-3 on qwen2, 2e-4 on llama; the leaks are 0.5 to 0.7).
    tolerance = 1e-3 if attn == attention.VARLEN else 5e-3

    def eval_loss(data, attn, batch=2, **flags) -> float:
        args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=batch, report_to="none", tf32=False,
                         attn_implementation=attn, **flags)
        return SFTTrainer(model=bf16_model(tokenizer, family, attn), args=args, processing_class=tokenizer,
                          eval_dataset=data).evaluate()["eval_loss"]

    packed_rows = pack_dataset(toy_dataset(), 64)
    leaky_rows = packed_rows.map(lambda row: {"position_ids": list(range(len(row["input_ids"]))),
                                              "seq_lengths": [len(row["input_ids"])]})
    alone = eval_loss(toy_dataset(), attn, batch=1)
    sdpa = eval_loss(toy_dataset(), "sdpa", batch=1)
    del calls[:]
    packed = eval_loss(packed_rows, attn, eval_packing=True)
    packed_calls = list(calls)
    leaky = eval_loss(leaky_rows, attn, eval_packing=True)
    style = attention.kernel_style(attention.TORCH_VARLEN) if attention.TORCH_VARLEN else None
    print(f"{family} {attn} bf16: alone {alone:.5f} (sdpa alone {sdpa:.5f}), packed {packed:.5f}, leaky "
          f"{leaky:.5f}; (window_size, enable_gqa, scale) {style}: packed calls {packed_calls}")
    assert len(packed_calls) == (2 if attn == attention.VARLEN else 0)  # one flattened batch x two layers
    if family == "qwen2" and attn == attention.VARLEN and style[0]:
        assert [c["window_size"] for c in packed_calls] == [(-1, 0), (3, 0)]  # layer 2: the 4-token window
    assert abs(leaky - alone) > 2 * tolerance  # a leak is caught: the comparison below can fail
    assert packed == pytest.approx(alone, abs=tolerance)
    assert alone == pytest.approx(sdpa, abs=2e-2)  # another kernel: bf16 rounding differs (CPU proxy: 6e-3)


def test_varlen_recipe_trains_like_sdpa_on_gpu(tmp_path):
    """The recipe path: packed bf16 training with attn_implementation varlen moves the weights as sdpa does, as
    closely as eager (another exact attention, other bf16 roundings) does; left unset, the run is varlen's. CPU proxy with a per-example sdpa kernel:
    varlen-sdpa 5e-3, eager-sdpa 6e-3; in fp32 varlen-sdpa 8e-7."""
    if attention.TORCH_VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    runs = {}
    for attn in ("sdpa", "eager", attention.VARLEN, None):  # None: unset, which a packed bf16 run on a GPU makes varlen
        keys = {"attn_implementation": attn} if attn else {}
        recipe = write_recipe(tmp_path, packing=True, bf16=True, tf32=False, **keys)
        runs[attn] = one_process(recipe, tmp_path / str(attn), accumulation=1)
    varlen = max_weight_difference(runs["sdpa"], runs[attention.VARLEN])
    eager = max_weight_difference(runs["sdpa"], runs["eager"])
    print(f"packed bf16 SGD, max weight difference from sdpa: varlen {varlen:.2e}, eager {eager:.2e}")
    assert varlen <= 2 * eager + 1e-4
    # the same kernel (flash's backward may add in another order: not bitwise), not sdpa's difference
    assert max_weight_difference(runs[None], runs[attention.VARLEN]) < varlen / 10


def test_an_unset_attention_is_varlen_for_packed_bf16_batches_on_gpu():
    """The kernel probe runs on this GPU, so packed bf16 Llama batches get varlen; float32 ones keep sdpa."""
    from transformers import AutoConfig

    if attention.TORCH_VARLEN is None:
        pytest.skip("this torch has no torch.nn.attention.varlen")
    gpu = torch.device("cuda", torch.cuda.current_device())
    assert attention.kernel_runs(gpu)
    assert attention.fastest_attention(AutoConfig.for_model("llama"), gpu, True, 2048)[0] == attention.VARLEN
    assert attention.fastest_attention(AutoConfig.for_model("llama"), gpu, False, 2048)[0] is None


@pytest.mark.parametrize("model_type", ["llama", "gpt_neox", "starcoder2", "phi"])
def test_the_cpu_simulated_layer_keeps_what_the_gpu_keeps(model_type):
    """sft plan's simulated step acts out CUDA's autocast on the CPU (LayerNorm and gelu_new's pow in float32): a
    decoder layer keeps the same bytes a token, by dtype and width, here and on the GPU (an H100 matched all four
    families, and kept an int64 pair of 0-dim tensors more, 2026-11-27)."""
    from test_cuda_autocast import SMALL
    from test_plan import family_config, recipe

    from sft.planning.memtrace import saved_per_layer
    from sft.training.recipe import load_recipe

    config = load_recipe(recipe("x", "full", 1, 256, False))
    arch = family_config(dict(model_type=model_type), **SMALL)
    cpu, gpu = saved_per_layer(config, arch, 256, "cpu"), saved_per_layer(config, arch, 256, "cuda")
    print(model_type, "cpu", cpu, "gpu", gpu)
    per_token = {key: nbytes for key, nbytes in gpu.items() if key[1]}
    assert cpu == per_token
    # and nothing else but 0-dim tensors (the flash kernel's random-state pair, 16 bytes a layer at any length)
    assert sum(gpu.values()) - sum(per_token.values()) <= 16 / 256


@pytest.mark.skipif(importlib.util.find_spec("bitsandbytes") is None, reason="bitsandbytes is not installed")
def test_qlora_trains_the_adapter_only_on_gpu(tmp_path):
    from safetensors.torch import load_file

    recipe = write_recipe(tmp_path, load_in_4bit=True, use_peft=True, bf16=True, optim="adamw_torch",
                          learning_rate=1e-3)
    out = one_process(recipe, tmp_path / "qlora", accumulation=1)
    adapter = load_file(out / "adapter_model.safetensors")
    assert adapter and all(adapter[k].abs().sum() > 0 for k in adapter if "lora_B" in k)
    assert not (out / "model.safetensors").exists()


def test_fsdp2_with_the_chunked_loss_equals_plain_training_on_one_gpu(tmp_path):
    recipe = write_recipe(tmp_path, tf32=False)
    out = tmp_path / "fsdp"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", PROBE, "train", recipe,
         "--output_dir", out, "--distributed", "fsdp"])
    report = json.loads((out / "batches-rank0.json").read_text())
    assert set(report["called"]) == {"FSDPLlamaForCausalLM"}  # fully_shard'ed root, not a DDP fallback
    assert report["chunked_train_forwards"] == STEPS
    plain = one_process(recipe, tmp_path / "plain", accumulation=1)
    assert max_weight_difference(out, plain) < 1e-5


def test_fsdp2_bf16_trains_fp32_master_weights_on_one_gpu(tmp_path):
    recipe = write_recipe(tmp_path, dtype="bfloat16", bf16=True)  # weights loaded in bf16, as the 8B recipes do
    out = tmp_path / "fsdp-bf16"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1", PROBE, "train", recipe,
         "--output_dir", out, "--distributed", "fsdp"])
    report = json.loads((out / "batches-rank0.json").read_text())
    # accelerate upcasts trainable parameters for FSDP2 once mixed_precision is bf16 (it was "no" before)
    assert report["trainable_dtypes"] == ["torch.float32"] and report["chunked_train_forwards"] == STEPS


def test_inductor_compiled_blocks_train_as_eager_on_gpu(tmp_path, tokenizer, count_chunked):  # noqa: F811
    from torch._dynamo.utils import counters

    eager, _ = losses(tmp_path, tokenizer, tf32=False)
    torch._dynamo.reset()
    counters.clear()
    compiled, calls = losses(tmp_path, tokenizer, torch_compile=True, tf32=False)
    assert calls == [("LlamaForCausalLM", 1)] * 2  # each block compiled in place; the chunked loss in the model
    assert 1 <= counters["stats"]["unique_graphs"] <= 2  # one graph for both layers (+1 dynamic recompile)
    assert compiled == pytest.approx(eager, abs=1e-4)


def head_and_loss(model, inputs, normalizer) -> tuple[float, dict]:
    model.zero_grad()
    loss = model(**inputs, num_items_in_batch=normalizer).loss
    loss.backward()
    return float(loss.detach()), {k: p.grad.float().clone() for k, p in model.named_parameters()}


def grad_gap(grads: dict, expected: dict) -> float:
    """The largest max |difference| / max |expected| over the parameters."""
    return max(float((grads[k] - v).abs().max() / v.abs().max()) for k, v in expected.items())


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_liger_loss_kernel_equals_the_chunked_loss_in_bf16_on_gpu(smoothing):
    from test_loss import batch

    from sft.training.loss import attach_chunked_loss, liger_linear_cross_entropy

    model = make_llama(300, initializer_range=0.3).to("cuda", torch.bfloat16)  # pure bf16 weights, as bench_gpu
    inputs = {k: v.to("cuda") for k, v in batch(300).items()}
    attach_chunked_loss(model, label_smoothing=smoothing)
    chunked, chunked_grads = head_and_loss(model, inputs, 97)
    attach_chunked_loss(model, label_smoothing=smoothing, liger=liger_linear_cross_entropy(torch.device("cuda")))
    fused, fused_grads = head_and_loss(model, inputs, 97)
    other, _ = head_and_loss(model, inputs, 39)  # the trained tokens instead of the step's 97
    gap = grad_gap(fused_grads, chunked_grads)
    print(f"smoothing {smoothing}: chunked {chunked:.6f}, liger {fused:.6f}, largest gradient gap {gap:.2e}")
    assert fused == pytest.approx(chunked, rel=1e-3)
    assert gap < 2e-2  # bf16 gradients: a few units of bf16's 2^-8
    assert abs(other - fused) > 0.1  # the normaliser reaches the loss: the comparison above can fail


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is None, reason="liger-kernel is not installed")
def test_trainer_with_loss_kernel_liger_trains_as_the_chunked_loss_on_gpu(tmp_path, tokenizer,
                                                                         count_chunked):  # noqa: F811
    chunked, _ = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1, loss_kernel="chunked")
    fused, calls = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1, loss_kernel="liger")
    assert calls == [("LlamaForCausalLM", 1)] * 2  # the chunked forward computed each step's loss, with Liger
    assert fused == pytest.approx(chunked, rel=1e-3)


def test_auto_loss_kernel_trains_with_the_fused_step_as_the_eager_one_on_gpu(tmp_path, tokenizer,
                                                                           count_chunked):  # noqa: F811
    """On this GPU `loss_kernel: auto` is the fused chunk step (Triton), and trains as the eager step does."""
    from sft.training.loss import fused_step_runs

    assert fused_step_runs(torch.device("cuda", torch.cuda.current_device()))
    eager, _ = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1, loss_kernel="chunked")
    torch._dynamo.reset()
    frames = torch._dynamo.utils.counters["frames"]["ok"]
    auto, calls = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1)
    assert calls == [("LlamaForCausalLM", 1)] * 2 and torch._dynamo.utils.counters["frames"]["ok"] > frames
    assert auto == pytest.approx(eager, rel=1e-3)


@pytest.mark.parametrize("dtype,autocast", [(torch.bfloat16, False), (torch.float16, False), (torch.float32, True)],
                         ids=["bf16", "fp16", "float32-under-bf16-autocast"])
def test_weight_gradient_accumulates_in_float32_on_gpu(dtype, autocast):
    """add_weight_grad's cuBLAS path (addmm out_dtype float32) against float64 sums of the same products over 8
    chunks: closer than the cast-and-add it replaced, which rounds each product. Float32 inputs under bf16 autocast
    (float32 weights with `bf16: true`, the shipped full fine-tune recipes) are multiplied in bf16, as autocast's
    matmul would."""
    from sft.training.linear_cross_entropy import add_weight_grad

    torch.manual_seed(0)
    chunks = [(torch.randn(512, 1000, device="cuda", dtype=dtype) / 30,
               torch.randn(512, 256, device="cuda", dtype=dtype)) for _ in range(8)]
    product = torch.bfloat16 if autocast else dtype  # the dtype the product is made in
    exact = sum(g.to(product).double().T @ h.to(product).double() for g, h in chunks).float()
    fused = torch.zeros(1000, 256, device="cuda")
    cast_add = torch.zeros(1000, 256, device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        for grad_logits, hidden in chunks:
            add_weight_grad(fused, grad_logits, hidden)
            cast_add += (grad_logits.T @ hidden).float()  # the product rounded to its dtype, then added
    fused_gap, cast_gap = (float((g - exact).abs().max() / exact.abs().max()) for g in (fused, cast_add))
    print(f"{dtype}, autocast {autocast}: cuBLAS float32 accumulation {fused_gap:.2e}, cast and add {cast_gap:.2e}")
    assert fused_gap < 1e-5 < cast_gap  # the cuBLAS path ran: the rounded products are further off


def test_an_unaligned_head_runs_aligned_kernels_on_gpu(monkeypatch):
    """A bf16 head of 151,665 rows (Qwen2.5's tokenizer; not a multiple of 8) ran the chunked loss's three matmuls
    on sm75 `align1` CUTLASS kernels: 61.5 of an H100 Qwen2.5-0.5B step's 122 ms of matmuls. Padded to 151,680 rows
    (sft.training.linear_cross_entropy.aligned_head) none runs; without the padding (the control) they do. Loss
    equal to 1e-3."""
    from torch.profiler import ProfilerActivity, profile

    from sft.training import linear_cross_entropy as kernel

    torch.manual_seed(0)
    hidden = torch.randn(4096, 896, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(151665, 896, device="cuda") / 30).to(torch.bfloat16)
    targets = torch.randint(0, 151665, (4096,), device="cuda")
    chunk = kernel.chunk_rows(151665)

    def run() -> tuple[float, set, float]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        kernel.LinearCrossEntropy.apply(h, w, targets, torch.tensor(4096.0, device="cuda"), chunk).backward()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            loss = kernel.LinearCrossEntropy.apply(h, w, targets, torch.tensor(4096.0, device="cuda"), chunk)
            loss.backward()
            end.record()
            torch.cuda.synchronize()
        return float(loss), {e.key for e in prof.key_averages() if "align1" in e.key}, start.elapsed_time(end)

    loss, slow_kernels, ms = run()
    monkeypatch.setattr(kernel, "aligned_head", lambda w: w)
    unpadded_loss, unpadded_slow, unpadded_ms = run()
    print(f"151,665-row head, 4096 rows: padded {ms:.1f} ms, unpadded {unpadded_ms:.1f} ms (under the profiler); "
          f"align1 kernels unpadded: {sorted(unpadded_slow)}")
    assert not slow_kernels and unpadded_slow
    assert abs(loss - unpadded_loss) < 1e-3


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_fused_loss_kernel_equals_the_chunked_loss_in_bf16_on_gpu(smoothing):
    """`loss_kernel: fused` (each chunk's softmax and gradient compiled by inductor into Triton kernels) against
    the eager chunk step, at a 151,665-row bf16 head (padded to 151,680: its padded columns must stay out), and
    how long each takes (forward + backward, 4096 rows of hidden 896, after a compiling warm-up)."""
    from sft.training import linear_cross_entropy as kernel

    torch.manual_seed(0)
    hidden = torch.randn(4096, 896, device="cuda", dtype=torch.bfloat16)
    weight = (torch.randn(151665, 896, device="cuda") / 30).to(torch.bfloat16)
    targets = torch.randint(0, 151665, (4096,), device="cuda")
    normalizer = torch.tensor(5000.0, device="cuda")
    chunk = kernel.chunk_rows(151665)

    def run(fused: bool) -> tuple[float, torch.Tensor, torch.Tensor, float]:
        h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
        for _ in range(2):  # the second is timed
            h.grad = w.grad = None
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            loss = kernel.LinearCrossEntropy.apply(h, w, targets, normalizer, chunk, smoothing, fused)
            loss.backward()
            end.record()
            torch.cuda.synchronize()
        return float(loss), h.grad, w.grad, start.elapsed_time(end)

    loss, grad_hidden, grad_weight, ms = run(False)
    fused_loss, fused_hidden, fused_weight, fused_ms = run(True)
    gap = grad_gap({"h": fused_hidden, "w": fused_weight}, {"h": grad_hidden, "w": grad_weight})
    print(f"smoothing {smoothing}: eager {ms:.1f} ms, fused {fused_ms:.1f} ms; loss {loss:.6f} vs {fused_loss:.6f}, "
          f"largest gradient gap {gap:.2e}")
    assert fused_loss == pytest.approx(loss, rel=1e-4)
    assert gap < 2e-2  # bf16 gradients: a few units of bf16's 2^-8


def test_the_divergence_guard_reads_a_step_later_without_waiting_on_gpu():
    """On a CUDA GPU the guard copies each step's values to the host without waiting and reads them a step later,
    after the event recorded behind the copy: the values read are the step's, though the copy was queued behind
    a long kernel when the host went on."""
    from transformers import TrainerControl

    from sft.training.divergence import DivergenceGuard

    class OneRank:
        num_processes, device = 1, torch.device("cuda")

    guard = DivergenceGuard(OneRank())
    assert guard.deferred
    control = TrainerControl()
    state = type("State", (), {"global_step": 1})()
    big = torch.randn(8192, 8192, device="cuda")
    for _ in range(20):  # ~tens of ms of queued work ahead of the values
        big = torch.tanh(big @ big / 100)
    guard.add_loss(big[0, 0] * 0 + 2.5)
    guard.add_grad_norm(big[0, 1] * 0 + float("inf"), fp16=False)
    guard.on_step_end(None, state, control)
    assert guard.bad is None  # not read yet
    state.global_step = 2
    guard.add_loss(torch.tensor(1.0, device="cuda"))
    guard.on_step_end(None, state, control)
    assert guard.bad == (1, "the gradient norm is inf at loss 2.5") and control.should_training_stop
