"""The planner's simulated step runs on the CPU but keeps what a GPU keeps: CUDA's autocast acted out
(sft.planning.cuda_autocast). The GPU check of the same bytes is tests/test_gpu.py's."""

import pytest
import torch
import torch.nn.functional as F
from test_plan import family_config, recipe

from sft.planning.cuda_autocast import CudaAutocastOnCpu
from sft.planning.memtrace import saved_per_layer
from sft.training.recipe import load_recipe

SMALL = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, vocab_size=500, max_position_embeddings=1024)


def test_cuda_float32_ops_get_float32_inputs_and_the_rest_is_left_alone():
    x = torch.randn(4, 8, dtype=torch.bfloat16)
    norm = torch.nn.LayerNorm(8)
    with torch.autocast("cpu", dtype=torch.bfloat16), CudaAutocastOnCpu():
        float32 = [norm(x), x.pow(3), x ** 2, 1 / x, x.exp(), x.sum(), F.softmax(x, -1), x.log_softmax(-1)]
        as_asked = [F.softmax(x, -1, dtype=torch.bfloat16), x @ x.T, F.silu(x), x * x]
        in_place = x.clone().pow_(2)
    assert {t.dtype for t in float32} == {torch.float32}
    assert {t.dtype for t in as_asked} == {torch.bfloat16} and in_place.dtype == torch.bfloat16
    with CudaAutocastOnCpu():  # no autocast: nothing to act out
        assert norm.to(torch.bfloat16)(x).dtype == x.pow(3).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU's own autocast: the control
        assert norm(x).dtype == x.pow(3).dtype == torch.bfloat16


@pytest.mark.parametrize("model_type", ["gpt_neox", "starcoder2"])
def test_a_layer_norm_keeps_a_float32_copy_of_its_input_as_on_a_gpu(model_type):
    """Two LayerNorms a layer, each a float32 copy of the hidden states on a GPU (CUDA autocasts layer_norm to
    float32), as a Llama layer's two RMSNorms keep (they upcast themselves): 8 bytes a token and hidden element."""
    config = load_recipe(recipe("x", "full", 1, 128, False))
    h = SMALL["hidden_size"]
    layer = saved_per_layer(config, family_config(dict(model_type=model_type), **SMALL), 128)
    llama = saved_per_layer(config, family_config(dict(model_type="llama"), **SMALL), 128)
    assert layer[("float32", h)] == llama[("float32", h)] == 8 * h


def test_without_acting_it_out_the_layer_norm_copies_are_missed(monkeypatch):
    import sft.planning.memtrace as memtrace

    monkeypatch.setattr(memtrace, "as_on_cuda", lambda device: torch.autocast("cpu", enabled=True,
                                                                              dtype=torch.bfloat16))
    config = load_recipe(recipe("x", "full", 1, 128, False))
    layer = saved_per_layer(config, family_config(dict(model_type="gpt_neox"), **SMALL), 128)
    assert ("float32", SMALL["hidden_size"]) not in layer
