"""Proofs 4 and 5 on whole runs: resuming after step k ends bitwise equal to the uninterrupted run, and what a run
saves reloads to the same logits (a LoRA adapter also merges to them)."""

from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoModelForSeq2SeqLM

from sft.check.prove.bench import Bench, exact_mode, weights
from sft.check.prove.result import Proof
from sft.check.prove.sharded import prove_sharded_save
from sft.data.stats import compute_stats
from sft.models.adapters import is_adapter_folder
from sft.models.export import merge_adapter
from sft.training.flows import save_run

STOP_AFTER = 1  # k: the run stops after step k and is resumed to step k + 2
MERGE_TOLERANCE = 1e-4


def run(bench: Bench, name: str, resume: str | None = None, trainer_cls: type | None = None) -> Any:
    """k + 2 steps of the recipe's training (checkpoint every k steps); returns the trainer."""
    recipe = bench.recipe  # its accumulation, on small micro-batches: the proof is about what a checkpoint restores
    config = bench.config(output_dir=str(bench.folder / name), max_steps=STOP_AFTER + 2, save_strategy="steps",
                          save_steps=STOP_AFTER, save_total_limit=None, save_only_model=False,
                          per_device_train_batch_size=min(recipe.per_device_train_batch_size, 2),
                          gradient_accumulation_steps=min(recipe.gradient_accumulation_steps, 2))
    trainer = bench.trainer(config, train_set=bench.train_rows, trainer_cls=trainer_cls)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def uninterrupted(bench: Bench) -> Any:
    """The reference run, shared by the resume and save/load proofs."""
    if "whole" not in bench.runs:
        bench.runs["whole"] = run(bench, "whole")
    return bench.runs["whole"]


def prove_resume(bench: Bench, trainer_cls: type | None = None) -> Proof:
    """Resume a fresh trainer from checkpoint-k of the uninterrupted run; compare every weight after step k + 2."""
    whole = uninterrupted(bench)
    checkpoint = Path(whole.args.output_dir) / f"checkpoint-{STOP_AFTER}"
    resumed = run(bench, "resumed", str(checkpoint), trainer_cls)
    expected, actual = weights(whole.model), weights(resumed.model)
    differ = [k for k in expected if not torch.equal(expected[k], actual[k])]
    dropout = any(isinstance(m, torch.nn.Dropout) and m.p > 0 for m in resumed.model.modules())
    random = ["dropout"] * dropout + ["NEFTune"] * bool(bench.base.neftune_noise_alpha)
    figure = (f"stopped after step {STOP_AFTER}, resumed to step {STOP_AFTER + 2}: "
              f"{len(expected) - len(differ)}/{len(expected)} tensors bitwise equal"
              f" ({whole.args.per_device_train_batch_size} x {whole.args.gradient_accumulation_steps} rows a step;"
              f" randomness after the stop: {', '.join(random) or 'none'})")
    evidence = ", ".join(f"{k} (max |Δ| {(expected[k] - actual[k]).abs().max().item():.2g})" for k in differ[:3])
    return Proof("resume", not differ, figure, f"differ: {evidence}" if differ else "")


def save_like_train(trainer: Any, bench: Bench) -> Path:
    """What `sft train` saves at the end of a run (model or adapter, tokenizer, recipe.yaml, ...)."""
    metrics = {k: v for k, v in trainer.state.log_history[-1].items() if k.startswith("train_")}
    stats = compute_stats(bench.splits[0], bench.base.max_length, 0, 0)
    save_run(trainer, trainer.args, stats, metrics, has_eval=False, formats=str(bench.raw[1]))
    return Path(trainer.args.output_dir)


def prove_save_load(bench: Bench, save: Callable[[Any, Bench], Path] = save_like_train) -> Proof:
    """The saved model (or adapter on its base) reloads to identical logits; an adapter merges to within 1e-4."""
    trainer = uninterrupted(bench)
    folder = save(trainer, bench)
    ids = torch.tensor([bench.splits[0][0]["input_ids"]])
    trained = logits(trainer.model, ids, bench)
    reloaded = bench.model(bench.config(model_name_or_path=str(folder)))  # as `sft train`/`sft eval` load it
    reload_gap = (logits(reloaded, ids, bench) - trained).abs().max().item()
    moved = (logits(bench.model(), ids, bench) - trained).abs().max().item()
    kind = "adapter" if is_adapter_folder(folder) else "model"
    figure = f"saved {kind} reloads: max |Δ logits| {reload_gap:.1e} (training moved them {moved:.1e})"
    passed, evidence = reload_gap == 0 and moved > 0, ""
    if kind == "adapter":
        merged_gap = merged_logits_gap(folder, ids, trained, bench)
        figure += f"; merged vs adapter {merged_gap:.1e}"
        passed = passed and merged_gap <= MERGE_TOLERANCE
    if not passed:
        evidence = (f"the reloaded {kind} computes different logits than the trained one ({reload_gap:.3g})"
                    if moved > 0 else "training changed no logit: nothing was compared")
        evidence += "" if kind == "model" or passed else f"; merge gap {merged_gap:.3g} (limit {MERGE_TOLERANCE})"
    sharded, sharded_figure = prove_sharded_save(bench)
    figure += f"; {sharded_figure}" if sharded_figure else ""
    if sharded is False:
        passed, evidence = False, (evidence + "; " if evidence else "") + sharded_figure
    return Proof("save/load", passed, figure, evidence)


def merged_logits_gap(folder: Path, ids: torch.Tensor, trained: torch.Tensor, bench: Bench) -> float:
    """Merge the adapter as `sft merge` does and compare the plain model's logits with the adapter's."""
    out = merge_adapter(folder, bench.folder / "merged", overwrite=True)
    auto = AutoModelForSeq2SeqLM if bench.encoder_decoder else AutoModelForCausalLM
    return (logits(auto.from_pretrained(out), ids, bench) - trained).abs().max().item()


def logits(model: Any, ids: torch.Tensor, bench: Bench) -> torch.Tensor:
    """Logits of one row, dropout off, with bitsandbytes' exact kernels."""
    exact_mode(model)
    extra = {"decoder_input_ids": ids[:, :8]} if bench.encoder_decoder else {}
    with torch.no_grad():
        return model(input_ids=ids, **extra).logits.float()
