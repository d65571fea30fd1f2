"""`torch_compile` as sft applies it: every repeated block of the model (a decoder layer, a T5 block) compiled in
place, the rest (embeddings, final norm, the chunked loss) eager.

Why not the Trainer's whole-model torch.compile (accelerate wraps the model): dynamo then traces every layer, so the
compile time grows with depth (tiny Llama, CPU inductor, cold caches: 36 s at 8 layers, 68 s at 24), though a
model's layers are one piece of code. Compiled in place, the first layer's graph serves them all (17 s at either
depth, same losses: scripts/bench_compile.py). The module tree and parameter names stay as they are, so saving,
PEFT and the chunked loss (which runs between the last block and the head) see the model they see without it.
accelerate's own regional compilation is not used: it compiles a shallow copy of the model, and the chunked forward,
attached to the original, would go on running the original's uncompiled layers.

`activation_memory_budget` below 1 lets the partitioner recompute the cheapest ops in the backward instead of keeping
their outputs (scripts/bench_activations.py: at 0.8 a Qwen2.5-0.5B layer keeps 26.6 KB a token instead of 39.6, with
the same 14 matmuls and one attention in its backward; at 0.6 matmuls and attention are recomputed too).
"""

import torch._functorch.config
from torch import nn


def repeated_blocks(model: nn.Module) -> list[nn.ModuleList]:
    """The outermost ModuleLists whose children are all of one class: a causal LM's decoder layers, T5's encoder and
    decoder blocks. Lists inside a found one (a block's experts) are part of its block."""
    found = []
    for child in model.children():
        if isinstance(child, nn.ModuleList) and len(child) and len({type(block) for block in child}) == 1:
            found.append(child)
        else:
            found.extend(repeated_blocks(child))
    return found


def compile_blocks(model: nn.Module, backend: str = "inductor", mode: str | None = None) -> int:
    """Compile each repeated block of `model` in place (nn.Module.compile); returns how many were compiled."""
    blocks = [block for blocks in repeated_blocks(model) for block in blocks]
    for block in blocks:
        block.compile(backend=backend, mode=mode)
    return len(blocks)


def set_activation_memory_budget(budget: float) -> None:
    """The share of activation memory AOTAutograd's partitioner keeps (torch's own setting, for this process: the
    blocks compile at their first forward, and again for a new input shape)."""
    torch._functorch.config.activation_memory_budget = budget
