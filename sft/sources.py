"""Data sources: local files, folders or Hub ids, loaded with `datasets`, renamed, weighted and concatenated."""

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets

from sft.errors import SFTError

FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text", ".arrow": "arrow"}
SOURCE_KEYS = ("path", "split", "columns", "weight", "name", "data_dir")


@dataclass
class Source:
    """One dataset to read: where it is, which split, how to rename its columns and how often to repeat it."""

    path: str
    split: str = "train"
    columns: dict[str, str] = field(default_factory=dict)
    weight: float = 1.0
    name: str | None = None
    data_dir: str | None = None

    @property
    def label(self) -> str:
        """How errors name this source."""
        return self.path if self.split == "train" else f"{self.path} [{self.split}]"


def parse_sources(spec: Any, key: str = "dataset") -> list[Source]:
    """Sources from a recipe value: a path or hub id, a mapping, or a list of either."""
    items = spec if isinstance(spec, list) else [spec]
    if spec is None or not items:
        raise SFTError(f"`{key}` is not set: give a local file/folder, a Hub dataset id, or a list of sources.")
    return [_parse_source(item, key) for item in items]


def _parse_source(item: Any, key: str) -> Source:
    if isinstance(item, str):
        return Source(path=item)
    if not isinstance(item, dict) or "path" not in item:
        raise SFTError(f"Each source in `{key}` must be a path string or a mapping with a `path` key, got {item!r}.")
    unknown = sorted(set(item) - set(SOURCE_KEYS))
    if unknown:
        raise SFTError(f"Unknown key `{unknown[0]}` in a `{key}` source; valid keys: {', '.join(SOURCE_KEYS)}.")
    columns = item.get("columns") or {}
    if not isinstance(columns, dict):
        raise SFTError(f"`columns` of source {item['path']} must map dataset columns to expected names.")
    weight = item.get("weight", 1.0)
    if not isinstance(weight, (int, float)) or weight <= 0:
        raise SFTError(f"`weight` of source {item['path']} must be a positive number, got {weight!r}.")
    return Source(str(item["path"]), str(item.get("split", "train")), columns, float(weight),
                  item.get("name"), item.get("data_dir"))


def load_source(source: Source) -> datasets.Dataset:
    """One source as a Dataset with its columns renamed; local files get errors that name the file and line."""
    path = Path(source.path)
    ds = _load_local(path, source.split) if path.exists() else _load_hub(source)
    return rename_columns(ds, source)


def _check_reachable(source: Source) -> None:
    """A path-looking source that is not on disk is a typo, not a Hub id."""
    if source.path.startswith((".", "/", "~")) or Path(source.path).suffix in FILE_TYPES:
        raise SFTError(f"Dataset file {source.path} does not exist. Check the path (relative paths start from "
                       f"{Path.cwd()}).")


def _load_local(path: Path, split: str = "train") -> datasets.Dataset:
    files = sorted(p for p in path.rglob("*") if p.suffix in FILE_TYPES) if path.is_dir() else [path]
    if not files:
        raise SFTError(f"Dataset folder {path} holds no {', '.join(FILE_TYPES)} files.")
    kinds = {FILE_TYPES.get(f.suffix) for f in files}
    if None in kinds or len(kinds) > 1:
        raise SFTError(f"Dataset {path}: use one file type among {', '.join(FILE_TYPES)} (found {sorted(map(str, kinds))}).")
    kind = kinds.pop()
    for f in files:
        _check_file(f, kind)
    try:
        # Local files form one "train" split; slices such as "train[:64]" or "train[10%:]" select rows of it.
        return datasets.load_dataset(kind, data_files=[str(f) for f in files], split=split)
    except Exception as err:  # datasets wraps parse errors in many types; re-scan to say where
        raise SFTError(f"Could not read dataset {path}: {_first_line(err)}") from None


def _check_file(path: Path, kind: str) -> None:
    """Catch what `datasets` reports badly: empty files, bad UTF-8, invalid JSON lines (with their line number)."""
    data = path.read_bytes()
    if not data.strip():
        raise SFTError(f"Dataset file {path} is empty. Add rows or remove it from the recipe.")
    if kind == "parquet" or kind == "arrow":
        return
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise SFTError(f"Dataset file {path}, line {line}: bytes that are not UTF-8 ({err.reason}). "
                       "Re-save the file as UTF-8.") from None
    if kind == "json":
        _check_json(path, text)


def _check_json(path: Path, text: str) -> None:
    """A JSON file is either one array/object or JSON Lines; name the first line that parses as neither."""
    stripped = text.lstrip()
    if stripped.startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as err:
            raise SFTError(f"Dataset file {path}, line {err.lineno}: invalid JSON ({err.msg}).") from None
        _check_rows_are_objects(path, rows)
        return
    lines = text.splitlines()
    try:  # fast path: one parse of all lines; the per-line scan below only runs to locate a problem
        if all(isinstance(row, dict) for row in json.loads("[" + ",".join(l for l in lines if l.strip()) + "]")):
            return
    except json.JSONDecodeError:
        pass
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise SFTError(f"Dataset file {path}, line {number}: invalid JSON ({err.msg}). "
                           "Each line of a .jsonl file must be one JSON object.") from None
        if not isinstance(row, dict):
            raise SFTError(f"Dataset file {path}, line {number}: expected a JSON object, got {type(row).__name__}.")


def _check_rows_are_objects(path: Path, rows: Any) -> None:
    if not isinstance(rows, list) or not rows:
        raise SFTError(f"Dataset file {path} must hold a non-empty JSON list of objects.")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not row:
            raise SFTError(f"Dataset file {path}, row {number}: expected a non-empty JSON object, got {row!r}.")


def _load_hub(source: Source) -> datasets.Dataset:
    _check_reachable(source)
    try:
        return datasets.load_dataset(source.path, source.name, data_dir=source.data_dir, split=source.split)
    except Exception as err:
        raise SFTError(f"Could not load dataset {source.label} from the Hub: {_first_line(err)}. Check the id and "
                       "split, your network, and `huggingface-cli login` for gated data.") from None


def rename_columns(ds: datasets.Dataset, source: Source) -> datasets.Dataset:
    """Apply the source's `columns` mapping (dataset name -> expected name)."""
    missing = [c for c in source.columns if c not in ds.column_names]
    if missing:
        raise SFTError(f"Dataset {source.label}: `columns` maps {missing[0]!r}, which is not a column "
                       f"(columns: {', '.join(ds.column_names)}).")
    return ds.rename_columns(source.columns) if source.columns else ds


def repeat_by_weight(ds: datasets.Dataset, weight: float, seed: int) -> datasets.Dataset:
    """Repeat the whole dataset floor(weight) times plus a seeded sample of the remaining fraction."""
    if weight == 1.0:
        return ds
    whole, frac = int(weight), weight - int(weight)
    parts = [ds] * whole
    if frac:
        parts.append(ds.shuffle(seed=seed).select(range(round(len(ds) * frac))))
    return datasets.concatenate_datasets(parts)


def _first_line(err: Exception) -> str:
    text = str(err).strip() or type(err).__name__
    return text.splitlines()[0]
