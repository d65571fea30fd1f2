"""Eval loss runs through the chunked forward: no full-vocabulary logits, the exact token mean for padded and
padding-free batches, plain cross entropy under label smoothing. (Multi-process exactness: tests/test_ddp.py.)"""

import pytest
import torch
from test_loss import batch
from test_trainer import toy_dataset
from torch.overrides import TorchFunctionMode

from sft import SFTConfig, SFTTrainer
from sft.data.encode import IGNORE_INDEX
from sft.training.loss import attach_chunked_loss

from conftest import make_llama, reference_causal_loss

VOCAB = 300


class LargestVocabularyTensor(TorchFunctionMode):
    """The most elements of any new tensor (not a view, such as the head's weight.T) with a vocabulary-sized last
    dimension produced inside the block."""

    largest = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if isinstance(out, torch.Tensor) and out.dim() and out.shape[-1] == VOCAB and out._base is None:
            self.largest = max(self.largest, out.numel())
        return out


def test_eval_forward_never_holds_full_vocabulary_logits(monkeypatch):
    monkeypatch.setattr("sft.training.linear_cross_entropy.MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr("sft.training.linear_cross_entropy.CHUNK_ELEMENTS", 7 * VOCAB)
    model = make_llama(VOCAB).eval()
    inputs = batch(VOCAB)
    with torch.no_grad(), LargestVocabularyTensor() as plain:
        logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    assert plain.largest == 3 * 20 * VOCAB  # negative control: the plain forward holds them all
    attach_chunked_loss(model)
    with torch.no_grad(), LargestVocabularyTensor() as chunked:
        out = model(**inputs)
    assert chunked.largest <= 7 * VOCAB and "logits" not in out
    trained = inputs["labels"][:, 1:] != IGNORE_INDEX
    assert torch.equal(out.token_losses != 0, trained)
    assert torch.allclose(out.loss, reference_causal_loss(logits, inputs["labels"], int(trained.sum())), atol=1e-6)


def token_mean(model: torch.nn.Module, smoothing: float = 0.0) -> float:
    total, count = 0.0, 0
    for row in toy_dataset():
        labels = torch.tensor(row["labels"][1:])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum",
                                                         label_smoothing=smoothing))
        count += int((labels != IGNORE_INDEX).sum())
    return total / count


@pytest.mark.parametrize("padding_free", [False, True])
def test_eval_loss_is_the_token_mean_over_the_eval_set(tmp_path, tokenizer, padding_free):
    model = make_llama(len(tokenizer), seed=1)
    expected = token_mean(model)
    args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=3, report_to="none",
                     padding_free=padding_free)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, eval_dataset=toy_dataset())
    assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, abs=1e-5)


def test_predict_still_returns_logits(tmp_path, tokenizer):
    model = make_llama(len(tokenizer), seed=1)
    expected = token_mean(model)
    args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=4, report_to="none")
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer)
    result = trainer.predict(toy_dataset())
    assert result.predictions.shape[:2] == (4, 16) and result.predictions.shape[2] == len(tokenizer)
    assert result.metrics["test_loss"] == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("chunked_loss", [True, False])
def test_eval_loss_is_plain_cross_entropy_under_label_smoothing(tmp_path, tokenizer, chunked_loss):
    """Label smoothing is a training loss: eval reports the plain token mean at any eval batch size, chunked or not.
    Without the chunked loss (gpt2, gemma2, phi, ...) the Trainer's LabelSmoother took the labels the eval sums read,
    and eval reported its smoothed per-batch means (here 7.5424 at batch 3, 7.5973 at batch 8, for 7.6102 plain)."""
    model = make_llama(len(tokenizer), seed=1, initializer_range=0.3)  # peaked logits: smoothing moves the loss
    expected = token_mean(model)
    assert abs(token_mean(model, smoothing=0.1) - expected) > 1e-3  # control: a smoothed loss would fail
    for batch_size in (3, 8):
        args = SFTConfig(output_dir=str(tmp_path), per_device_eval_batch_size=batch_size, report_to="none",
                         label_smoothing_factor=0.1, chunked_loss=chunked_loss)
        trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, eval_dataset=toy_dataset())
        assert trainer.evaluate()["eval_loss"] == pytest.approx(expected, abs=1e-5), batch_size
