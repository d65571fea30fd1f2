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


def pickled_model(folder, tokenizer):
    """A tiny Llama saved the old way, pytorch_model.bin only, with its tokenizer."""
    model = make_llama(len(tokenizer))
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    tokenizer.save_pretrained(folder)
    return folder


def lora_adapter(folder, base, tokenizer, pickled: bool):
    """A LoRA adapter on the model in `base`, saved as adapter_model.bin when `pickled`, with the tokenizer."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base, use_safetensors=None),
                           LoraConfig(r=2, target_modules=["q_proj"], init_lora_weights=False))
    model.save_pretrained(folder, safe_serialization=not pickled)
    tokenizer.save_pretrained(folder)
    assert (folder / "adapter_model.bin").exists() is pickled
    return folder


@pytest.mark.parametrize("case", ["model", "adapter on a pickled base", "adapter_model.bin"])
def test_inference_verbs_refuse_pickled_weights_unless_allowed(case, tmp_path, tiny_model_dir, tokenizer, capsys,
                                                                monkeypatch):
    """`sft train` refused pickled weights unless allow_pickle, but `sft generate`, `sft chat` and `sft merge` loaded
    a pytorch_model.bin model, an adapter's pickled base and an adapter_model.bin without asking. Now they refuse (exit
    2, before any weights load, naming the files and --allow_pickle), and load them with --allow_pickle."""
    import io

    pickled = pickled_model(tmp_path / "pickled", tokenizer)
    if case == "model":
        folder = pickled
    else:  # its base pickled, or its own weights
        base = pickled if case == "adapter on a pickled base" else tiny_model_dir
        folder = lora_adapter(tmp_path / "adapter", base, tokenizer, pickled=case == "adapter_model.bin")
    files = f"{folder} holds only pickled weights"
    if case == "adapter on a pickled base":
        files = (f"{pickled} (the base model named in {folder / 'adapter_config.json'}) holds only pickled weights "
                 "(pytorch_model.bin)")
    verbs = [["generate", str(folder), "--prompt", "hi", "--max_new_tokens", "2"], ["chat", str(folder)]]
    verbs += [["merge", str(folder), str(tmp_path / "merged")]] if case != "model" else []
    import sft.cli.chat

    chat = sft.cli.chat.chat  # its stdin default is bound at import: give it one line to answer
    monkeypatch.setattr(sft.cli.chat, "chat", lambda *args, **kwargs: chat(*args, **kwargs, stdin=io.StringIO("hi\n")))
    for verb in verbs:
        assert main(verb) == 2, verb
        err = capsys.readouterr().err
        assert files in err and "pass --allow_pickle" in err and "Traceback" not in err, err
        assert main([*verb, "--allow_pickle"]) == 0, capsys.readouterr().err[-2000:]
        capsys.readouterr()
    assert case == "model" or (tmp_path / "merged" / "model.safetensors").is_file()


def test_training_on_a_pickled_adapter_is_refused_unless_allowed(tmp_path, tiny_model_dir, tokenizer):
    """An adapter folder holding adapter_model.bin as model_name_or_path (`sft eval`, or `sft train --use_peft`): peft
    loaded the pickle though allow_pickle was off."""
    adapter = lora_adapter(tmp_path / "adapter", tiny_model_dir, tokenizer, pickled=True)
    with pytest.raises(SFTError, match="holds only pickled weights \\(adapter_model.bin\\).*allow_pickle: true"):
        load_model(load_recipe({"model_name_or_path": str(adapter)}), tokenizer)
    allowed = load_recipe({"model_name_or_path": str(adapter), "allow_pickle": True})
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
