"""Generation-based evaluation of decoder-only models: prompt-only left-padded generate(), decoding settings,
predictions.jsonl and metrics in eval_results.json, during training and from `sft eval`."""

import json
from pathlib import Path

import datasets
import pytest
import torch
from transformers import DataCollatorForSeq2Seq, GenerationConfig

from sft import SFTConfig, SFTTrainer, build_datasets, load_recipe, rundir, train
from sft.cli.main import main
from sft.data.collators import PackedCollator, PaddingFreeCollator
from sft.data.encode import IGNORE_INDEX
from sft.evaluation.predict import causal_examples, eval_generation_config

from conftest import EMBEDDED_MODEL, make_llama, write_json

# Prompts of different lengths, so left padding is exercised; answers a tiny model can memorise.
QA = [("Q: add 1 and 2\nA:", " 3"), ("Q: the capital of France\nA:", " Paris"), ("Q: hi\nA:", " Hello"),
      ("Q: add 3 and 4\nA:", " 7"), ("Q: what is the weather like today\nA:", " fine"), ("Q: a fox\nA:", " jumps"),
      ("Q: add 5 and 5\nA:", " 10"), ("Q: how are you\nA:", " I am fine")]


@pytest.fixture(scope="module")
def qa_file(tmp_path_factory) -> Path:
    rows = [{"prompt": p, "completion": c} for p, c in QA]
    return write_json(tmp_path_factory.mktemp("qa") / "qa.jsonl", rows, jsonl=True)


def recipe(model_dir: Path, data: Path, out: Path, **overrides) -> SFTConfig:
    values = dict(model_name_or_path=str(model_dir), dataset=str(data), eval_dataset=str(data), output_dir=str(out),
                  report_to="none", save_strategy="no", dtype="float32", per_device_train_batch_size=8,
                  per_device_eval_batch_size=3, predict_with_generate=True, max_new_tokens=6, use_cpu=True)
    return load_recipe({**values, **overrides})


def spy_on_generate(model: torch.nn.Module) -> list[dict]:
    """Record the keyword arguments of every model.generate() call (and still generate, in this one process)."""
    calls: list[dict] = []
    real = model.generate

    def generate(**kwargs):
        calls.append(kwargs)
        return real(**{**kwargs, "synced_gpus": False})  # synced_gpus needs a process group

    model.generate = generate
    return calls


def first_trained(labels: list[int]) -> int:
    return next(i for i, label in enumerate(labels) if label != IGNORE_INDEX)


def test_generate_sees_only_left_padded_prompts(tiny_model_dir, qa_file, tokenizer, tmp_path):
    config = recipe(tiny_model_dir, qa_file, tmp_path)
    _, eval_set = build_datasets(config, tokenizer)
    model = make_llama(len(tokenizer))
    calls = spy_on_generate(model)
    SFTTrainer(model=model, args=config, processing_class=tokenizer, eval_dataset=eval_set).evaluate()

    assert len(calls) == 3  # 8 rows in batches of 3
    rows = [(call["input_ids"][i], call["attention_mask"][i]) for call in calls for i in range(len(call["input_ids"]))]
    assert len(rows) == len(QA)
    for (row_ids, mask), example in zip(rows, eval_set):
        prompt = example["input_ids"][:first_trained(example["labels"])]
        assert row_ids[mask.bool()].tolist() == prompt  # exactly the prompt: no reference token
        assert mask.tolist() == sorted(mask.tolist())  # padding on the left only
        assert len(prompt) < len(example["input_ids"])
    generation = calls[0]["generation_config"]
    assert generation.max_new_tokens == 6 and not generation.do_sample
    assert tokenizer.eos_token_id in generation.eos_token_id and calls[0]["synced_gpus"] is False


def test_sharded_models_generate_with_synced_gpus(tiny_model_dir, qa_file, tokenizer, tmp_path, monkeypatch):
    monkeypatch.setattr("sft.evaluation.predict.is_deepspeed_zero3_enabled", lambda: True)
    config = recipe(tiny_model_dir, qa_file, tmp_path, per_device_eval_batch_size=8)
    model = make_llama(len(tokenizer))
    calls = spy_on_generate(model)
    SFTTrainer(model=model, args=config, processing_class=tokenizer, eval_dataset=build_datasets(config, tokenizer)[1]
               ).evaluate()
    assert [c["synced_gpus"] for c in calls] == [True]


def test_packed_and_padding_free_batches_give_the_same_prompts(qa_file, tiny_model_dir, tokenizer, tmp_path):
    _, eval_set = build_datasets(recipe(tiny_model_dir, qa_file, tmp_path), tokenizer)
    features = [{"input_ids": r["input_ids"], "labels": r["labels"]} for r in eval_set.select(range(3))]
    padded = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=IGNORE_INDEX)(features)
    expected = [[(r["input_ids"][:first_trained(r["labels"])], [t for t in r["labels"] if t != IGNORE_INDEX])]
                for r in features]
    for batch in (padded, PaddingFreeCollator()(features), PackedCollator(tokenizer.pad_token_id)(features)):
        assert [[(e.prompt, e.reference) for e in row] for row in causal_examples(batch)] == expected
    packed_row = {"input_ids": sum((f["input_ids"] for f in features), []),
                  "labels": sum((f["labels"] for f in features), []),
                  "seq_lengths": [len(f["input_ids"]) for f in features]}
    grouped = causal_examples(PackedCollator(tokenizer.pad_token_id)([packed_row]))
    assert [[(e.prompt, e.reference) for e in row] for row in grouped] == [[pair for [pair] in expected]]


def test_decoding_settings_come_from_the_recipe(tiny_model_dir, tokenizer, tmp_path):
    model = make_llama(len(tokenizer))
    model.generation_config.update(do_sample=True, temperature=0.6)
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True, generation_max_length=7,
                     generation_num_beams=3)
    config = eval_generation_config(model, tokenizer, args)
    assert (config.max_new_tokens, config.num_beams, config.do_sample) == (7, 3, False)  # greedy by default
    GenerationConfig(num_beams=2, do_sample=False, eos_token_id=[5], max_new_tokens=50).save_pretrained(tmp_path / "g")
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True, generation_config=str(tmp_path / "g"),
                     max_new_tokens=9)
    config = eval_generation_config(model, tokenizer, args, {"num_beams": 4})
    assert (config.max_new_tokens, config.num_beams) == (9, 4)
    assert set(config.eos_token_id) == {5, tokenizer.eos_token_id}  # the config's stop ids and the tokenizer's EOS


def test_a_recipe_generation_config_without_do_sample_decodes_greedily(tokenizer, tmp_path):
    """generate() takes what a passed config leaves unset from the model's: a sampling model (do_sample, temperature
    0.6, top_p 0.9) sampled under a recipe file setting only no_repeat_ngram_size, 3 seeds giving 3 outputs."""
    model = make_llama(len(tokenizer))
    model.generation_config.update(do_sample=True, temperature=0.6, top_p=0.9)
    (tmp_path / "g").mkdir()
    (tmp_path / "g" / "generation_config.json").write_text('{"no_repeat_ngram_size": 2}')
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True, generation_config=str(tmp_path / "g"),
                     max_new_tokens=12)
    config = eval_generation_config(model, tokenizer, args)
    assert (config.do_sample, config.num_beams, config.no_repeat_ngram_size) == (False, 1, 2)
    prompt = torch.tensor([tokenizer("Q: add 1 and 2\nA:")["input_ids"]])
    outputs = set()
    for seed in range(3):
        torch.manual_seed(seed)
        outputs.add(tuple(model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                         generation_config=config)[0].tolist()))
    assert len(outputs) == 1
    (tmp_path / "g" / "generation_config.json").write_text('{"do_sample": true, "top_k": 5}')
    config = eval_generation_config(model, tokenizer, args)
    assert (config.do_sample, config.top_k, config.num_beams) == (True, 5, 1)  # sampling where the file asks


@pytest.mark.parametrize("saved, flags, expected", [
    ({"max_new_tokens": 40}, {}, 40), ({"max_length": 60}, {}, 60), ({}, {}, 128),
    ({"max_new_tokens": 40}, {"generation_max_length": 7}, 7), ({"max_length": 60}, {"max_new_tokens": 9}, 9)])
def test_a_recipe_generation_configs_length_is_kept(tokenizer, tmp_path, saved, flags, expected):
    """Its max_new_tokens / max_length were replaced by the default 128 (Seq2SeqTrainer uses them where
    generation_max_length is unset); the recipe's own max_new_tokens or generation_max_length still win."""
    model = make_llama(len(tokenizer))
    GenerationConfig(num_beams=2, **saved).save_pretrained(tmp_path / "g")
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True, generation_config=str(tmp_path / "g"),
                     **flags)
    config = eval_generation_config(model, tokenizer, args)
    assert (config.max_new_tokens, config.max_length, config.num_beams) == (expected, None, 2)


def test_a_model_published_with_beam_search_is_evaluated_and_generated_greedily(tokenizer, tmp_path):
    """BART-CNN-style generation configs ask for beams; sft's default decoding is greedy, as documented."""
    from sft.evaluation.generation import GenerationOptions, generation_config

    model = make_llama(len(tokenizer))
    model.generation_config.update(num_beams=4, early_stopping=True)
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True)
    assert eval_generation_config(model, tokenizer, args).num_beams == 1
    assert generation_config(model, tokenizer, GenerationOptions()).num_beams == 1
    assert generation_config(model, tokenizer, GenerationOptions(do_sample=True)).num_beams == 1  # plain sampling
    args = SFTConfig(output_dir=str(tmp_path), predict_with_generate=True, generation_num_beams=2)
    assert eval_generation_config(model, tokenizer, args).num_beams == 2  # the recipe's beams still apply


@pytest.mark.parametrize("model", ["test", "embedded"])
def test_tiny_causal_model_memorises_and_generation_eval_scores_exact_match_1(model, tiny_model_dir, qa_file, tmp_path):
    if model == "embedded" and not (EMBEDDED_MODEL / "config.json").exists():
        pytest.skip("embedded model not built")
    model_dir, steps = (tiny_model_dir, 160) if model == "test" else (EMBEDDED_MODEL, 60)  # pretrained: faster
    out = train(recipe(model_dir, qa_file, tmp_path / "run", max_steps=steps, learning_rate=1e-2,
                       lr_scheduler_type="constant", eval_strategy="steps", eval_steps=steps // 2, logging_steps=20,
                       metrics=["exact_match", "rouge"]))
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    evals = [e for e in history if "eval_loss" in e]
    # halfway, at the end, then the final evaluation; generation metrics logged with eval_loss each time
    assert len(evals) == 3 and all("eval_exact_match" in e and "eval_rougeL" in e for e in evals)
    records = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["reference"] for r in records] == [c for _, c in QA]
    assert [r["prediction"] for r in records] == [c for _, c in QA], records
    assert json.loads((out / "eval_results.json").read_text())["eval_exact_match"] == 1.0


def test_sft_eval_writes_predictions_and_metrics(tiny_model_dir, qa_file, tmp_path, monkeypatch):
    (tmp_path / "usermetrics.py").write_text(
        "def score(predictions, references):\n    return {'answers': len(predictions)}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {qa_file}\neval_dataset: {qa_file}\n"
                           f"output_dir: {tmp_path / 'out'}\nreport_to: none\nuse_cpu: true\n"
                           "metrics: [exact_match, rouge, bleu, 'usermetrics:score']\n")
    code = main(["eval", str(recipe_file), "--predict_with_generate", "true", "--max_new_tokens", "3"])
    assert code == 0
    records = [json.loads(line) for line in (tmp_path / "out" / "predictions.jsonl").read_text().splitlines()]
    assert len(records) == len(QA) and all(set(r) == {"prompt", "reference", "prediction"} for r in records)
    assert records[0]["prompt"].endswith("Q: add 1 and 2\nA:") and records[0]["reference"] == " 3"
    results = json.loads((tmp_path / "out" / "eval_results.json").read_text())
    assert {"eval_loss", "eval_perplexity", "eval_exact_match", "eval_rouge1", "eval_rouge2", "eval_rougeL",
            "eval_bleu", "eval_answers"} <= set(results)
    assert results["eval_answers"] == len(QA)


def test_a_misspelt_metric_stops_training_before_the_model_loads(tiny_model_dir, qa_file, tmp_path, capsys):
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {qa_file}\noutput_dir: {tmp_path / 'o'}\n"
                           "predict_with_generate: true\nmetrics: [exact_match, rogue]\n")
    assert main(["train", str(recipe_file)]) == 2
    assert "Unknown metric `rogue` in `metrics`. Did you mean `rouge`?" in capsys.readouterr().err


@pytest.mark.parametrize("generates, warned", [(False, True), (True, False)])
def test_metrics_without_predict_with_generate_are_warned_about(tiny_model_dir, qa_file, tmp_path, caplog, generates,
                                                                  warned):
    # `sft eval recipe --metrics rouge` without generation reported eval_loss alone and said nothing
    import logging

    from sft.training.flows import check_generation_settings

    config = recipe(tiny_model_dir, qa_file, tmp_path, predict_with_generate=generates, metrics=["rouge", "bleu"])
    with caplog.at_level(logging.WARNING, logger="sft"):
        check_generation_settings(config)
    message = ("`metrics` (rouge, bleu) are computed on generated answers: with predict_with_generate false "
               "evaluation reports the loss only. Pass --predict_with_generate true for them.")
    assert (message in caplog.text) == warned
    caplog.clear()
    check_generation_settings(recipe(tiny_model_dir, qa_file, tmp_path, predict_with_generate=False))
    assert "metrics" not in caplog.text  # none asked for: nothing to say


def test_dataloader_drop_last_drops_no_eval_row(tiny_model_dir, qa_file, tokenizer, tmp_path):
    """dataloader_drop_last is for training batches: eval scores all 8 rows in batches of 3 (the Trainer dropped the
    last 2, so loss and metrics covered 6 rows, and on 2 processes fewer still)."""
    results, records = [], []
    for drop_last in (False, True):
        config = recipe(tiny_model_dir, qa_file, tmp_path / str(drop_last), dataloader_drop_last=drop_last)
        _, eval_set = build_datasets(config, tokenizer)
        trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                             eval_dataset=eval_set)
        results.append(trainer.evaluate())
        records.append([json.loads(line) for line in (tmp_path / str(drop_last) / "predictions.jsonl").open()])
        assert trainer.args.dataloader_drop_last is drop_last  # the training dataloader still drops
    assert [r["reference"] for r in records[1]] == [c for _, c in QA]
    assert records[1] == records[0] and results[1]["eval_loss"] == results[0]["eval_loss"]


def test_group_by_length_keeps_predictions_in_eval_row_order(tiny_model_dir, qa_file, tokenizer, tmp_path):
    """train_sampling_strategy group_by_length groups training batches; the Trainer also length-grouped eval in a
    seeded shuffle, so predictions.jsonl came out in another order than the eval file (the QA prompts differ in
    length: 8 rows in batches of 3)."""
    config = recipe(tiny_model_dir, qa_file, tmp_path, train_sampling_strategy="group_by_length")
    _, eval_set = build_datasets(config, tokenizer)
    SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
               eval_dataset=eval_set).evaluate()
    records = [json.loads(line) for line in (tmp_path / "predictions.jsonl").open()]
    assert [r["reference"] for r in records] == [c for _, c in QA]
    assert [r["prompt"][-len(p):] for r, (p, _) in zip(records, QA)] == [p for p, _ in QA]


def test_an_unreadable_generation_config_is_a_recipe_error(tiny_model_dir, qa_file, tmp_path, capsys):
    """Seq2SeqTrainer reads `generation_config` when it is built: a missing path or a folder without
    generation_config.json was an OSError traceback (exit 1) after tokenizing and loading the model."""
    (tmp_path / "empty").mkdir()
    recipe_file = tmp_path / "recipe.yaml"
    recipe_file.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {qa_file}\neval_dataset: {qa_file}\n"
                           f"output_dir: {tmp_path / 'o'}\nreport_to: none\nuse_cpu: true\npredict_with_generate: true\n")
    for verb in ("train", "eval"):
        assert main([verb, str(recipe_file), "--generation_config", str(tmp_path / "missing")]) == 2
        err = capsys.readouterr().err
        assert (f"sft: error: Bad value for `generation_config`: cannot read a generation config from "
                f"'{tmp_path / 'missing'}' (no such file or folder). Give a folder holding generation_config.json, "
                "that JSON file, or a Hub model id.") in err and "Traceback" not in err
    assert main(["eval", str(recipe_file), "--generation_config", str(tmp_path / "empty")]) == 2
    assert "does not appear to have a file named generation_config.json" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()  # refused before anything ran


@pytest.mark.parametrize("in_a_run", [True, False])
def test_predictions_written_during_training_are_the_runs(tiny_model_dir, qa_file, tokenizer, tmp_path, in_a_run):
    """Every evaluation during training rewrites predictions.jsonl in output_dir; it was recorded as sft's only when
    training ended, so a run killed after an evaluation could not be resumed ('output_dir holds files sft did not
    write: predictions.jsonl'). A folder that is no sft run (a Python user's output_dir) gets no manifest."""
    if in_a_run:
        rundir.claim(tmp_path)
    config = recipe(tiny_model_dir, qa_file, tmp_path)
    _, eval_set = build_datasets(config, tokenizer)
    SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
               eval_dataset=eval_set).evaluate()
    assert (tmp_path / "predictions.jsonl").is_file()
    assert rundir.foreign_entries(tmp_path) == ([] if in_a_run else ["predictions.jsonl"])
    assert rundir.is_run(tmp_path) == in_a_run


def test_a_compute_metrics_generation_would_never_call_is_refused(tokenizer, tmp_path):
    """With predict_with_generate the Trainer is never handed predictions (sft generates and scores texts itself):
    a user's compute_metrics was silently not called, its keys missing from the eval results without a word."""
    from transformers import Seq2SeqTrainingArguments

    from sft import SFTError

    rows = datasets.Dataset.from_list([{"input_ids": [1, 5, 6], "labels": [IGNORE_INDEX, 5, 6]}])
    args = Seq2SeqTrainingArguments(output_dir=str(tmp_path), predict_with_generate=True, use_cpu=True,
                                    report_to="none")
    with pytest.raises(SFTError, match=r"compute_metrics is not called with predict_with_generate.*metrics=\["):
        SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, eval_dataset=rows,
                   compute_metrics=lambda prediction: {"mine": 1.0})
    args.predict_with_generate = False  # on logits it is called, as transformers' Trainer calls it
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, eval_dataset=rows,
                         compute_metrics=lambda prediction: {"mine": float(prediction.predictions.shape[1])})
    assert trainer.evaluate()["eval_mine"] == 3.0
