"""Two processes (DDP over gloo on CPU), started as a launcher starts them: SIGTERM sent to rank 1 only stops both
ranks after the same step with one complete checkpoint, and the dataset is tokenized once, by the main process.

Each process runs `python -m sft train` (tests/count_probe.py adds only a counter of tokenized rows) with the
RANK/WORLD_SIZE/MASTER_* environment torchrun would give it, so each rank's own exit code is visible.
"""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from conftest import REPO, write_json

pytestmark = pytest.mark.multiprocess
PROBE = REPO / "tests" / "count_probe.py"
ROWS = [{"instruction": f"Add {i} and {i + 3}.", "input": "", "output": f"{i} plus {i + 3} is {2 * i + 3}."}
        for i in range(24)]
MAX_STEPS = 200  # far more than the signal lets it reach
TIMEOUT = 240  # a hang (ranks in different collectives) fails here instead of waiting for gloo's 30 minutes


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(recipe: Path, out: Path, logs: Path, extra: list[str]) -> list[subprocess.Popen]:
    """Start both ranks of `sft train` with torchrun's environment; output goes to logs/rank{R}.log."""
    port, procs = free_port(), []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "HF_HUB_OFFLINE": "1", "SFT_COUNT_DIR": str(logs), "HF_DATASETS_CACHE": str(logs.parent / "cache")}
        log = (logs / f"rank{rank}.log").open("a")
        command = [sys.executable, str(PROBE), "train", str(recipe), "--output_dir", str(out), *extra]
        procs.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait(procs: list[subprocess.Popen], logs: Path) -> list[int]:
    """Exit codes of both ranks; kills them and fails if they have not ended within TIMEOUT (a hang)."""
    deadline = time.time() + TIMEOUT
    try:
        return [p.wait(timeout=max(deadline - time.time(), 1)) for p in procs]
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        pytest.fail(f"ranks hung (no exit within {TIMEOUT} s)\n{tail(logs)}")


def tail(logs: Path) -> str:
    return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(logs.glob("rank*.log")))


def tokenized_rows(logs: Path, rank: int) -> int:
    path = logs / f"tokenized-rank{rank}.txt"
    return sum(int(n) for n in path.read_text().split()) if path.exists() else 0


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, tiny_model_dir) -> dict:
    """A 2-process run SIGTERMed on rank 1 (only) once rank 0 has logged a training step."""
    folder = tmp_path_factory.mktemp("signals")
    recipe = folder / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "model_name_or_path": str(tiny_model_dir), "dataset": str(write_json(folder / "data.json", ROWS)),
        # as users run it: float32 master weights under bf16 autocast, the chunked loss; a constant LR so that a run
        # stopped at any step and resumed to N steps follows the schedule of a run to N steps
        "dtype": "float32", "bf16": True, "use_cpu": True, "per_device_train_batch_size": 2, "max_steps": MAX_STEPS,
        "learning_rate": 1e-3, "lr_scheduler_type": "constant", "logging_steps": 1, "save_strategy": "steps",
        "save_steps": 10_000, "report_to": "none", "seed": 0, "dataloader_num_workers": 0}))
    out, logs = folder / "run", folder / "logs"
    logs.mkdir()
    procs = launch(recipe, out, logs, [])
    deadline = time.time() + TIMEOUT
    while "'loss'" not in (logs / "rank0.log").read_text() and time.time() < deadline and procs[0].poll() is None:
        time.sleep(0.05)
    procs[1].send_signal(signal.SIGTERM)
    codes = wait(procs, logs)
    return {"recipe": recipe, "out": out, "logs": logs, "codes": codes}


def test_sigterm_to_one_rank_stops_both_after_the_same_step(interrupted):
    out, logs = interrupted["out"], interrupted["logs"]
    assert interrupted["codes"] == [128 + 15, 128 + 15], tail(logs)
    steps = [re.findall(r"Stopped by SIGTERM at step (\d+)", (logs / f"rank{r}.log").read_text()) for r in (0, 1)]
    assert steps[0] and steps[0] == steps[1], tail(logs)  # both ranks stopped after the same step
    step = int(steps[0][0])
    assert 0 < step < MAX_STEPS
    assert sorted(p.name for p in out.iterdir() if "checkpoint" in p.name or "staging" in p.name) == [
        f"checkpoint-{step}"]
    checkpoint = out / f"checkpoint-{step}"
    for name in ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json",
                 "rng_state_0.pth", "rng_state_1.pth"):  # each rank wrote its RNG state: both were in the save
        assert (checkpoint / name).exists(), name
    assert json.loads((checkpoint / "trainer_state.json").read_text())["global_step"] == step


def test_the_main_process_tokenizes_and_the_other_loads_its_cache(interrupted):
    logs = interrupted["logs"]
    assert tokenized_rows(logs, 0) == len(ROWS)  # the counter sees tokenization where it happens
    assert tokenized_rows(logs, 1) == 0


def test_the_checkpoint_resumes_on_two_processes(interrupted):
    out, logs = interrupted["out"], interrupted["logs"]
    step = json.loads(next(out.glob("checkpoint-*/trainer_state.json")).read_text())["global_step"]
    for path in logs.glob("*.txt"):
        path.unlink()
    end = step + 3
    codes = wait(launch(interrupted["recipe"], out, logs, ["--resume_from_checkpoint", "true",
                                                           "--max_steps", str(end)]), logs)
    assert codes == [0, 0], tail(logs)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    logged = [entry["step"] for entry in history if "loss" in entry]
    assert logged == list(range(1, end + 1))  # steps 1..N from the checkpoint, then N+1.. once each
    assert tokenized_rows(logs, 0) == tokenized_rows(logs, 1) == 0  # both loaded the cache
    # The same 2-process run to `end` steps without the interruption: equal weights, and the whole run's train_loss
    # (a resumed run's used to cover only the steps since the resume)
    whole, whole_logs = out.parent / "uninterrupted", out.parent / "uninterrupted-logs"
    whole_logs.mkdir()
    assert wait(launch(interrupted["recipe"], whole, whole_logs, ["--max_steps", str(end)]), whole_logs) == [0, 0]
    resumed, uninterrupted = load_file(out / "model.safetensors"), load_file(whole / "model.safetensors")
    assert max(float((resumed[k] - uninterrupted[k]).abs().max()) for k in resumed) < 1e-6
    loss = [json.loads((run / "train_results.json").read_text())["train_loss"] for run in (out, whole)]
    assert loss[0] == pytest.approx(loss[1], abs=1e-5)
    checkpoint = next(out.glob("checkpoint-*"))
    assert max(float((resumed[k] - load_file(checkpoint / "model.safetensors")[k]).abs().max()) for k in resumed) > 1e-4


def test_one_process_resuming_the_two_process_checkpoint_is_told_the_accumulation_that_keeps_the_batch(
        interrupted, capsys):
    """Fewer GPUs than the run was started on: 2 rows per step instead of 2 x 2 would replay the wrong rows."""
    from sft.cli.main import main

    out = interrupted["out"]
    before = sorted(p.name for p in out.iterdir())
    assert main(["train", str(interrupted["recipe"]), "--output_dir", str(out), "--resume_from_checkpoint",
                 str(next(out.glob("checkpoint-*")))]) == 2
    error = capsys.readouterr().err
    assert "was trained on 4 rows per optimizer step" in error and "--gradient_accumulation_steps 2" in error
    assert sorted(p.name for p in out.iterdir()) == before
