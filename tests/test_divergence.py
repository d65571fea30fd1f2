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

    from sft.training.divergence import device_values

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        norm = DTensor.from_local(torch.tensor(0.75), init_device_mesh("cpu", (1,)), [Replicate()])
        assert device_values(torch.tensor(1.5), norm).tolist() == [1.5, 0.75]
    finally:
        dist.destroy_process_group()


def deferred_run(tmp_path, tokenizer, deferred: bool, poison_step: int = 3):
    """8 steps saving every 2, the weights made NaN before `poison_step`, the guard reading each step a step later
    (`deferred`, as on a CUDA GPU) or at once."""
    from test_checkpoints import PoisonAtStep
    from test_trainer import toy_dataset

    from sft import SFTConfig, SFTTrainer

    from conftest import make_llama

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=8, learning_rate=1e-3,
                     logging_steps=100, report_to="none", save_strategy="steps", save_steps=2,
                     logging_nan_inf_filter=False)
    trainer = SFTTrainer(model=make_llama(len(tokenizer), seed=1), args=args, processing_class=tokenizer,
                         train_dataset=toy_dataset())
    trainer.divergence.deferred = deferred
    trainer.add_callback(PoisonAtStep(poison_step))
    trainer.train()
    return trainer


@pytest.mark.parametrize("poison_step", [3, 4], ids=["step-without-save", "step-with-save"])
def test_read_a_step_later_the_guard_names_the_diverged_step_and_saves_nothing_after_it(tmp_path, tokenizer,
                                                                                        poison_step):
    """Deferred, a step that saves nothing is judged at the end of the next, which stops training there and cancels
    that step's save; a step that saves is judged at once. Either way the diverged step is named and the newest
    checkpoint is the last good one. Not deferred (the control), training stops at the diverged step itself."""
    trainer = deferred_run(tmp_path / "deferred", tokenizer, True, poison_step)
    assert trainer.divergence.bad[0] == poison_step and trainer.divergence.last_finite[0] == poison_step - 1
    assert trainer.state.global_step == (poison_step + 1 if poison_step == 3 else poison_step)
    assert sorted(p.name for p in (tmp_path / "deferred").glob("checkpoint-*")) == ["checkpoint-2"]
    weights = load_file(tmp_path / "deferred" / "checkpoint-2" / "model.safetensors")
    assert all(t.isfinite().all() for t in weights.values())
    control = deferred_run(tmp_path / "at-once", tokenizer, False, poison_step)
    assert control.divergence.bad[0] == poison_step and control.state.global_step == poison_step


def test_a_non_finite_value_on_another_process_stops_this_one():
    """The count of ranks with a non-finite loss or norm is summed across processes (on the device) before it is
    read: a rank whose own values are finite stops with the others."""
    import torch
    from transformers import TrainerControl

    from sft.training.divergence import DivergenceGuard

    class TwoRanks:  # accelerate's Accelerator as the guard uses it, the other rank's count being 1
        num_processes, device = 2, torch.device("cpu")

        def reduce(self, tensor, reduction):
            assert reduction == "sum"
            return tensor + 1

    guard = DivergenceGuard(TwoRanks(), deferred=True)
    guard.add_loss(torch.tensor(2.5))
    control = TrainerControl()
    guard.on_step_end(None, type("State", (), {"global_step": 1})(), control)
    assert guard.bad is None and not control.should_training_stop  # read a step later
    guard.on_train_end(None, None, control)
    assert guard.bad == (1, "the loss or gradient norm is not finite on another process")
    assert control.should_training_stop
