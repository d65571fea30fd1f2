"""A non-editable install works: the wheel carries the presets, recipes, sample data and embedded models, and the
README's commands run from an empty directory with nothing but the installed package.

The wheel is installed with `pip install --no-deps --target DIR` and run with PYTHONPATH=DIR by this environment's
Python, which already has the dependencies: a second virtual environment would have to reach this one's
site-packages (fragile, and different in CI's .venv), and installing the dependencies again would need the network.
The test asserts that `import sft` really comes from DIR, not from a checkout or an editable install.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO

pytestmark = pytest.mark.slow


def run(command: list, cwd: Path, env: dict, timeout: int = 300) -> str:
    done = subprocess.run([str(c) for c in command], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, f"{command}\n{done.stdout[-3000:]}\n{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, dict, Path]:
    """(the installed package's folder, an environment that uses only it, an empty working directory)."""
    root = tmp_path_factory.mktemp("install")
    wheels, target, empty = root / "wheels", root / "site", root / "empty"
    empty.mkdir()
    # Without setuptools here (a fresh CI venv), pip builds in isolation, fetching setuptools from the index.
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    source = root / "source"  # a copy: building in place would leave build/ and *.egg-info in the checkout
    shutil.copytree(REPO, source, ignore=shutil.ignore_patterns(".*", "build", "dist", "outputs", "*.egg-info",
                                                                 "__pycache__", "venv"))
    run([sys.executable, "-m", "pip", "wheel", source, "--no-deps", "-q", "-w", wheels, *isolation], root,
        dict(os.environ))
    wheel = next(wheels.glob("sft-*.whl"))
    run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", target, wheel], root, dict(os.environ))
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), HF_HUB_OFFLINE="1", HF_DATASETS_CACHE=str(root / "datasets-cache"),
               OMP_NUM_THREADS="1")
    where = run([sys.executable, "-c", "import sft; print(sft.__file__)"], empty, env).strip()
    assert Path(where).parent == target / "sft"  # the installed copy, not the checkout
    return target, env, empty


def test_the_wheel_ships_presets_recipes_data_and_the_embedded_models(installed):
    package = installed[0] / "sft"
    for path in ("recipes/quickstart.yaml", "recipes/deepspeed/zero3.json", "recipes/accelerate/zero3.yaml",
                 "assets/alpaca_sample.json", "assets/models/tiny-llama/model.safetensors",
                 "assets/models/tiny-t5/tokenizer.json"):  # data/ ships as sft/assets (sft/data is code)
        assert (package / path).is_file(), path


def test_sft_check_of_a_zero3_recipe_from_an_empty_directory(installed):
    target, env, empty = installed
    out = run([target / "bin" / "sft", "check", "mistral-7b/full-zero3"], empty, env)  # by catalog name
    assert "OK: the recipe is sound." in out and "deepspeed" in out  # the preset resolved, then skipped on CPU
    assert "quickstart" in run([target / "bin" / "sft", "recipes"], empty, env)


def test_the_readme_quickstart_from_an_empty_directory(installed):
    target, env, empty = installed
    run([target / "bin" / "sft", "train", "recipes/quickstart.yaml", "--max_steps", "3", "--save_strategy", "no"],
        empty, env)
    out = empty / "outputs" / "quickstart"  # output_dir stays relative to where the user runs it
    for name in ("model.safetensors", "recipe.yaml", "eval_results.json", "README.md"):
        assert (out / name).is_file(), name
    assert sorted(p.name for p in empty.iterdir()) == ["outputs"]
