"""train(): what `sft train` does — validate, tokenize, load, fit, save everything a run promises."""

import contextlib
import json
import logging
import math
from collections.abc import Iterator
from pathlib import Path

import datasets
import transformers
from transformers import PretrainedConfig

from sft import rundir
from sft.config.arguments import SFTConfig
from sft.data.build import Prepared, prepare_splits
from sft.data.describe import training_stats
from sft.data.formats import CHAT_FORMATS
from sft.data.packing import pack_dataset, pack_dataset_with_stats
from sft.data.proven_templates import unproven_template_hint
from sft.data.stats import DataStats
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError, TrainingDiverged, TrainingInterrupted
from sft.evaluation.generation import with_stop_tokens
from sft.evaluation.metrics import check_best_metric, eval_keys, resolve_metrics
from sft.evaluation.predict import read_generation_config
from sft.models.adapters import check_adapter_training
from sft.models.families import check_packing_supported, flattened_batches
from sft.models.hub import push_problem
from sft.models.loading import check_attention, check_loadable, load_model, load_model_config, with_attention
from sft.models.quantization import check_quantized_training
from sft.training.presets import (
    check_launcher,
    evaluation_config,
    prepare_final_save,
    warn_half_precision_masters,
)
from sft.training.recipe import save_recipe, with_model_limits
from sft.training.report import plot_loss, write_model_card
from sft.training.resume import check_resume, check_resumed_data, resume_setting
from sft.training.trainer import SFTMixin, trainer_class

log = logging.getLogger(__name__)
EVAL_FILES = ("eval_results.json", rundir.PREDICTIONS)  # what `sft eval` writes


def train(config: SFTConfig) -> Path:
    """Run a recipe end to end and return its output directory.

    Args:
        config: the validated recipe (see load_recipe).
    """
    try:
        return run_training(config)
    finally:  # the output_dir lock its main process took (check_before_loading), however the run ends
        rundir.release(Path(config.output_dir))


def run_training(config: SFTConfig) -> Path:
    """train(), with output_dir locked (check_before_loading) by the process that writes it."""
    resume = resume_setting(config.resume_from_checkpoint)
    config = check_before_loading(config, resume)
    tokenizer = load_tokenizer(config)
    with config.main_process_first(desc="tokenizing"):  # the main process tokenizes; the others load its cache
        train_data, eval_data = prepare_splits(config, tokenizer)  # data errors surface before the model loads
    log.info("Data formats: %s", "; ".join(map(str, train_data.sources)))
    hint_unproven_template([s.format for s in train_data.sources], tokenizer)
    stats = training_stats(train_data, config)  # what `sft data` reports (packing stats are added below)
    train_set, eval_set = apply_packing(config, train_data.dataset, eval_data.dataset if eval_data else None, stats)
    check_resumed_data(config, resume, train_set)
    log.info("\n%s", stats.table("Training data"))
    warn_eval_rows(eval_data, config.max_length)
    transformers.set_seed(config.seed)  # new embedding rows are sampled: make them reproducible
    model = load_model(config, tokenizer)
    with_stop_tokens(model.generation_config, tokenizer)  # saved with each checkpoint and the final model
    warn_half_precision_masters(model, config)
    trainer = trainer_class(model)(model=model, args=config, processing_class=tokenizer, train_dataset=train_set,
                                   eval_dataset=eval_set)
    if eval_set is not None and eval_set is not eval_data.dataset and trainer.generation_eval is not None:
        trainer.generation_eval.use_offsets_of(eval_data.dataset)  # the packed eval set no longer carries them
    output_dir = prepare_output_dir(config, resume, trainer)
    if trainer.is_world_process_zero():
        write_run_facts(config, stats, output_dir)
        if config.push_to_hub:
            trainer.add_callback(ClaimHubCopies(output_dir))
    result = trainer.train(resume_from_checkpoint=resume)
    if trainer.is_world_process_zero():
        rundir.claim(output_dir)  # checkpoints so far are sft's, however the run ends
    if trainer.divergence.bad is not None:
        raise TrainingDiverged(trainer.divergence.message(config))
    if trainer.interrupted:
        raise TrainingInterrupted(
            f"Stopped by {trainer.stop_on_signal.signal_name} at step {trainer.state.global_step}; checkpoint saved in "
            f"{output_dir}. Resume with the same command plus --resume_from_checkpoint true.",
            trainer.stop_on_signal.exit_code)
    if config.early_stopping_patience is not None and trainer.state.global_step < trainer.state.max_steps:
        log.warning("Stopped early at step %d of %d: eval %s did not improve on %.4g for %d evaluations.",
                    trainer.state.global_step, trainer.state.max_steps, config.metric_for_best_model,
                    trainer.state.best_metric, config.early_stopping_patience)
    try:
        save_run(trainer, config, stats, result.metrics, has_eval=eval_data is not None,
                 formats="; ".join(map(str, train_data.sources)))
    finally:  # what the final save wrote is sft's, however it ends
        if trainer.is_world_process_zero():
            rundir.claim(output_dir)
    return output_dir


class ClaimHubCopies(transformers.TrainerCallback):
    """Record, after each checkpoint, the files push_to_hub's checkpoint push copied into output_dir (the model,
    tokenizer, training_args.bin): unrecorded, a push_to_hub run killed after its first checkpoint left 7 files
    counted as the user's, and its resume (or --overwrite_output_dir) was refused."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_save(self, args: SFTConfig, state: transformers.TrainerState, control: transformers.TrainerControl,
                **kwargs: object) -> None:
        rundir.claim(self.out)


def warn_eval_rows(eval_data: Prepared | None, max_length: int) -> None:
    """Say how many eval rows have nothing to score within max_length (they are left out of every evaluation), or
    else how many are cut to it."""
    warning = eval_data.eval_warning(max_length) if eval_data is not None else None
    if warning:
        log.warning(warning)


def hint_unproven_template(formats: list[str], tokenizer: transformers.PreTrainedTokenizerBase) -> None:
    """One line suggesting `sft check --prove` for a chat template that has not passed it on this machine."""
    hint = unproven_template_hint(tokenizer.chat_template) if set(formats) & set(CHAT_FORMATS) else None
    if hint:
        log.info(hint)


def apply_packing(config: SFTConfig, train_set: datasets.Dataset, eval_set: datasets.Dataset | None,
                  stats: DataStats) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Pack train (and eval, per eval_packing) data (check_before_loading checked the model keeps them apart)."""
    if not (config.packing or config.packs_eval or config.padding_free):
        return train_set, eval_set
    if config.packing:
        train_set, packed = pack_dataset_with_stats(train_set, config.max_length, config.packing_strategy, config.seed)
        stats.packed_rows, stats.packing_efficiency = packed.packed_rows, packed.packing_efficiency
    if eval_set is not None and config.packs_eval:
        eval_set = pack_dataset(eval_set, config.max_length, config.packing_strategy, config.seed)
    return train_set, eval_set


def check_packing_model(config: SFTConfig) -> None:
    """Refuse packing / padding-free batches for models or attention backends that would mix examples."""
    try:
        # called when some split is packed or padding-free: default_collator flattens those for flash / varlen
        flattened = flattened_batches(config.attn_implementation, config.padding_free, packing=True)
        check_packing_supported(load_model_config(config), config.attn_implementation, flattened=flattened)
    except ValueError as err:
        raise SFTError(str(err)) from None


def check_before_loading(config: SFTConfig, resume: str | bool | None) -> SFTConfig:
    """Fail fast on what needs no data or model: GPU-only flags, a sharded run without a launcher, an adapter folder
    as the model, metric names, max_length, the output folder, the resume target; returns the recipe with max_length
    fitted to the model (fitted_max_length)."""
    problems = [*config.hardware_problems(), push_problem(config.push_to_hub, config.hub_model_id, config.output_dir)]
    if any(problems):
        raise SFTError(next(filter(None, problems)))
    check_launcher(config)
    check_optimizer(config)
    check_quantized_training(config)
    check_attention(config, training=True)
    check_adapter_training(config)
    check_generation_settings(config)
    if config.metric_for_best_model is not None:  # eval_keys calls a user metric function once to learn its keys
        reported = eval_keys(config.metrics, config.predict_with_generate)
        check_best_metric(config.metric_for_best_model, reported, config.predict_with_generate)
    model_config = load_model_config(config) if config.model_name_or_path is not None else None
    if model_config is not None:
        check_loadable(model_config)
    config = with_attention(with_model_limits(config, fitted_max_length(config, model_config)), model_config)
    if config.packing or config.packs_eval or config.padding_free:
        check_packing_model(config)  # reads the model's config only: no need to tokenize the data first
    out = Path(config.output_dir)
    rundir.check_writable(out)
    if config.should_save:  # the process that writes the run's files; the other ranks must not lock it against it
        rundir.hold(out)  # before looking at its files: a live run's are refused as that, not as a user's
    rundir.check_output_dir(out)
    check_resume(out, resume, config)
    if rundir.is_run(out) and not resume and not config.overwrite_output_dir:
        raise SFTError(f"output_dir {out} already holds an sft run. Pass --resume_from_checkpoint true to continue "
                       "it, --overwrite_output_dir true to replace it (only files sft wrote are removed), or choose "
                       "another output_dir.")
    check_inputs_kept(out, resume, config)
    return config


def check_inputs_kept(out: Path, resume: str | bool | None, config: SFTConfig) -> None:
    """--overwrite_output_dir deletes the earlier run before this one saves anything: a model or tokenizer loaded from
    it (continuing a run in its own folder) was gone, and a run that then failed or was killed left neither."""
    if not config.overwrite_output_dir or resume or not rundir.is_run(out):
        return
    for key in ("model_name_or_path", "tokenizer_name_or_path"):
        source = Path(getattr(config, key) or "").expanduser()
        if str(source) != "." and source.exists() and out.resolve() in (source.resolve(), *source.resolve().parents):
            raise SFTError(f"{key} {source} is in output_dir {out}, whose earlier run --overwrite_output_dir would "
                           "delete before this run saves its model. Train into another output_dir.")


def check_generation_settings(config: SFTConfig) -> None:
    """Metric names and the generation_config, before any data or model: a misspelt metric, and a generation_config
    that Seq2SeqTrainer cannot read when it is built (a traceback), failed after tokenizing and loading the model."""
    if config.predict_with_generate:
        resolve_metrics(config.metrics)
    elif config.metrics is not None:  # asked for and silently not reported: only generation gives them predictions
        log.warning("`metrics` (%s) are computed on generated answers: with predict_with_generate false evaluation "
                    "reports the loss only. Pass --predict_with_generate true for them.", ", ".join(config.metrics))
    if config.generation_config is not None:
        read_generation_config(config.generation_config)


def check_optimizer(config: SFTConfig) -> None:
    """An `optim` whose package is not installed (galore_adamw, lomo, schedule_free_adamw, adamw_torch_4bit, ...):
    the Trainer raises its ImportError when it builds the optimizer, after tokenization and model loading."""
    try:
        transformers.Trainer.get_optimizer_cls_and_kwargs(config)
    except (ImportError, ValueError) as err:
        if isinstance(err, ImportError) or "install" in str(err):  # grokadamw's is a ValueError
            name = getattr(config.optim, "value", config.optim)
            raise SFTError(f"optim: {name} needs a package that is not installed. {err}") from None


def fitted_max_length(config: SFTConfig, model_config: PretrainedConfig | None = None) -> int:
    """The max_length a run uses: beyond the model's positions it is refused when the recipe sets it (a warning when
    the model scales RoPE); the default max_length is lowered to the model's positions instead. `model_config`:
    the model's config when the caller has it (sft check, whose own model is a tiny stand-in)."""
    if config.model_name_or_path is None:
        return config.max_length
    model_config = model_config or load_model_config(config)
    positions = getattr(model_config, "max_position_embeddings", None)
    if not isinstance(positions, int) or config.max_length <= positions:
        return config.max_length
    if "max_length" not in config.recipe_keys:
        log.info("max_length: using the model's %d positions (the default %d is longer).", positions, config.max_length)
        return positions
    rope = getattr(model_config, "rope_parameters", None) or getattr(model_config, "rope_scaling", None) or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":  # linear, dynamic, yarn, llama3 ... stretch
        log.warning("max_length=%d is beyond the model's %d positions; relying on its RoPE scaling (%s).",
                    config.max_length, positions, rope.get("rope_type", rope.get("type")))
        return config.max_length
    raise SFTError(f"max_length={config.max_length} is beyond the {positions} positions the model "
                   f"{config.model_name_or_path} has (max_position_embeddings). Set max_length: {positions} or less.")


def prepare_output_dir(config: SFTConfig, resume: str | bool | None, trainer: SFTMixin) -> Path:
    """Create output_dir and mark it as sft's; with overwrite_output_dir (and no resume) the main process removes
    the earlier run's files, and only those (check_before_loading refused folders with anything else)."""
    out = Path(config.output_dir)
    if trainer.is_world_process_zero() and out.is_dir() and config.overwrite_output_dir and not resume:
        removed = rundir.clear_run(out)
        if removed:
            log.warning("overwrite_output_dir: removed the earlier run's %s from %s", rundir.describe(removed), out)
    trainer.accelerator.wait_for_everyone()  # no rank writes before the old run is gone
    out.mkdir(parents=True, exist_ok=True)
    if trainer.is_world_process_zero():
        rundir.claim(out)
    return out


def save_run(trainer: SFTMixin, config: SFTConfig, stats: DataStats, metrics: dict, has_eval: bool,
             formats: str) -> None:
    """Model, tokenizer, results, state, recipe, data stats, loss plot and model card."""
    out = Path(config.output_dir)
    prepare_final_save(trainer)
    # an adapter with its generation_config.json (SFTMixin._save), for sft merge; pushed once all is written (push_run)
    trainer.save_model(str(out), _internal_call=True)
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)
    if trainer.is_world_process_zero():  # the final evaluation can be long: a run killed in it still owns its model
        rundir.claim(out)
    if has_eval:
        eval_metrics = trainer.evaluate()
        trainer.log_metrics("eval", eval_metrics)
        trainer.save_metrics("eval", eval_metrics)
        metrics = {**metrics, **eval_metrics}
    trainer.save_state()
    if not trainer.is_world_process_zero():
        return
    write_run_facts(config, stats, out)
    plot_loss(trainer.state.log_history, out / "loss.png")
    write_model_card(config, metrics, stats.as_dict(), out / "README.md", formats)
    if config.push_to_hub:
        rundir.claim(out)
        push_run(trainer, out)


def push_run(trainer: SFTMixin, out: Path) -> None:
    """Upload the finished run: the Trainer's own push (in save_model) went before the final evaluation and sft's
    model card, so the Hub got transformers' generated card, no eval results and no loss plot; and it sent the lock."""
    trainer._finish_current_push()  # a checkpoint push still running
    log.info("Pushing %s to the Hub repository %s", out, trainer.hub_model_id)
    transformers.trainer.hf_api().upload_folder(
        repo_id=trainer.hub_model_id, folder_path=str(out), commit_message="End of training",
        revision=trainer.args.hub_revision, ignore_patterns=["_*", "checkpoint-*", *rundir.IN_FLIGHT])


def write_run_facts(config: SFTConfig, stats: DataStats, out: Path) -> None:
    """recipe.yaml and data_stats.json, which say how the run trained: its quantization and its prompt format.

    Written when training starts as well as at its end, so the checkpoints of a run killed before its end load as they
    trained: `sft merge` and `sft generate` of a QLoRA checkpoint put the adapter on the 4-bit base (not the
    full-precision one), and prompt an Alpaca run's with the Alpaca prompt, not the tokenizer's chat template.
    """
    save_recipe(config, out / rundir.RECIPE)
    (out / rundir.DATA_STATS).write_text(json.dumps(stats.as_dict(), indent=2) + "\n")
    rundir.claim(out, [rundir.RECIPE, rundir.DATA_STATS])  # sft's, however the run ends


def evaluate(config: SFTConfig) -> dict[str, float]:
    """Teacher-forced loss and perplexity on the recipe's eval set, plus generation metrics and predictions.jsonl
    with predict_with_generate; writes eval_results.json to output_dir, replacing an earlier one only when asked."""
    try:
        return run_evaluation(config)
    finally:  # the output_dir lock its main process took (check_eval_output), however the eval ends
        rundir.release(Path(config.output_dir))


def run_evaluation(config: SFTConfig) -> dict[str, float]:
    """evaluate(), with output_dir locked by the process that writes the results."""
    out = Path(config.output_dir)
    config = evaluation_config(config)
    check_launcher(config, "eval")
    check_eval_output(out, config.overwrite_output_dir, config.model_name_or_path, config.should_save)
    check_generation_settings(config)
    check_attention(config, training=False)
    model_config = load_model_config(config) if config.model_name_or_path is not None else None
    if model_config is not None:
        check_loadable(model_config)
    config = with_attention(with_model_limits(config, fitted_max_length(config, model_config)), model_config)
    tokenizer = load_tokenizer(config)
    with config.main_process_first(desc="tokenizing"):
        _, eval_data = prepare_splits(config, tokenizer)
    if eval_data is None:
        raise SFTError("sft eval needs an eval set: set `eval_dataset`, or `eval_split_size` to hold out rows.")
    warn_eval_rows(eval_data, config.max_length)
    model = load_model(config, tokenizer)
    with untrained_quantized_base():
        trainer = trainer_class(model)(model=model, args=config, processing_class=tokenizer,
                                       eval_dataset=eval_data.dataset)
    metrics = trainer.evaluate()
    metrics["eval_perplexity"] = math.exp(min(metrics["eval_loss"], 700.0))
    out.mkdir(parents=True, exist_ok=True)
    trainer.save_metrics("eval", metrics, combined=False)
    if trainer.is_world_process_zero():
        rundir.claim(out, list(EVAL_FILES))
    return metrics


@contextlib.contextmanager
def untrained_quantized_base() -> Iterator[None]:
    """Build an eval-only Trainer for a 4- or 8-bit base without an adapter: transformers' Trainer refuses such a
    model when it is built ("cannot perform fine-tuning on purely quantized models"), for training's sake, and sft
    eval trains nothing (the quantized base's loss is a QLoRA run's baseline). Training is refused earlier, with
    sft's own message (check_quantized_training)."""
    check = transformers.trainer.validate_quantization_for_training
    transformers.trainer.validate_quantization_for_training = lambda model: None
    try:
        yield
    finally:
        transformers.trainer.validate_quantization_for_training = check


def check_eval_output(out: Path, overwrite: bool, model: str | None, writer: bool = True) -> None:
    """sft eval writes beside a run (or anywhere new); it replaces its own earlier results only with overwrite. Into a
    run's folder it writes only the results of that run's model (or one of its checkpoints): a recipe's base model
    evaluated there would pass for the trained run's results, or replace them. The `writer` process (the main one)
    locks `out` until the eval ends: a training run (or resume) into it meanwhile is refused, as is another eval."""
    rundir.check_writable(out)
    if writer:  # before looking at its files: a live run's (eval of its checkpoint, beside it) are refused as that
        rundir.hold(out)
    evaluated = Path(model).expanduser().resolve() if model else None
    if rundir.is_run(out) and not (evaluated and (evaluated == out.resolve() or out.resolve() in evaluated.parents)):
        raise SFTError(f"output_dir {out} holds an sft run, and sft eval would write the results of {model} there, "
                       f"not of the model trained in it. Evaluate the run with --model_name_or_path {out}, or write "
                       "these results to --output_dir NEW_DIR.")
    present = [name for name in EVAL_FILES if (out / name).exists()]
    foreign = [name for name in present if name in rundir.foreign_entries(out)]
    if foreign:
        raise SFTError(f"output_dir {out} holds {', '.join(foreign)}, which sft did not write. Choose another "
                       "output_dir for the eval results.")
    if present and not overwrite:
        raise SFTError(f"output_dir {out} already holds {', '.join(present)}. Pass --overwrite_output_dir true to "
                       "replace them (nothing else is touched), or --output_dir NEW_DIR to keep them.")
