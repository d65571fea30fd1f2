"""Atomic checkpoints and clean interruption."""

import json
import os
import shutil
import signal
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from safetensors import safe_open
from transformers import TrainerCallback, TrainerState

from sft import SFTConfig, SFTTrainer, load_recipe, rundir
from sft.cli.main import main
from sft.errors import SFTError
from sft.training.checkpoints import (
    BATCH_KEY,
    LOSS_KEY,
    CheckpointStaging,
    check_same_batch,
    is_resumable,
    staging_root,
)

from conftest import REPO, make_gemma3, make_llama


def toy_data(n: int = 32) -> datasets.Dataset:
    g = torch.Generator().manual_seed(0)
    rows = []
    for _ in range(n):
        ids = torch.randint(5, 300, (12,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * 4 + ids[4:]})
    return datasets.Dataset.from_list(rows)


def make_trainer(tokenizer, out, **overrides) -> SFTTrainer:
    args = SFTConfig(**{"output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 6,
                        "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-3, "report_to": "none",
                        "seed": 0, **overrides})
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


def saved(folder: Path, *entries: str) -> Path:
    """A folder holding trainer_state.json and `entries` (a trailing / makes a folder)."""
    folder.mkdir(parents=True)
    (folder / "trainer_state.json").write_text("{}")
    for entry in entries:
        (folder / entry).mkdir() if entry.endswith("/") else (folder / entry).write_bytes(b"")
    return folder


@pytest.mark.parametrize("main_process", [True, False])
def test_every_rank_finds_the_best_checkpoint_where_it_was_promoted(tmp_path, main_process):
    """The Trainer records the best checkpoint under the staging folder; the main process renames it into place. Other
    ranks kept the staging path, gone by the end of training: with load_best_model_at_end a ZeRO-3 run failed on rank 1
    ("Can't find a valid checkpoint at .../.staging-2/checkpoint-2"), and under DDP rank 1 kept its last weights, so
    the final eval mixed two models (10.00 against the best checkpoint's 11.71)."""
    staged = staging_root(tmp_path, 2) / "checkpoint-2"
    staged.mkdir(parents=True)
    state = TrainerState(global_step=2, best_model_checkpoint=str(staged))
    args = SimpleNamespace(should_save=main_process, save_total_limit=None)
    CheckpointStaging(SimpleNamespace(wait_for_everyone=lambda: None)).finish(str(tmp_path), state, args)
    assert state.best_model_checkpoint == str(tmp_path / "checkpoint-2")
    assert (tmp_path / "checkpoint-2").is_dir() == main_process  # only the main process renames


@pytest.mark.parametrize("optimizer", ["optimizer.pt", "optimizer.bin", "optimizer_0/", "global_step3/"])
def test_a_checkpoint_with_optimizer_state_resumes(tmp_path, optimizer):
    # the Trainer's, accelerate's (FSDP full / sharded) and DeepSpeed's optimizer state
    assert is_resumable(saved(tmp_path / "checkpoint-3", "model.safetensors", optimizer))


def test_a_run_folder_is_not_a_checkpoint(tmp_path):
    assert not is_resumable(saved(tmp_path / "done", "model.safetensors", "training_args.bin"))  # a finished run
    assert not is_resumable(tmp_path / "done" / "missing")
    killed = tmp_path / "killed"
    saved(killed / "checkpoint-3", "optimizer.pt")
    assert not is_resumable(killed)


def resume_error(tmp_path, tiny_model_dir, capsys, resume: Path, out: Path) -> str:
    """sft train's one-line error for --resume_from_checkpoint `resume` (exit 2, nothing written)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {REPO / 'tests/bad_inputs/good.json'}\n"
                      "max_steps: 1\nreport_to: none\n")
    assert main(["train", str(recipe), "--output_dir", str(out), "--resume_from_checkpoint", str(resume)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.split("sft: error:")[1].strip().splitlines()) == 1
    return err


def test_resuming_from_a_killed_runs_folder_names_its_newest_checkpoint(tmp_path, tiny_model_dir, capsys):
    killed = tmp_path / "killed"
    for step in (2, 4):
        saved(killed / f"checkpoint-{step}", "optimizer.pt")
    err = resume_error(tmp_path, tiny_model_dir, capsys, killed, tmp_path / "new")
    assert (f"{killed} is a run folder, not a checkpoint. Resume from its newest checkpoint with "
            f"--resume_from_checkpoint {killed / 'checkpoint-4'}, or continue that run in its own folder with "
            f"--output_dir {killed} --resume_from_checkpoint true") in err
    assert not (tmp_path / "new").exists()


def test_resuming_from_a_finished_runs_folder_is_refused_not_restarted(tmp_path, tiny_model_dir, capsys):
    done = saved(tmp_path / "done", "model.safetensors")
    err = resume_error(tmp_path, tiny_model_dir, capsys, done, tmp_path / "new")
    assert f"{done} holds no optimizer state and no checkpoint-N folder" in err
    assert f"pass --model_name_or_path {done} instead" in err


def test_resume_true_needs_optimizer_state_in_the_newest_checkpoint(tmp_path, tiny_model_dir, capsys):
    out = tmp_path / "run"
    saved(out / "checkpoint-2", "optimizer.pt")
    saved(out / "checkpoint-4", "model.safetensors")  # save_only_model: weights and state, no optimizer
    rundir.claim(out)  # an earlier sft run's folder
    err = resume_error(tmp_path, tiny_model_dir, capsys, Path("true"), out)
    assert f"{out / 'checkpoint-4'} holds no optimizer state" in err


@pytest.fixture(scope="module")
def checkpoint_of_4_rows(tmp_path_factory, tokenizer) -> Path:
    """checkpoint-2 of a run at 4 rows per optimizer step (micro-batch 4, no accumulation, one process)."""
    out = tmp_path_factory.mktemp("run")
    trainer = make_trainer(tokenizer, out)
    trainer.args.max_steps = 2
    trainer.train()
    return out / "checkpoint-2"


def test_a_checkpoint_records_the_rows_per_optimizer_step(checkpoint_of_4_rows):
    state = json.loads((checkpoint_of_4_rows / "trainer_state.json").read_text())
    assert state["stateful_callbacks"][BATCH_KEY] == {
        "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1, "processes": 1}


@pytest.mark.parametrize("micro, accumulation", [(4, 1), (2, 2), (1, 4)])
def test_a_resume_at_the_same_rows_per_step_goes_ahead(checkpoint_of_4_rows, tmp_path, micro, accumulation):
    check_same_batch(checkpoint_of_4_rows, SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                                                     gradient_accumulation_steps=accumulation))


@pytest.mark.parametrize("micro, accumulation, fix", [
    (2, 1, "Resume with --gradient_accumulation_steps 2 to take 4 rows a step"),
    (4, 2, "Resume with --gradient_accumulation_steps 1 to take 4 rows a step"),
    (3, 1, "Resume with per_device_train_batch_size, gradient_accumulation_steps and the process count to take 4")])
def test_a_resume_at_other_rows_per_step_is_refused(checkpoint_of_4_rows, tmp_path, micro, accumulation, fix):
    # the Trainer skips already-trained rows by counting steps at the new size: some trained twice or never
    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=micro,
                       gradient_accumulation_steps=accumulation)
    with pytest.raises(SFTError) as error:
        check_same_batch(checkpoint_of_4_rows, config)
    assert (f"was trained on 4 rows per optimizer step (per_device_train_batch_size 4 x gradient_accumulation_steps 1 "
            f"x processes 1), and this run takes {micro * accumulation} ") in str(error.value)
    assert fix in str(error.value)


def test_a_group_by_length_resume_on_another_process_count_is_refused(tmp_path):
    """The same rows per step on one process as on two, but group_by_length orders rows in groups of 50 x each
    process's rows per step: a run started on 2 processes and resumed on 1 trained other rows."""
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    shape = {"gradient_accumulation_steps": 2, "per_device_train_batch_size": 2, "processes": 2}
    (folder / "trainer_state.json").write_text(json.dumps({"stateful_callbacks": {BATCH_KEY: shape}}))
    config = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=4,
                       train_sampling_strategy="group_by_length")
    with pytest.raises(SFTError) as error:
        check_same_batch(folder, config)
    assert str(error.value) == (
        f"resume_from_checkpoint: {folder} was trained with train_sampling_strategy group_by_length on "
        "per_device_train_batch_size 2 x gradient_accumulation_steps 2 x processes 2, and this run takes "
        "per_device_train_batch_size 2 x gradient_accumulation_steps 4 x processes 1. group_by_length orders rows in "
        "groups of 50 x per_device_train_batch_size x gradient_accumulation_steps, so the resumed run would train "
        "other rows than the run it continues. Resume with the checkpoint's per_device_train_batch_size, "
        f"gradient_accumulation_steps and process count, or start a new run from its weights with "
        f"--model_name_or_path {folder}.")
    check_same_batch(folder, SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                       gradient_accumulation_steps=4))  # random order: the same rows each step


def test_a_group_by_length_resume_at_the_same_rows_per_process_goes_ahead(checkpoint_of_4_rows, tmp_path):
    check_same_batch(checkpoint_of_4_rows, SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                                     gradient_accumulation_steps=2,
                                                     train_sampling_strategy="group_by_length"))


def test_sft_train_refuses_a_resume_at_other_rows_per_step_before_loading(checkpoint_of_4_rows, tmp_path,
                                                                          tiny_model_dir, capsys):
    err = resume_error(tmp_path, tiny_model_dir, capsys, checkpoint_of_4_rows, tmp_path / "new")
    assert "this run takes 8 (per_device_train_batch_size 8 x gradient_accumulation_steps 1 x processes 1)" in err
    assert not (tmp_path / "new").exists()


@pytest.mark.parametrize("micro, accumulation, exact", [(2, 2, True), (8, 1, False)])
def test_only_a_resume_at_the_same_rows_per_step_equals_the_uninterrupted_run(tmp_path, tokenizer, micro,
                                                                              accumulation, exact):
    """Why the rule: at 4 rows a step split another way the resumed run ends where the uninterrupted one does; at 8
    it skips the wrong rows (the Trainer's own resume, which check_same_batch stops sft train from reaching)."""
    reference = make_trainer(tokenizer, tmp_path / "reference")
    reference.train()
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", out / "checkpoint-2")
    resumed = make_trainer(tokenizer, out, per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    gap = max((a - b).abs().max().item() for a, b in zip(reference.model.parameters(), resumed.model.parameters()))
    assert (gap < 1e-6) == exact, gap


@pytest.mark.parametrize("logging_steps", [1, 4, 500])
def test_a_resumed_runs_train_loss_is_the_whole_runs(tmp_path, tokenizer, logging_steps):
    """The Trainer's train_loss of a resumed run averaged the steps since the resume only; sft carries the sum of
    the earlier steps' losses in the checkpoint (logged or not yet logged when it was saved)."""
    reference = make_trainer(tokenizer, tmp_path / "reference", logging_steps=logging_steps)
    expected = reference.train().training_loss
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", out / "checkpoint-2")
    resumed = make_trainer(tokenizer, out, logging_steps=logging_steps)
    assert resumed.train(resume_from_checkpoint=str(out / "checkpoint-2")).training_loss == pytest.approx(expected,
                                                                                                           rel=1e-6)
    steps_since = make_trainer(tokenizer, tmp_path / "since", logging_steps=logging_steps)  # the Trainer's own rule
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", tmp_path / "since" / "checkpoint-2")
    state = json.loads((tmp_path / "since" / "checkpoint-2" / "trainer_state.json").read_text())
    state["stateful_callbacks"].pop(LOSS_KEY)  # a checkpoint from before sft kept the sum
    (tmp_path / "since" / "checkpoint-2" / "trainer_state.json").write_text(json.dumps(state))
    assert steps_since.train(resume_from_checkpoint=str(tmp_path / "since" / "checkpoint-2")).training_loss != (
        pytest.approx(expected, rel=1e-4))


@pytest.mark.parametrize("patience, steps", [(2, 3), (None, 6)])
def test_early_stopping_stops_after_patience_evaluations_without_improvement(tmp_path, tokenizer, patience, steps):
    # learning rate 0: every evaluation's loss equals the first, so none improves on the best
    config = load_recipe({"output_dir": str(tmp_path), "per_device_train_batch_size": 4, "max_steps": 6,
                          "learning_rate": 0.0, "eval_strategy": "steps", "eval_steps": 1, "save_strategy": "no",
                          "report_to": "none", "early_stopping_patience": patience,
                          "eval_split_size": 0.1})  # (the eval data is given to the trainer below)
    assert config.metric_for_best_model == ("loss" if patience else None)  # the eval loss unless told otherwise
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                         train_dataset=toy_data(), eval_dataset=toy_data(8))
    trainer.train()
    assert trainer.state.global_step == steps


def test_early_stopping_without_evaluations_is_refused():
    with pytest.raises(SFTError, match="early_stopping_patience is 3, which stops training when evaluations stop "
                                       "improving, but eval_strategy is 'no'"):
        load_recipe({"early_stopping_patience": 3})


def test_early_stopping_resumes_its_count_of_evaluations_without_improvement(tmp_path, tokenizer):
    """Patience 3 on unchanging eval losses stops at step 4; resumed from checkpoint-2 (one evaluation without
    improvement so far) it must stop there too, not count from 0 and stop at step 5."""
    def trainer(out):
        config = load_recipe({"output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 8,
                              "learning_rate": 0.0, "eval_strategy": "steps", "eval_steps": 1, "save_steps": 1,
                              "report_to": "none", "early_stopping_patience": 3, "eval_split_size": 0.1})
        return SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                          train_dataset=toy_data(), eval_dataset=toy_data(8))

    uninterrupted = trainer(tmp_path / "reference")
    uninterrupted.train()
    assert uninterrupted.state.global_step == 4
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", out / "checkpoint-2")
    resumed = trainer(out)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert resumed.state.global_step == 4


def best_loading_trainer(tokenizer, out, **overrides) -> SFTTrainer:
    """Evaluates and saves every 2 steps and loads the best checkpoint at the end; greater_is_better on a falling
    eval loss makes the first checkpoint the best, so the best is not the last."""
    config = load_recipe({"output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 6,
                          "learning_rate": 1e-2, "eval_strategy": "steps", "eval_steps": 2, "save_steps": 2,
                          "load_best_model_at_end": True, "metric_for_best_model": "loss", "greater_is_better": True,
                          "report_to": "none", "seed": 0, "eval_split_size": 0.1, **overrides})
    return SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                      train_dataset=toy_data(), eval_dataset=toy_data(8))


def test_a_moved_runs_resume_keeps_and_loads_its_best_checkpoint(tmp_path, tokenizer):
    """trainer_state.json names the best checkpoint by the path it was saved at. Resumed after the run folder moved,
    the Trainer forgot it (kept best_metric): no later evaluation became the best, and the final model was the last
    step's weights, not checkpoint-2's."""
    reference = best_loading_trainer(tokenizer, tmp_path / "reference")
    reference.train()
    assert reference.state.best_model_checkpoint == str(tmp_path / "reference" / "checkpoint-2")
    expected = {name: tensor.clone() for name, tensor in reference.model.state_dict().items()}
    moved = tmp_path / "moved"
    for step in (2, 4):  # the run as it was when killed after checkpoint-4, then moved
        shutil.move(tmp_path / "reference" / f"checkpoint-{step}", moved / f"checkpoint-{step}")
    shutil.rmtree(tmp_path / "reference")
    resumed = best_loading_trainer(tokenizer, moved)
    resumed.train(resume_from_checkpoint=True)
    assert resumed.state.best_model_checkpoint == str(moved / "checkpoint-2")
    for name, tensor in resumed.model.state_dict().items():
        assert tensor.equal(expected[name]), name


def test_a_signal_keeps_its_checkpoint_beside_the_best_under_save_total_limit_1(tmp_path, tokenizer):
    """The Trainer's end of training deletes every checkpoint but the best under save_total_limit 1: a SIGTERM at
    step 5 deleted the checkpoint-5 it had just saved (the error still said 'checkpoint saved'), and a resume
    started again from checkpoint-2."""
    trainer = best_loading_trainer(tokenizer, tmp_path, save_total_limit=1)
    trainer.add_callback(SignalAtStep(5, signal.SIGTERM))
    trainer.train()
    assert trainer.interrupted and trainer.state.global_step == 5
    assert trainer.args.save_total_limit == 1 and trainer.args.load_best_model_at_end  # the recipe's, unchanged
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-5"]


def test_a_resumed_runs_speed_counts_the_steps_it_trained(tmp_path, tokenizer):
    """Resumed from checkpoint-2 of 6 steps, a run trains 4 steps: its steps and samples per second (train_results.json,
    the model card) divide those by its runtime. Carrying the loss sum counted all 6 (2.3 steps/s reported for 2 steps
    in 5.2 s, in a real run)."""
    make_trainer(tokenizer, tmp_path / "reference").train()
    out = tmp_path / "resumed"
    shutil.copytree(tmp_path / "reference" / "checkpoint-2", out / "checkpoint-2")
    metrics = make_trainer(tokenizer, out).train(resume_from_checkpoint=str(out / "checkpoint-2")).metrics
    runtime = metrics["train_runtime"]
    assert metrics["train_steps_per_second"] == pytest.approx(4 / runtime, rel=1e-2, abs=2e-3)
    assert metrics["train_samples_per_second"] == pytest.approx(4 * 4 / runtime, rel=1e-2, abs=2e-3)


class PoisonAtStep(TrainerCallback):
    """Makes the weights NaN before `step`: the divergence guard stops there without saving."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        if state.global_step + 1 == self.step:
            with torch.no_grad():
                next(model.parameters()).fill_(float("nan"))


def test_divergence_keeps_the_last_good_checkpoint_beside_the_best_under_save_total_limit_1(tmp_path, tokenizer):
    """A diverged run names its newest checkpoint as the last good one to resume from; under save_total_limit 1 the
    Trainer's end of training had deleted it (checkpoint-4), leaving only the best, checkpoint-2."""
    trainer = best_loading_trainer(tokenizer, tmp_path, save_total_limit=1)
    trainer.add_callback(PoisonAtStep(5))
    trainer.train()
    assert trainer.divergence.bad is not None and trainer.state.global_step == 5
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]


def make_mixtral(vocab_size: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "mixtral", vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, use_cache=False))


@pytest.mark.parametrize("make_model", [make_gemma3, make_mixtral], ids=["gemma3", "mixtral"])
def test_a_model_saved_under_other_names_resumes_and_loads_its_best_from_its_checkpoints(tmp_path, tokenizer,
                                                                                          make_model):
    """transformers 5 saves some models otherwise than their modules: Gemma-3 4B+ `vision_tower.*` for
    `model.vision_tower.*`, Mixtral and Qwen-MoE one tensor per expert for their fused experts. The Trainer's resume
    and load_best_model_at_end loaded their checkpoints with load_state_dict(strict=False), which missed those
    tensors, and went on from the weights it had."""
    def renamed_trainer(out, **overrides) -> SFTTrainer:
        args = SFTConfig(**{"output_dir": str(out), "per_device_train_batch_size": 4, "max_steps": 4,
                            "save_strategy": "steps", "save_steps": 2, "learning_rate": 1e-3, "report_to": "none",
                            "seed": 0, **overrides})
        return SFTTrainer(model=make_model(len(tokenizer)), args=args, processing_class=tokenizer,
                          train_dataset=toy_data(), eval_dataset=toy_data(8) if args.eval_strategy != "no" else None)

    reference = renamed_trainer(tmp_path / "reference")
    reference.train()
    with safe_open(tmp_path / "reference" / "checkpoint-2" / "model.safetensors", "pt") as file:
        assert not set(file.keys()) <= set(reference.model.state_dict())  # not the modules' names
    resumed = renamed_trainer(tmp_path / "reference")
    resumed.train(resume_from_checkpoint=str(tmp_path / "reference" / "checkpoint-2"))
    expected = reference.model.state_dict()
    for name, tensor in resumed.model.state_dict().items():
        assert tensor.equal(expected[name]), name
    best = renamed_trainer(tmp_path / "best", eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                          metric_for_best_model="loss", greater_is_better=True)  # checkpoint-2 is the best
    best.train()
    assert best.state.best_model_checkpoint == str(tmp_path / "best" / "checkpoint-2")
    saved = type(best.model).from_pretrained(tmp_path / "best" / "checkpoint-2").state_dict()  # transformers' reading
    assert any(not tensor.equal(saved[name]) for name, tensor in reference.model.state_dict().items())  # 4 steps moved
    for name, tensor in best.model.state_dict().items():
        assert tensor.equal(saved[name]), name


@pytest.mark.parametrize("processes, warned", [(2, True), (1, False)])
def test_a_resume_on_another_process_count_warns_that_random_streams_differ(tmp_path, caplog, processes, warned):
    """2 processes resumed on 1 at the same rows per step is allowed, but one process cannot replay two ranks'
    dropout streams: a LoRA-dropout run ended 2.2e-3 away from the uninterrupted one, said only at info level."""
    folder = tmp_path / "checkpoint-3"
    folder.mkdir()
    shape = {"gradient_accumulation_steps": 4 // processes, "per_device_train_batch_size": 2, "processes": processes}
    (folder / "trainer_state.json").write_text(json.dumps({"stateful_callbacks": {BATCH_KEY: shape}}))
    with caplog.at_level("WARNING", logger="sft.training.checkpoints"):
        check_same_batch(folder, SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2,
                                           gradient_accumulation_steps=4))
    assert ("random state (dropout, NEFTune noise) cannot be restored" in caplog.text) == warned
