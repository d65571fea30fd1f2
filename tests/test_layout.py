"""The package layout holds: each layer imports only from the layers below it, modules import no cycle, no module
is over 400 lines and no function over 50. The rank table is the package map of sft/__init__.py's docstring."""

import ast
from pathlib import Path

from conftest import REPO

FOUNDATION = ("sft.errors", "sft.rundir")  # layer 0: top-level modules that may import each other
RANKS = {  # package -> layer; a module may import its own package and lower layers only
    "sft.errors": 0, "sft.rundir": 0,
    "sft.config": 1,
    "sft.models": 2,
    "sft.data": 3,
    "sft.evaluation": 4,
    "sft.training": 5,
    "sft.planning": 6, "sft.check": 6,
    "sft.cli": 7,
}
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 50


def module_name(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules(root: Path) -> dict[str, Path]:
    return {module_name(p, root): p for p in sorted((root / "sft").rglob("*.py"))}


def imported(path: Path, name: str) -> set[str]:
    """sft modules `path` imports anywhere in its body (deferred imports inside functions count too)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            found.add(base)
            found |= {f"{base}.{alias.name}" for alias in node.names}
    return {m for m in found if m == "sft" or m.startswith("sft.")}


def layer(module: str) -> tuple[str, int] | None:
    """The package of `module` in RANKS and its rank (None for sft itself and sft.__main__)."""
    for package, rank in RANKS.items():
        if module == package or module.startswith(package + "."):
            return ("foundation" if package in FOUNDATION else package), rank
    return None


def violations(root: Path) -> list[str]:
    """`A imports B` for every import of a higher layer, or of another package on the same layer."""
    known = modules(root)
    problems = []
    for name, path in known.items():
        mine = layer(name)
        if mine is None:
            continue
        for target in sorted(imported(path, name) & set(known)):
            theirs = layer(target)
            if theirs is None or theirs[0] == mine[0]:
                continue
            if theirs[1] >= mine[1]:
                problems.append(f"{name} (layer {mine[1]}) imports {target} (layer {theirs[1]})")
    return problems


def cycles(root: Path) -> list[list[str]]:
    """Import cycles among sft's modules (strongly connected components of more than one module). A package's
    __init__ importing its own modules is not one: Python finds the package already in sys.modules."""
    known = modules(root)
    graph = {name: {t for t in imported(path, name) if t in known and t != name} for name, path in known.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def long_functions(root: Path) -> list[str]:
    problems = []
    for name, path in modules(root).items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    problems.append(f"{name}.{node.name}: {lines} lines")
    return problems


def long_modules(root: Path) -> list[str]:
    return [f"{name}: {n} lines" for name, path in modules(root).items()
            if (n := len(path.read_text().splitlines())) > MAX_MODULE_LINES]


def unplaced(root: Path) -> set[str]:
    """Top-level packages and modules of sft/ that no layer names (a new one must be placed in the map)."""
    tops = {".".join(name.split(".")[:2]) for name in modules(root) if name.count(".") >= 1}
    return tops - set(RANKS) - {"sft.__main__"}


def test_every_package_and_top_level_module_has_a_layer(tmp_path):
    assert unplaced(REPO) == set()
    (tmp_path / "sft" / "extra").mkdir(parents=True)  # negative control: a new package and a new module
    for name in ("sft/__init__.py", "sft/errors.py", "sft/extra/__init__.py", "sft/utils.py"):
        (tmp_path / name).write_text("")
    assert unplaced(tmp_path) == {"sft.extra", "sft.utils"}


def test_no_module_imports_a_higher_layer():
    assert violations(REPO) == []


def test_no_import_cycle():
    assert cycles(REPO) == []


def test_no_module_over_400_lines():
    assert long_modules(REPO) == []


def test_no_function_over_50_lines():
    assert long_functions(REPO) == []


def test_sizes_and_layers_are_read_from_the_code(tmp_path):
    """Negative controls: a data module importing the trainer, a two-module cycle, a 51-line function and a 401-line
    module are each reported."""
    (tmp_path / "sft" / "data").mkdir(parents=True)
    (tmp_path / "sft" / "training").mkdir()
    for init in ("sft", "sft/data", "sft/training"):
        (tmp_path / init / "__init__.py").write_text("")
    (tmp_path / "sft/data/build.py").write_text("def f():\n    from sft.training.trainer import SFTTrainer\n")
    (tmp_path / "sft/training/trainer.py").write_text("from sft.training import flows\n")
    (tmp_path / "sft/training/flows.py").write_text("from sft.training.trainer import x\n")
    body = "".join(f"    a{i} = {i}\n" for i in range(50))
    (tmp_path / "sft/training/long.py").write_text("def long():\n" + body + "\n" * 360)
    assert violations(tmp_path) == ["sft.data.build (layer 3) imports sft.training.trainer (layer 5)"]
    assert cycles(tmp_path) == [["sft.training.flows", "sft.training.trainer"]]
    assert long_functions(tmp_path) == ["sft.training.long.long: 51 lines"]
    assert long_modules(tmp_path) == ["sft.training.long: 411 lines"]


def test_import_sft_sets_no_environment_and_imports_no_trainer():
    import subprocess
    import sys

    code = ("import os, sys; before = dict(os.environ); import sft; "
            "assert dict(os.environ) == before, set(os.environ.items()) ^ set(before.items()); "
            "heavy = [m for m in ('transformers', 'transformers.trainer', 'torch', 'sft.training.trainer') "
            "if m in sys.modules]; assert not heavy, heavy; "
            "from sft import SFTTrainer, load_recipe; assert 'transformers.trainer' in sys.modules")
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
