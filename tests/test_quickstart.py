"""End to end on the embedded tiny model: the quickstart recipe trains, saves every promised file, reloads, re-runs."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from sft.cli.main import main

from conftest import EMBEDDED_MODEL, REPO

pytestmark = pytest.mark.skipif(not (EMBEDDED_MODEL / "config.json").exists(), reason="embedded model not built")
PROMISED = ["model.safetensors", "config.json", "tokenizer.json", "recipe.yaml", "trainer_state.json",
            "train_results.json", "eval_results.json", "all_results.json", "README.md", "loss.png", "data_stats.json"]


@pytest.fixture(scope="module")
def quickstart_run(tmp_path_factory):
    """`sft train recipes/quickstart.yaml` for 10 steps with overrides, run from the repository root."""
    out = tmp_path_factory.mktemp("quickstart") / "out"
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        code = main(["train", "recipes/quickstart.yaml", "--max_steps", "10", "--learning_rate=1e-3",
                     "--output_dir", str(out), "--logging_steps", "1", "--eval_strategy", "steps",
                     "--eval_steps", "5", "--save_strategy", "steps", "--save_steps", "5", "--report_to", "tensorboard"])
    assert code == 0
    return out


def test_every_promised_file_is_written(quickstart_run):
    for name in PROMISED:
        assert (quickstart_run / name).is_file(), name
    assert sorted(p.name for p in quickstart_run.glob("checkpoint-*")) == ["checkpoint-10"]  # save_total_limit 1
    assert list((quickstart_run / "runs").rglob("events.out.tfevents.*"))  # report_to tensorboard
    stats = json.loads((quickstart_run / "data_stats.json").read_text())
    assert stats["rows"] > 300 and 0 < stats["trained_tokens"] < stats["tokens"]


def test_overrides_are_applied_and_recorded(quickstart_run):
    state = json.loads((quickstart_run / "trainer_state.json").read_text())
    assert state["max_steps"] == 10 and state["global_step"] == 10
    assert "learning_rate: 0.001" in (quickstart_run / "recipe.yaml").read_text()


def test_loss_falls_and_weights_change(quickstart_run):
    history = json.loads((quickstart_run / "trainer_state.json").read_text())["log_history"]
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 10 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    before, after = load_file(EMBEDDED_MODEL / "model.safetensors"), load_file(quickstart_run / "model.safetensors")
    changed = [k for k in before if not torch.equal(before[k], after[k])]
    assert len(changed) == len(before)


def test_saved_model_reloads_and_generates(quickstart_run):
    tokenizer = AutoTokenizer.from_pretrained(quickstart_run)
    model = AutoModelForCausalLM.from_pretrained(quickstart_run)
    prompt = tokenizer("### Instruction:\nWhat is 2 plus 3?\n\n### Response:", return_tensors="pt")
    out = model.generate(**prompt, max_new_tokens=5, do_sample=False)
    assert out.shape[1] > prompt["input_ids"].shape[1]


def test_resolved_recipe_reruns(quickstart_run, tmp_path):
    code = main(["train", str(quickstart_run / "recipe.yaml"), "--max_steps", "2", "--output_dir", str(tmp_path / "again"),
                 "--save_strategy", "no", "--eval_strategy", "no", "--report_to", "none"])
    assert code == 0 and (tmp_path / "again" / "model.safetensors").is_file()


def test_output_dir_holding_a_run_is_refused(quickstart_run, capsys):
    code = main(["train", str(quickstart_run / "recipe.yaml"), "--max_steps", "2"])
    assert code == 2 and "already holds an sft run" in capsys.readouterr().err
