"""Safe defaults: no remote code unless asked, safetensors only unless asked, secrets never written or logged."""

import logging
import os

import pytest
import torch

from sft.cli.main import main
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.models.loading import load_model
from sft.training.recipe import load_recipe

from conftest import make_llama

SECRET = "hf_DoNotLeakThisToken123"


def test_trust_remote_code_is_off_by_default_and_warned_about_when_on(tiny_model_dir, caplog):
    assert load_recipe({}).trust_remote_code is False
    with caplog.at_level(logging.WARNING):
        load_tokenizer(load_recipe({"model_name_or_path": str(tiny_model_dir), "trust_remote_code": True}))
    assert f"Python code from {tiny_model_dir} will run" in caplog.text


def test_pickle_weights_are_refused_unless_allowed(tmp_path, tokenizer):
    folder = tmp_path / "pickled"
    model = make_llama(len(tokenizer))
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")  # an old-style pickle checkpoint
    tokenizer.save_pretrained(folder)
    assert (folder / "pytorch_model.bin").exists() and not (folder / "model.safetensors").exists()
    config = load_recipe({"model_name_or_path": str(folder)})
    with pytest.raises(SFTError, match="allow_pickle"):
        load_model(config, tokenizer)
    allowed = load_recipe({"model_name_or_path": str(folder), "allow_pickle": True})
    assert isinstance(load_model(allowed, tokenizer), torch.nn.Module)


def test_hub_token_never_reaches_disk_or_logs(tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    data = tmp_path / "data.json"
    data.write_text('[{"instruction": "Say hi", "output": "hi"}, {"instruction": "Say yo", "output": "yo"}]')
    out = tmp_path / "out"
    code = main(["train",
        str(write_recipe(tmp_path, tiny_model_dir, data, out)), "--hub_token", SECRET, "--max_steps", "2",
        "--save_strategy", "steps", "--save_steps", "1"])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert SECRET not in captured.out + captured.err
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any(p.name == "training_args.bin" for p in files) and any(p.name == "recipe.yaml" for p in files)
    for path in files:
        assert SECRET.encode() not in path.read_bytes(), path


def write_recipe(tmp_path, model, data, out):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {model}\ndataset: {data}\noutput_dir: {out}\nreport_to: none\n")
    return recipe


@pytest.mark.parametrize("flag", [["--hub_token", SECRET], [f"--hub_token={SECRET}"], ["--token", SECRET]])
def test_sft_launch_hands_the_token_over_in_the_environment_not_the_command(tmp_path, monkeypatch, capsys, flag):
    """`sft launch` prints its accelerate command (job logs) and the processes' argv is visible to every user (ps):
    the token goes to them as HF_TOKEN, which SFTConfig reads the same way (it moves hub_token there itself)."""
    from sft.cli import launch as launcher

    monkeypatch.delenv("HF_TOKEN", raising=False)
    runs = []
    # the processes inherit the launcher's environment (accelerate runs in sft's process): read it at the launch
    monkeypatch.setattr(launcher, "run_accelerate", lambda command: runs.append((command, dict(os.environ))) or 0)
    recipe = write_recipe(tmp_path, "data/models/tiny-llama", tmp_path / "data.json", tmp_path / "out")
    assert main(["launch", str(recipe), "--num_processes", "2", *flag, "--max_steps", "2"]) == 0
    (command, env), printed = runs[0], capsys.readouterr()
    assert SECRET not in " ".join(command) + printed.out + printed.err
    assert env["HF_TOKEN"] == SECRET and command[-2:] == ["--max_steps", "2"]  # the other overrides stay
    assert main(["launch", str(recipe), "--num_processes", "2", "--dry_run"]) == 0 and runs[1:] == []
