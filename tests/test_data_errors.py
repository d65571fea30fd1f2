"""Malformed data fails with exit 2, naming the file, the row and the problem, before any model loads."""

import gzip
import json

import pytest

from sft.cli.main import main

GOOD = {"instruction": "Say hi", "input": "", "output": "hi"}
CASES = {
    "missing_column.json": ([GOOD, {"instruction": "x", "input": ""}], "missing.json, row 2: field `output` is missing"),
    "misnamed.json": ([{"instrution": "x", "output": "y"}], "Column `instrution` looks like `instruction`"),
    "non_string.json": ([GOOD, {"instruction": "x", "output": 123}], "row 2: field `output` is int '123', not a string"),
    "list_value.json": ([GOOD, {"instruction": ["x"], "output": "y"}], "row 2: field `instruction` is list"),
    "empty_output.json": ([GOOD, {"instruction": "x", "output": "  "}], "row 2: field `output` is empty"),
    "empty_row.json": ([GOOD, {}], "row 2: expected a non-empty JSON object"),
    # An empty row of JSON Lines was "empty_row.jsonl mixes formats: row 1 is alpaca, row 2 is in no format (keys )".
    "empty_row.jsonl": (json.dumps(GOOD) + "\n{}\n", "empty_row.jsonl, line 2: expected a JSON object, got an empty "
                        "one, {}. Remove the line or fill in the row."),
    # A row of nulls (a Parquet or CSV row of missing cells reads the same): the same "mixes formats" message.
    "null_row.jsonl": (json.dumps(GOOD) + '\n{"instruction": null, "input": null, "output": null}\n',
                       "null_row.jsonl, row 2 is empty: every field is null or missing. Remove the row."),
    "empty.json": ("", "is empty"),
    "bad_line.jsonl": (json.dumps(GOOD) + '\n{"instruction": "x", "output": }\n', "bad_line.jsonl, line 2: invalid JSON"),
    "non_utf8.jsonl": (json.dumps(GOOD).encode() + b'\n{"instruction": "\xff", "output": "y"}\n', "line 2: bytes that are not UTF-8"),
    "not_a_list.json": ('"just a string"', "expected a JSON object"),
    # A file type sft does not read (it failed with "found ['None']"): an archive sft does not open is told to be
    # decompressed, one side of a line-aligned translation pair (Multi30K's train.en) how to make it one file of pairs.
    "rows.jsonl.zst": (b"(\xb5/\xfd", "sft reads .json, .jsonl, .csv, .tsv, .parquet, .txt, .arrow files (also as .gz, "
                       ".bz2, .xz), not .jsonl.zst. Decompress it first, or compress it as .gz, .bz2, .xz."),
    "broken.jsonl.gz": (gzip.compress(json.dumps(GOOD).encode())[:-12], "broken.jsonl.gz is not valid .gz data"),
    "captions.en": ("A man sleeping in a green room on a couch.\n", "not .en. Two line-aligned files of source and "
                    "target sentences (train.en + train.de) are one dataset of pairs: write them as one JSON Lines "
                    "file with a `source` and a `target` per line"),
}


def write_case(path, content):
    if isinstance(content, bytes):
        path.write_bytes(content)
    else:
        path.write_text(content if isinstance(content, str) else json.dumps(content), encoding="utf-8")


@pytest.mark.parametrize("name", sorted(CASES))
def test_malformed_data_exits_2_with_file_row_and_problem(tmp_path, capsys, tiny_model_dir, name):
    content, message = CASES[name]
    data = tmp_path / name.replace("missing_column", "missing")
    write_case(data, content)
    out = tmp_path / "out"
    recipe = tmp_path / "r.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {data}\noutput_dir: {out}\n")
    code = main(["train", str(recipe)])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err and str(data.name) in err
    assert "Traceback" not in err
    assert not out.exists()
