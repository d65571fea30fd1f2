"""SFTTrainer: the loss is normalised by the trained tokens of the whole optimizer step."""

import json
import re

import datasets
import pytest
import torch
from transformers import DataCollatorForLanguageModeling, DataCollatorForSeq2Seq, TrainerCallback, TrainingArguments

from sft import SFTConfig, SFTError, SFTTrainer
from sft.data.collators import PackedCollator, PaddingFreeCollator
from sft.data.encode import IGNORE_INDEX
from sft.training.throughput import ThroughputLog

from conftest import make_llama


def toy_dataset(seed: int = 0) -> datasets.Dataset:
    """Four examples of different lengths and very different numbers of trained tokens."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for length, n_trained in ((7, 1), (12, 9), (5, 2), (16, 3)):
        ids = torch.randint(5, 300, (length,), generator=g).tolist()
        labels = [IGNORE_INDEX] * (length - n_trained) + ids[length - n_trained:]
        rows.append({"input_ids": ids, "labels": labels})
    return datasets.Dataset.from_list(rows)


def one_step(tmp_path, tokenizer, batch: int, accumulation: int, arguments: type = SFTConfig) -> tuple[float, dict]:
    """Run one SGD step (lr 1, no clipping) and return the logged loss and the weight change (= -gradient);
    `arguments`: SFTConfig, or transformers' own TrainingArguments as a user's script passes them."""
    model = make_llama(len(tokenizer), seed=1)
    before = {k: v.clone() for k, v in model.named_parameters()}
    args = arguments(output_dir=str(tmp_path / f"b{batch}"), per_device_train_batch_size=batch,
                     gradient_accumulation_steps=accumulation, max_steps=1, learning_rate=1.0, optim="sgd",
                     lr_scheduler_type="constant", max_grad_norm=0.0, logging_steps=1, report_to="none",
                     save_strategy="no", seed=3, dataloader_drop_last=False)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=toy_dataset())
    trainer.train()
    loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    return loss, {k: before[k] - v.detach() for k, v in model.named_parameters()}


def test_gradient_accumulation_matches_the_full_batch(tmp_path, tokenizer):
    loss_full, grad_full = one_step(tmp_path, tokenizer, batch=4, accumulation=1)
    loss_accum, grad_accum = one_step(tmp_path, tokenizer, batch=1, accumulation=4)
    assert loss_accum == pytest.approx(loss_full, abs=1e-5)
    for name, grad in grad_full.items():
        assert torch.allclose(grad, grad_accum[name], atol=1e-5), name
    assert any(g.abs().max() > 0 for g in grad_full.values())


@pytest.mark.parametrize("arguments", [SFTConfig, TrainingArguments])
def test_loss_is_the_mean_over_trained_tokens(tmp_path, tokenizer, arguments):
    # With transformers' TrainingArguments (README: the trainers "can be used directly") SFTTrainer failed when it was
    # built: AttributeError 'TrainingArguments' object has no attribute 'packing' (the default collator's choice).
    loss, _ = one_step(tmp_path, tokenizer, batch=2, accumulation=2, arguments=arguments)
    model = make_llama(len(tokenizer), seed=1)
    total, count = 0.0, 0
    for row in toy_dataset():
        ids, labels = torch.tensor([row["input_ids"]]), torch.tensor(row["labels"])
        logits = model(input_ids=ids).logits[0, :-1]
        targets = labels[1:]
        total += torch.nn.functional.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum").item()
        count += int((targets != IGNORE_INDEX).sum())
    assert loss == pytest.approx(total / count, abs=1e-4)  # logged loss is rounded by the Trainer


def test_throughput_log_counts_exact_tokens_and_logs_plain_numbers(monkeypatch):
    """Attended tokens per second since the last log and the running trained-token count, as JSON numbers (the
    counts stay tensors between logs so a GPU is not synchronised every micro-step)."""
    clock = iter([100.0, 102.0, 103.0, 104.0])
    monkeypatch.setattr("sft.training.throughput.time.perf_counter", lambda: next(clock))
    log = ThroughputLog()  # t = 100
    log.count({"input_ids": torch.ones(2, 5, dtype=torch.long),
               "attention_mask": torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]]),
               "labels": torch.tensor([[-100, -100, 3, -100, -100], [-100, 4, 5, 6, -100]])})
    log.count({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.tensor([[-100, 1, 2, -100]])})
    assert torch.is_tensor(log.pending_trained) and torch.is_tensor(log.window_tokens)  # no int() per micro-step
    assert log.add_to({"learning_rate": 1e-3}) == {"learning_rate": 1e-3}  # not a training-loss log
    first = log.add_to({"loss": 1.0})  # t = 102: 8 attended + 4 unmasked tokens in 2 s
    assert first == {"loss": 1.0, "tokens_per_second": 6.0, "trained_tokens": 6}
    log.count({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.tensor([[-100, 1, 2, -100]])})
    second = log.add_to({"loss": 0.5})  # t = 103: a new window of 4 tokens in 1 s; trained tokens keep counting
    assert second == {"loss": 0.5, "tokens_per_second": 4.0, "trained_tokens": 8}
    assert json.loads(json.dumps(second)) == second and type(second["trained_tokens"]) is int
    log.count({"input_ids": torch.ones(1, 4, dtype=torch.long), "labels": torch.tensor([[-100, 1, 2, -100]])})
    third = log.add_to({"loss": 0.2}, reduce=lambda counts: 2 * counts)  # two processes with equal batches
    assert third["trained_tokens"] == 8 + 4 and third["tokens_per_second"] > 0


@pytest.mark.parametrize("layout", ["padded", "padded, model's own loss", "padding_free"])
def test_trained_tokens_are_the_next_token_targets_the_loss_trains(tmp_path, tokenizer, layout):
    """A causal LM trains next-token targets, labels[:, 1:]: a row's first label is predicted by nothing. With a user's
    labels = input_ids (4 rows of 10 tokens) the log counted every label, 40 trained tokens, where the loss trained
    36 (the Trainer's num_items_in_batch); padding-free batches, whose examples start with -100, counted 36 already."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": ids, "labels": list(ids)} for ids in torch.randint(5, 300, (4, 10), generator=g).tolist()]
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                     report_to="none", save_strategy="no", chunked_loss=layout == "padded",
                     padding_free=layout == "padding_free")
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows))
    trainer.train()
    assert [e["trained_tokens"] for e in trainer.state.log_history if "trained_tokens" in e] == [4 * (10 - 1)]


def test_throughput_log_counts_what_the_loss_scores():
    """Causal (shifted): labels[:, 1:] per row, so a trained first label is not counted; an encoder-decoder's loss
    scores every decoder label, the first included."""
    labels = torch.tensor([[7, 8, -100, 9], [5, -100, -100, 6]])
    causal, seq2seq = ThroughputLog(), ThroughputLog(shifted=False)
    for log in (causal, seq2seq):
        log.count({"input_ids": torch.ones(2, 4, dtype=torch.long), "labels": labels})
    assert (int(causal.pending_trained), int(seq2seq.pending_trained)) == (3, 5)


def test_throughput_counts_packed_rows_without_their_padding():
    """PackedCollator pads rows to the widest with one more example of pad ids and no labels, and passes no
    attention_mask: counting every position logged the padding as trained-on tokens."""
    rows = [{"input_ids": [5, 6, 7, 8, 9, 10], "labels": [-100, 6, 7, -100, 9, 10], "position_ids": [0, 1, 2, 0, 1, 2]},
            {"input_ids": [5, 6, 7], "labels": [-100, 6, 7], "position_ids": [0, 1, 2]},
            {"input_ids": [0, 0, 4], "labels": [-100, -100, 4], "position_ids": [0, 1, 2]}]  # pad ids, yet real
    batch = PackedCollator(pad_token_id=0)(rows)
    assert batch["input_ids"].shape == (3, 6) and "attention_mask" not in batch
    log = ThroughputLog(pad_token_id=0)
    log.count(batch)
    assert int(log.window_tokens) == 6 + 3 + 3
    flat = PaddingFreeCollator()(rows)  # one row, no padding: every token counts
    log = ThroughputLog(pad_token_id=0)
    log.count(flat)
    assert int(log.window_tokens) == 12
    unknown = ThroughputLog()  # without the pad id nothing is taken for padding
    unknown.count(batch)
    assert int(unknown.window_tokens) == 18


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])
def test_an_infinite_gradient_norm_stops_training_at_its_own_step(tmp_path, tokenizer, max_grad_norm):
    """The step whose gradients are infinite while its loss is finite is the diverged one (the Trainer's own norm,
    with and without clipping, reaches the guard); a guard blind to the norm would stop a step later, on the NaN
    loss the broken weights give."""
    model = make_llama(len(tokenizer), seed=1)
    first = model.model.embed_tokens.weight
    handle = first.register_hook(lambda grad: grad * float("inf"))  # inf, or nan where the gradient is 0
    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-3,
                     max_grad_norm=max_grad_norm, logging_steps=1, report_to="none", save_strategy="no",
                     logging_nan_inf_filter=False)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=toy_dataset())
    trainer.add_callback(RemoveAfterFirstStep(handle))
    trainer.train()
    step, what = trainer.divergence.bad
    assert step == 1 and re.match(r"the gradient norm is (nan|inf) at loss \d", what) and trainer.state.global_step == 1


class RemoveAfterFirstStep(TrainerCallback):
    """Removes a gradient hook once the first optimizer step is taken."""

    def __init__(self, handle) -> None:
        self.handle = handle

    def on_step_end(self, args, state, control, **kwargs):
        self.handle.remove()
        return control


def test_group_by_length_order_is_a_function_of_seed_and_epoch(tmp_path, tokenizer):
    """train_sampling_strategy group_by_length drew each epoch's order from the global torch RNG, which a resume
    restores only after its first epoch has begun: a run resumed in epoch 1 trained other rows than the uninterrupted
    run (weights 3.5e-4 apart after 5 steps, tests/test_resume.py). The order must not depend on that RNG."""
    g = torch.Generator().manual_seed(0)
    rows = [{"input_ids": torch.randint(5, 300, (n,), generator=g).tolist()} for n in range(3, 123)]
    rows = [{**row, "labels": row["input_ids"]} for row in rows]  # 120 lengths: 3 mega-batches of 50 rows
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=1, train_sampling_strategy="group_by_length",
                     report_to="none", seed=3, use_cpu=True)
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                         train_dataset=datasets.Dataset.from_list(rows))
    loader = trainer.get_train_dataloader()

    def order(epoch: int, rng_seed: int) -> list[int]:
        loader.set_epoch(epoch)  # as the Trainer does when each epoch begins
        torch.manual_seed(rng_seed)  # the global RNG: whatever training or a resume left it at
        return [len(batch["input_ids"][0]) for batch in loader]

    assert order(1, 0) == order(1, 1) == order(1, 2)
    assert order(0, 0) == order(0, 5)
    assert order(0, 0) != order(1, 0)  # still shuffled anew each epoch
    assert sorted(order(1, 0)) == list(range(3, 123))


@pytest.mark.parametrize(("row", "missing"), [({"text": "Hello, how are you today?"}, "input_ids or labels"),
                                              ({"messages": [{"role": "user", "content": "hi"}]}, "input_ids or labels"),
                                              ({"input_ids": [1, 5, 6]}, "labels")])
def test_rows_the_trainer_cannot_train_are_refused_when_it_is_built(tmp_path, tokenizer, row, missing):
    """Raw rows failed only in train(), with transformers' advice to set remove_unused_columns=False (then a crash in
    the collator); input_ids without labels crashed with AttributeError: 'bool' object has no attribute 'sum'."""
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none")
    rows = datasets.Dataset.from_list([row] * 2)
    with pytest.raises(SFTError, match=f"train_dataset has no {missing} column.*sft.build_datasets"):
        SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, train_dataset=rows)
    with pytest.raises(SFTError, match=f"eval_dataset has no {missing} column"):
        SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, eval_dataset=rows)


def test_a_users_collator_makes_the_labels(tmp_path, tokenizer):
    """input_ids-only rows with the user's own collator: labels from DataCollatorForLanguageModeling train every token
    (the token-normalised loss: the mean over all targets); a collator that makes none gets the Trainer's own error."""
    ids = toy_dataset().select_columns(["input_ids"])
    args = TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", max_steps=1, learning_rate=0.0,
                             per_device_train_batch_size=4, logging_steps=1, save_strategy="no")
    trainer = SFTTrainer(model=make_llama(len(tokenizer), seed=1), args=args, processing_class=tokenizer,
                         train_dataset=ids, data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False))
    trainer.train()
    model, total, count = make_llama(len(tokenizer), seed=1), 0.0, 0
    for row in ids:
        logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
        total += torch.nn.functional.cross_entropy(logits, torch.tensor(row["input_ids"][1:]), reduction="sum").item()
        count += len(row["input_ids"]) - 1
    assert next(e["loss"] for e in trainer.state.log_history if "loss" in e) == pytest.approx(total / count, abs=1e-4)
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, train_dataset=ids,
                         data_collator=DataCollatorForSeq2Seq(tokenizer))
    with pytest.raises(ValueError, match="did not return a loss"):
        trainer.train()


@pytest.mark.parametrize("settings, warnings", [
    ({"warmup_steps": 5}, [("warmup_steps=5 is 5 optimizer steps, and the run has 2: the learning rate rises for the "
                            "whole run, reaches at most 20% of learning_rate=0.001 and never decays. Set warmup_steps "
                            "below 2, or as a share of the run (warmup_steps: 0.03).")]),
    ({"warmup_steps": 1}, []),
    ({"warmup_steps": 0.5}, []),  # a share: 1 of the 2 steps
    ({"eval_strategy": "steps", "eval_steps": 3},
     [("eval_steps=3 is beyond the run's 2 optimizer steps: no evaluation runs during training (only the final one), "
       "so nothing is compared for load_best_model_at_end or early stopping. Set eval_steps below 2, or as a share of "
       "the run (eval_steps: 0.1).")]),
    ({"eval_strategy": "steps", "eval_steps": 2}, []),
])
def test_step_counts_the_run_never_reaches_are_warned_of(tmp_path, tokenizer, caplog, settings, warnings):
    """A warmup written for a longer run (quickstart-chat's 36 steps with warmup_steps 200: eval loss 3.23 against
    1.87) or an eval_steps past the run's end trained on without a word; the run's step count is known only once the
    Trainer has the data, so the check runs as training begins."""
    import logging

    args = SFTConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=2, num_train_epochs=1,
                     learning_rate=1e-3, lr_scheduler_type="linear", logging_steps=1, report_to="none",
                     save_strategy="no", **settings)
    trainer = SFTTrainer(model=make_llama(len(tokenizer), seed=1), args=args, processing_class=tokenizer,
                         train_dataset=toy_dataset(), eval_dataset=toy_dataset(1))
    with caplog.at_level(logging.WARNING, logger="sft.training.schedule"):
        trainer.train()
    assert trainer.state.global_step == 2
    assert [r.getMessage() for r in caplog.records if r.name == "sft.training.schedule"] == warnings
    rates = [e["learning_rate"] for e in trainer.state.log_history if "learning_rate" in e]
    if settings.get("warmup_steps") == 5:  # what the warning says: the rate never gets near learning_rate
        assert rates == pytest.approx([0.0, 0.2e-3])
