"""A diverged run is a failure: exit 1 within a step of the first non-finite loss, the last good checkpoint kept and
named, no diverged weights saved as the result."""

import re
from pathlib import Path

import pytest
from safetensors.torch import load_file

from sft.cli.main import main

from conftest import REPO


@pytest.fixture
def quickstart(monkeypatch):
    monkeypatch.chdir(REPO)  # the quickstart names data/ relative to the repository
    return str(REPO / "recipes" / "quickstart.yaml")


def test_learning_rate_1000_on_the_quickstart_fails_and_keeps_the_last_good_checkpoint(quickstart, tmp_path,
                                                                                          capsys):
    out = tmp_path / "run"
    code = main(["train", quickstart, "--learning_rate", "1000", "--output_dir", str(out), "--save_strategy",
                 "steps", "--save_steps", "1", "--max_steps", "40", "--eval_strategy", "no"])
    err = capsys.readouterr().err
    assert code == 1, err[-2000:]
    found = re.search(r"Training diverged at step (\d+): .*The last good checkpoint is (\S+);", err)
    assert found, err[-2000:]
    step, checkpoint = int(found[1]), Path(found[2])
    assert step < 40 and checkpoint == out / f"checkpoint-{step - 1}"
    weights = load_file(checkpoint / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())
    assert not (out / "model.safetensors").exists()  # the diverged model is not the run's result
    assert "Traceback" not in err


def test_a_sane_learning_rate_still_succeeds(quickstart, tmp_path):
    """Negative control: the guard does not stop a healthy run."""
    out = tmp_path / "run"
    assert main(["train", quickstart, "--output_dir", str(out), "--max_steps", "3", "--eval_strategy", "no",
                 "--save_strategy", "steps", "--save_steps", "1"]) == 0
    assert (out / "model.safetensors").exists()


def test_the_guard_reads_fsdp2s_dtensor_gradient_norm(tmp_path):
    """Under FSDP2 clip_grad_norm_ returns the norm as a replicated DTensor, which refuses .tolist(): the guard's read
    crashed every FSDP run at the end of its first optimizer step."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate

    from sft.training.divergence import host_values

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        norm = DTensor.from_local(torch.tensor(0.75), init_device_mesh("cpu", (1,)), [Replicate()])
        assert host_values(torch.tensor(1.5), norm) == [1.5, 0.75]
    finally:
        dist.destroy_process_group()
