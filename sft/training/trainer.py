"""SFTTrainer / Seq2SeqSFTTrainer: transformers' trainers with SFT batching and the SFT layer (SFTMixin), which keeps
the Trainer's hooks and hands each concern to the object that owns it: the token loss and the exact eval loss
(sft.training.loss), NEFTune per example (neftune), signals (signals), divergence (divergence), staged checkpoints
(checkpoints), throughput logs (throughput) and generation-based evaluation (sft.evaluation.predict)."""

import contextlib
import copy
import os
from pathlib import Path
from typing import Any

import torch
from peft import PeftModel
from torch import nn
from torch.utils.data import IterableDataset, SequentialSampler
from transformers import (
    EarlyStoppingCallback,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
    Trainer,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.trainer_pt_utils import nested_gather
from transformers.trainer_utils import get_last_checkpoint, has_length

from sft import rundir
from sft.data.collators import TRAINED_TARGETS, HostCount, PaddingFreeCollator, default_collator
from sft.evaluation.predict import GenerationEval
from sft.models.compilation import compile_blocks, repeated_blocks, set_activation_memory_budget
from sft.models.hub import uploads_skipping
from sft.training import checkpoints, sampling
from sft.training.checkpoints import LOSS_KEY, RESUME_KEYS, CheckpointStaging, resume_facts
from sft.training.divergence import DivergenceGuard
from sft.training.inputs import trainer_datasets
from sft.training.loss import EvalTokenSums, TokenLoss
from sft.training.masters import loaded_in_float32, master_weights
from sft.training.neftune import NEFTune
from sft.training.schedule import RunLengthCheck
from sft.training.signals import StopOnSignal
from sft.training.throughput import STATE_KEY, ThroughputLog


def compiles_blocks(model: nn.Module | None, args: Any) -> bool:
    """Whether torch_compile compiles the model's repeated blocks in place (sft.models.compilation) rather than
    accelerate the whole model: on one process or DDP, for a model with repeated blocks. FSDP and DeepSpeed keep
    accelerate's compile, which knows their wrappers."""
    sharded = bool(args.fsdp or args.deepspeed or os.environ.get("ACCELERATE_USE_FSDP", "").lower() == "true"
                   or os.environ.get("ACCELERATE_USE_DEEPSPEED", "").lower() == "true")
    return bool(args.torch_compile and model is not None and not sharded and repeated_blocks(model))


class SFTMixin(sampling.EpochSeededSampling):
    """The SFT layer shared by SFTTrainer and Seq2SeqSFTTrainer: the Trainer's hooks, each delegating to the object
    of one concern, built once per trainer."""

    def __init__(self, model: nn.Module, args: Any, processing_class: PreTrainedTokenizerBase | None = None,
                 data_collator: Any = None, **kwargs: Any) -> None:
        unpacked_eval = kwargs.get("eval_dataset")
        kwargs.update(trainer_datasets(model, args, data_collator, kwargs))
        if data_collator is None and processing_class is not None:
            data_collator = default_collator(processing_class, args)
        self.compiles_blocks = compiles_blocks(model, args)  # read while the Trainer builds its accelerator
        super().__init__(model=model, args=args, processing_class=processing_class,
                         data_collator=data_collator, **kwargs)
        self._init_sft()
        if self.generation_eval is not None and self.eval_dataset is not unpacked_eval:
            self.generation_eval.use_offsets_of(unpacked_eval)  # the packed eval set no longer carries them

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        """The Trainer's accelerator arguments; where sft compiles the blocks, accelerate compiles nothing."""
        args = super()._build_accelerator_args(**kwargs)
        if self.compiles_blocks:
            from accelerate.utils import TorchDynamoPlugin

            args["dynamo_plugin"] = TorchDynamoPlugin(backend="no")
        return args

    def _init_sft(self) -> None:
        budget = getattr(self.args, "activation_memory_budget", None)
        if budget is not None and self.args.torch_compile:  # whoever compiles: sft's blocks or accelerate's model
            set_activation_memory_budget(budget)
        if self.compiles_blocks:
            compile_blocks(self.model, self.args.torch_compile_backend, self.args.torch_compile_mode)
        self.token_loss = TokenLoss(self.model, getattr(self.args, "chunked_loss", True),
                                    self.args.label_smoothing_factor, getattr(self.args, "loss_kernel", "auto"),
                                    self.args.device)
        if self.token_loss.smooths:
            self.label_smoother = None  # sft's own loss applies label smoothing
        self.eval_tokens = EvalTokenSums(self.accelerator)
        pad_id = getattr(self.processing_class, "pad_token_id", None)
        self.throughput = ThroughputLog(self.accelerator.device, pad_id, shifted=not self.token_loss.encoder_decoder)
        # The Trainer's own NEFTune hook scales noise by the padded/packed row length; ours by each example's.
        self.neftune = NEFTune(self.neftune_noise_alpha) if self.neftune_noise_alpha else None
        self.neftune_noise_alpha = None
        self.stop_on_signal = StopOnSignal(self.accelerator)
        self.add_callback(self.stop_on_signal)
        self.divergence = DivergenceGuard(self.accelerator)
        self.add_callback(self.divergence)  # after StopOnSignal: a diverged step is not saved on a signal either
        self.add_callback(RunLengthCheck())
        patience = getattr(self.args, "early_stopping_patience", None)
        self.early_stopping = None if patience is None else EarlyStoppingCallback(
            patience, self.args.early_stopping_threshold)  # its count is saved with each checkpoint
        if self.early_stopping is not None:
            self.add_callback(self.early_stopping)
        self.checkpoint_staging = CheckpointStaging(self.accelerator)
        self.resumed_loss_sum: float | None = None  # the checkpoint's, on resume (see _finalize_training)
        self.resumed_from: Path | None = None  # the checkpoint train() resumes from
        self.zero3_parameters: int | None = None  # full non-embedding parameter count (floating_point_ops)
        self.saves_masters = loaded_in_float32(self.model)  # read before DeepSpeed casts the weights (masters)
        self.masters: dict[str, torch.Tensor] = {}  # gathered by save_model for _save
        generating = isinstance(self.args, Seq2SeqTrainingArguments) and self.args.predict_with_generate
        self.generation_eval = GenerationEval(self.args, self.accelerator, self.eval_dataset) if generating else None

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train with per-example NEFTune and signal handling attached for its duration."""
        if self.is_world_process_zero():
            checkpoints.remove_stale_staging(self.args.output_dir)
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        if resume is True:  # as the Trainer resolves it
            resume = get_last_checkpoint(self.args.output_dir)
        self.resumed_from = Path(resume) if isinstance(resume, (str, os.PathLike)) and resume else None
        noise = contextlib.nullcontext()
        if self.neftune is not None:
            noise = self.neftune.attached(self.accelerator.unwrap_model(self.model).get_input_embeddings())
        with noise, self.stop_on_signal.installed():
            return super().train(*args, **kwargs)

    def _get_dataloader(self, dataset: Any, description: str, batch_size: int, *args: Any, **kwargs: Any) -> Any:
        """The Trainer's dataloader; for the chunked loss its collator also counts trained targets on the host
        (HostCount), so that the loss never waits for the GPU to learn how many there are. Evaluation and prediction
        batch every row, whatever dataloader_drop_last says for training."""
        collator, settings = self.data_collator, self.args
        if self._counts_on_host(dataset):
            self.data_collator = HostCount(collator)
        if not kwargs.get("is_training") and settings.dataloader_drop_last:
            # dataloader_drop_last is for training batches; the Trainer applies it to eval too, which then skipped
            # the last partial batch (21 eval rows in batches of 4: 20 scored on one process, 16 on two).
            self.args = copy.copy(settings)  # a copy: the recipe's own value stays for the training dataloader
            self.args.dataloader_drop_last = False
        try:
            return super()._get_dataloader(dataset, description, batch_size, *args, **kwargs)
        finally:
            self.data_collator, self.args = collator, settings

    def _get_eval_sampler(self, eval_dataset: Any) -> Any:
        """Eval rows in dataset order. train_sampling_strategy group_by_length also length-grouped eval batches, in a
        seeded shuffle, so predictions.jsonl (and predict()'s arrays) no longer followed the eval file's rows."""
        if self.args.train_sampling_strategy != "group_by_length" or not has_length(eval_dataset):
            return super()._get_eval_sampler(eval_dataset)
        return SequentialSampler(eval_dataset) if self.args.world_size <= 1 else None  # the Trainer's other rule

    def _counts_on_host(self, dataset: Any) -> bool:
        # accelerate dispatches batches of iterable datasets from one process, concatenating tensors only
        dispatch = self.accelerator.dataloader_config.dispatch_batches
        dispatched = self.accelerator.num_processes > 1 and (
            dispatch or (dispatch is None and isinstance(dataset, IterableDataset)))
        return self.token_loss.chunked and self.data_collator is not None and not dispatched

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The Trainer's loss (for plain-head causal LMs the model's chunked forward computes it); seq2seq training:
        token-normalised, label-smoothed by sft; eval: also accumulate per-row token sums for the exact eval loss
        (plain cross entropy, whatever loss the Trainer returns)."""
        if TRAINED_TARGETS in inputs and not self.token_loss.chunked:  # only the chunked forward takes it
            inputs = {k: v for k, v in inputs.items() if k != TRAINED_TARGETS}
        training = self._is_training(model)
        if training and not return_outputs and self._seq2seq_loss_applies(inputs):
            across = self.args.average_tokens_across_devices and num_items_in_batch is not None
            return self.token_loss.seq2seq(model, inputs, num_items_in_batch,
                                           self.accelerator.num_processes if across else 1)
        # A copy: the Trainer's LabelSmoother pops "labels" from the dict it gets, and the eval sums need them.
        result = super().compute_loss(model, dict(inputs), return_outputs, num_items_in_batch)
        if not training and return_outputs and "labels" in inputs:
            self.eval_tokens.add(result[1], inputs, shifted=not self.token_loss.encoder_decoder)
        return result

    def floating_point_ops(self, inputs: dict[str, Any]) -> int:
        """The Trainer's 6 x input tokens x non-embedding parameters (total_flos: train_results.json, the model card),
        counting ZeRO-3 parameters at their full size. Partitioned, each rank's module holds an empty tensor outside
        the forward, so the Trainer counted only what stays whole (norms): 1.37e7 against 1.37e10 for the same run on
        one process."""
        main_input = getattr(self.model, "main_input_name", "input_ids")
        if not self.is_deepspeed_enabled or not is_deepspeed_zero3_enabled() or main_input not in inputs:
            return super().floating_point_ops(inputs)
        if self.zero3_parameters is None:  # the model's parameters do not change during a run: count them once
            embeddings = {f"{name}.weight" for name, module in self.model.named_modules()
                          if isinstance(module, nn.Embedding)}
            self.zero3_parameters = sum(getattr(param, "ds_numel", param.numel())
                                        for name, param in self.model.named_parameters() if name not in embeddings)
        return 6 * inputs[main_input].numel() * self.zero3_parameters

    def _is_training(self, model: nn.Module) -> bool:
        """Whether `model` runs a training step. DeepSpeedEngine.train()/eval() switch only the module it wraps and
        leave the engine's own `training` at True: an eval-only run under ZeRO-3 (`sft eval`, where the Trainer
        evaluates through the engine) read as training, and its eval loss fell back to the Trainer's mean of batch
        losses, repeated rows included (2.43 against the exact 2.22)."""
        return self.accelerator.unwrap_model(model).training if self.is_deepspeed_enabled else model.training

    def _seq2seq_loss_applies(self, inputs: dict[str, Any]) -> bool:
        # Every encoder-decoder training step but a compute_loss_func's: sft's loss is the one that label-smooths.
        # A model that does not "accept loss kwargs" gets no num_items_in_batch, so this is its micro-batch mean,
        # which the Trainer then divides by the accumulation steps, as it would the model's own.
        return "labels" in inputs and self.token_loss.encoder_decoder and self.compute_loss_func is None

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """Trainer.evaluation_loop with `<prefix>_loss` replaced by the exact mean over trained tokens, plus the
        generation metrics (and predictions.jsonl) with predict_with_generate."""
        flattened = isinstance(self.data_collator, PaddingFreeCollator)
        packed = "position_ids" in (getattr(dataloader.dataset, "column_names", None) or [])
        self.eval_tokens.start(flattened, packed, self.args.device)
        generation = self.generation_eval
        with generation.evaluating(self.model, self.processing_class) if generation else contextlib.nullcontext():
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        loss = self.eval_tokens.mean()
        if loss is not None and f"{metric_key_prefix}_loss" in output.metrics:
            output.metrics[f"{metric_key_prefix}_loss"] = loss
        if generation is not None:
            output.metrics.update(generation.metrics(metric_key_prefix, self.is_world_process_zero()))
        return output

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate; with predict_with_generate, `gen_kwargs` (max_new_tokens, num_beams, ...) override the
        recipe's decoding settings for this call."""
        generation = self.generation_eval
        with generation.overriding(gen_kwargs) if generation else contextlib.nullcontext():
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **gen_kwargs: Any) -> tuple:
        """Teacher-forced loss; with predict_with_generate also generate from each example's prompt alone."""
        if self.generation_eval is None or self.generation_eval.generator is None:
            inputs = self.token_loss.prediction_inputs(inputs, prediction_loss_only)
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)
        self.generation_eval.step(self._prepare_inputs(inputs))
        return loss, None, None

    @property
    def interrupted(self) -> bool:
        """Whether the last train() stopped early on SIGINT/SIGTERM."""
        return self.stop_on_signal.signal_name is not None

    def _get_output_dir(self, trial: Any) -> str:
        return self.checkpoint_staging.folder or super()._get_output_dir(trial)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Trainer.save_model; under DeepSpeed 16-bit training of float32-loaded weights the model saved (final and
        in checkpoints) holds the float32 masters (sft.training.masters), gathered here on every rank."""
        engine = getattr(self, "deepspeed", None)
        if self.saves_masters and self.is_deepspeed_enabled and getattr(engine, "optimizer", None) is not None and (
                engine.zero_optimization_stage() != 3 or engine.zero_gather_16bit_weights_on_model_save()):
            # (a ZeRO-3 save without the 16-bit gather writes DeepSpeed's shards, no model file)
            self.masters = master_weights(engine, self.args.should_save)
        try:
            super().save_model(output_dir, _internal_call)
        finally:
            self.masters = {}

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        """The Trainer's, or transformers' loading of weights saved under other names (load_renamed_weights)."""
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not checkpoints.load_renamed_weights(
                model or self.model, resume_from_checkpoint):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or not checkpoints.load_renamed_weights(
                self.model, self.state.best_model_checkpoint):  # as _load_from_checkpoint
            super()._load_best_model()

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write checkpoint-N into a staging folder, then rename it into place and rotate old ones."""
        run_dir = super()._get_output_dir(trial)
        self.throughput.save_to(self.state.stateful_callbacks, self._sum_over_processes)
        self.state.stateful_callbacks.update(resume_facts(self.args, self.train_dataset))  # what a resume must match
        # every step's loss so far (the logged windows plus the one not logged yet, averaged over processes)
        pending = nested_gather(self._tr_loss, self.args.parallel_mode).mean().item()
        total = (self.resumed_loss_sum or 0.0) + self._total_loss_scalar + pending
        self.state.stateful_callbacks[LOSS_KEY] = {"loss_sum": total}
        self.checkpoint_to_push = None
        with self.checkpoint_staging.writing(run_dir, self.state.global_step):
            super()._save_checkpoint(model, trial)
        self.checkpoint_staging.finish(run_dir, self.state, self.args)
        if self.checkpoint_to_push:
            with uploads_skipping(rundir.IN_FLIGHT):
                super()._push_from_checkpoint(str(Path(run_dir) / Path(self.checkpoint_to_push).name))

    def _push_from_checkpoint(self, checkpoint_folder: str) -> None:
        """Held until the checkpoint is in place (_save_checkpoint): the Trainer pushes while it saves, from the
        staging folder, which is renamed while the upload runs in the background."""
        self.checkpoint_to_push = checkpoint_folder

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        """The Trainer's save (final model and checkpoints), with DeepSpeed's float32 masters in place of their 16-bit
        copies where the weights loaded in float32 (sft.training.masters), and an adapter's generation_config.json: a
        peft save writes none, and `sft merge RUN/checkpoint-N` took the base's, whose stop ids may lack the run's end
        of turn (ChatML's <|im_end|> on a base Mistral), so transformers, vLLM and TGI wrote past every turn."""
        out = output_dir or self.args.output_dir
        masters = self.masters if state_dict is not None else {}
        super()._save(output_dir, {**state_dict, **masters} if masters else state_dict)
        if masters and self.args.should_save:
            config = self.accelerator.unwrap_model(self.model).config
            config.dtype = torch.float32
            config.save_pretrained(out)
        if self.args.should_save and isinstance(self.model, PeftModel):
            self.model.generation_config.save_pretrained(out)

    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch forward/backward, counting its tokens; the loss goes to the divergence guard."""
        self.throughput.count(inputs)
        if self.neftune is not None:
            self.neftune.see(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.divergence.add_loss(loss)  # every step's loss: the Trainer's logs filter NaN out
        return loss

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        """The Trainer's gradient norm of this step (computed every step), handed to the divergence guard."""
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        self.divergence.add_grad_norm(grad_norm, self.args.fp16)
        return grad_norm

    def _load_callback_state(self) -> None:
        """On resume: the trained-token count and the loss sum go on from the checkpoint's (they and what a resume must
        match, checked before, are no callbacks to restore), and so does early stopping's count of evaluations
        without improvement (the Trainer restores callbacks only with restore_callback_states_from_checkpoint)."""
        self.throughput.resume_from(self.state.stateful_callbacks)
        for key in (STATE_KEY, *RESUME_KEYS):
            self.state.stateful_callbacks.pop(key, None)
        self.resumed_loss_sum = (self.state.stateful_callbacks.pop(LOSS_KEY, None) or {}).get("loss_sum")
        if self.resumed_from is not None:  # where the best checkpoint is now (best_of_resumed)
            self.state.best_model_checkpoint = checkpoints.best_of_resumed(self.resumed_from)
        saved = self.state.stateful_callbacks.get(EarlyStoppingCallback.__name__)  # saved by the Trainer itself
        if self.early_stopping is not None and isinstance(saved, dict):
            self.early_stopping.early_stopping_patience_counter = saved["attributes"]["early_stopping_patience_counter"]
        super()._load_callback_state()

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        """train_loss over the whole run, also when it resumed (the Trainer's covers the steps since the resume: 3.6
        against 2.1, weights bitwise equal); the carried sum is scaled to the steps of this call, which the Trainer
        divides by, as its steps and samples per second (the whole run's count reported 2.3 steps/s for 2 steps in
        5.2 s). Checkpoints from before sft kept the sum (no LOSS_KEY) report the Trainer's. A run stopped by a signal
        or divergence keeps its newest checkpoint: under save_total_limit 1 the Trainer's end deleted all but the best
        (SIGTERM at step 7 deleted checkpoint-7; a resume restarted from checkpoint-2) and loaded the best model."""
        if self.resumed_loss_sum is not None:
            steps, here = self.state.global_step, self.state.global_step - self._initial_global_step
            pending = self._tr_loss.item()  # the Trainer adds it to the sum first
            whole = self.resumed_loss_sum + self._total_loss_scalar + pending
            if here > 0:
                self._total_loss_scalar = whole * here / steps - pending
            else:  # nothing trained since the checkpoint: no speed to report either
                self._total_loss_scalar, self._initial_global_step = whole - pending, 0
            self.resumed_loss_sum = None
        settings = self.args
        if self.interrupted or self.divergence.bad is not None:
            self.args = copy.copy(settings)  # a copy: the recipe keeps its own values
            self.args.save_total_limit, self.args.load_best_model_at_end = None, False
        try:
            return super()._finalize_training(*args, **kwargs)
        finally:
            self.args = settings

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add tokens/s (since the last log) and the running trained-token count, over all processes, to training
        logs."""
        super().log(self.throughput.add_to(logs, self._sum_over_processes), start_time)

    def _sum_over_processes(self, counts: torch.Tensor) -> torch.Tensor:
        return self.accelerator.reduce(counts, "sum")


class SFTTrainer(SFTMixin, Trainer):
    """Trainer for causal-LM SFT on datasets of input_ids/labels; every Trainer customization point still works.

    The loss is the sum over trained tokens divided by the trained tokens of the whole optimizer step
    (the Trainer's `num_items_in_batch`), so gradient accumulation and padding do not change it.
    With predict_with_generate, evaluation also generates from each example's prompt (the tokens before its
    first trained label, left-padded) and reports the recipe's metrics; generate() never sees the answer.
    """


class Seq2SeqSFTTrainer(SFTMixin, Seq2SeqTrainer):
    """Seq2SeqTrainer for encoder-decoder SFT (T5, Flan-T5, BART, mT5) with the same SFT layer as SFTTrainer.

    Datasets hold encoder input_ids and decoder labels (target + EOS); the loss is normalised by the trained tokens
    of the optimizer step, and generation-based evaluation generates from the encoder input.
    """


def trainer_class(model: nn.Module) -> type[SFTTrainer] | type[Seq2SeqSFTTrainer]:
    """Seq2SeqSFTTrainer for encoder-decoder models, SFTTrainer otherwise."""
    return Seq2SeqSFTTrainer if model.config.is_encoder_decoder else SFTTrainer
