"""Inputs a user has are read: BOM, `~`, one JSON object or a {"data": [...]} wrapper, hidden folders skipped, split
slices in `sft check`; duplicate recipe keys refused; a tokenizer of another family warned about; weighted sources
and eval_split_size hold out rows, not copies, and the stats count the training part only."""

import json
import logging
from collections import Counter
from pathlib import Path

import pytest
import yaml
from transformers import AutoTokenizer

from sft import build_datasets
from sft.cli.main import main
from sft.data.sources import Source, load_source
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.models.saved import load_saved_tokenizer
from sft.training.recipe import load_recipe

from conftest import EMBEDDED_MODEL, FIXTURES, REPO, write_json

CORPUS = Path(__file__).parent / "bad_inputs"
ROWS = json.loads((CORPUS / "good.json").read_text())
TOKENIZERS = FIXTURES / "tokenizers"
ALPACA = REPO / "data" / "alpaca_sample.json"  # 400 distinct rows, none over 100 tokens on the embedded model


def rows_of(path: Path, split: str = "train") -> list[dict]:
    return load_source(Source(str(path), split=split)).to_list()


@pytest.mark.parametrize("jsonl", [False, True])
def test_utf8_bom_files_are_read(tmp_path, jsonl):
    text = "\n".join(json.dumps(r) for r in ROWS) if jsonl else json.dumps(ROWS)
    path = tmp_path / ("bom.jsonl" if jsonl else "bom.json")
    path.write_bytes(b"\xef\xbb\xbf" + text.encode())
    assert rows_of(path) == ROWS
    assert rows_of(path, "train[:3]") == ROWS[:3]


def test_one_object_and_a_data_wrapper_are_read(tmp_path):
    single, wrapped = tmp_path / "one.json", tmp_path / "wrapped.json"
    single.write_text(json.dumps(ROWS[0], indent=2))  # pretty-printed: not JSON Lines
    wrapped.write_text(json.dumps({"version": "1.0", "data": ROWS}, indent=2))
    assert rows_of(single) == ROWS[:1]
    assert rows_of(wrapped) == ROWS


def test_a_single_chat_row_is_a_row_not_a_wrapper(tmp_path):
    """Negative control for the wrapper rule: `messages` is a list of objects inside one row."""
    row = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    path = tmp_path / "chat.json"
    path.write_text(json.dumps(row, indent=2))
    assert rows_of(path) == [row]


MIXED = [  # real-world chat rows: content as text or as parts, tool-call arguments as a string or an object
    {"messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}]},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "Weather in Paris?"}]},
                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                      "name": "weather", "arguments": {"city": "Paris"}}}]},
                  {"role": "tool", "content": "sunny"}, {"role": "assistant", "content": "Sunny."}]},
    {"messages": [{"role": "user", "content": "And in Rome?"},
                  {"role": "assistant", "tool_calls": [{"type": "function", "function": {
                      "name": "weather", "arguments": "{\"city\": \"Rome\"}"}}]},
                  {"role": "tool", "content": "rain"}, {"role": "assistant", "content": "Rain."}]}]


def test_mixed_type_rows_read_the_same_from_every_json_shape(tmp_path):
    """A UTF-8 BOM or a {"data": [...]} wrapper sends a file through sft's own reader: rows whose fields change
    type from row to row failed there with an Arrow traceback while the plain JSON Lines file loaded."""
    plain, bom, wrapped = tmp_path / "plain.jsonl", tmp_path / "bom.jsonl", tmp_path / "wrapped.json"
    plain.write_text("\n".join(json.dumps(r) for r in MIXED))
    bom.write_bytes(b"\xef\xbb\xbf" + plain.read_bytes())
    wrapped.write_text(json.dumps({"data": MIXED}))
    assert rows_of(bom) == rows_of(wrapped) == rows_of(plain)
    assert rows_of(plain)[2]["messages"][1]["tool_calls"][0]["function"]["arguments"] == "{\"city\": \"Rome\"}"


def test_hidden_and_checkpoint_folders_are_not_data(tmp_path):
    (tmp_path / "part1.json").write_text(json.dumps(ROWS))
    for hidden in (".ipynb_checkpoints/part1-checkpoint.json", ".cache/copy.json"):
        (tmp_path / hidden).parent.mkdir()
        (tmp_path / hidden).write_text(json.dumps(ROWS))
    assert len(rows_of(tmp_path)) == len(ROWS)


def test_home_paths_are_expanded(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "data.json").write_text(json.dumps(ROWS))
    assert rows_of(Path("~/data.json")) == ROWS


def test_check_samples_a_sliced_split(tmp_path):
    from sft.check.smoke import CheckReport, sample_data

    (tmp_path / "data.json").write_text(json.dumps(ROWS))
    config = load_recipe({"dataset": [{"path": str(tmp_path / "data.json"), "split": "train[:6]"}]})
    sample = sample_data(config, CheckReport(recipe="recipe.yaml"))
    split = sample["dataset"][0]["split"]
    assert split.count("[") == 1
    assert rows_of(tmp_path / "data.json", split) == ROWS[:len(rows_of(tmp_path / "data.json", split))]


def test_duplicate_recipe_keys_name_both_lines(tmp_path):
    path = tmp_path / "recipe.yaml"
    path.write_text("dataset:\n  - path: a.json\n    weight: 1\n    weight: 2\nlearning_rate: 1.0e-4\n")
    with pytest.raises(SFTError, match="key `weight` is set twice, on lines 3 and 4"):
        load_recipe(path)
    path.write_text("learning_rate: 1.0e-4\nmax_steps: 3\n")  # control: distinct keys load
    assert load_recipe(path).max_steps == 3


@pytest.mark.skipif(not (TOKENIZERS / "qwen2.5-coder-3b-instruct").is_dir(),
                    reason=f"no real tokenizers at {TOKENIZERS}")
def test_a_tokenizer_of_another_family_warns_with_the_new_rows(tiny_model_dir, caplog):
    from sft.data.tokenizer import load_tokenizer
    from sft.models.loading import load_model

    config = load_recipe({"model_name_or_path": str(tiny_model_dir)})
    own = load_tokenizer(config)
    with caplog.at_level(logging.WARNING, logger="sft"):
        load_model(config, own)  # control: the model's own tokenizer
    assert "DOES NOT FIT" not in caplog.text
    config = load_recipe({"model_name_or_path": str(tiny_model_dir),
                          "tokenizer_name_or_path": str(TOKENIZERS / "qwen2.5-coder-3b-instruct")})
    tokenizer = load_tokenizer(config)
    with caplog.at_level(logging.WARNING, logger="sft"):
        load_model(config, tokenizer)
    rows = len(tokenizer) - len(own)
    assert f"so {rows} new untrained rows are added" in caplog.text


def data_keys(tmp_path, dataset, **keys) -> dict:
    """Recipe keys for `dataset` on the embedded tiny Llama."""
    return {"model_name_or_path": str(EMBEDDED_MODEL), "dataset": dataset, "max_length": 256,
            "output_dir": str(tmp_path / "out"), "report_to": "none", **keys}


def test_weighted_sources_hold_out_rows_and_repeat_only_the_training_ones(tmp_path):
    """eval_split_size holds out rows of the data, each once; `weight` then repeats the rows left for training, so
    no held-out row is trained on."""
    texts = write_json(tmp_path / "texts.jsonl", [{"text": f"Note {i}: the quick brown fox."} for i in range(20)],
                       jsonl=True)
    config = load_recipe(data_keys(tmp_path, [{"path": str(ALPACA), "weight": 2}, str(texts)], eval_split_size=0.1))
    train, evaluation = build_datasets(config)
    held, trained = Counter(map(tuple, evaluation["input_ids"])), Counter(map(tuple, train["input_ids"]))
    assert len(held) == sum(held.values()) == 42  # 10% of the 420 rows, each once
    assert not held.keys() & trained.keys()
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    notes = {ids for ids in trained if "Note " in tokenizer.decode(ids)}
    # control: the comparison sees repeated rows: the Alpaca source's (weight 2) twice, the other source's once
    assert {trained[ids] for ids in notes} == {1} and {trained[ids] for ids in trained.keys() - notes} == {2}
    assert len(trained) + len(held) == 420


def test_training_stats_count_only_the_rows_left_for_training(tmp_path, capsys):
    """With eval_split_size, `sft data` (and data_stats.json) count truncated rows of the training part only."""
    data = write_json(tmp_path / "lengths.jsonl", [{"text": " ".join(["word"] * n)} for n in range(1, 41)],
                      jsonl=True)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data_keys(tmp_path, str(data), eval_split_size=0.5, max_length=24)))
    assert main(["data", str(recipe), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    # The same rows are held out at any max_length (text rows are never dropped): untruncated, they show which
    # training rows are over 24 tokens.
    whole, held = build_datasets(load_recipe(data_keys(tmp_path, str(data), eval_split_size=0.5, max_length=1000)))
    over, held_over = sum(n > 24 for n in whole["length"]), sum(n > 24 for n in held["length"])
    assert stats["rows"] == len(whole) == len(held) == 20
    assert stats["truncated_rows"] == over > 0 and held_over > 0  # control: both parts have rows over 24 tokens


def test_eval_rows_dropped_at_max_length_are_reported(tmp_path, caplog):
    """Eval rows whose prompt fills max_length have nothing to score and are left out of every evaluation; sft eval
    (and sft train) say how many, where they were dropped without a word (DialogSum dev, decoder model, max_length
    256: 155 of 500 dialogues, the longest)."""
    short = [{"instruction": f"Say {word}", "output": word} for word in ("yes", "no", "maybe")]
    long = [{"instruction": "Count: " + " ".join(["word"] * n), "output": "no"} for n in (60, 80)]
    data = write_json(tmp_path / "eval.json", short + [long[0], short[0], long[1]])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data_keys(tmp_path, str(ALPACA), eval_dataset=str(data), max_length=48,
                                               per_device_eval_batch_size=8)))
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert main(["eval", str(recipe)]) == 0
    warning = ("Eval data: 2 of 6 rows dropped, no trained token fits in max_length=48. Eval loss and metrics leave "
               "them out: raise max_length or shorten the prompts to score them.")
    assert warning in caplog.text
    _, evaluation = build_datasets(load_recipe(data_keys(tmp_path, str(ALPACA), eval_dataset=str(data),
                                                         max_length=48)))
    assert len(evaluation) == 4  # the two long rows are the ones left out


def test_a_save_to_disk_folder_is_a_dataset(tmp_path):
    """A Dataset or DatasetDict saved with save_to_disk (arrow shards + json state files) reads as its rows: it was
    refused as a folder of mixed file types. A DatasetDict's split is the source's `split`, sliceable."""
    import datasets

    saved, both = tmp_path / "saved", tmp_path / "dict"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(saved))
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
                         ).save_to_disk(str(both))
    assert rows_of(saved) == ROWS and rows_of(saved, "train[:3]") == ROWS[:3]
    assert rows_of(both) == ROWS and rows_of(both, "test") == ROWS[:2]
    with pytest.raises(SFTError, match="has no split 'validation'; it has train, test"):
        rows_of(both, "validation")
    config = load_recipe({"model_name_or_path": "data/models/tiny-llama", "dataset": str(saved)})
    from sft.data.build import build_datasets

    assert len(build_datasets(config)[0]) == len(ROWS)  # trains like the same rows in a JSON file


def test_building_from_a_save_to_disk_folder_writes_nothing_into_it(tmp_path):
    """Dataset.map caches beside a dataset's own Arrow files: tokenizing a save_to_disk folder left cache-*.arrow
    files in the user's folder (read back as data by a glob such as saved/*.arrow, and failing on a read-only one)."""
    import datasets

    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS[:2])}
                         ).save_to_disk(str(saved))
    before = {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()}
    config = load_recipe({"model_name_or_path": "data/models/tiny-llama", "dataset": str(saved),
                          "eval_dataset": {"path": str(saved), "split": "test"}})
    train, evaluation = build_datasets(config)
    assert (len(train), len(evaluation)) == (len(ROWS), 2)
    assert {p: p.read_bytes() for p in saved.rglob("*") if p.is_file()} == before


@pytest.mark.parametrize("name", ["zephyr-7b-beta", "mistral-7b-instruct-v0.2", "mistral-7b-instruct-v0.1"])
def test_a_saved_tokenizer_tokenizes_as_training_did(tmp_path, name):
    """transformers 5 saves a legacy sentencepiece tokenizer (Zephyr, Mistral v0.2: legacy true) without `legacy`, and
    reloads it non-legacy: the run's folder tokenized every chat row differently from training ('</s>' '▁' '\\n'
    became '</s>' '\\n', '<s>' '▁[' became '<s>' '[')."""
    folder = TOKENIZERS / name
    if not folder.is_dir():
        pytest.skip(f"real tokenizers not found at {TOKENIZERS} (../shared/fixtures is beside a checkout)")
    config = load_recipe({"model_name_or_path": str(EMBEDDED_MODEL), "tokenizer_name_or_path": str(folder),
                          "dataset": str(write_json(tmp_path / "d.json", [{"text": "x"}]))})
    tokenizer = load_tokenizer(config)
    tokenizer.save_pretrained(tmp_path / "run")  # what the Trainer does with its processing_class
    saved = AutoTokenizer.from_pretrained(tmp_path / "run")
    texts = ["<s>[INST] hi [/INST] yo</s>", "<|user|>\nhi</s>\n<|assistant|>\nyo</s>\n", "a</s>\nb", " two  spaces"]
    assert [saved(t)["input_ids"] for t in texts] == [tokenizer(t)["input_ids"] for t in texts]
    load_saved_tokenizer(tmp_path / "run").save_pretrained(tmp_path / "merged")  # what sft merge does
    merged = AutoTokenizer.from_pretrained(tmp_path / "merged")
    assert [merged(t)["input_ids"] for t in texts] == [tokenizer(t)["input_ids"] for t in texts]


def test_a_folder_of_split_files_trains_on_its_train_split_only(tmp_path, caplog):
    """A folder laid out in splits as `datasets` reads one (train.jsonl beside validation.jsonl and test.jsonl; a Hub
    repository's data/train-00000-of-00001.parquet) trains on its train files; `split` picks another, sliceable.
    Every file was read as training data: the 1000-row Alpaca fixture split 800/100/100 trained 1000 rows, its test
    rows included, without a word, and `split: test` was refused."""
    import datasets

    rows = [{"instruction": f"Say {i}", "input": "", "output": str(i)} for i in range(10)]
    files, plain = tmp_path / "files", tmp_path / "test_parts"  # split names in a folder's own path do not count
    files.mkdir(), plain.mkdir()
    for name, part in (("train", rows[:6]), ("validation", rows[6:8]), ("test", rows[8:])):
        write_json(files / f"{name}.jsonl", part, jsonl=True)
    with caplog.at_level(logging.WARNING, logger="sft.data.sources"):
        assert rows_of(files) == rows[:6]
    assert "training on its `train` files (train.jsonl); validation: validation.jsonl; test: test.jsonl" in caplog.text
    assert rows_of(files, "test") == rows[8:] and rows_of(files, "validation[:1]") == rows[6:7]
    hub = tmp_path / "hub" / "data"
    hub.mkdir(parents=True)
    datasets.Dataset.from_list(rows[:7]).to_parquet(str(hub / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_list(rows[7:]).to_parquet(str(hub / "test-00000-of-00001.parquet"))
    assert rows_of(hub.parent) == rows[:7] and rows_of(hub.parent, "test") == rows[7:]
    with pytest.raises(SFTError, match="has no split 'validation': its file names make the splits train, test"):
        rows_of(hub.parent, "validation")
    write_json(plain / "a.json", rows[:4])
    write_json(plain / "b.json", rows[4:])
    assert rows_of(plain) == rows


CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: stuff/mytrain.parquet
  - split: test
    path: stuff/heldout.parquet
- config_name: small
  data_files: stuff/heldout.parquet
---
# A dataset repository as `git clone`d from the Hub
"""


def test_a_folder_reads_the_splits_its_readme_card_declares(tmp_path):
    """A Hub dataset repository names its splits in README.md `configs`, not always in file names: a clone with
    stuff/mytrain.parquet (train) and stuff/heldout.parquet (test) trained on both, 125 rows for 120 (the 5 test rows
    trained on, without a word). `name` picks a config, `data_dir` a subfolder, as load_dataset(folder) reads them."""
    import datasets

    rows = ROWS * 3
    repo = tmp_path / "repo"
    (repo / "stuff").mkdir(parents=True)
    datasets.Dataset.from_list(rows[:-2]).to_parquet(str(repo / "stuff" / "mytrain.parquet"))
    datasets.Dataset.from_list(rows[-2:]).to_parquet(str(repo / "stuff" / "heldout.parquet"))
    (repo / "README.md").write_text(CARD)
    assert rows_of(repo) == rows[:-2] and rows_of(repo, "test[:1]") == rows[-2:-1]
    assert load_source(Source(str(repo), name="small")).to_list() == rows[-2:]
    with pytest.raises(SFTError, match=r"README.md has no config 'big' \(configs: default, small\)"):
        load_source(Source(str(repo), name="big"))
    assert load_source(Source(str(tmp_path), data_dir="repo", name="small")).to_list() == rows[-2:]
    (repo / "README.md").unlink()
    with pytest.raises(SFTError, match="selects a config of a README.md `configs` list, and the folder has none"):
        load_source(Source(str(repo), name="small"))


def test_compressed_tab_separated_and_globbed_files_train_the_same_examples(tmp_path):
    """Forms the Hub and users keep data in, each training the same tokens and labels as the plain JSON file: they
    were refused (.jsonl.gz, .json.gz, .csv.gz, .bz2, .xz: "Decompress it first"; .tsv: "not .tsv", with advice for
    line-aligned translation files; data/*.parquet: "does not exist"), though `datasets` reads them."""
    import bz2
    import gzip
    import lzma

    import pandas as pd

    rows = json.loads(ALPACA.read_text())[:40]
    table = pd.DataFrame(rows)
    shards = tmp_path / "shards"
    shards.mkdir()
    for i in range(3):
        table.iloc[i * 15:(i + 1) * 15].to_parquet(shards / f"part-{i}.parquet")
    (shards / "notes.md").write_text("not data")  # a glob's files are filtered by type, as a folder's are
    lines = "".join(json.dumps(row) + "\n" for row in rows).encode()
    forms = {"a.jsonl.gz": gzip.compress(lines), "a.json.gz": gzip.compress(json.dumps(rows).encode()),
             "a.jsonl.bz2": bz2.compress(lines), "a.jsonl.xz": lzma.compress(lines),
             "wrapped.json.gz": gzip.compress(json.dumps({"data": rows}).encode()),
             "a.tsv": table.to_csv(sep="\t", index=False).encode(),
             "a.csv.gz": gzip.compress(table.to_csv(index=False).encode())}
    paths = [str(shards / "*.parquet")]
    for name, data in forms.items():
        path = tmp_path / name
        path.write_bytes(data)
        paths.append(str(path))

    def trained(dataset: str) -> list:
        train, _ = build_datasets(load_recipe(data_keys(tmp_path, dataset)))
        return list(zip(train["input_ids"], train["labels"]))

    plain = trained(str(write_json(tmp_path / "plain.json", rows)))
    assert len(plain) == 40
    assert {path: trained(path) == plain for path in paths} == dict.fromkeys(paths, True)


def test_csv_cells_are_the_text_written(tmp_path):
    """pandas reads "NA", "N/A", "None", "null" and "nan" cells as missing: an Alpaca input "NA" became None and the
    row trained with the no-input prompt, an answer "None" was refused as missing. Each cell is its text; an empty
    cell is empty text (the no-input prompt, as in a JSON file with "input": "")."""
    csv = tmp_path / "data.csv"
    csv.write_text("instruction,input,output\nWhat does f return?,def f(): pass,None\nTranslate the code,NA,N/A\n"
                   "Say hi,,hi\n", encoding="utf-8")
    assert rows_of(csv) == [{"instruction": "What does f return?", "input": "def f(): pass", "output": "None"},
                            {"instruction": "Translate the code", "input": "NA", "output": "N/A"},
                            {"instruction": "Say hi", "input": "", "output": "hi"}]
    config = load_recipe({"model_name_or_path": str(EMBEDDED_MODEL), "dataset": str(csv)})
    tokenizer = load_tokenizer(config)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in build_datasets(config, tokenizer)[0]["input_ids"]]
    assert "### Input:\nNA\n\n### Response:N/A" in texts[1] and "### Input:" not in texts[2]


def test_eval_rows_that_are_also_training_rows_are_counted_in_a_warning(tmp_path, caplog):
    """Data holding a row more than once puts copies on both sides of eval_split_size (LLaMA-Factory's glaive demo:
    5 of the 30 held-out rows were training rows), and an eval_dataset may share rows with the training data: eval
    loss on them measures recall. Nothing said so; a warning counts them, exactly."""
    rows = json.loads(ALPACA.read_text())[:30] + [json.loads(ALPACA.read_text())[0]] * 10
    data = write_json(tmp_path / "data.json", rows)
    with caplog.at_level(logging.WARNING, logger="sft.data.build"):
        train, evaluation = build_datasets(load_recipe(data_keys(tmp_path, str(data), eval_split_size=0.5, seed=1)))
    trained = set(map(tuple, train["input_ids"]))
    seen = sum(tuple(ids) in trained for ids in evaluation["input_ids"])
    assert 0 < seen < len(evaluation) == 20
    assert f"The training data holds {seen} of the 20 eval rows (the same tokens)" in caplog.text
    caplog.clear()
    other = write_json(tmp_path / "other.json", rows[20:25] + [{"instruction": "Say hi", "output": "hi"}])
    with caplog.at_level(logging.WARNING, logger="sft.data.build"):
        build_datasets(load_recipe(data_keys(tmp_path, str(data), eval_dataset=str(other))))
    assert "The training data holds 5 of the 6 eval rows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft.data.build"):
        build_datasets(load_recipe(data_keys(tmp_path, str(ALPACA), eval_split_size=0.1)))
    assert "eval rows" not in caplog.text  # 400 distinct rows: none on both sides
