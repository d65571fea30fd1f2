"""What only a GPU proves: bf16 end to end, packed == unpacked with sdpa and flash varlen kernels, QLoRA, FSDP2 with
the chunked loss on one GPU, and inductor compile. Skipped without CUDA; run with `pytest -m gpu` on the lent
machine (../shared/gpu/README.md)."""

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


def test_inductor_compile_computes_the_loss_on_gpu(tmp_path, tokenizer, count_chunked):  # noqa: F811
    eager, _ = losses(tmp_path, tokenizer, tf32=False)
    compiled, calls = losses(tmp_path, tokenizer, torch_compile=True, tf32=False)
    assert calls == [("OptimizedModule", 1)] * 2
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
    chunked, _ = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1)
    fused, calls = losses(tmp_path, tokenizer, bf16=True, label_smoothing_factor=0.1, loss_kernel="liger")
    assert calls == [("LlamaForCausalLM", 1)] * 2  # the chunked forward computed each step's loss, with Liger
    assert fused == pytest.approx(chunked, rel=1e-3)
