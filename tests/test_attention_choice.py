"""An unset attn_implementation with packed or padding-free batches: varlen where it is fastest and computes the
model's attention exactly (sft.models.attention.fastest_attention / varlen_problem), else transformers' default.
The rule is checked on every family whose packing sft verifies, through a CPU stand-in of torch's kernel (the real
one needs a GPU: tests/test_gpu.py)."""

import copy
import logging

import pytest
import torch
import yaml
from test_packing import VOCAB, family_config
from test_varlen import Reference
from transformers import AutoConfig, AutoModelForCausalLM

from sft import SFTConfig
from sft.cli.main import main
from sft.errors import SFTError
from sft.models import attention
from sft.models.families import VARLEN, packing_families
from sft.models.loading import attention_on_a_gpu, with_attention

from conftest import REPO, write_json

LENGTHS = (5, 12, 9)


@pytest.fixture
def kernel(monkeypatch):
    """varlen registered with the newer-style CPU stand-in as its kernel."""
    ref = Reference("new")
    monkeypatch.setattr(attention, "varlen_attn", ref.kernel)
    attention.register()
    return ref


def packed_and_alone(model) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits of three examples packed in one flattened row (with the collator's cu_seq_lens) and each run alone."""
    seqs = [torch.randint(3, VOCAB, (1, n)) for n in LENGTHS]
    cu = torch.tensor([0, 5, 17, 26], dtype=torch.int32)
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s, use_cache=False).logits for s in seqs], 1)
        packed = model(input_ids=torch.cat(seqs, 1), position_ids=torch.cat([torch.arange(n) for n in LENGTHS])[None],
                       cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=12, max_length_k=12, use_cache=False).logits
    return packed, alone


def train_forward(model) -> None:
    """One forward in training mode (attention dropout on, as in training) on a flattened row."""
    model.train()
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    model(input_ids=torch.randint(3, VOCAB, (1, 10)), position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3, 4, 5]]),
          cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6, use_cache=False)


@pytest.mark.parametrize("model_type", packing_families(True))
def test_varlen_is_accepted_exactly_where_it_computes_the_models_attention(model_type, kernel):
    """Accepted: the model loads with varlen, trains a step and its packed examples equal each run alone. Refused:
    one of those really fails (the negative control of each rule)."""
    config = family_config(model_type)
    problem = attention.varlen_problem(config, 64)
    torch.manual_seed(0)
    try:
        model = AutoModelForCausalLM.from_config(config, attn_implementation=VARLEN, dtype=torch.float32).eval()
        packed, alone = packed_and_alone(model)
        exact = (packed - alone).abs().max().item() < 1e-5
        train_forward(model)
    except (KeyError, SFTError):
        exact = False
    assert exact is (problem is None), problem


def test_a_chunked_attention_longer_than_its_chunk_is_refused(kernel):
    """Llama-4 attends within chunks on 3 of 4 layers; the kernel would attend across them."""
    config = family_config("llama4_text")
    config.attention_chunk_size = 8
    assert "chunks of 8 tokens" in attention.varlen_problem(config, 64)
    assert attention.varlen_problem(config, 8) is None  # no example outgrows a chunk: nothing to refuse
    torch.manual_seed(0)
    sdpa = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation="sdpa", dtype=torch.float32)
    varlen = AutoModelForCausalLM.from_config(copy.deepcopy(config), attn_implementation=VARLEN, dtype=torch.float32)
    varlen.load_state_dict(sdpa.state_dict())
    ids = torch.randint(3, VOCAB, (1, 20))
    with torch.no_grad():
        assert (sdpa.eval()(input_ids=ids).logits - varlen.eval()(input_ids=ids).logits).abs().max() > 1e-3


def test_a_window_is_refused_only_for_a_kernel_without_window_size(monkeypatch):
    config = family_config("mistral")  # a window of 8 tokens
    monkeypatch.setattr(attention, "varlen_attn", Reference("old").kernel)
    assert "sliding window of 8 tokens" in attention.varlen_problem(config, 64)
    assert attention.varlen_problem(config, 8) is None
    config.sliding_window = None
    assert attention.varlen_problem(config, 64) is None
    monkeypatch.setattr(attention, "varlen_attn", Reference("new").kernel)
    assert attention.varlen_problem(family_config("mistral"), 64) is None


@pytest.mark.parametrize("cuda, half, has_kernel, runs, chosen", [
    (True, True, True, True, VARLEN),
    (False, True, True, True, None),
    (True, False, True, True, None),
    (True, True, False, True, None),
    (True, True, True, False, None),
])
def test_varlen_is_chosen_only_on_a_gpu_it_runs_on_in_16_bits(monkeypatch, cuda, half, has_kernel, runs, chosen):
    monkeypatch.setattr(attention, "TORCH_VARLEN", attention.TORCH_VARLEN if has_kernel else None)
    monkeypatch.setattr(attention, "kernel_runs", lambda device: runs)
    gpu = torch.device("cuda", 1) if cuda else None
    choice, why = attention.fastest_attention(AutoConfig.for_model("llama"), gpu, half, 2048)
    assert choice == chosen and why


def test_a_model_varlen_cannot_run_keeps_the_default(monkeypatch):
    monkeypatch.setattr(attention, "kernel_runs", lambda device: True)
    choice, why = attention.fastest_attention(AutoConfig.for_model("gemma2"), torch.device("cuda", 0), True, 2048)
    assert choice is None and "soft-caps" in why


def recipe(tmp_path, model_dir, **keys) -> SFTConfig:
    fields = dict(output_dir=str(tmp_path / "out"), model_name_or_path=str(model_dir), packing=True, bf16=True,
                  use_cpu=True, report_to="none", max_length=64) | keys
    return SFTConfig(**fields)


@pytest.fixture
def on_gpu(monkeypatch) -> list:
    """A run that sees a GPU the kernel runs on (the CPU stand-in computes); yields the devices probed."""
    probed = []
    monkeypatch.setattr(SFTConfig, "on_cuda", property(lambda self: True))
    monkeypatch.setattr(attention, "kernel_runs", lambda device: probed.append(device) or True)
    return probed


def test_unset_attention_becomes_varlen_for_packed_16_bit_batches_on_a_gpu(tmp_path, tiny_model_dir, on_gpu, caplog):
    config = recipe(tmp_path, tiny_model_dir)
    model_config = AutoConfig.from_pretrained(tiny_model_dir)
    with caplog.at_level(logging.INFO, logger="sft.models.loading"):
        chosen = with_attention(config, model_config)
    assert chosen.attn_implementation == VARLEN and config.attn_implementation is None  # a copy
    assert on_gpu == [config.device]  # the process's own device, not "cuda" (GPU 0 from every rank)
    assert "attn_implementation: varlen (unset" in caplog.text
    assert attention_on_a_gpu(config, model_config).startswith("varlen (packed 16-bit batches")
    for kept in (dict(attn_implementation="sdpa"), dict(packing=False), dict(bf16=False, dtype="float32")):
        assert with_attention(recipe(tmp_path, tiny_model_dir, **kept), model_config).attn_implementation \
            == kept.get("attn_implementation")


def test_explicit_varlen_on_a_model_it_cannot_run_is_refused_before_loading(tmp_path, tiny_model_dir):
    config = recipe(tmp_path, tiny_model_dir, attn_implementation=VARLEN)
    with pytest.raises(SFTError, match=r"cannot run this gemma2 model: it soft-caps .* Use attn_implementation: sdpa"):
        with_attention(config, family_config("gemma2"))
    assert with_attention(config, family_config("llama")) is config


@pytest.mark.parametrize("gpu", [True, False])
def test_sft_train_runs_the_chosen_attention(tmp_path, tiny_model_dir, kernel, monkeypatch, gpu):
    """The whole `sft train` path: on a GPU the packed bf16 run's attention is the varlen kernel (flattened rows),
    without one it never is."""
    if gpu:
        monkeypatch.setattr(SFTConfig, "on_cuda", property(lambda self: True))
        monkeypatch.setattr(attention, "kernel_runs", lambda device: True)
    data = write_json(tmp_path / "rows.json", [{"prompt": f"Say {i}", "completion": f" number {i} " * (1 + i % 4)}
                                              for i in range(24)])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(model_name_or_path=str(tiny_model_dir), dataset=str(data), packing=True,
                                        bf16=True, use_cpu=True, max_length=64, max_steps=2, logging_steps=1,
                                        per_device_train_batch_size=2, save_strategy="no", report_to="none",
                                        output_dir=str(tmp_path / "out"))))
    assert main(["train", str(path)]) == 0
    assert (kernel.calls > 0) is gpu


def test_sft_check_refuses_explicit_varlen_on_a_model_with_attention_dropout(tmp_path, tokenizer, capsys):
    """GPT-2 trains with attention dropout 0.1: `sft train` on a GPU would stop at its first step, so `sft check`
    (whose CPU smoke run swaps varlen for sdpa) says so before anything runs."""
    config = family_config("gpt2")
    config.vocab_size = len(tokenizer)
    model_dir = tmp_path / "gpt2"
    AutoModelForCausalLM.from_config(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    data = write_json(tmp_path / "rows.json", [{"prompt": f"Say {i}", "completion": f" {i}"} for i in range(8)])
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(dict(model_name_or_path=str(model_dir), dataset=str(data), packing=True,
                                        attn_implementation=VARLEN, max_length=64, output_dir=str(tmp_path / "o"))))
    assert main(["check", str(path)]) == 2
    assert "cannot run this gpt2 model: it drops attention weights out in training (0.1)" in capsys.readouterr().err


def test_sft_check_tells_which_attention_the_recipe_gets_on_a_gpu(tmp_path, tiny_model_dir):
    """`sft check` runs sdpa on CPU; its table says what a GPU run of the recipe computes, and why."""
    cases = {(): "varlen (packed 16-bit batches", ("packing",): "sdpa, transformers' default (batches are not packed",
             ("bf16",): "sdpa, transformers' default (float32 activations"}
    for dropped, expected in cases.items():
        config = recipe(tmp_path, tiny_model_dir, **dict.fromkeys(dropped, False))
        assert attention_on_a_gpu(config, AutoConfig.from_pretrained(tiny_model_dir)).startswith(expected)
    assert attention_on_a_gpu(recipe(tmp_path, tiny_model_dir), family_config("gpt2")).startswith(
        "sdpa, transformers' default (the model drops attention weights out")
    assert attention_on_a_gpu(recipe(tmp_path, tiny_model_dir, attn_implementation="eager"),
                              family_config("llama")) == "eager (the recipe's)"


def test_sft_check_reports_the_gpu_attention_in_its_table(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart names data/ paths relative to the repository
    path = tmp_path / "packed.yaml"
    path.write_text((REPO / "recipes" / "quickstart.yaml").read_text() + "packing: true\nbf16: true\n")
    assert main(["check", str(path)]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("attention on a GPU"))
    assert "varlen (packed 16-bit batches" in row
