"""Encoder-decoder SFT: seq2seq encoding, Seq2SeqSFTTrainer (full and LoRA), token-normalised loss, label
smoothing, memorisation."""

import json
import math
from pathlib import Path

import datasets
import pytest
import torch
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer, T5Config, T5ForConditionalGeneration

from sft import Seq2SeqSFTTrainer, SFTConfig, SFTError, build_datasets, load_recipe, train
from sft.data.build import prepare_splits
from sft.data.encode import IGNORE_INDEX
from sft.data.seq2seq import fit_keeping_special

from conftest import FIXTURES, write_json

FLAN_T5_TOKENIZER = FIXTURES / "tokenizers" / "flan-t5-seq2seq-no-chat-template"
PAIRS = [("add 1 and 2", "3"), ("add 3 and 4", "7"), ("the capital of France", "Paris"), ("greet me", "Hello"),
         ("what is the weather like", "fine"), ("add 5 and 5", "10"), ("the quick brown fox", "jumps"),
         ("how are you today", "I am fine")]


def make_t5(tokenizer, seed: int = 0) -> T5ForConditionalGeneration:
    """A 2+2-layer T5 with d_model 64, no dropout; decoding starts from the pad id, as T5's does."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(tokenizer), d_model=64, d_ff=128, num_layers=2, num_decoder_layers=2,
                      num_heads=4, d_kv=16, dropout_rate=0.0, decoder_start_token_id=tokenizer.pad_token_id,
                      pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return T5ForConditionalGeneration(config).float()


@pytest.fixture(scope="module")
def t5_dir(tmp_path_factory, tokenizer) -> Path:
    path = tmp_path_factory.mktemp("tiny-t5")
    make_t5(tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def pairs_file(tmp_path_factory) -> Path:
    rows = [{"source": s, "target": t} for s, t in PAIRS]
    return write_json(tmp_path_factory.mktemp("data") / "pairs.jsonl", rows, jsonl=True)


def recipe(t5_dir: Path, data: Path, out: Path, **overrides) -> SFTConfig:
    values = dict(model_name_or_path=str(t5_dir), dataset=str(data), output_dir=str(out), report_to="none",
                  save_strategy="no", dtype="float32", per_device_train_batch_size=8, per_device_eval_batch_size=8,
                  learning_rate=1e-2, lr_scheduler_type="constant", logging_steps=10, use_cpu=True)
    return load_recipe({**values, **overrides})


def test_encoder_input_is_the_source_and_labels_the_target_plus_eos(t5_dir, pairs_file, tokenizer, tmp_path):
    train_set, _ = build_datasets(recipe(t5_dir, pairs_file, tmp_path), tokenizer)
    for row, (source, target) in zip(train_set, PAIRS):
        assert row["input_ids"] == tokenizer(source)["input_ids"]  # the tokenizer's special tokens (here BOS)
        assert row["labels"] == tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert IGNORE_INDEX not in row["labels"]


def test_column_mapping_and_prompt_completion_rows(t5_dir, tokenizer, tmp_path):
    dialogue = write_json(tmp_path / "d.json", [{"dialogue": "Hello, how are you?", "summary": "A greeting."}])
    config = recipe(t5_dir, dialogue, tmp_path, dataset=[{"path": str(dialogue),
                                                          "columns": {"dialogue": "source", "summary": "target"}}])
    train, _ = prepare_splits(config, tokenizer)
    assert train.dataset[0]["input_ids"] == tokenizer("Hello, how are you?")["input_ids"]
    assert [s.format for s in train.sources] == ["seq2seq"] and config.dataset_format == "auto"  # not mutated
    completion = write_json(tmp_path / "pc.json", [{"prompt": "Q: 2+3?", "completion": "5"}])
    row = build_datasets(recipe(t5_dir, completion, tmp_path), tokenizer)[0][0]
    assert row["input_ids"] == tokenizer("Q: 2+3?")["input_ids"] and row["labels"][-1] == tokenizer.eos_token_id


def test_text_data_is_refused_for_encoder_decoder_models(t5_dir, tokenizer, tmp_path):
    text = write_json(tmp_path / "t.json", [{"text": "just text"}])
    with pytest.raises(SFTError, match="Encoder-decoder models need source/target pairs"):
        build_datasets(recipe(t5_dir, text, tmp_path), tokenizer)


def test_decoder_only_models_read_seq2seq_rows_as_prompt_and_completion(tiny_model_dir, pairs_file, tokenizer,
                                                                        tmp_path):
    config = load_recipe(dict(model_name_or_path=str(tiny_model_dir), dataset=str(pairs_file),
                              output_dir=str(tmp_path)))
    row = build_datasets(config, tokenizer)[0][0]
    trained = [t for t in row["labels"] if t != IGNORE_INDEX]
    assert tokenizer.decode(row["input_ids"], skip_special_tokens=True) == "add 1 and 2\n3"
    assert tokenizer.decode(trained, skip_special_tokens=True).strip() == "3" and trained[-1] == tokenizer.eos_token_id


def test_sft_data_shows_source_and_target(t5_dir, pairs_file, tmp_path, capsys):
    from sft.cli.main import main

    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"model_name_or_path: {t5_dir}\ndataset: {pairs_file}\noutput_dir: {tmp_path}\n")
    assert main(["data", str(recipe_file), "--show", "1"]) == 0
    shown = capsys.readouterr().out
    assert "<s>add 1 and 2\n--- target:\n[[3</s>]]" in shown and "2 target tokens (all trained)" in shown


def test_sft_eval_reports_eval_rows_cut_to_max_length(t5_dir, pairs_file, tmp_path, caplog):
    """Seq2seq eval rows are never dropped (every target keeps its EOS), so a source or target cut to max_length was
    scored without a word: generated from a cut source, against a cut reference (DialogSum dev at 256 flan-t5
    tokens: 153 of 500 rows cut)."""
    import logging

    from sft.cli.main import main

    long_rows = [{"source": "the quick brown fox " * 6, "target": "jumps"},
                 {"source": "greet me", "target": "Hello, how are you today? " * 4}]
    data = write_json(tmp_path / "eval.jsonl", [{"source": s, "target": t} for s, t in PAIRS] + long_rows, jsonl=True)
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(f"model_name_or_path: {t5_dir}\ndataset: {pairs_file}\neval_dataset: {data}\n"
                           f"output_dir: {tmp_path / 'out'}\nmax_length: 16\nreport_to: none\nuse_cpu: true\n")
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert main(["eval", str(recipe_file)]) == 0
    assert ("Eval data: 2 of 10 rows are longer than max_length=16 and truncated. Eval loss and metrics score what "
            "fits (a cut source or prompt is generated from, a cut answer is the reference): raise max_length to "
            "score them whole.") in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="sft"):  # control: nothing cut, nothing said
        assert main(["eval", str(recipe_file), "--max_length", "64", "--output_dir", str(tmp_path / "out2")]) == 0
    assert "Eval data" not in caplog.text


def test_truncation_keeps_the_tokenizers_special_tokens():
    # [BOS] a b c d [EOS] cut to 4 keeps both ends' special tokens
    ids, special = [1, 10, 11, 12, 13, 2], [1, 0, 0, 0, 0, 1]
    assert fit_keeping_special(ids, special, 4, "right") == ([1, 10, 11, 2], True)
    assert fit_keeping_special(ids, special, 4, "left") == ([1, 12, 13, 2], True)
    assert fit_keeping_special(ids, special, 6, "right") == (ids, False)


@pytest.mark.skipif(not (FLAN_T5_TOKENIZER / "tokenizer.json").exists(), reason="flan-t5 tokenizer fixture absent")
def test_flan_t5_tokenizer_ends_sources_and_targets_with_eos(t5_dir, pairs_file, tmp_path):
    t5_tokenizer = AutoTokenizer.from_pretrained(FLAN_T5_TOKENIZER)
    config = recipe(t5_dir, pairs_file, tmp_path, max_length=4)
    row = build_datasets(config, t5_tokenizer)[0][2]  # "the capital of France" -> "Paris"
    assert len(row["input_ids"]) == 4 and row["input_ids"][-1] == t5_tokenizer.eos_token_id
    assert row["labels"] == t5_tokenizer("Paris")["input_ids"]  # T5 appends </s> itself: same tokens


@pytest.mark.skipif(not (FLAN_T5_TOKENIZER / "tokenizer.json").exists(), reason="flan-t5 tokenizer fixture absent")
def test_generation_eval_keeps_unk_where_t5_cannot_write_a_character():
    """SAMSum's "Maria Skłodowska-Curie": T5 has no `ł` (nor `{`, `<`, Chinese), the labels hold <unk>. Dropping it
    with the special tokens scored a reply that left the character out, or an empty reply to a target of such
    characters, an exact match."""
    from transformers import GenerationConfig

    from sft.evaluation.metrics import exact_match
    from sft.evaluation.predict import Example, PromptGenerator

    t5_tokenizer = AutoTokenizer.from_pretrained(FLAN_T5_TOKENIZER)
    config = GenerationConfig(eos_token_id=[t5_tokenizer.eos_token_id], pad_token_id=t5_tokenizer.pad_token_id)
    generator = PromptGenerator(None, t5_tokenizer, config, encoder_decoder=True)
    target, unwritable = (t5_tokenizer(text)["input_ids"] for text in ("Maria Skłodowska-Curie", "猫"))
    left_out = t5_tokenizer("Maria Skodowska-Curie")["input_ids"]
    records = [generator.record(Example([5], ids), [5], reply)
               for ids, reply in ((target, target), (target, left_out), (unwritable, [t5_tokenizer.eos_token_id]))]
    assert [r["reference"] for r in records] == ["Maria Sk<unk>odowska-Curie"] * 2 + ["<unk>"]
    assert [r["prediction"] for r in records] == ["Maria Sk<unk>odowska-Curie", "Maria Skodowska-Curie", ""]
    assert exact_match([r["prediction"] for r in records], [r["reference"] for r in records]) == {"exact_match": 1 / 3}


def step_rows(tokenizer) -> list[dict]:
    """Four encoded pairs of very different target lengths."""
    pairs = (("a", "b"), ("hello there", "the capital of France is Paris"), ("c", "d e"), ("f g", "h"))
    return [{"input_ids": tokenizer(source)["input_ids"],
             "labels": tokenizer(target, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]}
            for source, target in pairs]


def one_step_grads(tokenizer, batch: int, accumulation: int, out: Path, **overrides) -> tuple[float, dict]:
    """One SGD step (lr 1) on step_rows; logged loss and weight change."""
    model = make_t5(tokenizer, seed=1)
    before = {k: v.clone() for k, v in model.named_parameters()}
    args = SFTConfig(output_dir=str(out), per_device_train_batch_size=batch, gradient_accumulation_steps=accumulation,
                     max_steps=1, learning_rate=1.0, optim="sgd", lr_scheduler_type="constant", max_grad_norm=0.0,
                     logging_steps=1, report_to="none", save_strategy="no", seed=3, use_cpu=True, **overrides)
    trainer = Seq2SeqSFTTrainer(model=model, args=args, processing_class=tokenizer,
                                train_dataset=datasets.Dataset.from_list(step_rows(tokenizer)))
    trainer.train()
    loss = next(e["loss"] for e in trainer.state.log_history if "loss" in e)
    return loss, {k: before[k] - v.detach() for k, v in model.named_parameters()}


def test_trained_tokens_are_every_decoder_label(tokenizer, tmp_path):
    """An encoder-decoder's loss scores every label (the decoder input is the labels shifted right, no label is
    dropped), so the log's trained_tokens counts them all, each row's first included: 23 here, where a causal LM's
    count of the same labels would be 19."""
    rows = step_rows(tokenizer)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, logging_steps=1,
                     report_to="none", save_strategy="no", use_cpu=True)
    trainer = Seq2SeqSFTTrainer(model=make_t5(tokenizer, seed=1), args=args, processing_class=tokenizer,
                                train_dataset=datasets.Dataset.from_list(rows))
    trainer.train()
    assert [e["trained_tokens"] for e in trainer.state.log_history if "trained_tokens" in e] == [
        sum(len(row["labels"]) for row in rows)]


def token_mean(model, rows: list[dict], smoothing: float = 0.0) -> torch.Tensor:
    """The reference loss, independent of sft: each row's decoder cross entropy alone (no padding), with PyTorch's
    label smoothing, summed over every row and divided by all their target tokens."""
    total, count = 0.0, 0
    for row in rows:
        labels = torch.tensor([row["labels"]])
        logits = model(input_ids=torch.tensor([row["input_ids"]]), labels=labels).logits[0]
        total = total + torch.nn.functional.cross_entropy(logits, labels[0], reduction="sum", label_smoothing=smoothing)
        count += labels.shape[1]
    return total / count


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_seq2seq_loss_is_normalised_by_the_trained_tokens_of_the_step(tokenizer, tmp_path, smoothing):
    loss_full, grads_full = one_step_grads(tokenizer, 4, 1, tmp_path / "full", label_smoothing_factor=smoothing)
    loss_accum, grads_accum = one_step_grads(tokenizer, 1, 4, tmp_path / "accum", label_smoothing_factor=smoothing)
    assert loss_accum == pytest.approx(loss_full, abs=1e-5)
    for name, grad in grads_full.items():
        assert torch.allclose(grad, grads_accum[name], atol=1e-5), name


def test_label_smoothing_trains_t5_on_pytorchs_smoothed_token_mean(tokenizer, tmp_path):
    """sft's encoder-decoder loss applies label smoothing (the Trainer's LabelSmoother took the labels out of the
    batch, and T5 then had no decoder input: a ValueError at step 1): value and gradients of PyTorch's
    label-smoothed cross entropy, averaged over the batch's target tokens."""
    loss, change = one_step_grads(tokenizer, 4, 1, tmp_path, label_smoothing_factor=0.1)
    model, rows = make_t5(tokenizer, seed=1), step_rows(tokenizer)
    reference = token_mean(model, rows, smoothing=0.1)
    reference.backward()
    assert loss == pytest.approx(reference.item(), abs=1e-5)
    with torch.no_grad():  # control: smoothing moves this loss far beyond the tolerance (6.7440 plain, 6.7278)
        assert abs(float(token_mean(model, rows)) - loss) > 1e-3
    for name, param in model.named_parameters():
        assert torch.allclose(change[name], param.grad, atol=1e-5), name
    assert any(c.abs().max() > 0 for c in change.values())


def test_t5_run_with_label_smoothing_evaluates_plain_cross_entropy(t5_dir, pairs_file, tokenizer, tmp_path):
    """A T5 run (sft.train, as `sft train`) with label_smoothing_factor trains, and its eval loss is the plain token mean (eval batches
    of 3, 3 and 2 rows), not smoothed: label smoothing is a training loss."""
    out = train(recipe(t5_dir, pairs_file, tmp_path / "run", max_steps=2, logging_steps=1, label_smoothing_factor=0.1,
                       eval_dataset=str(pairs_file), per_device_eval_batch_size=3))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "loss" in e and math.isfinite(e["loss"])] == [1, 2]
    model = AutoModelForSeq2SeqLM.from_pretrained(out)
    start = AutoModelForSeq2SeqLM.from_pretrained(t5_dir).state_dict()
    assert any(not torch.equal(value, start[name]) for name, value in model.state_dict().items())
    rows = [{"input_ids": tokenizer(s)["input_ids"],
             "labels": tokenizer(t, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]} for s, t in PAIRS]
    with torch.no_grad():
        plain, smoothed = float(token_mean(model, rows)), float(token_mean(model, rows, smoothing=0.1))
    eval_loss = json.loads((out / "eval_results.json").read_text())["eval_loss"]
    assert eval_loss == pytest.approx(plain, abs=1e-5) and abs(smoothed - plain) > 1e-3  # control: they differ


@pytest.mark.parametrize("use_peft", [False, True], ids=["full", "lora"])
def test_tiny_t5_trains_and_generates(t5_dir, pairs_file, tmp_path, use_peft):
    peft = {"use_peft": True, "lora_r": 4} if use_peft else {}  # a LoRA key without use_peft is refused
    out = train(recipe(t5_dir, pairs_file, tmp_path / "run", max_steps=6, logging_steps=2, **peft,
                       eval_dataset=str(pairs_file), predict_with_generate=True, max_new_tokens=4))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [e["loss"] for e in history if "loss" in e]
    assert losses and all(loss == loss for loss in losses)  # finite
    results = json.loads((out / "eval_results.json").read_text())
    assert {"eval_loss", "eval_exact_match", "eval_rouge1", "eval_rougeL", "eval_bleu"} <= set(results)
    assert len((out / "predictions.jsonl").read_text().splitlines()) == len(PAIRS)
    if use_peft:
        adapter = json.loads((out / "adapter_config.json").read_text())
        assert adapter["task_type"] == "SEQ_2_SEQ_LM"
        assert {"q", "k", "v", "o", "wi", "wo"} <= set(adapter["target_modules"])
        from peft import PeftModel

        model = PeftModel.from_pretrained(AutoModelForSeq2SeqLM.from_pretrained(t5_dir), str(out))
    else:
        model = AutoModelForSeq2SeqLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    generated = model.generate(**tokenizer(["add 1 and 2"], return_tensors="pt"), max_new_tokens=3)
    assert generated.shape[0] == 1 and 2 <= generated.shape[1] <= 4  # decoder start + 1 to 3 new tokens


def test_tiny_t5_memorises_its_pairs_and_generation_eval_scores_them(t5_dir, pairs_file, tmp_path):
    out = train(recipe(t5_dir, pairs_file, tmp_path / "run", max_steps=120, eval_dataset=str(pairs_file),
                       predict_with_generate=True, max_new_tokens=8, metrics=["exact_match"]))
    assert json.loads((out / "eval_results.json").read_text())["eval_exact_match"] == 1.0
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert sorted((r["reference"], r["prediction"]) for r in records) == sorted((t, t) for _, t in PAIRS)


@pytest.mark.multiprocess
def test_two_process_generation_eval_scores_every_row_once_in_order(tmp_path):
    """`torchrun --nproc_per_node 2 -m sft eval` with predict_with_generate on the embedded tiny T5: 7 eval rows in
    batches of 2 (rank 1's last batch repeats a row to even out) give the one-process predictions.jsonl, row for row,
    and its eval loss; also with dataloader_drop_last, which made one process score 6 rows and two processes 4."""
    import os
    import subprocess
    import sys

    import yaml

    from sft.cli.main import main

    from conftest import REPO

    model = REPO / "data" / "models" / "tiny-t5"
    if not (model / "model.safetensors").exists():
        pytest.skip("embedded tiny T5 not built (scripts/make_tiny_t5.py)")
    lines = (REPO / "data" / "seq2seq_sample.jsonl").read_text().splitlines()[:7]
    (tmp_path / "eval.jsonl").write_text("\n".join(lines) + "\n")
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(yaml.safe_dump({
        "model_name_or_path": str(model), "dataset": str(tmp_path / "eval.jsonl"),
        "eval_dataset": str(tmp_path / "eval.jsonl"), "dtype": "float32", "predict_with_generate": True,
        "max_new_tokens": 6, "generation_num_beams": 2, "per_device_eval_batch_size": 2,
        "dataloader_drop_last": True, "report_to": "none", "use_cpu": True}))
    assert main(["eval", str(recipe_file), "--output_dir", str(tmp_path / "one")]) == 0
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                             "-m", "sft", "eval", str(recipe_file), "--output_dir", str(tmp_path / "two")],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr[-4000:]
    one, two = ([json.loads(line) for line in (tmp_path / run / "predictions.jsonl").open()] for run in ("one", "two"))
    assert [r["reference"] for r in one] == [json.loads(line)["target"] for line in lines]
    assert two == one
    losses = [json.loads((tmp_path / run / "eval_results.json").read_text())["eval_loss"] for run in ("one", "two")]
    assert losses[1] == pytest.approx(losses[0], abs=1e-6)
