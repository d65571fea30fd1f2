"""Stanford Alpaca compatibility: its command line verbatim, its templates, a [PAD] token, masks from offsets."""

import copy
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from sft.cli.alpaca import alpaca_recipe, main
from sft.data.encode import IGNORE_INDEX, Encoding
from sft.data.formats import ALPACA_PROMPT_INPUT, ALPACA_PROMPT_NO_INPUT, render_alpaca

from conftest import FIXTURES, REPO, make_llama, make_tokenizer, write_json

STANFORD_COMMAND = (
    "--bf16 True --num_train_epochs 3 --per_device_train_batch_size 4 --per_device_eval_batch_size 4 "
    "--gradient_accumulation_steps 8 --evaluation_strategy no --save_strategy steps --save_steps 2000 "
    "--save_total_limit 1 --learning_rate 2e-5 --weight_decay 0. --warmup_ratio 0.03 --lr_scheduler_type cosine "
    "--logging_steps 1 --fsdp").split() + ["full_shard auto_wrap", "--fsdp_transformer_layer_cls_to_wrap",
                                          "LlamaDecoderLayer", "--tf32", "True"]


@pytest.fixture(scope="module")
def alpaca_json(tmp_path_factory):
    rows = json.loads((REPO / "data" / "alpaca_sample.json").read_text())[:40]
    return write_json(tmp_path_factory.mktemp("alpaca") / "alpaca_data.json", rows)


def test_stanford_command_runs_verbatim_on_cpu(tmp_path, tiny_model_dir, alpaca_json):
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(tiny_model_dir), "--data_path", str(alpaca_json), "--output_dir", str(out),
            *STANFORD_COMMAND, "--max_steps", "3"]
    assert main(argv) == 0
    state = json.loads((out / "trainer_state.json").read_text())
    assert state["global_step"] == 3
    assert (out / "model.safetensors").exists() and (out / "checkpoint-3").exists()



@pytest.mark.parametrize("use_cpu", ["True", "false", None])
def test_bf16_with_use_cpu_is_cpu_autocast_not_dropped(use_cpu):
    """Without a GPU, --bf16 True is dropped (a smoke test of a GPU command), but with --use_cpu True it is CPU bf16
    autocast, as in `sft train`; it was dropped there too, and the run trained fp32."""
    argv = ["--bf16", "True", "--tf32", "True"] + (["--use_cpu", use_cpu] if use_cpu else [])
    _, flags = alpaca_recipe(argv, has_gpu=False)
    kept = ["--bf16", "True"] if use_cpu == "True" else []
    assert flags == kept + (["--use_cpu", use_cpu] if use_cpu else [])

def test_pad_token_is_added_with_mean_initialised_rows(tmp_path, alpaca_json):
    tokenizer = make_tokenizer()
    tokenizer.pad_token = None
    model_dir = tmp_path / "no-pad"
    make_llama(len(tokenizer)).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    out = tmp_path / "out"
    argv = ["--model_name_or_path", str(model_dir), "--data_path", str(alpaca_json), "--output_dir", str(out),
            "--max_steps", "1", "--learning_rate", "0", "--save_strategy", "no", "--report_to", "none"]
    assert main(argv) == 0
    saved = AutoTokenizer.from_pretrained(out)
    assert saved.pad_token == "[PAD]" and saved.pad_token_id == len(tokenizer)
    before, after = load_file(model_dir / "model.safetensors"), load_file(out / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        old = before[name]
        assert after[name].shape[0] % 64 == 0 and after[name].shape[0] > old.shape[0]
        assert torch.allclose(after[name][saved.pad_token_id], old.mean(dim=0), atol=1e-4), name
        assert torch.equal(after[name][: old.shape[0]], old)


def stanford_labels(tokenizer, row: dict, max_length: int) -> tuple[list[int], list[int]]:
    """The original train.py preprocessing: tokenize prompt and prompt+output separately, mask len(prompt ids)."""
    template = ALPACA_PROMPT_INPUT if row.get("input", "") != "" else ALPACA_PROMPT_NO_INPUT
    source = template.format_map(row)
    example = source + f"{row['output']}{tokenizer.eos_token}"
    ids = tokenizer(example, max_length=max_length, truncation=True)["input_ids"]
    source_len = len(tokenizer(source, max_length=max_length, truncation=True)["input_ids"])
    labels = copy.deepcopy(ids)
    labels[:source_len] = [IGNORE_INDEX] * source_len
    return ids, labels


def alpaca_rows() -> list[dict]:
    path = FIXTURES / "alpaca" / "alpaca_data_1k.json"
    rows = json.loads(path.read_text()) if path.exists() else json.loads((REPO / "data/alpaca_sample.json").read_text())
    return rows[:300]


def comparison_tokenizer(name: str):
    path = FIXTURES / "tokenizers" / name
    return AutoTokenizer.from_pretrained(path) if path.exists() else make_tokenizer()


def assert_trains_the_whole_output(tokenizer, row: dict, labels: list[int]) -> None:
    """Trained tokens decode to output + EOS, plus at most the prompt characters merged into the first answer token."""
    trained = tokenizer.decode([t for t in labels if t != IGNORE_INDEX]).strip()
    expected = (row["output"] + tokenizer.eos_token).strip()
    assert trained.endswith(expected), (trained[:60], expected[:60])
    merged_prefix = trained[: len(trained) - len(expected)].strip()
    assert ALPACA_PROMPT_NO_INPUT.endswith(merged_prefix) and len(merged_prefix) <= 2, merged_prefix


# TinyLlama-Chat is Llama 2's tokenizer, saved with padding to 2048 and truncation in its tokenizer.json.
@pytest.mark.parametrize("name", ["mistral-7b-instruct-v0.1", "tinyllama-1.1b-chat-v1.0"])
def test_labels_match_the_original_algorithm_except_where_it_is_off_by_one(name):
    tokenizer = comparison_tokenizer(name)
    # The original's tokenizer is its own instance: a call through transformers resets the saved padding.
    reference = comparison_tokenizer(name)
    encoding = Encoding(tokenizer, max_length=512)
    differing = []
    for number, row in enumerate(alpaca_rows(), 1):
        ours = encoding.encode([render_alpaca(row, "alpaca", number, completion_only=True)])
        ids, labels = ours["input_ids"][0], ours["labels"][0]
        ref_ids, ref_labels = stanford_labels(reference, row, 512)
        if not ours["truncated"][0]:
            assert_trains_the_whole_output(tokenizer, row, labels)
        if (ids, labels) != (ref_ids, ref_labels):
            differing.append((number, row, ref_ids, ref_labels, ids, labels))
    for number, row, ref_ids, ref_labels, ids, labels in differing:
        # The original counts the prompt's tokens from a separate tokenization; where the answer's first
        # characters merge with the prompt's last ones, that count is one token off and the mask shifts.
        ref_trained = tokenizer.decode([t for t in ref_labels if t != IGNORE_INDEX])
        print(f"row {number}: original trains {ref_trained[:40]!r}, sft trains "
              f"{tokenizer.decode([t for t in labels if t != IGNORE_INDEX])[:40]!r}")
        assert ref_ids == ids and ref_trained.strip() != (row["output"] + tokenizer.eos_token).strip()
    print(f"{len(differing)} of {len(alpaca_rows())} rows differ from the original algorithm")
