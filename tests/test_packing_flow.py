"""Packing through the whole pipeline: same eval loss packed or not, stats, refusals, bfd_split (long examples
kept whole for the packer to cut, eval data that is not packed truncated)."""

import json

import pytest
from transformers import AutoTokenizer, OPTConfig

from sft.cli.main import main
from sft.data.build import prepare_splits
from sft.training.recipe import load_recipe

from conftest import REPO

ALPACA = REPO / "data" / "alpaca_sample.json"


def recipe(tmp_path, model, **extra) -> str:
    lines = {"model_name_or_path": model, "dataset": ALPACA, "max_length": 128, "output_dir": tmp_path / "out",
             "report_to": "none", "eval_split_size": 0.25, "per_device_eval_batch_size": 8, **extra}
    path = tmp_path / "recipe.yaml"
    path.write_text("".join(f"{k}: {v}\n" for k, v in lines.items()))
    return str(path)


def eval_loss(tmp_path, model, packing: str) -> float:
    out = tmp_path / f"eval-{packing}"
    assert main(["eval", recipe(tmp_path, model), "--packing", packing, "--dtype", "float32",
                 "--output_dir", str(out)]) == 0
    return json.loads((out / "eval_results.json").read_text())["eval_loss"]


def test_packed_eval_loss_equals_unpacked(tmp_path, tiny_model_dir):
    packed, unpacked = eval_loss(tmp_path, tiny_model_dir, "true"), eval_loss(tmp_path, tiny_model_dir, "false")
    assert abs(packed - unpacked) / unpacked < 1e-5


def test_packed_training_reports_packing_stats(tmp_path, tiny_model_dir):
    out = tmp_path / "out"
    assert main(["train", recipe(tmp_path, tiny_model_dir, packing="true", max_steps=2, neftune_noise_alpha=5)]) == 0
    stats = json.loads((out / "data_stats.json").read_text())
    assert 0 < stats["packed_rows"] < stats["rows"] and 0.5 < stats["packing_efficiency"] <= 1.0
    assert stats["packing_efficiency"] == pytest.approx(stats["tokens"] / (stats["packed_rows"] * 128))


def test_packing_is_refused_for_a_family_that_would_mix_examples(tmp_path, tokenizer, capsys, monkeypatch):
    def tokenize(*args, **kwargs):  # the refusal needs only the model's config: it comes before any tokenizing
        raise AssertionError("the data was tokenized before packing was refused")

    monkeypatch.setattr("sft.training.flows.prepare_splits", tokenize)
    folder = tmp_path / "opt"
    OPTConfig(vocab_size=len(tokenizer), hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
              word_embed_proj_dim=32).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    code = main(["train", recipe(tmp_path, folder, packing="true", max_steps=1)])
    assert code == 2 and "Packing is not supported for opt models" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bfd_split_trains_every_chunk_of_long_examples(tmp_path, tiny_model_dir, capsys):
    long_rows = [{"text": " ".join(f"word{i}" for i in range(n))} for n in (300, 40, 500)]
    data = tmp_path / "long.json"
    data.write_text(json.dumps(long_rows))
    base = ["data", recipe(tmp_path, tiny_model_dir, dataset=data, eval_split_size=0), "--json", "--packing", "true"]
    assert main([*base, "--packing_strategy", "bfd_split"]) == 0
    split = json.loads(capsys.readouterr().out)
    assert main([*base, "--packing_strategy", "bfd"]) == 0
    cut = json.loads(capsys.readouterr().out)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    lengths = [len(tokenizer(r["text"])["input_ids"]) + 1 for r in long_rows]  # + EOS
    assert split["tokens"] == sum(lengths) and split["truncated_rows"] == 0
    assert cut["truncated_rows"] == sum(n > 128 for n in lengths) >= 2
    assert cut["tokens"] == sum(min(n, 128) for n in lengths)


@pytest.mark.parametrize("held_out", [{"eval_split_size": 0.25}, {"eval_dataset": ALPACA, "eval_split_size": 0}],
                         ids=["eval_split_size", "eval_dataset"])
def test_bfd_split_truncates_the_eval_data_it_does_not_pack(tmp_path, tiny_model_dir, held_out):
    """bfd_split keeps long examples whole because the packer cuts them into max_length chunks; eval data that is
    not packed (eval_packing: false) reaches the model as it is, so it is truncated and counted like any other."""
    def splits(eval_packing: bool):
        keys = dict(packing="true", packing_strategy="bfd_split", eval_packing=eval_packing, max_length=64, **held_out)
        return prepare_splits(load_recipe(recipe(tmp_path, tiny_model_dir, **keys)))

    (train, packed), (_, unpacked) = splits(True), splits(False)
    longer = sum(n > 64 for n in packed.dataset["length"])
    assert longer > 0 and packed.truncated_rows == packed.dropped_rows == 0  # control: packed eval is kept whole
    assert max(train.dataset["length"]) > 64 and train.truncated_rows == 0  # and so is the training data
    assert max(unpacked.dataset["length"]) <= 64
    assert unpacked.truncated_rows + unpacked.dropped_rows == longer > unpacked.dropped_rows
    assert len(unpacked.dataset) + unpacked.dropped_rows == len(packed.dataset)


def test_the_trainer_packs_rows_from_build_datasets_as_train_does(tmp_path, tokenizer, tiny_model_dir):
    """README's Python API: build_datasets(cfg), then sft.SFTTrainer(args=cfg). With packing: true the trainer
    batched the unpacked rows one example per row (only train() packed): 8 rows where packing makes 4."""
    from transformers import T5Config, T5ForConditionalGeneration

    from sft import SFTError, SFTTrainer, build_datasets
    from sft.data.packing import pack_dataset

    from conftest import make_llama, write_json

    rows = [{"instruction": f"Add {i} and {i + 1}.", "output": str(2 * i + 1)} for i in range(8)]
    config = load_recipe({"model_name_or_path": str(tiny_model_dir), "dataset": str(write_json(tmp_path / "a.json", rows)),
                          "eval_dataset": str(tmp_path / "a.json"), "packing": True, "max_length": 128,
                          "output_dir": str(tmp_path / "out"), "use_cpu": True, "report_to": "none"})
    train_set, eval_set = build_datasets(config, tokenizer)
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                         train_dataset=train_set, eval_dataset=eval_set)
    expected = pack_dataset(train_set, 128, seed=config.seed)
    assert len(trainer.train_dataset) == len(expected) == 4
    assert trainer.train_dataset["input_ids"] == expected["input_ids"]
    assert trainer.train_dataset["position_ids"] == expected["position_ids"]
    assert trainer.eval_dataset["input_ids"] == expected["input_ids"]  # eval_packing follows packing
    again = SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer, train_dataset=expected)
    assert again.train_dataset is expected  # packed already (as train() passes them): kept
    t5 = T5ForConditionalGeneration(T5Config(vocab_size=len(tokenizer), d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                             d_kv=8, decoder_start_token_id=tokenizer.pad_token_id))
    with pytest.raises(SFTError, match="packing and padding_free need a decoder-only model"):
        SFTTrainer(model=t5, args=config, processing_class=tokenizer, train_dataset=train_set)


@pytest.mark.parametrize("flags, warned", [(["--max_length", "48"], True), (["--max_length", "1024"], False),
                                           (["--max_length", "48", "--packing", "true"], False)])
def test_a_max_length_that_cuts_most_rows_is_warned_of(tmp_path, capsys, caplog, flags, warned):
    """max_length far below the data's lengths printed its counts in the stats table and nothing else: `sft train`
    and `sft check` ran on, most answers cut before their EOS. Packing with bfd_split keeps every row whole (no
    warning); past 5% of the rows cut or dropped, it is one warning line with the table's exact counts."""
    import logging

    with caplog.at_level(logging.WARNING, logger="sft"):
        model = REPO / "data" / "models" / "tiny-llama"  # the quickstart's: its rows are 50 tokens at p50, 64 at p95
        assert main(["data", recipe(tmp_path, model, packing_strategy="bfd_split"), "--json", *flags]) == 0
    stats = json.loads(capsys.readouterr().out)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training data:")]
    cut, total = stats["dropped_rows"] + stats["truncated_rows"], stats["rows"] + stats["dropped_rows"]
    if not warned:
        assert lines == [] and cut <= 0.05 * total
        return
    assert cut > 0.05 * total and stats["truncated_rows"] > 0
    expected = (f"Training data: {cut:,} of {total:,} rows ({cut / total:.0%}) do not fit max_length=48: "
                f"{stats['dropped_rows']:,} dropped (no trained token fits), {stats['truncated_rows']:,} cut, each "
                "losing the end of its answer, EOS or end of turn included, which the model then never learns to "
                "write. Raise max_length, or shorten the rows.")
    assert lines == [expected]


def test_the_cut_rows_warning_of_an_encoder_decoder_keeps_its_targets_eos(monkeypatch, capsys, caplog):
    """An encoder-decoder's cut rows lose their source's or target's tail, never the target's EOS (sft.data.seq2seq
    keeps it): the warning does not say the model never learns to stop."""
    import logging

    monkeypatch.chdir(REPO)
    with caplog.at_level(logging.WARNING, logger="sft"):
        assert main(["data", "recipes/quickstart-seq2seq.yaml", "--json", "--max_length", "16"]) == 0
    stats = json.loads(capsys.readouterr().out)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Training data:")]
    cut = stats["truncated_rows"]
    expected = (f"Training data: {cut:,} of {stats['rows']:,} rows ({cut / stats['rows']:.0%}) do not fit "
                f"max_length=16: 0 dropped (no trained token fits), {cut:,} cut, each losing the tail of its source or "
                "target (the target keeps its EOS). Raise max_length, or shorten the rows.")
    assert stats["dropped_rows"] == 0 and lines == [expected]
