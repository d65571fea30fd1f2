"""The wheel's package list names every Python package under sft/ (a missing one installs a broken `sft`, which
only the slow install test would otherwise notice)."""

import tomllib

from conftest import REPO


def declared_packages() -> set[str]:
    return set(tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])


def source_packages() -> set[str]:
    return {".".join(init.parent.relative_to(REPO).parts) for init in (REPO / "sft").rglob("__init__.py")}


def test_every_sub_package_of_sft_is_in_the_wheel():
    assert source_packages() - declared_packages() == set()


def test_the_check_sees_a_sub_package_left_out(tmp_path):
    """Negative control: a package folder the list lacks is reported."""
    missing = REPO / "sft" / "prove"
    assert "sft.prove" in source_packages() and "sft.prove" in declared_packages()
    assert "sft.prove" in source_packages() - (declared_packages() - {"sft.prove"})
    assert missing.is_dir()
