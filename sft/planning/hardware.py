"""GPU kinds `sft plan` knows: memory, dense bf16 throughput and the model-FLOP utilisation it assumes.

Peak throughput is the vendor's dense (no sparsity) bf16 tensor-core figure with fp32 accumulation, which is what
PyTorch's matmuls use. MFU (model FLOPs / peak) is the fraction a well-configured fine-tune reaches: published
7-8B full fine-tunes reach 35-45% on A100/H100 (FSDP, sdpa/flash attention, packed sequences); consumer and
inference cards lose more to memory bandwidth. These are stated assumptions, not measurements of this code.
"""

import difflib
from dataclasses import dataclass

from sft.errors import SFTError


@dataclass(frozen=True)
class GPU:
    """One GPU kind."""

    name: str
    """Name as given on the command line, e.g. H100-80GB."""
    memory_gib: float
    """Memory the CUDA driver reports (a card sold as 80 GB has about 79.2 GiB usable)."""
    bf16_tflops: float
    """Dense bf16 tensor-core peak, TFLOP/s."""
    mfu: float
    """Assumed model-FLOP utilisation of an SFT run on this kind."""
    bf16: bool = True
    """Whether it computes in bf16 (Ampere and newer); a T4 (Turing) has fp16 tensor cores only, at the same peak."""


GPUS = {gpu.name.lower(): gpu for gpu in (
    GPU("H200-141GB", 139.8, 989.0, 0.40),
    GPU("H100-80GB", 79.2, 989.0, 0.38),
    GPU("A100-80GB", 79.2, 312.0, 0.45),
    GPU("A100-40GB", 39.4, 312.0, 0.45),
    GPU("L40S-48GB", 44.4, 362.0, 0.35),
    GPU("A6000-48GB", 47.5, 155.0, 0.40),
    GPU("L4-24GB", 22.0, 121.0, 0.35),
    GPU("A10G-24GB", 22.0, 125.0, 0.35),
    GPU("RTX4090-24GB", 23.6, 165.0, 0.35),
    GPU("RTX3090-24GB", 23.6, 71.0, 0.40),
    GPU("T4-16GB", 14.6, 65.0, 0.30, bf16=False),
)}
DEFAULT_GPU = "H100-80GB"


def find_gpu(name: str) -> GPU:
    """The GPU kind called `name` (case-insensitive), or an error naming the known kinds."""
    gpu = GPUS.get(name.lower())
    if gpu:
        return gpu
    names = [g.name for g in GPUS.values()]
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.4)
    hint = f"Did you mean {close[0]}? " if close else ""
    raise SFTError(f"--gpu: unknown GPU {name!r}. {hint}Known: {', '.join(names)}.")
