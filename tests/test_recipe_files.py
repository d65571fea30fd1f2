"""Every shipped recipe loads, documents itself, and names a launch command that really parses."""

import pytest

from sft.cli.main import main
from sft.training.catalog import list_recipes, recipes_table
from sft.training.recipe import load_recipe

from conftest import REPO

RECIPES = list_recipes(REPO / "recipes")
LAUNCHERS = {"sft", "accelerate", "torchrun", "deepspeed", "python"}


def test_the_catalog_covers_the_promised_runs():
    names = {r.name for r in RECIPES}
    for expected in ("quickstart", "alpaca-llama2-7b-fsdp", "alpaca-llama3-8b-lora", "mistral-7b/zephyr-qlora",
                     "mistral-7b/full-zero3", "qwen2.5-7b-instruct/full-zero3", "qwen2.5-0.5b-instruct/full",
                     "llama-3.1-8b-instruct/full-fsdp"):
        assert expected in names


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_recipe_validates_and_has_a_complete_header(recipe):
    config = load_recipe(recipe.path)
    assert config.model_name_or_path and config.dataset
    assert recipe.description and all(recipe.fields.get(k) for k in ("Data", "Hardware", "Memory", "Launch"))


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_launch_command_is_a_real_command_for_this_recipe(recipe):
    argv = recipe.launch_argv
    assert argv[0] in LAUNCHERS
    assert f"recipes/{recipe.name}.yaml" in argv
    if argv[0] == "sft":
        assert argv[1] in ("train", "launch")


def test_sft_recipes_prints_a_table(capsys):
    assert main(["recipes", "--dir", str(REPO / "recipes")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split()[:3] == ["recipe", "hardware", "description"] and set(out[1]) <= {"-", " "}
    assert len(out) == len(RECIPES) + 2 and out == recipes_table(RECIPES).splitlines()
