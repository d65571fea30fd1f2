"""Generation eval hands generate() the prompt text exactly and scores against the answer text exactly, also where
a real tokenizer merges the prompt's last characters with the answer's first (Qwen / Llama-3 on Alpaca's
`### Response:` + output)."""

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from sft.data.build import build_datasets
from sft.data.formats import ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT
from sft.evaluation.predict import PromptGenerator, answer_offsets, causal_examples
from sft.training.recipe import load_recipe

from conftest import FIXTURES

ALPACA = FIXTURES / "alpaca" / "alpaca_tiny_100.json"
needs_fixtures = pytest.mark.skipif(not ALPACA.is_file(), reason=f"shared fixtures not found at {FIXTURES} "
                                    "(tokenizers and Alpaca rows from /work/shared)")


def prompt_text(row: dict) -> str:
    template = ALPACA_PROMPT_INPUT if row["input"].strip() else ALPACA_PROMPT_NO_INPUT
    return template.format(instruction=row["instruction"], input=row["input"])


def generation_records(tokenizer_dir: Path, tmp_path: Path, with_offsets: bool) -> tuple[list[dict], list[dict]]:
    rows = json.loads(ALPACA.read_text())[:40]
    data = tmp_path / "alpaca.json"
    data.write_text(json.dumps([{k: r[k] for k in ("instruction", "input", "output")} for r in rows]))
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    config = load_recipe({"dataset": str(data), "max_length": 4096, "output_dir": str(tmp_path / "out")})
    train, _ = build_datasets(config, tokenizer)
    generator = PromptGenerator(None, tokenizer, GenerationConfig(eos_token_id=[tokenizer.eos_token_id]), False,
                                offsets=answer_offsets(train) if with_offsets else {})
    records = []
    for example in train:
        batch = {"input_ids": torch.tensor([example["input_ids"]]), "labels": torch.tensor([example["labels"]])}
        (found,), = causal_examples(batch, generator.offsets)
        records.append(generator.record(found, generator.prompt_ids(found), []))
    return rows, records


@needs_fixtures
@pytest.mark.parametrize("name", ["qwen2.5-coder-3b-instruct", "meta-llama-3-8b-instruct"])
def test_prompt_and_reference_are_the_texts_exactly(name, tmp_path):
    rows, records = generation_records(FIXTURES / "tokenizers" / name, tmp_path, with_offsets=True)
    assert [r["prompt"] for r in records] == [prompt_text(row) for row in rows]
    assert [r["reference"] for r in records] == [row["output"] for row in rows]


@needs_fixtures
def test_without_offsets_the_colon_goes_to_the_reference(tmp_path):
    """Negative control: the merged-token rows exist in this data, and cutting at the token boundary gets them
    wrong (prompt without its colon, reference starting with it)."""
    rows, records = generation_records(FIXTURES / "tokenizers" / "qwen2.5-coder-3b-instruct", tmp_path, False)
    wrong = [r for r, row in zip(records, rows) if r["prompt"] != prompt_text(row)]
    assert wrong and all(r["prompt"].endswith("### Response") and r["reference"].startswith(":") for r in wrong)
