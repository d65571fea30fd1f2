"""The bad-input corpus (tests/bad_inputs/cases.yaml): exit 2, one clear message, no traceback, untouched output."""

from pathlib import Path

import pytest
import yaml

from sft.cli import main

CORPUS = Path(__file__).parent / "bad_inputs"
CASES = yaml.safe_load((CORPUS / "cases.yaml").read_text())


def test_the_corpus_has_at_least_30_cases():
    assert len(CASES) >= 30


def fill(text: str, model: Path) -> str:
    return text.replace("{dir}", str(CORPUS)).replace("{model}", str(model)).replace("{repo}", str(CORPUS.parents[1]))


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_exits_2_with_a_clear_message(name, tmp_path, tiny_model_dir, capsys):
    case = CASES[name]
    out = tmp_path / "out"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {CORPUS / 'good.json'}\noutput_dir: {out}\n"
                      "max_steps: 1\nreport_to: none\nsave_strategy: 'no'\n")
    if case.get("existing_run"):
        out.mkdir()
        (out / "recipe.yaml").write_text("learning_rate: 1.0\n")
    before = sorted((p.name, p.read_bytes()) for p in out.iterdir()) if out.exists() else None
    recipe_path = fill(case["recipe"], tiny_model_dir) if "recipe" in case else str(recipe)
    code = main(["train", recipe_path, *(fill(a, tiny_model_dir) for a in case["args"])])
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    assert fill(case["message"], tiny_model_dir) in err, err[-2000:]
    assert "Traceback" not in err
    assert len([line for line in err.splitlines() if line.startswith("sft: error:")]) == 1
    after = sorted((p.name, p.read_bytes()) for p in out.iterdir()) if out.exists() else None
    assert after == before, "output_dir was touched"
