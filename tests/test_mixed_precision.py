"""bf16 / tf32 go through transformers' own resolution (mixed_precision, DeepSpeed "auto", FSDP policy), and a CPU
bf16 step really runs the linear layers in bf16 under autocast while the master weights stay fp32."""

import pytest
import torch
from test_trainer import toy_dataset
from torch import nn
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from sft import SFTConfig, SFTTrainer
from sft.cli.main import main
from sft.errors import SFTError
from sft.training.recipe import load_recipe

from conftest import REPO, make_llama


def test_bf16_sets_mixed_precision_and_the_zero3_json():
    assert load_recipe({"bf16": True}).mixed_precision == "bf16"
    assert load_recipe({}).mixed_precision == "no"
    try:
        zero3 = load_recipe({"bf16": True, "distributed": "zero3"}).hf_deepspeed_config.config
        assert zero3["bf16"]["enabled"] is True  # "auto" in recipes/deepspeed/zero3.json, filled by transformers
        assert load_recipe({"distributed": "zero3"}).hf_deepspeed_config.config["bf16"]["enabled"] is False
    finally:
        unset_hf_deepspeed_config()  # validating a ZeRO-3 recipe sets a process-wide global


def test_bf16_gives_fsdp_a_bf16_mixed_precision_policy():
    from accelerate.utils import FullyShardedDataParallelPlugin

    def policy(values: dict):
        config = load_recipe({**values, "distributed": "fsdp"})
        plugin = FullyShardedDataParallelPlugin(**config.fsdp_plugin_args)  # as Trainer builds it
        if config.mixed_precision != "no":  # as accelerate's AcceleratorState does under FSDP
            plugin.set_mixed_precision(config.mixed_precision)
        return plugin.mixed_precision_policy

    bf16 = policy({"bf16": True})
    assert bf16.param_dtype == torch.bfloat16 and bf16.reduce_dtype == torch.bfloat16
    assert policy({}) is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_bf16_without_gpu_loads_but_train_asks_for_use_cpu(tmp_path):
    config = load_recipe({"bf16": True, "output_dir": str(tmp_path / "out")})
    assert config.use_cpu and config.cpu_by_default  # transformers would train on CPU here anyway
    (problem,) = config.hardware_problems()
    assert "bf16: true needs a CUDA GPU" in problem and "--use_cpu true" in problem and "--bf16 false" in problem
    assert load_recipe({"bf16": True, "use_cpu": True}).hardware_problems() == []
    from sft.training.flows import train

    with pytest.raises(SFTError, match="bf16"):
        train(config)


def train_step(tmp_path, tokenizer, **flags) -> tuple[float, set, nn.Module, dict]:
    """One AdamW step on the toy data; returns loss, dtypes seen at the decoder's linear outputs, model, start."""
    model = make_llama(len(tokenizer), seed=1)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    seen = set()
    for module in model.model.modules():
        if isinstance(module, nn.Linear):
            module.register_forward_hook(lambda _m, _i, out: seen.add(out.dtype))
    args = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=4, max_steps=1,
                     learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=3,
                     **{"use_cpu": True, **flags})
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=toy_dataset())
    trainer.train()
    loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    return loss, seen, model, before


def test_cpu_bf16_step_runs_linears_in_bf16_with_fp32_master_weights(tmp_path, tokenizer):
    loss32, seen32, _, _ = train_step(tmp_path, tokenizer)
    loss16, seen16, model, before = train_step(tmp_path, tokenizer, bf16=True)
    assert seen32 == {torch.float32}  # negative control: the hook sees fp32 without autocast
    assert seen16 == {torch.bfloat16}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert all(not torch.equal(p.detach(), before[k]) for k, p in model.named_parameters())  # all trained
    assert loss16 == pytest.approx(loss32, rel=0.02) and loss16 != loss32


def test_cpu_fp16_step_would_silently_run_in_fp32(tmp_path, tokenizer):
    # Why fp16 is refused on CPU: accelerate enables no fp16 autocast there (SFTConfig built directly, unchecked).
    loss32, _, _, _ = train_step(tmp_path, tokenizer)
    loss16, seen16, _, _ = train_step(tmp_path, tokenizer, fp16=True)
    assert seen16 == {torch.float32} and loss16 == loss32


def test_fp16_with_use_cpu_is_refused_by_check_and_train(capsys, monkeypatch):
    with pytest.raises(SFTError, match="fp16: true cannot run with use_cpu: true.*bf16: true"):
        load_recipe({"fp16": True, "use_cpu": True})
    monkeypatch.chdir(REPO)
    for verb in ("check", "train"):
        assert main([verb, "recipes/quickstart.yaml", "--fp16", "true", "--use_cpu", "true"]) == 2
        assert "fp16: true cannot run with use_cpu: true" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour on a machine without a GPU")
def test_fp16_without_gpu_loads_but_train_refuses_it_naming_cpu_bf16(tmp_path):
    config = load_recipe({"fp16": True, "output_dir": str(tmp_path / "out")})
    (problem,) = config.hardware_problems()
    assert "fp16: true needs a GPU" in problem and "--fp16 false --bf16 true --use_cpu true" in problem
    from sft.training.flows import train

    with pytest.raises(SFTError, match="fp16"):
        train(config)
    assert not (tmp_path / "out").exists()
    assert load_recipe({"bf16": True, "use_cpu": True}).hardware_problems() == []  # the alternative it names


def changed_share(run, start: dict) -> float:
    from safetensors.torch import load_file

    trained = load_file(run / "model.safetensors")
    changed = sum(int((trained[k] != start[k].to(trained[k].dtype)).sum()) for k in start if k in trained)
    return changed / sum(start[k].numel() for k in start if k in trained)


def test_a_full_fine_tune_of_bf16_weights_is_warned_that_updates_round_away(tmp_path, caplog):
    """sft train of weights loaded as bfloat16 (one process, CPU bf16 autocast as on a GPU): AdamW at a fine-tuning
    learning rate changes few weights, because a bf16 weight cannot take a step below its precision; the run says
    so. Controls: float32 master weights under the same autocast change most weights and are not warned about,
    and LoRA adapters (float32) are not warned about."""
    from safetensors.torch import load_file

    start = load_file(REPO / "data/models/tiny-llama/model.safetensors")
    base = ["train", str(REPO / "recipes/quickstart.yaml"), "--bf16", "true", "--use_cpu", "true", "--max_steps", "3",
            "--learning_rate", "2e-5", "--warmup_steps", "0", "--eval_strategy", "no", "--save_strategy", "no"]
    shares, warned = {}, {}
    for dtype, extra in (("bfloat16", []), ("float32", []), ("bfloat16", ["--use_peft", "true"])):
        caplog.clear()
        run = tmp_path / f"{dtype}{len(extra)}"
        assert main([*base, "--dtype", dtype, "--output_dir", str(run), *extra]) == 0
        warned[dtype, bool(extra)] = "with no float32 copy" in caplog.text
        if not extra:
            shares[dtype] = changed_share(run, start)
    assert warned == {("bfloat16", False): True, ("float32", False): False, ("bfloat16", True): False}
    assert shares["bfloat16"] < 0.5 < shares["float32"], shares  # what the warning is about
