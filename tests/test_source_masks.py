"""Masking decided per source, and EOS trained exactly once whoever appends it (sft or the tokenizer)."""

import pytest
from transformers import AutoTokenizer

from sft import load_recipe
from sft.data.build import prepare_splits
from sft.data.encode import IGNORE_INDEX
from sft.data.formats import ALPACA_PROMPT_NO_INPUT

from conftest import FIXTURES, write_json

TEXT = [{"text": "The quick brown fox jumps over the lazy dog."}]
ALPACA = [{"instruction": "Say hello.", "input": "", "output": "Hello, how are you today?"}]
MISTRAL = FIXTURES / "tokenizers" / "mistral-7b-instruct-v0.1"


def build(tmp_path, tiny_model_dir, tokenizer, order: list[str], **keys):
    files = {"text": write_json(tmp_path / "text.jsonl", TEXT, jsonl=True),
             "alpaca": write_json(tmp_path / "alpaca.json", ALPACA)}
    config = load_recipe({"model_name_or_path": str(tiny_model_dir), "dataset": [str(files[n]) for n in order],
                          "output_dir": str(tmp_path / "out"), "report_to": "none", **keys})
    train, _ = prepare_splits(config, tokenizer)
    rows = {name: train.dataset[i] for i, name in enumerate(order)}
    return rows, train.sources, config


def expected_rows(tokenizer) -> dict[str, tuple[list[int], list[int]]]:
    """input_ids and labels built by hand from separately tokenized pieces; EOS is the last token, trained."""
    eos = tokenizer.eos_token_id
    text_ids = tokenizer(TEXT[0]["text"])["input_ids"]
    text_ids = text_ids if text_ids[-1] == eos else text_ids + [eos]
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=ALPACA[0]["instruction"])
    alpaca_ids = tokenizer(prompt + ALPACA[0]["output"])["input_ids"]
    alpaca_ids = alpaca_ids if alpaca_ids[-1] == eos else alpaca_ids + [eos]
    prompt_ids = tokenizer(prompt)["input_ids"]  # BOS + prompt (+ EOS with add_eos_token, not part of the prompt)
    n_prompt = len(prompt_ids) - (prompt_ids[-1] == eos)
    return {"text": (text_ids, [IGNORE_INDEX] + text_ids[1:]),
            "alpaca": (alpaca_ids, [IGNORE_INDEX] * n_prompt + alpaca_ids[n_prompt:])}


@pytest.mark.parametrize("order", [["text", "alpaca"], ["alpaca", "text"]])
def test_each_source_gets_its_own_masking(tmp_path, tiny_model_dir, tokenizer, order):
    rows, sources, config = build(tmp_path, tiny_model_dir, tokenizer, order)
    for name, (ids, labels) in expected_rows(tokenizer).items():
        assert rows[name]["input_ids"] == ids and rows[name]["labels"] == labels, name
    assert {s.format: s.completion_only_loss for s in sources} == {"text": False, "alpaca": True}
    assert config.dataset_format == "auto" and config.completion_only_loss is None  # decided, not written back


def test_an_explicit_completion_only_loss_applies_to_every_source(tmp_path, tiny_model_dir, tokenizer):
    rows, _, _ = build(tmp_path, tiny_model_dir, tokenizer, ["text", "alpaca"], completion_only_loss=False)
    ids, _ = expected_rows(tokenizer)["alpaca"]
    assert rows["alpaca"]["labels"] == [IGNORE_INDEX] + ids[1:]  # the prompt is trained, as asked


@pytest.fixture(scope="module")
def mistral_tokenizers():
    if not (MISTRAL / "tokenizer.json").exists():
        pytest.skip(f"needs the Mistral tokenizer fixture at {MISTRAL} (set SFT_FIXTURES to the fixtures folder)")
    plain = AutoTokenizer.from_pretrained(MISTRAL)
    # transformers drops BOS when only add_eos_token is given; both flags are what such a tokenizer_config holds
    appending = AutoTokenizer.from_pretrained(MISTRAL, add_eos_token=True, add_bos_token=True)
    for tok in (plain, appending):
        tok.pad_token = tok.eos_token
    return plain, appending


def test_eos_appended_by_the_tokenizer_is_trained_once(tmp_path, tiny_model_dir, mistral_tokenizers):
    plain, appending = mistral_tokenizers
    eos = appending.eos_token_id
    assert appending("hi")["input_ids"][-1] == eos and plain("hi")["input_ids"][-1] != eos  # the premise
    rows, _, _ = build(tmp_path, tiny_model_dir, appending, ["text", "alpaca"])
    for name, (ids, labels) in expected_rows(appending).items():
        row = rows[name]
        assert row["input_ids"] == ids and row["labels"] == labels, name
        assert row["input_ids"].count(eos) == 1 and row["labels"][-1] == eos, name  # once, and trained
    # sft appending EOS itself (plain tokenizer) gives exactly the same tokens and labels
    (tmp_path / "plain").mkdir()
    assert build(tmp_path / "plain", tiny_model_dir, plain, ["text", "alpaca"])[0] == rows
