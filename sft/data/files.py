"""Local data files: which files of a path are data, the `datasets` loader each is read with, and their bytes."""

import bz2
import glob
import gzip
import lzma
from pathlib import Path

from sft.errors import SFTError

FILE_TYPES = {".json": "json", ".jsonl": "json", ".csv": "csv", ".tsv": "tsv", ".parquet": "parquet", ".txt": "text",
              ".arrow": "arrow"}
# Compressed text files as the Hub and users keep them (train.jsonl.gz), read as `datasets` reads them: decompressed
# whole. They were refused ("Decompress it first"), though `datasets` reads them as they are.
DECOMPRESS = {".gz": gzip.decompress, ".bz2": bz2.decompress, ".xz": lzma.decompress}
COMPRESSED = (*DECOMPRESS, ".zst", ".zip", ".lz4", ".7z")
TEXT_KINDS = ("json", "csv", "tsv", "text")  # the kinds read compressed; Parquet and Arrow compress inside the file
# The `datasets` loader and its options per kind. A CSV cell is text as written: pandas reads "NA", "N/A", "None",
# "null", "nan" (and more) as missing by default, so an Alpaca input "NA" trained with the no-input prompt and an
# answer "None" was "missing". Empty cells read as "". A .tsv is CSV with tabs (it was refused as "not .tsv").
LOADERS = {"tsv": "csv"}
READ_OPTIONS = {"csv": {"keep_default_na": False}, "tsv": {"keep_default_na": False, "sep": "\t"}}


def file_kind(path: Path) -> str | None:
    """The kind (a FILE_TYPES value) of a data file, also compressed (rows.jsonl.gz is json); None if sft reads none."""
    if path.suffix in DECOMPRESS:
        kind = FILE_TYPES.get(Path(path.stem).suffix)
        return kind if kind in TEXT_KINDS else None
    return FILE_TYPES.get(path.suffix)


def file_bytes(path: Path) -> bytes:
    """The content of a data file, decompressed."""
    data = path.read_bytes()
    unpack = DECOMPRESS.get(path.suffix)
    if unpack is None or not data:
        return data
    try:
        return unpack(data)
    except (OSError, EOFError, lzma.LZMAError) as err:  # each decompressor raises its own type
        raise SFTError(f"Dataset file {path} is not valid {path.suffix} data ({err}). Re-compress it, or save it "
                       "uncompressed.") from None


def is_glob(path: str) -> bool:
    return glob.has_magic(path)


def data_files(path: Path) -> list[Path]:
    """The data files of a file, a folder or a glob pattern (data/*.parquet); hidden folders and files
    (.ipynb_checkpoints, .git, ...) are not data."""
    if is_glob(str(path)) and not path.exists():
        return sorted(p for p in map(Path, glob.glob(str(path), recursive=True)) if p.is_file() and file_kind(p))
    if not path.is_dir():
        return [path]
    return sorted(p for p in path.rglob("*") if file_kind(p) and p.is_file()
                  and not any(part.startswith(".") for part in p.relative_to(path).parts))


def unread_type(path: Path) -> SFTError:
    """The error for a data file sft does not read, with what to do for the two cases real datasets ship: archives
    (.zip, .zst) and a translation corpus as two line-aligned text files (Multi30K's train.en.gz + train.de.gz), which
    are one dataset of pairs, not two."""
    compressed = path.suffix in COMPRESSED
    inner = Path(path.stem).suffix if compressed else path.suffix  # .jsonl of train.jsonl.zst, .en of train.en.gz
    fix = [f"Decompress it first, or compress it as {', '.join(DECOMPRESS)}."] if compressed and file_kind(
        Path(path.stem)) else []
    if inner not in FILE_TYPES:
        fix.append("Two line-aligned files of source and target sentences (train.en + train.de) are one dataset of "
                   "pairs: write them as one JSON Lines file with a `source` and a `target` per line (README: "
                   "Seq2Seq).")
    kind = (inner + path.suffix if compressed else inner) or "files without an extension"
    readable = ", ".join(FILE_TYPES) + f" files (also as {', '.join(DECOMPRESS)})"
    return SFTError(f"Dataset file {path}: sft reads {readable}, not {kind}. " + " ".join(fix))
