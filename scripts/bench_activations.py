"""Activation memory of one decoder layer per token, by implementation, at the issue-19 shapes: the part of a full
fine-tune's peak that grows with tokens per step, measured on the CPU.

    python scripts/bench_activations.py                        # Qwen2.5-0.5B, Llama-3.2-1B and Llama-3.1-8B layers
    python scripts/bench_activations.py --shapes qwen2.5-0.5b --json activations.json

What autograd keeps from the forward for the backward does not depend on the device, except inside attention, so
every variant runs one attention stand-in that keeps what a flash kernel keeps (q, k, v, the output and an fp32
log-sum-exp per query; a custom op, as torch's flash and varlen kernels are). The variants:

- eager: the transformers layer as sft runs it without torch_compile (and TRL without Liger);
- compiled: each decoder block compiled in place with inductor (sft's torch_compile; what inductor's partitioner
  keeps is decided on the joint graph, before any device code); `compiled@B`: with the partitioner's
  activation_memory_budget B (sft's `activation_memory_budget`), below 1 recomputing the cheapest ops in backward;
- liger: the layer after liger_kernel's `_apply_liger_kernel_to_instance`, what TRL's `use_liger_kernel` does
  (Liger's RMSNorm, SwiGLU MLP and RoPE). What they keep is decided by Liger's autograd Functions, which run as
  they are; only their Triton launches (`rms_norm_forward`, `swiglu_forward`, `rope_forward`) are replaced by torch
  math returning the same tensors, as Triton needs a GPU (its interpreter fails on Liger's RMSNorm kernel).

One layer's bytes are those saved by a 2-layer model minus a 1-layer model (embedding and final norm cancel), over
one packed row of `--tokens` tokens (examples of 128-384 tokens), bf16 weights, parameters not counted; a storage
saved twice counts once. The projection multiplies by the layer count and the issue-19 job's 8 x 2048 tokens, and
adds bf16 weights, gradients and AdamW's two states (8 bytes a parameter): the peak a full fine-tune reaches
before the loss, which sft and TRL's Liger both compute without full logits. Each variant runs in a fresh process
(Liger patches transformers' modules for the whole process).
"""

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHAPES = {"qwen2.5-0.5b": "qwen/qwen2.5-0.5b", "llama-3.2-1b": "meta-llama/llama-3.2-1b",
          "llama-3.1-8b": "meta-llama/llama-3.1-8b"}
VARIANTS = ("eager", "compiled", "compiled@0.8", "liger")
JOB_TOKENS = 8 * 2048


def flash_like_attention():
    """An attention function for transformers that keeps what flash attention keeps, per packed example."""
    import torch
    import torch.nn.functional as F
    from transformers import AttentionInterface

    def segments(q, k, v, cu):  # [T, H, D] states, causal within each [cu[i], cu[i+1])
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], 1) for t in (k, v))
        bounds = cu.tolist()
        return torch.cat([F.scaled_dot_product_attention(*(t[a:b].transpose(0, 1) for t in (q, k, v)),
                                                         is_causal=True).transpose(0, 1)
                          for a, b in zip(bounds, bounds[1:])])

    @torch.library.custom_op("sft_bench::attention", mutates_args={})
    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
        return segments(q, k, v, cu).contiguous(), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)

    @attention.register_fake
    def _(q, k, v, cu):
        return torch.empty_like(q), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)

    @torch.library.custom_op("sft_bench::attention_backward", mutates_args={})
    def backward_op(grad: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                    lse: torch.Tensor, cu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        _, pullback = torch.func.vjp(lambda *states: segments(*states, cu), q, k, v)  # a custom op runs below autograd
        return tuple(g.contiguous() for g in pullback(grad))

    @backward_op.register_fake
    def _(grad, q, k, v, out, lse, cu):
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs[:3], *output, inputs[3])  # q, k, v, out, lse, cu: flash's set

    def backward(ctx, grad, _grad_lse):
        return (*backward_op(grad, *ctx.saved_tensors), None)

    attention.register_autograd(backward, setup_context=setup_context)

    def forward(module, query, key, value, attention_mask, cu_seq_lens_q=None, **kwargs):
        flat = [t.transpose(1, 2).reshape(-1, t.shape[1], t.shape[3]) for t in (query, key, value)]
        out, _ = attention(*flat, cu_seq_lens_q)
        return out.view(query.shape[0], query.shape[2], *out.shape[1:]), None

    AttentionInterface.register("sft_bench_kernel", forward)
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    AttentionMaskInterface.register("sft_bench_kernel", ALL_MASK_ATTENTION_FUNCTIONS["flash_attention_2"])


def liger_launches_in_torch() -> None:
    """Liger's three Triton launches as torch math with the same outputs (shapes, dtypes, the views of the inputs
    that Liger's Functions then keep); the Functions, which choose what to keep, are untouched."""
    import torch
    import torch.nn.functional as F
    from liger_kernel.ops import rms_norm, rope, swiglu

    def rms_norm_forward(X, W, eps, offset, casting_mode, row_mode):
        mode = casting_mode if isinstance(casting_mode, int) else rms_norm._str_to_casting_mode[casting_mode]
        shape, X = X.shape, X.view(-1, X.shape[-1])
        rstd = torch.rsqrt(X.float().pow(2).mean(-1) + eps)
        Y = (X.float() * rstd[:, None] * (offset + W.float())).to(X.dtype)
        return Y.view(*shape), X, rstd, 1024, 4, mode  # rstd in fp32, as the llama and gemma modes keep it

    def swiglu_forward(a, b, gate_multiplier: float = 1.0):
        shape = a.shape
        a, b = a.view(-1, shape[-1]), b.view(-1, shape[-1])
        return a, b, (F.silu(a * gate_multiplier) * b).view(*shape)

    def rope_forward(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        cos, sin = (t.squeeze(1) if t.ndim == 4 else t for t in (cos, sin))
        cos, sin = (t.unsqueeze(0) if t.ndim == 2 else t for t in (cos, sin))
        q, k = q.transpose(1, 2).contiguous(), k.transpose(1, 2).contiguous()  # rotated in place there

        def rotate(x):
            half = x.shape[-1] // 2
            return x * cos[:, :, None] + torch.cat([-x[..., half:], x[..., :half]], -1) * sin[:, :, None]
        q.copy_(rotate(q))
        k.copy_(rotate(k))
        return q.transpose(1, 2), k.transpose(1, 2), cos.contiguous(), sin.contiguous()

    rms_norm.rms_norm_forward, swiglu.swiglu_forward, rope.rope_forward = rms_norm_forward, swiglu_forward, rope_forward


def saved_bytes(model, batch: dict) -> int:
    """Bytes of the distinct non-parameter storages autograd saves in one forward of the decoder."""
    import torch

    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        hidden = model.model(**batch, use_cache=False).last_hidden_state
    del hidden
    return sum(seen.values())


def worker(spec: dict) -> dict:
    """Saved bytes per token of one layer of `spec["shape"]` in `spec["variant"]`."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    from sft.models.architectures import known_config
    from sft.models.compilation import compile_blocks

    flash_like_attention()
    generator = torch.Generator().manual_seed(0)
    lengths, total = [], 0
    while total < spec["tokens"]:
        lengths.append(min(int(torch.randint(128, 385, (), generator=generator)), spec["tokens"] - total))
        total += lengths[-1]
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    batch = {"input_ids": torch.randint(0, 1000, (1, total), generator=generator),
             "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "cu_seq_lens_q": cu,
             "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths)}
    measured = {}
    for layers in (1, 2):
        config = known_config(SHAPES[spec["shape"]])
        config.num_hidden_layers, config.vocab_size, config.use_cache = layers, 1000, False
        if getattr(config, "layer_types", None):
            config.layer_types = config.layer_types[:layers]
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sft_bench_kernel")
        if spec["variant"] == "liger":
            from liger_kernel.transformers import _apply_liger_kernel_to_instance

            liger_launches_in_torch()
            _apply_liger_kernel_to_instance(model=model)
        elif spec["variant"].startswith("compiled"):
            import torch._functorch.config

            budget = float(spec["variant"].partition("@")[2] or 1.0)
            torch._functorch.config.activation_memory_budget = budget
            compile_blocks(model)
        saved_bytes(model, batch)  # a first call compiles; the second is measured
        measured[layers] = saved_bytes(model, batch)
    layer = measured[2] - measured[1]
    return {"shape": spec["shape"], "variant": spec["variant"], "tokens": total, "bytes_per_token": layer / total,
            "hidden_size": config.hidden_size, "intermediate_size": config.intermediate_size,
            "layers": known_config(SHAPES[spec["shape"]]).num_hidden_layers}


def run(spec: dict) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], capture_output=True, text=True,
                          env=env)
    if done.returncode != 0:
        return {**spec, "error": (done.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(done.stdout.strip().splitlines()[-1])


def parameters(shape: str) -> int:
    """Parameters of the full model (embedding and head included)."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(REPO))
    from sft.models.architectures import known_config

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForCausalLM.from_config(known_config(SHAPES[shape])).parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--tokens", type=int, default=2048, help="tokens in the measured packed row")
    parser.add_argument("--json")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    results = []
    print(f"{'shape':<14}{'variant':<10}{'KB/token/layer':>15}{'vs eager':>9}{'activations GB':>15}"
          f"{'+ states GB':>12}   (projected: {JOB_TOKENS} tokens/step, all layers)")
    for shape in args.shapes.split(","):
        states = 8 * parameters(shape)  # bf16 weights + gradients + AdamW's two bf16 states
        eager = None
        for variant in args.variants.split(","):
            result = run({"shape": shape, "variant": variant, "tokens": args.tokens})
            results.append(result)
            if "error" in result:
                print(f"{shape:<14}{variant:<10}failed: {result['error'][:90]}")
                continue
            eager = result["bytes_per_token"] if variant == "eager" else eager
            activations = result["bytes_per_token"] * result["layers"] * JOB_TOKENS
            ratio = f"{result['bytes_per_token'] / eager:.2f}x" if eager else ""
            print(f"{shape:<14}{variant:<10}{result['bytes_per_token'] / 1024:>15.1f}{ratio:>9}"
                  f"{activations / 1e9:>15.1f}{(activations + states) / 1e9:>12.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"setup": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
