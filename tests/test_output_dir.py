"""sft only replaces what sft wrote: user files in output_dir survive train (with and without
--overwrite_output_dir) and eval; an earlier sft run is replaced only when asked, and only its own files."""

import contextlib
import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import transformers
from transformers.trainer_utils import get_last_checkpoint

from sft import rundir
from sft.cli.main import main

from conftest import EMBEDDED_MODEL, REPO, descendants, locked_by_another_process, snapshot

DATA = REPO / "data" / "alpaca_sample.json"


def run(*argv: str) -> int:
    return main(list(argv))


def recipe(tmp_path: Path, out: Path, dataset: Path = DATA) -> str:
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: {EMBEDDED_MODEL}\ndataset: {dataset}\noutput_dir: {out}\n"
                    "max_steps: 1\nmax_length: 128\nreport_to: none\nsave_strategy: 'no'\neval_split_size: 8\n")
    return str(path)


def test_user_files_survive_train_with_and_without_overwrite(tmp_path, capsys):
    out = tmp_path / "project"
    out.mkdir()
    (out / "data.json").write_bytes(DATA.read_bytes())  # the training data lives in the output folder
    (out / "notes.md").write_text("experiment log\n")
    (out / "README.md").write_text("# My project\n")
    (out / "config.json").write_text(json.dumps({"mine": True}))
    before = snapshot(out)
    for extra in ([], ["--overwrite_output_dir", "true"]):
        assert run("train", recipe(tmp_path, out, out / "data.json"), *extra) == 2
        err = capsys.readouterr().err
        assert "README.md, config.json, data.json, notes.md" in err  # every foreign file named
        assert "--overwrite_output_dir" not in err  # the refusal never points at a flag that would delete them
        assert snapshot(out) == before


def test_overwrite_replaces_only_an_earlier_runs_files(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("train", recipe(tmp_path, out)) == 0
    assert rundir.is_run(out) and (out / "README.md").exists()
    first = (out / "sft_run.json").read_bytes()
    assert run("train", recipe(tmp_path, out)) == 2  # an earlier run is not replaced unless asked
    assert "already holds an sft run" in capsys.readouterr().err
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 0  # control: it can be
    assert (out / "sft_run.json").read_bytes() != first
    (out / "notes.txt").write_text("added by the user after the run\n")
    card = (out / "README.md").read_text()
    (out / "README.md").write_text(card + "\nMy edits.\n")
    before = snapshot(out)
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 2
    assert "README.md, notes.txt" in capsys.readouterr().err  # the edited model card is the user's now
    assert snapshot(out) == before


def test_a_copied_run_is_still_sfts(tmp_path):
    out, copy = tmp_path / "run", tmp_path / "copy"
    assert run("train", recipe(tmp_path, out)) == 0
    shutil.copytree(out, copy, copy_function=shutil.copy)  # new modification times, same content
    assert rundir.foreign_entries(copy) == []
    (copy / "eval_results.json").write_text("{}\n")  # control: a changed file is the user's
    assert rundir.foreign_entries(copy) == ["eval_results.json"]


def test_eval_writes_beside_a_run_and_replaces_its_results_only_when_asked(tmp_path, capsys):
    out = tmp_path / "run"
    assert run("train", recipe(tmp_path, out)) == 0
    before = snapshot(out)
    for overwrite in ([], ["--overwrite_output_dir", "true"]):  # the recipe's base model, not the run's
        assert run("eval", recipe(tmp_path, out), *overwrite) == 2
        assert f"Evaluate the run with --model_name_or_path {out}" in capsys.readouterr().err
        assert snapshot(out) == before
    trained = ["--model_name_or_path", str(out)]
    assert run("eval", recipe(tmp_path, out), *trained) == 2
    assert "already holds eval_results.json" in capsys.readouterr().err
    assert snapshot(out) == before
    assert run("eval", recipe(tmp_path, out), *trained, "--overwrite_output_dir", "true") == 0
    after = snapshot(out)
    changed = {name for name in before if after.get(name) != before[name]}
    assert changed <= {"eval_results.json", "sft_run.json"} and "eval_results.json" in changed
    assert "eval_perplexity" in json.loads(after["eval_results.json"])
    assert not rundir.foreign_entries(out)


def test_unwritable_output_dir_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(rundir.os, "access", lambda path, mode: False)  # root ignores permission bits
    with pytest.raises(rundir.SFTError, match="is not writable"):
        rundir.check_output_dir(tmp_path / "out")


def test_another_ranks_write_probe_is_not_a_user_file(tmp_path):
    """Every rank of a launch checks output_dir, creating and removing a writability probe; another rank must not
    take that probe for a user's file (a 2-process resume was refused for it), record it or delete it."""
    new, earlier = tmp_path / "new", tmp_path / "earlier"
    new.mkdir()
    assert run("train", recipe(tmp_path, earlier)) == 0
    for out in (new, earlier):
        probe = out / f"{rundir.WRITE_PROBE}x1y2"
        probe.mkdir()  # another rank is between mkdtemp and rmdir
        rundir.check_output_dir(out)
        assert rundir.foreign_entries(out) == []
        rundir.claim(out)
        assert probe.name not in rundir.read_manifest(out)
        assert probe.name not in rundir.clear_run(out) and probe.is_dir()
        (out / "notes.md").write_text("mine\n")  # control: a user's file still is
        assert rundir.foreign_entries(out) == ["notes.md"]


def test_eval_beside_a_users_own_checkpoints_keeps_them_theirs(tmp_path, capsys):
    """`sft eval` of a checkpoint of the user's own Trainer run, written beside it, marks that folder as sft's; its
    checkpoint-N and runs/ folders were then taken for a killed sft run's, and `sft train --overwrite_output_dir`
    deleted them (7 files of checkpoint-500 and runs/ lost, exit 0)."""
    out = tmp_path / "hf_run"
    shutil.copytree(EMBEDDED_MODEL, out / "checkpoint-500")
    (out / "runs").mkdir()
    (out / "runs" / "events.out.tfevents").write_bytes(b"tensorboard")
    before = snapshot(out / "checkpoint-500"), snapshot(out / "runs")
    assert run("eval", recipe(tmp_path, out), "--model_name_or_path", str(out / "checkpoint-500")) == 0
    assert rundir.foreign_entries(out) == ["checkpoint-500", "runs"]
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 2
    assert "checkpoint-500, runs" in capsys.readouterr().err
    assert (snapshot(out / "checkpoint-500"), snapshot(out / "runs")) == before


def test_a_users_checkpoint_folder_in_a_finished_run_is_theirs_its_own_checkpoints_are_sft_s(tmp_path, capsys):
    """Any checkpoint-N folder of a training run counted as sft's (a killed run never listed them): a model the user
    put in RUN/checkpoint-99 was deleted by --overwrite_output_dir (exit 0). Each checkpoint is recorded now as it is
    moved into place, so the run's own are still replaced and resumed from, and the user's is refused."""
    out = tmp_path / "run"
    path = recipe(tmp_path, out)
    saving = ["--save_strategy", "steps", "--save_steps", "1", "--max_steps", "2"]
    assert run("train", path, *saving) == 0
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert rundir.foreign_entries(out) == []
    assert run("train", path, *saving, "--max_steps", "3", "--resume_from_checkpoint", "true") == 0  # its own
    assert (out / "checkpoint-3").is_dir() and rundir.foreign_entries(out) == []
    shutil.copytree(EMBEDDED_MODEL, out / "checkpoint-99")
    before = snapshot(out / "checkpoint-99")
    assert run("train", path, *saving, "--overwrite_output_dir", "true") == 2
    assert "checkpoint-99" in capsys.readouterr().err
    assert snapshot(out / "checkpoint-99") == before


def test_overwrite_never_deletes_the_model_the_run_trains_from(tmp_path, capsys):
    """Continuing a run in its own folder (--model_name_or_path RUN --output_dir RUN --overwrite_output_dir true)
    deleted the model being trained from before the new one was saved: a run that failed or was killed left
    neither."""
    out = tmp_path / "run"
    assert run("train", recipe(tmp_path, out)) == 0
    before = snapshot(out)
    assert run("train", recipe(tmp_path, out), "--model_name_or_path", str(out), "--overwrite_output_dir", "true") == 2
    err = capsys.readouterr().err
    assert f"model_name_or_path {out} is in output_dir {out}" in err and "Traceback" not in err
    assert snapshot(out) == before



def test_a_run_killed_after_saving_its_model_owns_it(tmp_path, monkeypatch):
    """The final model and results were recorded only once the whole run ended: a run killed in its final evaluation
    (which can be long: generation) left config.json, model.safetensors, the tokenizer, train_results.json ...
    unrecorded, and a rerun with --overwrite_output_dir was refused as if they were the user's files."""
    out, seen = tmp_path / "run", []

    def killed(*args, **kwargs):
        seen.append(rundir.foreign_entries(out))  # as a SIGKILL here would leave the folder
        raise SystemExit(9)

    monkeypatch.setattr(transformers.Trainer, "evaluate", killed)  # only the final one: eval_strategy is no
    with pytest.raises(SystemExit):
        run("train", recipe(tmp_path, out))
    assert (out / "model.safetensors").exists() and seen == [[]] and rundir.foreign_entries(out) == []
    monkeypatch.undo()
    (out / "notes.md").write_text("mine\n")  # control: a user's file still is theirs
    assert rundir.foreign_entries(out) == ["notes.md"]
    (out / "notes.md").unlink()
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 0


def test_what_a_kill_mid_staged_write_leaves_is_sfts_a_users_tmp_file_is_not(tmp_path, capsys):
    """sft writes sft_run.json and predictions.jsonl as NAME.tmp, then renames them: a kill in between left NAME.tmp,
    taken for a user's file, and the rerun was refused ("holds files sft did not write ...: sft_run.json.tmp")."""
    new, out = tmp_path / "new", tmp_path / "run"
    new.mkdir()
    (new / "sft_run.json.tmp").write_text('{"written_by": "sf')  # killed in the first record of a new run
    assert rundir.foreign_entries(new) == []
    assert run("train", recipe(tmp_path, out)) == 0
    leftovers = ["sft_run.json.tmp", "predictions.jsonl.tmp", "test_predictions.jsonl.tmp"]
    for name in leftovers:
        (out / name).write_text("{}\n")
    assert rundir.foreign_entries(out) == []
    rundir.claim(out)
    assert not set(leftovers) & set(rundir.read_manifest(out))  # never recorded as finished files
    (out / "notes.tmp").write_text("mine\n")  # control: a user's own .tmp file is theirs
    assert rundir.foreign_entries(out) == ["notes.tmp"]
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 2
    assert "notes.tmp" in capsys.readouterr().err
    (out / "notes.tmp").unlink()
    assert run("train", recipe(tmp_path, out), "--overwrite_output_dir", "true") == 0
    assert not any((out / name).exists() for name in leftovers) and rundir.foreign_entries(out) == []


SAVING = ["--save_strategy", "steps", "--save_steps", "1", "--save_total_limit", "1"]


def start_training(command: list[str], out: Path) -> subprocess.Popen:
    """Start a run that trains (and saves every step) until killed; returns once its first checkpoint exists."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this checkout's sft first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    proc = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while get_last_checkpoint(str(out)) is None if out.is_dir() else True:
        if proc.poll() is not None or time.time() > deadline:
            kill_job(proc)
            pytest.fail(f"the first run never saved a checkpoint: {proc.stderr.read()[-3000:]}")
        time.sleep(0.1)
    return proc


def kill_job(proc: subprocess.Popen) -> None:
    """SIGKILL the run and every process it started, and wait until they are gone."""
    job = [*descendants(proc.pid), proc.pid]
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    deadline = time.time() + 60
    while any(Path(f"/proc/{pid}").exists() for pid in job) and time.time() < deadline:  # until init reaps them
        time.sleep(0.05)


@pytest.mark.multiprocess
def test_a_second_run_into_a_live_runs_folder_is_refused_its_resume_goes_ahead_once_it_is_killed(tmp_path, capsys):
    """Nothing stopped two runs writing one output_dir: a resume started while the run still trained (its launcher
    killed, its process living on) loaded the checkpoint and wrote its model into the live run's folder (exit 0)."""
    out = tmp_path / "run"
    path = recipe(tmp_path, out)
    proc = start_training([sys.executable, "-m", "sft", "train", path, *SAVING, "--max_steps", "100000"], out)
    try:
        checkpoint = get_last_checkpoint(str(out))
        for argv in (["train", path, *SAVING, "--resume_from_checkpoint", "true"],
                     ["eval", path, "--model_name_or_path", checkpoint]):
            assert run(*argv) == 2
            err = capsys.readouterr().err
            assert f"output_dir {out} is being written by another sft run (pid {proc.pid} on " \
                   f"{socket.gethostname()}), still running." in err and "Traceback" not in err
        assert proc.poll() is None  # the live run goes on
    finally:
        kill_job(proc)
    step = int(Path(get_last_checkpoint(str(out))).name.split("-")[1])  # the killed run's lock went with it
    assert run("train", path, *SAVING, "--max_steps", str(step + 1), "--resume_from_checkpoint", "true") == 0
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == step + 1
    assert not (out / rundir.LOCK).exists() and rundir.foreign_entries(out) == []


@pytest.mark.multiprocess
def test_a_two_process_run_is_locked_by_its_main_process_alone(tmp_path, capsys):
    """Under torchrun the process that writes the run (rank 0) holds the lock: rank 1 trains beside it, and a second
    run is refused naming rank 0's process."""
    out = tmp_path / "run"
    path = recipe(tmp_path, out)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "sft",
               "train", path, *SAVING, "--max_steps", "100000"]
    proc = start_training(command, out)
    try:
        workers = descendants(proc.pid)
        same_batch = ["--gradient_accumulation_steps", "2"]  # one process resuming two's rows per step
        assert run("train", path, *SAVING, *same_batch, "--resume_from_checkpoint", "true") == 2
        err = capsys.readouterr().err
        assert "is being written by another sft run (pid " in err, err
        holder = int(err.split("(pid ")[1].split()[0])
        assert holder in workers and holder == json.loads((out / rundir.LOCK).read_text())["pid"]
        assert proc.poll() is None and all(Path(f"/proc/{pid}").exists() for pid in workers)  # both ranks train on
    finally:
        kill_job(proc)
    rundir.hold(out)  # free again once the job is gone
    rundir.release(out)
    assert not (out / rundir.LOCK).exists()


def test_sft_eval_holds_its_output_dir_until_its_results_are_written(tmp_path, monkeypatch):
    """sft eval looked for a live run only at its start: a training run (or another eval) started into the folder
    while it evaluated was let in, and both wrote there. Its process now holds the lock until it ends."""
    out = tmp_path / "run"
    path = recipe(tmp_path, out)
    assert run("train", path) == 0
    seen = []
    save_metrics = transformers.Trainer.save_metrics

    def probed(self, *args, **kwargs):  # the last thing sft eval does: write eval_results.json
        seen.append(locked_by_another_process(out))
        return save_metrics(self, *args, **kwargs)

    monkeypatch.setattr(transformers.Trainer, "save_metrics", probed)
    assert run("eval", path, "--model_name_or_path", str(out), "--overwrite_output_dir", "true") == 0
    assert seen == [True]
    assert not locked_by_another_process(out) and not (out / rundir.LOCK).exists()
    assert run("eval", path, "--output_dir", str(tmp_path / "nothing"), "--eval_split_size", "0") == 2
    assert not (tmp_path / "nothing").exists()  # a refused eval leaves no folder behind


def test_a_file_system_without_locks_trains_unprotected_with_a_warning(tmp_path, monkeypatch, caplog):
    """Some NFS mounts refuse flock (ENOLCK): the run must go on as before the lock, not end in a traceback."""
    def unsupported(path):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(rundir, "_lock", unsupported)  # not fcntl.flock itself: the datasets cache locks with it
    out = tmp_path / "run"
    assert run("train", recipe(tmp_path, out)) == 0
    assert "cannot be locked against another sft run writing there at once" in caplog.text
    assert rundir.foreign_entries(out) == [] and (out / "model.safetensors").exists()
