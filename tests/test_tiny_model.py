"""The embedded default model (data/models/tiny-llama) and the shipped sample datasets load and behave as documented."""

import json
import os
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]
MODEL_DIR = REPO / "data" / "models" / "tiny-llama"
DATA = REPO / "data"
TEXT = "The capital of France is Paris.  Add 17 and 25:\n\n### Response:42 (tab\there)"

pytestmark = pytest.mark.skipif(not (MODEL_DIR / "config.json").exists(),
                                reason="data/models/tiny-llama not built (run scripts/make_tiny_model.py)")


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def model():
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(MODEL_DIR).eval()


def test_special_tokens_are_distinct(tok) -> None:
    assert tok.is_fast
    assert tok.pad_token == "<pad>" and tok.eos_token == "</s>" and tok.bos_token == "<s>" and tok.unk_token == "<unk>"
    assert tok.pad_token_id != tok.eos_token_id
    assert len({tok.pad_token_id, tok.eos_token_id, tok.bos_token_id, tok.unk_token_id}) == 4
    assert tok.model_max_length == 1024


def test_bos_prepended_and_no_eos_appended(tok) -> None:
    ids = tok("Hello there.")["input_ids"]
    assert ids[0] == tok.bos_token_id and tok.bos_token_id not in ids[1:]
    assert ids[-1] != tok.eos_token_id
    assert tok("Hello there.", add_special_tokens=False)["input_ids"] == ids[1:]


@pytest.mark.parametrize("literal", ["<s>", "</s>", "<pad>", "<|im_start|>", "<|im_end|>"])
def test_special_tokens_in_text_are_single_tokens(tok, literal: str) -> None:
    ids = tok(f"a{literal}b", add_special_tokens=False)["input_ids"]
    assert tok.convert_tokens_to_ids(literal) in ids
    assert tok.convert_ids_to_tokens(ids) == ["a", literal, "b"]


def test_offsets_map_back_to_the_text(tok) -> None:
    enc = tok(TEXT, return_offsets_mapping=True)
    ids, offsets = enc["input_ids"], enc["offset_mapping"]
    assert offsets[0] == (0, 0)  # the BOS covers no characters
    for token_id, (start, end) in zip(ids[1:], offsets[1:]):
        # Byte-level tokens carry their leading space; untrimmed offsets cover exactly what the token decodes to.
        assert tok.decode([token_id]) == TEXT[start:end]
    assert [e for _, e in offsets[1:-1]] == [s for s, _ in offsets[2:]]  # contiguous, no gaps or overlaps
    assert offsets[-1][1] == len(TEXT)


def test_offsets_of_multibyte_characters_cover_the_whole_character(tok) -> None:
    text = "café 😀"
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=False)
    # Rare characters split into several byte tokens; each such token's offsets cover the whole character.
    covered = {text[s:e] for s, e in enc["offset_mapping"]}
    assert "😀" in covered or " 😀" in covered
    assert tok.decode(enc["input_ids"]) == text


def test_chat_template_renders_chatml(tok) -> None:
    messages = [{"role": "user", "content": "Hi!"}, {"role": "assistant", "content": "Hello."}]
    assert tok.apply_chat_template(messages, tokenize=False) == (
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\nHello.<|im_end|>\n")
    prompt = tok.apply_chat_template(messages[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"


def test_model_config_matches_tokenizer(tok, model) -> None:
    config = model.config
    assert config.model_type == "llama" and not config.tie_word_embeddings
    assert config.vocab_size == len(tok) == model.get_input_embeddings().weight.shape[0]
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        tok.bos_token_id, tok.eos_token_id, tok.pad_token_id)
    assert set(model.generation_config.eos_token_id) == {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    assert model.generation_config.pad_token_id == tok.pad_token_id
    assert next(model.parameters()).dtype == torch.float32


def test_model_generates(tok, model) -> None:
    enc = tok(["The capital of France is", "Question: What is 2 plus 3? Answer:"], return_tensors="pt",
              padding=True, padding_side="left")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False)
    assert out.shape[0] == 2 and out.shape[1] > enc["input_ids"].shape[1]
    assert all(tok.decode(row, skip_special_tokens=True).strip() for row in out[:, enc["input_ids"].shape[1]:])


def test_folder_is_small(tok) -> None:
    files = [f for f in MODEL_DIR.rglob("*") if f.is_file()]
    assert any(f.suffix == ".safetensors" for f in files)
    assert sum(f.stat().st_size for f in files) < 8 * 1024 * 1024


@pytest.mark.parametrize("name, columns, rows", [
    ("alpaca_sample.json", {"instruction", "input", "output"}, 400),
    ("chat_sample.jsonl", {"messages"}, 200),
    ("seq2seq_sample.jsonl", {"source", "target"}, 200),
])
def test_sample_datasets_load(name: str, columns: set, rows: int) -> None:
    import datasets

    ds = datasets.load_dataset("json", data_files=str(DATA / name), split="train")
    assert set(ds.column_names) == columns
    assert len(ds) == rows


def test_alpaca_sample_shape() -> None:
    rows = json.loads((DATA / "alpaca_sample.json").read_text(encoding="utf-8"))
    share = sum(bool(r["input"]) for r in rows) / len(rows)
    assert 0.3 <= share <= 0.5
    assert all(r["instruction"].strip() and 1 <= len(r["output"].split()) <= 30 for r in rows)


def test_chat_sample_roles() -> None:
    for line in (DATA / "chat_sample.jsonl").read_text(encoding="utf-8").splitlines():
        messages = json.loads(line)["messages"]
        turns = [m for m in messages if m["role"] != "system"]
        assert messages[0]["role"] in ("system", "user") and 1 <= len(turns) // 2 <= 3
        assert [m["role"] for m in turns] == ["user", "assistant"] * (len(turns) // 2)


def test_pretrain_text_loads() -> None:
    import datasets

    ds = datasets.load_dataset("text", data_files=str(DATA / "pretrain_sample.txt"), split="train")
    assert ds.column_names == ["text"] and len(ds) > 1000
