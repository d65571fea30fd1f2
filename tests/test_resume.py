"""Exact resume: a run SIGKILLed at random steps and resumed ends bitwise equal to an uninterrupted run."""

import contextlib
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import EMBEDDED_MODEL, REPO, descendants, write_json

pytestmark = pytest.mark.slow
MAX_STEPS = 12
MODES = {
    "full": [],
    "lora": ["--use_peft", "true", "--lora_r", "4", "--lora_dropout", "0.1"],
    "packed": ["--packing", "true", "--max_length", "96"],
}


def sft_command(recipe: Path, out: Path, extra: list[str]) -> list[str]:
    return [sys.executable, "-m", "sft", "train", str(recipe), "--output_dir", str(out), *extra]


def run_to_end(command: list[str]) -> None:
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def run_and_kill(command: list[str], out: Path, kill_after: int) -> None:
    """Start training and SIGKILL it as soon as checkpoint-`kill_after` exists: the whole job, torchrun's workers too
    (as a scheduler or the OOM killer ends a job); torchrun starts them in sessions of their own."""
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.time() + 300
    while not (out / f"checkpoint-{kill_after}").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.005)
    job = [*descendants(proc.pid), proc.pid]
    for pid in job:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    while any(Path(f"/proc/{pid}").exists() for pid in job) and time.time() < deadline:  # until init reaps them
        time.sleep(0.05)


def weights(out: Path) -> dict:
    name = "adapter_model.safetensors" if (out / "adapter_model.safetensors").exists() else "model.safetensors"
    return load_file(out / name)


@pytest.fixture
def recipe(tmp_path, tiny_model_dir):
    rows = [{"instruction": f"Add {i} and {i + 3}.", "input": "" if i % 3 else f"{i}, {i + 3}",
             "output": f"{i} plus {i + 3} is {2 * i + 3}."} for i in range(60)]
    data = write_json(tmp_path / "data.json", rows)
    path = tmp_path / "recipe.yaml"
    path.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {data}\nmax_length: 128\n"
                    f"max_steps: {MAX_STEPS}\nper_device_train_batch_size: 4\nlearning_rate: 1.0e-3\n"
                    "save_strategy: steps\nsave_steps: 1\nsave_total_limit: 2\nlogging_steps: 1\nreport_to: none\n"
                    "seed: 7\ndataloader_num_workers: 0\n")
    return path


@pytest.mark.parametrize("mode", sorted(MODES))
def test_killed_and_resumed_run_equals_uninterrupted_run(tmp_path, recipe, mode):
    extra = MODES[mode]
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_to_end(sft_command(recipe, reference, extra))
    kill_points = sorted(random.sample(range(2, MAX_STEPS - 1), 3))
    print(f"{mode}: SIGKILL after checkpoints {kill_points}")
    run_and_kill(sft_command(recipe, resumed, extra), resumed, kill_points[0])
    for point in kill_points[1:]:
        run_and_kill(sft_command(recipe, resumed, [*extra, "--resume_from_checkpoint", "true"]), resumed, point)
    run_to_end(sft_command(recipe, resumed, [*extra, "--resume_from_checkpoint", "true"]))
    expected, actual = weights(reference), weights(resumed)
    assert expected.keys() == actual.keys()
    for name, tensor in expected.items():
        assert tensor.equal(actual[name]), f"{mode}: {name} differs after resume"
    assert logged_trained_tokens(resumed) == logged_trained_tokens(reference)  # the count goes on, not from 0


def logged_trained_tokens(out: Path) -> list[int]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["trained_tokens"] for entry in history if "trained_tokens" in entry]


def torchrun_probe(recipe: Path, out: Path, extra: list[str]) -> list[str]:
    """`sft train` on 2 CPU processes over gloo, each rank recording its batches (tests/batch_probe.py)."""
    probe = Path(__file__).parent / "batch_probe.py"
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(probe),
            "train", str(recipe), "--output_dir", str(out), *extra]


@pytest.mark.multiprocess
def test_two_process_bf16_accumulated_packed_lora_run_resumes_exactly(tmp_path):
    """The run users launch: torchrun over gloo, bf16 autocast on CPU, gradient accumulation, packing, LoRA dropout
    (an RNG state per rank), evaluation each step, the best model loaded at the end and 2 checkpoints kept. Killed
    (every process) right after checkpoint-4 and resumed: each rank trains the rows the uninterrupted run trained
    after step 4, the logs (losses, gradient norms, eval losses) and the last checkpoint are bitwise equal, and
    checkpoint-1 (the best: greater_is_better on eval_loss) survives the rotation and is the final model."""
    if not (EMBEDDED_MODEL / "model.safetensors").exists():
        pytest.skip(f"the embedded model {EMBEDDED_MODEL} is missing (scripts/make_tiny_model.py builds it)")
    rows = json.loads((REPO / "data" / "alpaca_sample.json").read_text())
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model_name_or_path": str(EMBEDDED_MODEL), "dataset": str(write_json(tmp_path / "train.json", rows[:48])),
        "eval_dataset": str(write_json(tmp_path / "eval.json", rows[48:56])), "bf16": True, "use_cpu": True,
        "gradient_accumulation_steps": 2, "packing": True, "max_length": 128, "per_device_train_batch_size": 2,
        "use_peft": True, "lora_r": 4, "lora_dropout": 0.1, "max_steps": 6, "learning_rate": 1.0e-3,
        "eval_strategy": "steps", "eval_steps": 1, "save_strategy": "steps", "save_steps": 1, "save_total_limit": 2,
        "load_best_model_at_end": True, "metric_for_best_model": "eval_loss", "greater_is_better": True,
        "logging_steps": 1, "report_to": "none", "seed": 7}))
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_to_end(torchrun_probe(recipe, reference, []))
    run_and_kill(torchrun_probe(recipe, resumed, []), resumed, 4)
    run_to_end(torchrun_probe(recipe, resumed, ["--resume_from_checkpoint", "true"]))
    for rank in (0, 1):
        trained = [json.loads((out / f"batches-rank{rank}.json").read_text())["batches"] for out in (reference, resumed)]
        assert len(trained[0]) == 12 and trained[1] == trained[0][8:]  # 2 micro-batches a step, steps 5 and 6
    logs = [json.loads((out / "trainer_state.json").read_text())["log_history"] for out in (reference, resumed)]
    assert [[e.get(k) for k in ("step", "loss", "grad_norm", "eval_loss")] for e in logs[1]] == [
        [e.get(k) for k in ("step", "loss", "grad_norm", "eval_loss")] for e in logs[0]]
    assert sorted(p.name for p in resumed.glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-6"]
    for name, tensor in weights(reference / "checkpoint-6").items():
        assert tensor.equal(weights(resumed / "checkpoint-6")[name]), name
    assert all(t.equal(weights(resumed)[k]) for k, t in weights(resumed / "checkpoint-1").items())


@pytest.mark.multiprocess
@pytest.mark.parametrize("processes", [1, 2])
def test_group_by_length_run_resumed_in_a_later_epoch_equals_uninterrupted_run(tmp_path, recipe, processes):
    """group_by_length drew each epoch's order from the global RNG, which a resume restores only after the epoch has
    begun; and under torchrun accelerate's set_epoch does not reach the sampler of a resumed epoch. Resumed 2 steps into
    epoch 1 (60 rows of 1 a step, 2 mega-batches of 50), the last steps trained other rows: weights 3.5e-4 apart on
    one process, 3.7e-4 on two. Every rank must train the rows the uninterrupted run trained."""
    steps = 64 if processes == 1 else 34  # epoch 1 begins at step 60 (30 on 2 processes): resumed 2 steps in
    extra = ["--per_device_train_batch_size", "1", "--train_sampling_strategy", "group_by_length",
             "--max_steps", str(steps), "--save_steps", str(steps - 2)]
    command = sft_command if processes == 1 else torchrun_probe
    reference, resumed = tmp_path / "reference", tmp_path / "resumed"
    run_to_end(command(recipe, reference, extra))
    run_and_kill(command(recipe, resumed, extra), resumed, steps - 2)
    run_to_end(command(recipe, resumed, [*extra, "--resume_from_checkpoint", "true"]))
    expected, actual = weights(reference), weights(resumed)
    assert all(tensor.equal(actual[name]) for name, tensor in expected.items())
    for rank in range(processes if processes > 1 else 0):
        trained = [json.loads((out / f"batches-rank{rank}.json").read_text())["batches"] for out in (reference, resumed)]
        assert trained[1] == trained[0][-2:]
