"""The benchmark's FLOPs count (scripts/bench.py::model_flops) against a hand count on a known shape."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from bench import model_flops  # noqa: E402

from sft.models.architectures import known_config  # noqa: E402


def test_model_flops_matches_hand_count_for_llama_3_2_1b():
    config = known_config("meta-llama/Llama-3.2-1B")
    # per layer: q and o 2048x2048, k and v 2048x512 (8 kv heads x 64), gate/up/down 2048x8192; LM head 128256x2048
    matmul = 16 * (2 * 2048 * 2048 + 2 * 2048 * 512 + 3 * 2048 * 8192) + 128256 * 2048
    assert matmul == 1_235_746_816  # 1.24B: the 1.50B parameters less the (tied) embedding lookup
    pairs = 2 * (100 * 101 // 2)  # two examples of 100 tokens, each attending causally within itself
    attention = 12 * 16 * 32 * 64 * pairs  # QK^T + AV: 4 FLOPs x head dims per pair and layer, x3 with the backward
    assert model_flops(config, 200, pairs) == 6 * matmul * 200 + attention
    assert model_flops(config, 200, pairs, frozen=True) == 4 * matmul * 200 + attention
    assert model_flops(config, 200) == 6 * matmul * 200  # the CPU table's count: no attention term
