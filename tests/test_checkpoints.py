"""Atomic checkpoints and clean interruption."""

import os
import signal

import datasets
import pytest
import torch
from transformers import TrainerCallback

from sft import SFTConfig, SFTTrainer

from conftest import make_llama


def toy_data(n: int = 32) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(5, 300, (12,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    return datasets.Dataset.from_list(rows)


def make_trainer(tokenizer, out, **overrides) -> SFTTrainer:
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=4, max_steps=6, save_strategy="steps",
                     save_steps=2, learning_rate=1e-3, report_to="none", seed=0, **overrides)
    return SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, train_dataset=toy_data())


def test_checkpoint_broken_mid_save_is_never_resumed_or_rotated_over(tmp_path, tokenizer, monkeypatch):
    trainer = make_trainer(tokenizer, tmp_path, save_total_limit=1)
    original = SFTTrainer._save_rng_state

    def crash_at_step_4(self, output_dir):
        if self.state.global_step == 4:
            raise OSError("disk full (injected)")
        return original(self, output_dir)

    monkeypatch.setattr(SFTTrainer, "_save_rng_state", crash_at_step_4)
    with pytest.raises(OSError, match="injected"):
        trainer.train()
    assert sorted(p.name for p in tmp_path.iterdir() if "checkpoint" in p.name or "staging" in p.name) == [
        ".staging-4", "checkpoint-2"]  # the newest complete checkpoint survived save_total_limit=1
    monkeypatch.setattr(SFTTrainer, "_save_rng_state", original)

    resumed = make_trainer(tokenizer, tmp_path, save_total_limit=1)
    resumed.train(resume_from_checkpoint=True)
    history = resumed.state.log_history
    assert resumed.state.global_step == 6 and not (tmp_path / ".staging-4").exists()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-6"]
    assert history[-1]["step"] == 6


class SignalAtStep(TrainerCallback):
    def __init__(self, step: int, signum: int) -> None:
        self.step, self.signum = step, signum

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step + 1 == self.step:
            os.kill(os.getpid(), self.signum)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_at_the_step_boundary_with_a_checkpoint(tmp_path, tokenizer, signum):
    trainer = make_trainer(tokenizer, tmp_path, save_total_limit=None)
    trainer.args.save_steps = 100
    trainer.add_callback(SignalAtStep(3, signum))
    before = signal.getsignal(signum)
    trainer.train()
    assert trainer.interrupted and trainer.state.global_step == 3
    assert (tmp_path / "checkpoint-3" / "model.safetensors").exists()
    assert trainer.stop_on_signal.exit_code == 128 + signum
    assert signal.getsignal(signum) is before  # handlers restored after training
