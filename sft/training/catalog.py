"""The recipe catalog, read from the recipe files' own header comments (no hand-kept registry)."""

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from sft.errors import SFTError

HEADER_FIELDS = ("Data", "Hardware", "Memory", "Launch")


@dataclass
class RecipeInfo:
    """What a recipe's header says about it."""

    name: str
    path: Path
    description: str
    fields: dict[str, str]

    @property
    def num_gpus(self) -> int:
        """The GPU count the header's Hardware line starts with ("8x80 GB ..."); 1 when it names none."""
        match = re.match(r"(\d+)x", self.fields.get("Hardware", ""))
        return int(match.group(1)) if match else 1

    @property
    def launch_argv(self) -> list[str]:
        """The header's launch command split as a shell would split it."""
        return shlex.split(self.fields.get("Launch", ""))


IN_WHEEL = {"recipes": "recipes", "data": "assets"}  # a checkout's top-level folder -> its place inside the wheel


def shipped(folder: str) -> Path:
    """A folder shipped with sft (`recipes`, `data`): inside the package in an installed wheel (sft/recipes,
    sft/assets), else beside it in a source checkout (editable install, PYTHONPATH)."""
    package = Path(__file__).resolve().parents[1]
    inside = package / IN_WHEEL[folder]
    return inside if inside.is_dir() else package.parent / folder


def default_root() -> Path:
    """./recipes when run from a checkout, else the recipes shipped with sft."""
    here = Path("recipes")
    return here if here.is_dir() else shipped("recipes")


def shipped_recipe(reference: str | Path) -> Path | None:
    """The shipped recipe a missing path refers to: a catalog name (`quickstart`, `mistral-7b/full-zero3`) or a
    path under recipes/ (`recipes/quickstart.yaml`, as the docs write it); None if there is none."""
    if not Path(reference).name or Path(reference).is_absolute():
        return None
    parts = Path(reference).with_suffix(".yaml").parts
    candidate = shipped("recipes").joinpath(*parts[1:] if parts[0] == "recipes" else parts)
    return candidate if candidate.is_file() else None


def rebase_shipped_data(value: object) -> object:
    """A shipped recipe's `data/...` paths (sample data, the embedded models), pointed at sft's shipped data when
    they are not under the current directory: the quickstarts then run from any directory."""
    if isinstance(value, dict):
        return {key: rebase_shipped_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [rebase_shipped_data(item) for item in value]
    if isinstance(value, str) and value.startswith("data/") and not Path(value).exists():
        located = shipped("data") / value.removeprefix("data/")
        return str(located) if located.exists() else value
    return value


def read_header(path: Path, root: Path) -> RecipeInfo:
    """Parse the leading comments: a description line, `Key: value` lines, indented lines continue a value."""
    fields: dict[str, str] = {}
    description, key = "", None
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        text = line[1:].strip()
        head, sep, rest = text.partition(":")
        if line.startswith("#   ") and key:
            fields[key] += " " + text
        elif sep and head in HEADER_FIELDS:
            key, fields[head] = head, rest.strip()
        else:
            key = None
            description = description or text
    return RecipeInfo(str(path.relative_to(root).with_suffix("")), path, description, fields)


def list_recipes(root: Path | None = None) -> list[RecipeInfo]:
    """Every training recipe under `root` (launcher presets in accelerate/ and deepspeed/ excluded)."""
    root = root or default_root()
    paths = sorted(p for p in root.rglob("*.yaml") if p.relative_to(root).parts[0] not in ("accelerate", "deepspeed"))
    if not paths:  # `sft recipes --dir typo` printed an empty table and exit 0, as if no recipe existed anywhere
        where = "does not exist" if not root.exists() else "is not a folder" if not root.is_dir() else \
            "holds no .yaml recipes"
        raise SFTError(f"Recipes folder {root} {where}. Give --dir the folder of your recipes, or leave --dir out "
                       "for the shipped ones.")
    return [read_header(p, root) for p in paths]


def recipes_table(recipes: list[RecipeInfo]) -> str:
    """A readable fixed-width table: name, hardware, description."""
    rows = [("recipe", "hardware", "description")] + [
        (r.name, r.fields.get("Hardware", "-"), r.description) for r in recipes]
    widths = [min(max(len(row[i]) for row in rows), cap) for i, cap in enumerate((40, 34, 200))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines = [fmt.format(*(_clip(v, w) for v, w in zip(row, widths))).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _clip(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"
