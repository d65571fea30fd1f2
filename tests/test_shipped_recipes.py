"""The location rule for shipped files: recipes by catalog name or recipes/ path from any directory, their data/
paths pointed at sft's shipped data unless the current directory has its own."""

import json

import pytest

from sft import SFTError, load_recipe
from sft.training.catalog import shipped

from conftest import REPO


@pytest.mark.parametrize("reference", ["quickstart", "recipes/quickstart.yaml", "quickstart.yaml"])
def test_a_shipped_recipe_loads_from_any_directory(tmp_path, monkeypatch, reference):
    monkeypatch.chdir(tmp_path)
    config = load_recipe(reference)
    assert config.model_name_or_path == str(shipped("data") / "models" / "tiny-llama")
    assert config.dataset == str(shipped("data") / "alpaca_sample.json")
    assert config.output_dir == "outputs/quickstart"  # outputs stay where the user runs it


def test_local_files_win_over_shipped_ones(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "alpaca_sample.json").write_text(json.dumps([{"instruction": "a", "output": "b"}]))
    assert load_recipe("quickstart").dataset == "data/alpaca_sample.json"
    (tmp_path / "recipes").mkdir()
    (tmp_path / "recipes" / "quickstart.yaml").write_text("learning_rate: 0.5\n")
    assert load_recipe("recipes/quickstart.yaml").learning_rate == 0.5


def test_the_checkout_layout_is_found_from_a_checkout():
    assert shipped("recipes") == REPO / "recipes" and shipped("data") == REPO / "data"


@pytest.mark.parametrize("reference", ["no-such-recipe", "recipes/nope.yaml", "/abs/missing.yaml"])
def test_an_unknown_recipe_is_one_clear_error(tmp_path, monkeypatch, reference):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SFTError, match="does not exist. Pass the path to a .yaml recipe, or the name of a shipped"):
        load_recipe(reference)


@pytest.mark.parametrize("where", ["missing", "empty", "file"])
def test_a_recipes_folder_without_recipes_is_an_error_not_an_empty_table(tmp_path, capsys, where):
    """`sft recipes --dir TYPO` printed a header-only table and exited 0."""
    from sft.cli.main import main

    folder = tmp_path / where
    if where == "empty":
        folder.mkdir()
    elif where == "file":
        folder.write_text("x\n")
    said = {"missing": "does not exist", "empty": "holds no .yaml recipes", "file": "is not a folder"}[where]
    assert main(["recipes", "--dir", str(folder)]) == 2
    assert f"sft: error: Recipes folder {folder} {said}. Give --dir the folder of your recipes" in capsys.readouterr().err
