"""Bytes autograd keeps per token in one decoder layer, by tensor width, eager and with compiled blocks, on a device.

    python scripts/layer_memory.py                       # CPU: inductor's partitioner without its codegen
    python scripts/layer_memory.py --device cuda         # the GPU: inductor itself

sft plan's activation rows (sft.planning.memory: LAYER_BYTES, COMPILED_SAVINGS) are fitted to what autograd saves
(sft.planning.memtrace.saved_per_layer). This prints it for full fine-tuning and LoRA, eager and compiled at the
partitioner budgets the planner knows, on a Llama-family layer whose widths all differ (hidden h 512, attention q
4 x 96 = 384, key/value kv 2 x 96 = 192, MLP i 1408), so each kept tensor's width names what it is. Where the GPU
keeps other tensors than CPU, the two tables differ: on an H100 (2026-11-27) only LoRA's dropout did (CUDA keeps a
bool mask, CPU bf16 noise), which the simulated step now runs as CUDA does (memtrace.dropout_as_on_cuda).
"""

import argparse
import json

import torch

from sft.models.architectures import known_config
from sft.planning.memtrace import saved_per_layer
from sft.training.recipe import load_recipe

WIDTHS = {"h": 512, "q": 384, "kv": 192, "i": 1408}
CONFIGS = [("full", None), ("full", 1.0), ("full", 0.8), ("lora", None), ("lora", 1.0), ("lora", 0.8)]


def arch():
    config = known_config("meta-llama/Llama-3.2-1B")
    for key, value in dict(hidden_size=WIDTHS["h"], num_attention_heads=4, num_key_value_heads=2, head_dim=96,
                           intermediate_size=WIDTHS["i"], vocab_size=1000, tie_word_embeddings=False).items():
        setattr(config, key, value)
    return config


def name_width(width: int) -> str:
    """A kept tensor's elements per token as a multiple of the layer's widths (e.g. 2h), else the number."""
    for name, size in WIDTHS.items():
        if width % size == 0:
            return name if width == size else f"{width // size}{name}"
    return str(width)


def measure(method: str, budget: float | None, device: str, tokens: int) -> dict[str, float]:
    values = dict(model_name_or_path="meta-llama/Llama-3.2-1B", dataset="unused.json", output_dir="unused",
                  dtype="bfloat16", bf16=True, max_length=tokens, use_peft=method == "lora")
    backend = None if budget is None else ("inductor" if device == "cuda" else "aot_eager_decomp_partition")
    with torch._functorch.config.patch(activation_memory_budget=budget or 1.0):
        kept = saved_per_layer(load_recipe(values), arch(), tokens, device, backend)
    return {f"{dtype} {name_width(width)}": round(nbytes, 3) for (dtype, width), nbytes in kept.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--json", help="also write the tables here")
    args = parser.parse_args(argv)
    results = {}
    for method, budget in CONFIGS:
        label = f"{method} {'eager' if budget is None else f'compiled {budget}'}"
        kept = measure(method, budget, args.device, args.tokens)
        total = sum(kept.values())
        units = total / WIDTHS["h"]
        print(f"{label}: {total:,.0f} bytes per token and layer ({units:.2f} x h)", flush=True)
        for kind, nbytes in sorted(kept.items(), key=lambda item: -item[1]):
            print(f"    {kind:<16} {nbytes:>10,.1f}")
        results[label] = kept
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": args.device, "tokens": args.tokens, "widths": WIDTHS, "kept": results}, f, indent=1)


if __name__ == "__main__":
    main()
