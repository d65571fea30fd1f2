"""The wheel's package list names every Python package under sft/ (a missing one installs a broken `sft`, which
only the slow install test would otherwise notice)."""

from pathlib import Path

import tomllib

from conftest import REPO


def declared_packages() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def source_packages(root: Path) -> set[str]:
    """Dotted names of the packages (folders with __init__.py) under root/sft."""
    return {".".join(init.parent.relative_to(root).parts) for init in (root / "sft").rglob("__init__.py")}


def test_every_sub_package_of_sft_is_in_the_wheel():
    assert source_packages(REPO) - declared_packages() == set()


def test_a_sub_package_missing_from_the_list_is_reported(tmp_path):
    """Negative control: a tree with one more sub-package than pyproject lists fails the check."""
    for package in [*declared_packages(), "sft.newpart.inner"]:
        folder = tmp_path.joinpath(*package.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").touch()
    assert source_packages(tmp_path) - declared_packages() == {"sft.newpart.inner"}
