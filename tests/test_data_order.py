"""A checkpoint records what decides which rows each step trains (sft.training.data_order); sft train refuses a resume
that would train other rows: another seed, max_length, packing or training data."""

import json
import shutil
from pathlib import Path

import datasets
import pytest

from sft.cli.main import main
from sft.data.packing import pack_dataset
from sft.training.data_order import ORDER_KEY, content_digest

from conftest import write_json


def rows(n: int = 24) -> list[dict]:
    return [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{i} plus {i + 3} is {2 * i + 3}."}
            for i in range(n)]


@pytest.fixture(scope="module")
def run(tmp_path_factory, tiny_model_dir) -> Path:
    """A run stopped after checkpoint-2 (4 rows a step, seed 7, max_length 128), with its recipe and data beside."""
    base = tmp_path_factory.mktemp("order")
    data = write_json(base / "data.json", rows())
    (base / "recipe.yaml").write_text(
        f"model_name_or_path: {tiny_model_dir}\ndataset: {data}\nmax_length: 128\nmax_steps: 2\n"
        "per_device_train_batch_size: 4\nsave_strategy: steps\nsave_steps: 2\nreport_to: none\nseed: 7\n")
    assert main(["train", str(base / "recipe.yaml"), "--output_dir", str(base / "run")]) == 0
    return base


def resume(run: Path, tmp_path: Path, *extra: str, recipe: Path | None = None, checkpoint: Path | None = None) -> int:
    """sft train resumed from the run's checkpoint-2 into a fresh output_dir, for one more step."""
    return main(["train", str(recipe or run / "recipe.yaml"), "--output_dir", str(tmp_path / "new"), "--max_steps",
                 "3", "--resume_from_checkpoint", str(checkpoint or run / "run" / "checkpoint-2"), *extra])


def error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err.split("sft: error: ")[1].strip()


WHY = ("The Trainer skips the rows already trained by counting steps, so the resumed run would train other rows than "
       "the run it continues: some twice, some never.")


def test_a_checkpoint_records_the_data_order(run):
    state = json.loads((run / "run" / "checkpoint-2" / "trainer_state.json").read_text())
    order = state["stateful_callbacks"][ORDER_KEY]
    assert {key: order[key] for key in ("seed", "data_seed", "packing", "max_length", "padding_free",
                                        "train_sampling_strategy", "rows")} == {
        "seed": 7, "data_seed": None, "packing": False, "max_length": 128, "padding_free": False,
        "train_sampling_strategy": "random", "rows": 24}
    assert len(order["content"]) == 16 and order["fingerprint"]


@pytest.mark.parametrize("extra, changes, restore", [
    (["--seed", "8"], "seed 7 -> 8", "--seed 7"),
    (["--data_seed", "3"], "data_seed unset -> 3", "without --data_seed"),
    (["--max_length", "96"], "max_length 128 -> 96", "--max_length 128"),
    (["--packing", "true", "--seed", "1"], "seed 7 -> 1, packing false -> true", "--seed 7 --packing false"),
    (["--packing", "true", "--packing_strategy", "bfd_split"], "packing false -> true", "--packing false"),
    (["--train_sampling_strategy", "group_by_length"], "train_sampling_strategy random -> group_by_length",
     "--train_sampling_strategy random"),
])
def test_a_resume_with_other_data_order_settings_is_refused(run, tmp_path, capsys, extra, changes, restore):
    assert resume(run, tmp_path, *extra) == 2
    folder = run / "run" / "checkpoint-2"
    assert error(capsys) == (
        f"resume_from_checkpoint: {folder} was trained with other settings that decide which rows each step trains "
        f"({changes}). {WHY} Resume with {restore}, or start a new run from its weights with --model_name_or_path "
        f"{folder}.")
    assert not (tmp_path / "new").exists()  # refused before anything was written


@pytest.mark.parametrize("edit, rows_said", [
    (lambda data: data[:-1], "24 rows -> 23 rows"),  # a row removed
    (lambda data: data[::-1], "24 rows, other content"),  # the file re-ordered
    (lambda data: [*data[:5], {**data[5], "output": "8 plus 11 is 19"}, *data[6:]], "24 rows, other content"),
])
def test_a_resume_on_other_training_data_is_refused(run, tmp_path, capsys, edit, rows_said):
    data = write_json(tmp_path / "data.json", edit(rows()))
    recipe = (run / "recipe.yaml").read_text().replace(str(run / "data.json"), str(data))
    (tmp_path / "recipe.yaml").write_text(recipe)
    folder = run / "run" / "checkpoint-2"
    assert resume(run, tmp_path, recipe=tmp_path / "recipe.yaml") == 2
    assert error(capsys) == (
        f"resume_from_checkpoint: {folder} was trained on other training data than this run builds ({rows_said}: the "
        f"dataset files, sources, weights or tokenizer differ). {WHY} Resume with the data it was trained on, or "
        f"start a new run from its weights with --model_name_or_path {folder}.")


def test_an_unchanged_resume_goes_ahead_and_records_the_same_order(run, tmp_path, caplog):
    assert resume(run, tmp_path, "--save_steps", "1") == 0
    assert "Resuming" not in caplog.text  # neither a layout nor a fingerprint warning

    def order(folder: Path) -> dict:
        return json.loads((folder / "trainer_state.json").read_text())["stateful_callbacks"][ORDER_KEY]

    assert order(tmp_path / "new" / "checkpoint-3") == order(run / "run" / "checkpoint-2")


def test_packed_rows_built_from_reordered_examples_differ(tokenizer):
    """Packing sorts examples by length into rows: a reordered file can give packed rows of the same lengths, with
    other examples in them."""
    examples = [{"input_ids": [i] * (3 + i % 4), "labels": [i] * (3 + i % 4)} for i in range(40)]
    packed, again, reordered = (pack_dataset(datasets.Dataset.from_list(rows), 16, "bfd", seed=7)
                                for rows in (examples, examples, examples[::-1]))
    assert content_digest(packed) == content_digest(again)
    assert len(packed) == len(reordered)
    assert content_digest(packed) != content_digest(reordered)


def test_a_packed_resume_with_another_packing_strategy_is_refused_naming_it(run, tmp_path, capsys):
    """bfd truncates an over-long example, bfd_split cuts it into max_length rows: other rows. The change was refused
    as 'other training data' (or not at all where no example is over-long), without naming packing_strategy."""
    packed = ["--packing", "true", "--max_length", "64"]  # the fixture's rows are longer: bfd_split adds rows
    assert main(["train", str(run / "recipe.yaml"), "--output_dir", str(tmp_path / "packed"), *packed]) == 0
    folder = tmp_path / "packed" / "checkpoint-2"
    assert resume(run, tmp_path, *packed, "--packing_strategy", "bfd_split", checkpoint=folder) == 2
    assert error(capsys).startswith(
        f"resume_from_checkpoint: {folder} was trained with other settings that decide which rows each step trains "
        f"(packing_strategy bfd -> bfd_split). {WHY} Resume with --packing_strategy bfd, or start")
    assert resume(run, tmp_path, "--packing_strategy", "bfd_split") == 0  # unpacked: the strategy decides nothing


def test_a_resume_with_padding_free_toggled_warns_only(run, tmp_path, caplog):
    """padding_free lays the same rows out as one flattened row: the same rows in the same order."""
    assert resume(run, tmp_path, "--padding_free", "true") == 0
    assert "with padding_free true; it was trained with false. The same rows are trained" in caplog.text


def test_a_checkpoint_from_before_the_record_resumes(run, tmp_path):
    """Checkpoints saved before sft recorded the data order are not checked."""
    old = tmp_path / "old" / "checkpoint-2"
    shutil.copytree(run / "run" / "checkpoint-2", old)
    state = json.loads((old / "trainer_state.json").read_text())
    del state["stateful_callbacks"][ORDER_KEY]
    (old / "trainer_state.json").write_text(json.dumps(state))
    assert resume(run, tmp_path, "--seed", "8", checkpoint=old) == 0
