"""The bad-input corpus (tests/bad_inputs/cases.yaml): exit 2 (1 for a diverged run), one clear message, no
traceback, and every file that was in output_dir before the run byte-identical after it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sft import rundir
from sft.cli.main import main

from conftest import REPO, snapshot

CORPUS = Path(__file__).parent / "bad_inputs"
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text())


def test_the_corpus_has_at_least_70_cases():
    assert len(CASES) >= 70


def fill(text: str, model: Path, tmp: Path) -> str:
    return (text.replace("{dir}", str(CORPUS)).replace("{model}", str(model)).replace("{repo}", str(REPO))
            .replace("{tmp}", str(tmp)))


def make_output_dir(case: dict, out: Path) -> None:
    """The folder a case starts from: an earlier sft run (existing_run) and/or a user's files (files)."""
    if case.get("existing_run"):
        out.mkdir()
        (out / "recipe.yaml").write_text("learning_rate: 1.0\n")
        (out / "eval_results.json").write_text('{"eval_loss": 1.0}\n')
        rundir.claim(out)
    for name, content in case.get("files", {}).items():
        out.mkdir(exist_ok=True)
        (out / name).write_text(content)


def make_template_model(tiny_model_dir: Path, tmp: Path, template: str) -> Path:
    """A copy of the tiny model whose saved tokenizer carries `template`."""
    model = tmp / "template-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "chat_template.jinja").write_text(template)
    return model


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_with_one_clear_line(name, tmp_path, tiny_model_dir, capsys, monkeypatch):
    case = CASES[name]
    monkeypatch.chdir(REPO)  # cases name relative paths from the repository root
    model = (make_template_model(tiny_model_dir, tmp_path, case["chat_template"]) if "chat_template" in case
             else tiny_model_dir)
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {CORPUS / 'good.json'}\noutput_dir: {out}\n"
                      "max_steps: 1\nreport_to: none\nsave_strategy: 'no'\n")
    make_output_dir(case, out)
    before = snapshot(out)
    recipe_path = fill(case["recipe"], model, tmp_path) if "recipe" in case else str(recipe)
    head = [case.get("verb", "train")] + ([] if case.get("verb") == "generate" else [recipe_path])
    code = main([*head, *(fill(a, model, tmp_path) for a in case["args"])])
    err = capsys.readouterr().err
    assert code == case.get("exit", 2), err[-2000:]
    assert fill(case["message"], model, tmp_path) in err, err[-2000:]
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("sft: error:")]) == 1
    assert "\n" not in err.split("sft: error:")[1].strip(), "the error is more than one line"
    if "not_in" in case:
        assert case["not_in"] not in err, err[-2000:]
    after = snapshot(out)
    if case.get("writes"):  # a run that started: what was there before is still there, unchanged
        assert before is None or all(after.get(k) == v for k, v in before.items())
    else:
        assert after == before, "output_dir was touched"


@pytest.mark.parametrize("command", [["train", "--help"], ["recipes"], ["alpaca", "--help"]])
def test_output_into_a_reader_that_stopped_reading_ends_without_a_traceback(command):
    """`sft train --help | head -1`: the reader closes the pipe before sft is done writing (here before it starts)."""
    proc = subprocess.Popen([sys.executable, "-m", "sft", *command], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    proc.stdout.close()
    error = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 141 and "Traceback" not in error, error  # 128 + SIGPIPE, as a shell reports

