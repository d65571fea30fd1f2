"""SFTTrainer: transformers.Trainer with SFT batching, token-normalised loss and throughput logging."""

import time
from typing import Any

import torch
from torch import nn
from transformers import DataCollatorForSeq2Seq, PreTrainedTokenizerBase, Trainer

from sft import checkpoints
from sft.encode import IGNORE_INDEX
from sft.interrupt import StopOnSignal
from sft.loss import chunked_causal_loss, reference_causal_loss, supports_chunked_loss
from sft.neftune import NEFTune, token_example_lengths


def default_collator(tokenizer: PreTrainedTokenizerBase) -> DataCollatorForSeq2Seq:
    """Right-pad input_ids with the pad id and labels with -100, so padding never hides a trained EOS."""
    return DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX, padding=True)


class SFTMixin:
    """The SFT layer shared by SFTTrainer and its Seq2Seq sibling: token accounting and throughput logs."""

    def _init_sft(self) -> None:
        self._tokens_window, self._trained_total, self._window_start = 0, 0, time.perf_counter()
        # The Trainer's own NEFTune hook scales noise by the padded/packed row length; ours by each example's.
        self._neftune = NEFTune(self.neftune_noise_alpha) if self.neftune_noise_alpha else None
        self.neftune_noise_alpha = None
        self.stop_on_signal = StopOnSignal()
        self.add_callback(self.stop_on_signal)
        self._staging: str | None = None
        self._eval_sums = torch.zeros(2)

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
        """Training: the chunked trained-positions loss where exact; eval: also accumulate token-weighted sums."""
        if model.training and not return_outputs and self._chunked_loss_applies(model, inputs):
            loss = chunked_causal_loss(model, inputs, num_items_in_batch)
            if self.args.average_tokens_across_devices and num_items_in_batch is not None:
                loss = loss * self.accelerator.num_processes  # num_items_in_batch counts every rank's tokens
            return loss
        result = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if not model.training and return_outputs and "labels" in inputs:
            self._add_eval_tokens(result[1], inputs["labels"])
        return result

    def _chunked_loss_applies(self, model: nn.Module, inputs: dict[str, Any]) -> bool:
        unwrapped = self.accelerator.unwrap_model(model)
        return (self.args.chunked_loss and "labels" in inputs and not self.is_fsdp_enabled
                and not self.is_deepspeed_enabled and supports_chunked_loss(unwrapped))

    def _add_eval_tokens(self, outputs: Any, labels: torch.Tensor) -> None:
        """Sum of token losses and trained-token count, so eval loss is a token mean however rows are grouped."""
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[1]
        shifted = not self.accelerator.unwrap_model(self.model).config.is_encoder_decoder
        if shifted:
            total = reference_causal_loss(logits.float(), labels, 1)
            count = (labels[:, 1:] != IGNORE_INDEX).sum()
        else:
            total = nn.functional.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(),
                                                ignore_index=IGNORE_INDEX, reduction="sum")
            count = (labels != IGNORE_INDEX).sum()
        self._eval_sums += torch.stack([total.detach().float(), count.float()]).to(self._eval_sums.device)

    def evaluation_loop(self, dataloader: Any, description: str, prediction_loss_only: bool | None = None,
                        ignore_keys: list[str] | None = None, metric_key_prefix: str = "eval") -> Any:
        """Trainer.evaluation_loop with `<prefix>_loss` replaced by the exact mean over trained tokens."""
        self._eval_sums = torch.zeros(2, device=self.args.device)
        output = super().evaluation_loop(dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
        sums = self.accelerator.reduce(self._eval_sums, reduction="sum")
        prefix = metric_key_prefix
        if sums[1] > 0 and f"{prefix}_loss" in output.metrics:
            output.metrics[f"{prefix}_loss"] = float(sums[0] / sums[1])
        return output

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
        """One micro-batch forward/backward, counting its tokens."""
        mask = inputs.get("attention_mask")
        self._tokens_window += int(mask.sum()) if mask is not None else int(inputs["input_ids"].numel())
        if "labels" in inputs:
            self._trained_total += int((inputs["labels"] != IGNORE_INDEX).sum())
        if self._neftune is not None:
            self._neftune.lengths = token_example_lengths(inputs)
        return super().training_step(model, inputs, num_items_in_batch)

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
    """

    def __init__(self, model: nn.Module, args: Any, processing_class: PreTrainedTokenizerBase | None = None,
                 data_collator: Any = None, **kwargs: Any) -> None:
        if data_collator is None and processing_class is not None:
            data_collator = default_collator(processing_class)
        super().__init__(model=model, args=args, processing_class=processing_class,
                         data_collator=data_collator, **kwargs)
        self._init_sft()
