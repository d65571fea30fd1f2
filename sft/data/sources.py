"""Data sources: local files, folders or Hub ids, loaded with `datasets`, renamed, weighted and concatenated."""

import codecs
import difflib
import hashlib
import json
import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
from datasets.data_files import DEFAULT_PATTERNS_ALL, DataFilesDict, get_data_patterns

from sft.data.cards import card_patterns
from sft.data.files import (
    FILE_TYPES,
    LOADERS,
    READ_OPTIONS,
    data_files,
    file_bytes,
    file_kind,
    is_glob,
    unread_type,
)
from sft.data.hub import first_line, load_hub
from sft.errors import SFTError

log = logging.getLogger(__name__)
# Columns a row of some format holds as a list of objects: a file with one such object is one row, not a wrapper.
ROW_KEYS = ("messages", "conversations", "prompt", "completion", "chosen", "rejected", "tools", "images")
SOURCE_KEYS = ("path", "split", "columns", "weight", "name", "data_dir")
# load_dataset's (and the Hub's) words for what a source says otherwise: they were refused with the key list only.
_SUBSET = " A Hub dataset's subset (its config) is the source's `name`, e.g. {{path: glue, name: mrpc}}."
HF_KEYS = {"subset": _SUBSET, "config": _SUBSET, "config_name": _SUBSET, "data_files": (
    " Give the files as `path` (a file, a folder, or a glob such as data/*.parquet), one source per split: "
    "{key}: {{path: train.jsonl}} and eval_dataset: {{path: validation.jsonl}}.")}


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
        raise SFTError(f"Unknown key `{unknown[0]}` in a `{key}` source; valid keys: {', '.join(SOURCE_KEYS)}."
                       + HF_KEYS.get(unknown[0], "").format(key=key))
    columns = item.get("columns") or {}
    if not isinstance(columns, dict) or not all(isinstance(n, str) and n for pair in columns.items() for n in pair):
        raise SFTError(f"`columns` of source {item['path']} must map dataset columns to expected names (text to "
                       f"text, e.g. {{question: instruction}}), got {columns!r}.")
    weight = _weight(item.get("weight", 1.0), item["path"], key)
    return Source(str(item["path"]), str(item.get("split", "train")), columns, float(weight),
                  item.get("name"), item.get("data_dir"))


def _weight(weight: Any, path: Any, key: str) -> float:
    """A source's weight: a positive number (a YAML `true` is a boolean, read as 1 by Python, so it is refused), and
    1 for eval sources: eval scores each row once, as it does held-out rows, where a weight dropped rows (0.5) or
    repeated them in eval loss and predictions.jsonl (2)."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
        kind = " (a YAML boolean)" if isinstance(weight, bool) else ""
        raise SFTError(f"`weight` of source {path} must be a positive number, got {weight!r}{kind}. Write a number, "
                       "e.g. weight: 2 to repeat the source twice, or weight: 0.5 for half of its rows.")
    if key == "eval_dataset" and weight != 1:
        raise SFTError(f"`weight` of eval_dataset source {path} is {weight:g}: eval scores each row once, so a weight "
                       "would drop or repeat eval rows. Remove it; to evaluate on part of the source, set its `split` "
                       "(e.g. split: train[:50%]).")
    return float(weight)


def load_source(source: Source) -> datasets.Dataset:
    """One source as a Dataset with its columns renamed; local files get errors that name the file and line."""
    path = Path(source.path).expanduser()
    if path.is_dir() and source.data_dir:  # as load_dataset(folder, data_dir=...) reads it; it was ignored
        path = path / source.data_dir
    local = path.exists() or is_glob(str(path))  # a glob (data/*.parquet) is local files, as in data_files
    ds = _load_local(path, source.split, source.name) if local else load_hub(source, _load_local)
    return rename_columns(ds, source)


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    """A folder written by Dataset.save_to_disk (state.json) or DatasetDict.save_to_disk (dataset_dict.json, one
    folder per split); `split` picks the split of a DatasetDict and may slice it ("train[:100]")."""
    name, _, part = split.partition("[")
    try:
        saved = datasets.load_from_disk(str(path))
    except Exception as err:  # datasets raises several types for a damaged folder
        raise SFTError(f"Could not read the saved dataset {path}: {first_line(err)}") from None
    if isinstance(saved, datasets.DatasetDict):
        if name not in saved:
            raise SFTError(f"Dataset {path} has no split {name!r}; it has {', '.join(saved)}. Set the source's "
                           "`split`.")
        saved = saved[name]
    # Read into the datasets cache, as every other local file is: Dataset.map caches beside a dataset's own Arrow
    # files, so tokenizing left cache-*.arrow files in the user's folder (a glob such as saved/*.arrow read them back
    # as data; a read-only folder failed).
    files = [entry["filename"] for entry in saved.cache_files]
    saved = datasets.load_dataset("arrow", data_files=files, split="train", features=saved.features)
    return _sliced(saved, f"train[{part}" if part else "train", path)


def all_local(sources: list[Source]) -> bool:
    """Whether every source is on this machine. A missing file with a near namesake beside it is a typo `sft train`
    refuses (SFTError naming the namesake), not data kept elsewhere: `sft check` must not stand sample data in for
    it. Data not here at all (a Hub id, a file still to download, another machine's path) is simply not local."""
    missing = [path for path in (Path(source.path).expanduser() for source in sources)
               if not path.exists() and not (is_glob(str(path)) and data_files(path))]
    for path in missing:
        siblings = [p.name for p in path.parent.iterdir()] if path.parent.is_dir() else []
        near = difflib.get_close_matches(path.name, siblings, n=1, cutoff=0.9)
        if near:
            raise SFTError(f"Dataset file {path} does not exist. Did you mean {path.parent / near[0]}?")
    return not missing


def _load_local(path: Path, split: str = "train", config: str | None = None) -> datasets.Dataset:
    if (path / "state.json").is_file() or (path / "dataset_dict.json").is_file():
        return _load_saved(path, split)
    files = data_files(path)
    if not files:
        what = "pattern {} matches" if is_glob(str(path)) and not path.exists() else "folder {} holds"
        raise SFTError(f"Dataset {what.format(path)} no {', '.join(FILE_TYPES)} files.")
    if path.is_file() and not file_kind(path):  # a folder's files are filtered by type
        raise unread_type(path)
    files, split = _split_files(path, files, split, config)
    kinds = {file_kind(f) for f in files}
    if len(kinds) > 1:
        raise SFTError(f"Dataset {path}: use one file type among {', '.join(FILE_TYPES)} (found {sorted(kinds)}).")
    kind = kinds.pop()
    parsed = [_check_file(f, kind) for f in files]
    if any(rows is not None for rows in parsed):  # a BOM or a top-level object: rows read here, not by `datasets`
        return _from_rows(files, [rows if rows is not None else _json_rows(f, file_bytes(f).decode("utf-8"))
                                  for f, rows in zip(files, parsed)], split)
    try:
        # Local files form one "train" split; slices such as "train[:64]" or "train[10%:]" select rows of it.
        return datasets.load_dataset(LOADERS.get(kind, kind), data_files=[str(f) for f in files], split=split,
                                     **READ_OPTIONS.get(kind, {}))
    except Exception as err:  # datasets wraps parse errors in many types; re-scan to say where
        raise SFTError(f"Could not read dataset {path}: {first_line(err)}") from None


def _split_files(path: Path, files: list[Path], split: str, config: str | None) -> tuple[list[Path], str]:
    """The files of `split` in a folder laid out in splits as `datasets` reads one (train/validation/test, also dev
    and eval, in file or folder names: train.jsonl beside test.jsonl, a Hub repository's
    data/test-00000-of-00001.parquet, or the `configs` of its README.md: sft.data.cards), and the spec selecting
    their rows ("test[:10]" -> "train[:10]": the chosen files are one split). A folder without split names is one training split. Every file used to be read as
    training data, so a folder's test and validation rows were trained on, without a word."""
    if not path.is_dir():
        return files, split
    patterns = card_patterns(path, config) or get_data_patterns(str(path))
    if patterns == DEFAULT_PATTERNS_ALL:
        return files, split
    try:
        named = {str(name): {Path(f).resolve() for f in found}
                 for name, found in DataFilesDict.from_patterns(patterns, str(path)).items()}
    except FileNotFoundError as err:  # a card's pattern that matches no file
        raise SFTError(f"Dataset folder {path}: {first_line(err)}. Fix the README.md `configs` paths.") from None
    parts = {name: [f for f in files if f.resolve() in found] for name, found in named.items()}
    parts = {name: part for name, part in parts.items() if part}
    name = split.partition("[")[0]
    if name not in parts:
        raise SFTError(f"Dataset folder {path} has no split {name!r}: its file names make the splits "
                       f"{', '.join(parts)} (as `datasets` reads a folder). Set the source's `split` to one of them.")
    if name == "train" and (len(parts) > 1 or len(parts[name]) < len(files)):  # the rows left out were trained
        log.warning("Dataset folder %s: training on its `train` files (%s); %s. Evaluate on another split with "
                    "eval_dataset: {path: %s, split: %s}.", path, ", ".join(f.name for f in parts[name]),
                    _split_listing(files, parts), path, next((o for o in parts if o != name), "test"))
    return parts[name], "train" + split[len(name):]


def _split_listing(files: list[Path], parts: dict[str, list[Path]]) -> str:
    """The other splits of a folder and the files in none, for the log."""
    others = [f"{name}: {', '.join(f.name for f in part)}" for name, part in parts.items() if name != "train"]
    unnamed = [f.name for f in files if not any(f in part for part in parts.values())]
    return "; ".join(others + ([f"in no split, not read: {', '.join(unnamed)}"] if unnamed else []))


def _check_file(path: Path, kind: str) -> list[dict] | None:
    """Catch what `datasets` reports badly: empty files, bad UTF-8, invalid JSON lines (with their line number).

    Returns the rows of a JSON file `datasets` cannot read as it is (a UTF-8 BOM, or one top-level object), else None.
    """
    data = file_bytes(path)
    if not data.strip():
        raise SFTError(f"Dataset file {path} is empty. Add rows or remove it from the recipe.")
    if kind == "parquet" or kind == "arrow":
        return None
    try:
        text = data.decode("utf-8-sig")  # Windows editors start UTF-8 files with a byte-order mark
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise SFTError(f"Dataset file {path}, line {line}: bytes that are not UTF-8 ({err.reason}). "
                       "Re-save the file as UTF-8.") from None
    if kind == "text":  # `datasets` makes each line a row: a blank one was refused as "row N: field `text` is empty"
        blank = next((n for n, line in enumerate(text.splitlines(), 1) if not line.strip()), None)
        if blank:
            raise SFTError(f"Dataset file {path}, line {blank} is blank: sft reads a .txt file as one example per line, "
                           "and a blank line is an empty example. Remove the blank lines (one document per line), or "
                           "save documents that span lines as JSON Lines, one {\"text\": ...} per document.")
    # A header and no row: `datasets` said `Instruction "train" corresponds to no data!`
    if kind in ("csv", "tsv") and len(text.strip().splitlines()) == 1:
        raise SFTError(f"Dataset file {path} holds a header line and no rows. Add rows or remove it from the recipe.")
    if kind != "json":
        return None
    if text.lstrip().startswith("{"):
        rows = _object_rows(path, text)
        if rows is not None:
            return rows
    _check_json(path, text)
    return _json_rows(path, text) if data.startswith(codecs.BOM_UTF8) else None


def _object_rows(path: Path, text: str) -> list[dict] | None:
    """The rows of a file holding one JSON object: a wrapper such as {"data": [...]}, or a single example.
    None when the text is not one object (JSON Lines)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(value, dict):
        return None
    lists = [key for key, item in value.items() if key not in ROW_KEYS and isinstance(item, list) and item
             and all(isinstance(row, dict) for row in item)]
    if len(lists) > 1:
        raise SFTError(f"Dataset file {path} is one JSON object with several lists of rows ({', '.join(lists)}). "
                       "Keep the rows in one list, or save them as a JSON list or JSON Lines.")
    if lists:
        log.info("Dataset file %s: reading the rows of its `%s` list.", path, lists[0])
        _check_rows_are_objects(path, value[lists[0]])
        return value[lists[0]]
    return [value] if value else None


def _json_rows(path: Path, text: str) -> list[dict]:
    """The rows of a checked JSON array or JSON Lines text."""
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _from_rows(files: list[Path], parts: list[list[dict]], split: str) -> datasets.Dataset:
    """A Dataset of rows read here; columns are the union of every row's keys (missing ones are None). They go
    through datasets' own JSON reader, as a plain file does: it types a field that holds text in one row and a list
    or object in another (message content as parts, tool-call arguments as a string or an object) as Json, where
    Dataset.from_dict fails with an Arrow error."""
    with tempfile.TemporaryDirectory(prefix="sft-rows-") as tmp:
        lines = Path(tmp) / "rows.jsonl"
        lines.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for part in parts for row in part),
                         encoding="utf-8")
        try:  # in memory: nothing is left in the folder removed below
            ds = datasets.load_dataset("json", data_files=str(lines), split="train", cache_dir=tmp,
                                       keep_in_memory=True)
        except Exception as err:  # datasets wraps Arrow's type errors in several types
            raise SFTError(f"Could not read dataset {files[0]}: {first_line(err)}") from None
    # The tokenization cache keys on the fingerprint; make it follow the files' content, not a random id.
    ds._fingerprint = hashlib.sha256(b"".join(f.read_bytes() for f in files)).hexdigest()[:16]
    return _sliced(ds, split, files[0])


def _sliced(ds: datasets.Dataset, split: str, where: Path) -> datasets.Dataset:
    """The rows a split spec such as "train[:64]" or "train[10%:]" selects of `ds` (all for "train")."""
    if split == "train":
        return ds
    try:
        bounds = datasets.ReadInstruction.from_spec(split).to_absolute({"train": len(ds)})
    except (ValueError, AssertionError) as err:
        raise SFTError(f"Bad split {split!r} for {where}: {err}") from None
    return ds.select([i for b in bounds for i in range(b.from_, b.to)])


def _check_json(path: Path, text: str) -> None:
    """A JSON file is either one array or JSON Lines; name the first line that parses as neither."""
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
        rows = json.loads("[" + ",".join(l for l in lines if l.strip()) + "]")
        if all(isinstance(row, dict) and row for row in rows):
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
        if not isinstance(row, dict) or not row:  # {} was reported as a row "in no format (keys )" of a mixed file
            got = "an empty one, {}" if isinstance(row, dict) else type(row).__name__
            raise SFTError(f"Dataset file {path}, line {number}: expected a JSON object, got {got}. Remove the line or "
                           "fill in the row.")


def _check_rows_are_objects(path: Path, rows: Any) -> None:
    if not isinstance(rows, list) or not rows:
        raise SFTError(f"Dataset file {path} must hold a non-empty JSON list of objects.")
    for number, row in enumerate(rows, 1):
        if not isinstance(row, dict) or not row:
            raise SFTError(f"Dataset file {path}, row {number}: expected a non-empty JSON object, got {row!r}.")


def rename_columns(ds: datasets.Dataset, source: Source) -> datasets.Dataset:
    """Apply the source's `columns` mapping (dataset name -> expected name)."""
    missing = [c for c in source.columns if c not in ds.column_names]
    if missing:
        raise SFTError(f"Dataset {source.label}: `columns` maps {missing[0]!r}, which is not a column "
                       f"(columns: {', '.join(ds.column_names)}).")
    targets = list(source.columns.values())
    twice = next((t for t in targets if targets.count(t) > 1), None)
    if twice:
        names = ", ".join(repr(c) for c, t in source.columns.items() if t == twice)
        raise SFTError(f"Dataset {source.label}: `columns` maps {names} all to {twice!r}; a name takes one column. "
                       "Keep one of them in `columns`.")
    # A target the data already has, not itself renamed away, would be a second column of that name (datasets
    # makes one, and reading it failed later with an Arrow traceback).
    kept = [c for c in ds.column_names if c not in source.columns]
    clash = next(((c, t) for c, t in source.columns.items() if t in kept and t != c), None)
    if clash:
        raise SFTError(f"Dataset {source.label}: `columns` maps {clash[0]!r} to {clash[1]!r}, a column the data "
                       f"already has. Rename that one too, e.g. `columns: {{{clash[0]}: {clash[1]}, {clash[1]}: "
                       f"{clash[1]}_original}}`.")
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
