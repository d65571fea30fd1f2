"""SFTTrainer / Seq2SeqSFTTrainer: transformers' trainers with SFT batching, token-normalised loss, throughput
logging and generation-based evaluation (sft.evaluation.predict)."""

import time
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import (DataCollatorForSeq2Seq, PreTrainedTokenizerBase, Seq2SeqTrainer, Seq2SeqTrainingArguments,
                          Trainer)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from sft.training import checkpoints
from sft.config.arguments import SFTConfig
from sft.training.divergence import DivergenceGuard
from sft.data.encode import IGNORE_INDEX
from sft.training.signals import StopOnSignal
from sft.training.loss import attach_chunked_loss, seq2seq_token_loss, token_cross_entropy
from sft.evaluation.metrics import compute_metrics, resolve_metrics
from sft.training.neftune import NEFTune, token_example_lengths
from sft.evaluation.predict import PromptGenerator, answer_offsets, eval_generation_config, write_predictions
from sft.data.collators import PackedCollator, PaddingFreeCollator


def default_collator(tokenizer: PreTrainedTokenizerBase, args: Any) -> Any:
    """Batches for the recipe's layout; padding never hides a trained EOS (labels are padded with -100).

    Packed rows keep examples apart with restarting position_ids and no attention mask, one batch row per packed
    row (a [B, L] mask, not one quadratic [B*L]^2 mask); padding-free batches and flash attention (which needs
    cu_seq_lens) get one flattened row.
    """
    packs = args.packing or bool(args.eval_packing)
    if args.padding_free or (packs and "flash" in (args.attn_implementation or "")):
        return PaddingFreeCollator()
    if packs:
        return PackedCollator(tokenizer.pad_token_id)
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)


class SFTMixin:
    """The SFT layer shared by SFTTrainer and Seq2SeqSFTTrainer: token-normalised loss, token accounting,
    throughput logs, atomic checkpoints and generation-based evaluation."""

    def __init__(self, model: nn.Module, args: Any, processing_class: PreTrainedTokenizerBase | None = None,
                 data_collator: Any = None, **kwargs: Any) -> None:
        if data_collator is None and processing_class is not None:
            data_collator = default_collator(processing_class, args)
        super().__init__(model=model, args=args, processing_class=processing_class,
                         data_collator=data_collator, **kwargs)
        self._init_sft()

    def _init_sft(self) -> None:
        smoothing = self.args.label_smoothing_factor
        self._chunked = getattr(self.args, "chunked_loss", True) and attach_chunked_loss(self.model, smoothing)
        if self._chunked:
            self.label_smoother = None  # the chunked forward applies it (LabelSmoother would need full logits)
        self._tokens_window, self._trained_total, self._window_start = 0, 0, time.perf_counter()
        # The Trainer's own NEFTune hook scales noise by the padded/packed row length; ours by each example's.
        self._neftune = NEFTune(self.neftune_noise_alpha) if self.neftune_noise_alpha else None
        self.neftune_noise_alpha = None
        self.stop_on_signal = StopOnSignal(self.accelerator)
        self.add_callback(self.stop_on_signal)
        self.divergence = DivergenceGuard(self)
        self.add_callback(self.divergence)  # after StopOnSignal: a diverged step is not saved on a signal either
        self._staging: str | None = None
        self._eval_sums = torch.zeros(2)
        self._eval_split_examples = self._eval_dedup = False  # set per evaluation (evaluation_loop)
        self._generating = isinstance(self.args, Seq2SeqTrainingArguments) and self.args.predict_with_generate
        # Unknown metric names or a bad import path fail here, before any training step.
        self._metric_fns = resolve_metrics(self.args.metrics if isinstance(self.args, SFTConfig) else None
                                           ) if self._generating else []
        self._generator: PromptGenerator | None = None
        # Where answers start inside a token (sft.evaluation.predict); train() sets it from the unpacked eval set when packing.
        self.answer_offsets = answer_offsets(self.eval_dataset) if self._generating else {}
        self._gen_overrides: dict[str, Any] = {}
        self._predictions: list[dict[str, str]] = []

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer.train with per-example NEFTune and signal handling attached for its duration."""
        if self.is_world_process_zero():
            checkpoints.remove_stale_staging(self.args.output_dir)
        if self._neftune is not None:
            self._neftune.attach(self.accelerator.unwrap_model(self.model).get_input_embeddings())
        self.stop_on_signal.install()
        try:
            return super().train(*args, **kwargs)
        finally:
            self.stop_on_signal.uninstall()
            if self._neftune is not None:
                self._neftune.detach()

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        """The Trainer's loss (for plain-head causal LMs the model's chunked forward computes it); seq2seq training:
        token-normalised; eval: also accumulate per-row token sums for the exact eval loss."""
        if model.training and not return_outputs and self._seq2seq_loss_applies(model, inputs):
            loss = seq2seq_token_loss(model, inputs, num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes
            return loss
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training and return_outputs and "labels" in inputs:
            self._add_eval_tokens(result[1], inputs)
        return result

    def _seq2seq_loss_applies(self, model: nn.Module, inputs: dict[str, Any]) -> bool:
        # Only where the Trainer skips its division by the accumulation steps (the model "accepts loss kwargs").
        unwrapped = self.accelerator.unwrap_model(model)
        return ("labels" in inputs and unwrapped.config.is_encoder_decoder and self.model_accepts_loss_kwargs
                and self.label_smoother is None and self.compute_loss_func is None)

    def _add_eval_tokens(self, outputs: Any, inputs: dict[str, Any]) -> None:
        """Per-row sums of token losses and trained tokens, so eval loss is a token mean however rows are grouped.

        Multi-process, rows are gathered with gather_for_metrics, which drops the rows accelerate repeats to even
        out the last batch. A flattened (padding-free) batch is split back into its examples; when those are packed
        rows they cannot be told apart, and the repeats (at most one batch) count.
        """
        labels = inputs["labels"]
        shifted = not self.accelerator.unwrap_model(self.model).config.is_encoder_decoder
        token_losses = outputs.get("token_losses") if isinstance(outputs, dict) else None
        if token_losses is None:  # models without the chunked forward return logits
            logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
            token_losses = token_cross_entropy(logits, labels, shifted)
        targets = labels[:, 1:] if shifted else labels
        trained = targets != IGNORE_INDEX
        rows = torch.arange(targets.shape[0], device=targets.device)[:, None].expand_as(targets)
        if self._eval_split_examples:
            rows = (inputs["position_ids"] == 0).cumsum(-1)[:, 1:] - 1  # example of each target token
        values = torch.stack([token_losses[trained].float(), torch.ones_like(token_losses[trained])], dim=1)
        sums = torch.zeros(int(rows.max()) + 1, 2, device=values.device).index_add_(0, rows[trained], values)
        if self._eval_dedup:
            sums = self.accelerator.gather_for_metrics(sums)
        self._eval_sums += sums.sum(0).to(self._eval_sums.device)

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """Trainer.evaluation_loop with `<prefix>_loss` replaced by the exact mean over trained tokens, plus the
        generation metrics (and predictions.jsonl) with predict_with_generate."""
        self._eval_sums = torch.zeros(2, device=self.args.device)
        flattened = isinstance(self.data_collator, PaddingFreeCollator)
        packed = "position_ids" in (getattr(dataloader.dataset, "column_names", None) or [])
        self._eval_split_examples = flattened and not packed
        self._eval_dedup = self.accelerator.num_processes > 1 and not (flattened and packed)
        self._generator, self._predictions = (self._prompt_generator() if self._generating else None), []
        try:
            output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys,
                                             metric_key_prefix)
        finally:
            generator, self._generator = self._generator, None
        sums = self._eval_sums if self._eval_dedup else self.accelerator.reduce(self._eval_sums, reduction="sum")
        prefix = metric_key_prefix
        if sums[1] > 0 and f"{prefix}_loss" in output.metrics:
            output.metrics[f"{prefix}_loss"] = float(sums[0] / sums[1])
        if generator is not None:
            output.metrics.update(self._generation_metrics(prefix))
        return output

    def evaluate(self, eval_dataset: Any = None, ignore_keys: list[str] | None = None,
                 metric_key_prefix: str = "eval", **gen_kwargs: Any) -> dict[str, float]:
        """Trainer.evaluate; with predict_with_generate, `gen_kwargs` (max_new_tokens, num_beams, ...) override the
        recipe's decoding settings for this call."""
        previous = self._gen_overrides  # Trainer.evaluate calls itself once per dataset of an eval dict
        self._gen_overrides = {**previous, **gen_kwargs}
        try:
            return super().evaluate(eval_dataset, ignore_keys=ignore_keys, metric_key_prefix=metric_key_prefix)
        finally:
            self._gen_overrides = previous

    def prediction_step(self, model: nn.Module, inputs: dict[str, Any], prediction_loss_only: bool,
                        ignore_keys: list[str] | None = None, **gen_kwargs: Any) -> tuple:
        """Teacher-forced loss; with predict_with_generate also generate from each example's prompt alone."""
        if self._generator is None:
            if self._chunked and not prediction_loss_only:  # predict() / compute_metrics want the logits
                inputs = {**inputs, "full_logits": True}
            return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys=ignore_keys)
        loss, _, _ = super().prediction_step(model, inputs, True, ignore_keys=ignore_keys)
        rows = self._generator.examples(self._prepare_inputs(inputs))
        texts = iter(self._generator.generate([e for row in rows for e in row], self.args.device))
        grouped = [[next(texts) for _ in row] for row in rows]
        if self.accelerator.num_processes > 1:  # gather_for_metrics drops the rows repeated to even out batches
            grouped = self.accelerator.gather_for_metrics(grouped, use_gather_object=True)
        self._predictions.extend(record for row in grouped for record in row)
        return loss, None, None

    def _prompt_generator(self) -> PromptGenerator:
        """The generator for one evaluation: decoding settings from the recipe, prompts cut from each batch."""
        unwrapped = self.accelerator.unwrap_model(self.model)
        config = eval_generation_config(unwrapped, self.processing_class, self.args, self._gen_overrides)
        # Sharded parameters are gathered layer by layer on every rank: all ranks must keep stepping together.
        synced = is_deepspeed_zero3_enabled() or is_fsdp_managed_module(self.model)
        return PromptGenerator(self.model, self.processing_class, config, unwrapped.config.is_encoder_decoder, synced,
                               self.answer_offsets)

    def _generation_metrics(self, prefix: str) -> dict[str, float]:
        """Metrics of the collected predictions (prefixed); predictions.jsonl written by the main process."""
        if self.is_world_process_zero():
            name = "predictions.jsonl" if prefix == "eval" else f"{prefix}_predictions.jsonl"
            write_predictions(self._predictions, Path(self.args.output_dir) / name)
        predictions = [r["prediction"] for r in self._predictions]
        references = [r["reference"] for r in self._predictions]
        values = compute_metrics(self._metric_fns, predictions, references)
        return {f"{prefix}_{key}": value for key, value in values.items()}

    @property
    def interrupted(self) -> bool:
        """Whether the last train() stopped early on SIGINT/SIGTERM."""
        return self.stop_on_signal.signal_name is not None

    def _get_output_dir(self, trial: Any) -> str:
        return self._staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        """Write checkpoint-N into a staging folder, then rename it into place and rotate old ones."""
        run_dir, step = super()._get_output_dir(trial), self.state.global_step
        self._staging = str(checkpoints.staging_root(run_dir, step))
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        self.accelerator.wait_for_everyone()  # every rank has written its shard
        if self.args.should_save:
            final = checkpoints.promote(run_dir, step)
            best = self.state.best_model_checkpoint
            if best and best.startswith(str(checkpoints.staging_root(run_dir, step))):
                self.state.best_model_checkpoint = str(final)
            checkpoints.rotate(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
        self.accelerator.wait_for_everyone()

    def training_step(self, model: nn.Module, inputs: dict[str, torch.Tensor | Any],
                      num_items_in_batch: torch.Tensor | int | None = None) -> torch.Tensor:
        """One micro-batch forward/backward, counting its tokens; the loss goes to the divergence guard."""
        mask = inputs.get("attention_mask")
        self._tokens_window += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        if "labels" in inputs:
            self._trained_total += int((inputs["labels"] != IGNORE_INDEX).sum())
        if self._neftune is not None:
            self._neftune.lengths = token_example_lengths(inputs)
        loss = super().training_step(model, inputs, num_items_in_batch)
        self.divergence.add_loss(loss)  # every step's loss: the Trainer's logs filter NaN out
        return loss

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Add tokens/s (since the last log) and the running trained-token count to training logs."""
        if "loss" in logs:
            now = time.perf_counter()
            rate = self._tokens_window / max(now - self._window_start, 1e-9)
            logs = {**logs, "tokens_per_second": round(rate, 1), "trained_tokens": self._trained_total}
            self._tokens_window, self._window_start = 0, now
        super().log(logs, start_time)


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
