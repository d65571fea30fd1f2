"""sft against TRL's SFTTrainer (the reference a user moves from) on the same job: real Alpaca and chat fixture rows,
real tokenizers, a tiny random Llama with the tokenizer's vocabulary.

The definition both are held to: train exactly the completion / assistant tokens through the token generation stops
on (EOS, the end of turn), and the loss is the mean over the trained tokens of the global batch (micro-batches
under gradient accumulation included). Where TRL differs deliberately, the test asserts the exact difference.
"""

import json
from collections import Counter
from functools import cache
from pathlib import Path
from types import SimpleNamespace

import datasets
import pytest
import torch
from transformers import AutoTokenizer, GenerationConfig

from sft.data.build import build_datasets
from sft.data.encode import IGNORE_INDEX
from sft.data.packing import pack_dataset
from sft.data.tokenizer import load_tokenizer
from sft.training.recipe import load_recipe
from sft.training.trainer import SFTTrainer

from conftest import FIXTURES, make_llama, reference_causal_loss, write_json

trl = pytest.importorskip("trl")
TOKENIZERS = FIXTURES / "tokenizers"
pytestmark = pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizers not found at {TOKENIZERS} "
                                "(the shared fixtures live in ../shared next to the repository; set SFT_FIXTURES)")

# The stop ids of each publisher's generation_config.json (the Hub's, not part of the fixtures): chat turns end there.
STOPS = {"qwen2.5-coder-3b-instruct": [151645, 151643], "phi-3-mini-4k-instruct": [32000, 32001, 32007],
         "llama-3.2-3b-instruct": [128001, 128008, 128009], "mistral-7b-instruct-v0.1": [2],
         "tinyllama-1.1b-chat-v1.0": [2]}


@cache
def real_tokenizer(name: str):
    return AutoTokenizer.from_pretrained(TOKENIZERS / name)


@cache
def alpaca_rows() -> list[dict]:
    return json.loads((FIXTURES / "alpaca" / "alpaca_data_cleaned_first102.json").read_text())


def rows_of(kind: str, n: int) -> list[dict]:
    """Rows a user would give both: prompt/completion derived from Alpaca rows (`merge`: the prompt ends in "\\n" and
    the completion starts with one, so byte-level BPE merges the two into one token), text, or chat conversations."""
    alpaca = alpaca_rows()[:n]
    if kind == "prompt_completion":
        return [{"prompt": r["instruction"] + (f"\n\n{r['input']}" if r["input"] else "") + "\n\n",
                 "completion": r["output"]} for r in alpaca]
    if kind == "merge":
        return [{"prompt": r["instruction"] + "\n", "completion": "\n" + r["output"]} for r in alpaca]
    if kind == "text":
        return [{"text": f"{r['instruction']}\n{r['output']}"} for r in alpaca]
    turns = json.loads((FIXTURES / "datasets" / "chat" / "fastchat_dummy_conversation.json").read_text())[:n]
    roles = {"human": "user", "gpt": "assistant"}
    return [{"messages": [{"role": roles[t["from"]], "content": t["value"]} for t in c["conversations"]]}
            for c in turns]


def model_dir(tmp_path: Path, name: str) -> Path:
    """A saved tiny Llama with the tokenizer's vocabulary and the publisher's stop ids, and the tokenizer."""
    tokenizer, path = real_tokenizer(name), tmp_path / "model"
    model = make_llama(len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    model.generation_config = GenerationConfig(bos_token_id=tokenizer.bos_token_id, eos_token_id=STOPS[name])
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def sft_data(tmp_path: Path, name: str, rows: list[dict], **recipe) -> datasets.Dataset:
    config = load_recipe({"model_name_or_path": str(model_dir(tmp_path, name)), "max_length": 1024,
                          "dataset": str(write_json(tmp_path / "data.json", rows)), **recipe})
    return build_datasets(config, load_tokenizer(config))[0]


def trl_trainer(tmp_path: Path, name: str, rows: list[dict], **settings):
    """TRL's SFTTrainer as its documentation runs it on these rows (its dataset is prepared when it is built)."""
    tokenizer = real_tokenizer(name)
    args = trl.SFTConfig(**{"output_dir": str(tmp_path / "trl"), "report_to": "none", "use_cpu": True,
                            "max_length": 1024, **settings})
    return trl.SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer,
                          train_dataset=datasets.Dataset.from_list(rows))


def trained(labels: list[int]) -> set[int]:
    """Positions whose token is trained. Position 0 never is (nothing predicts it): TRL's text labels keep it, sft's
    mask it; the loss is the same."""
    return {i for i, label in enumerate(labels) if label != IGNORE_INDEX and i > 0}


QUICK = {("prompt_completion", "mistral-7b-instruct-v0.1"),
         ("merge", "qwen2.5-coder-3b-instruct"), ("text", "mistral-7b-instruct-v0.1")}
PLAIN = [("prompt_completion", name) for name in STOPS] + [("merge", "qwen2.5-coder-3b-instruct"),
         ("merge", "mistral-7b-instruct-v0.1")] + [("text", name) for name in STOPS]


@pytest.mark.parametrize("kind, name", [pytest.param(*case, marks=() if case in QUICK else pytest.mark.slow)
                                        for case in PLAIN])
def test_plain_formats_train_the_tokens_trl_trains(tmp_path, kind, name):
    """prompt/completion with completion-only loss, and text: the same input_ids and the same trained positions,
    token by token, on 12 Alpaca rows, also where the prompt's last token merges with the completion's first
    (TRL trains the merged token and so does sft)."""
    rows = rows_of(kind, 12)
    ours = sft_data(tmp_path, name, rows)
    theirs = trl_trainer(tmp_path, name, rows).train_dataset
    assert ours["input_ids"] == theirs["input_ids"]
    assert [trained(x) for x in ours["labels"]] == [trained(x) for x in theirs["labels"]]


def extra_trl_tokens(ours: datasets.Dataset, theirs: datasets.Dataset, tokenizer) -> Counter:
    """(previous token, token) of every position TRL trains and sft does not; sft must train nothing TRL does not."""
    extra = Counter()
    for ids, mine, its in zip(ours["input_ids"], ours["labels"], theirs["labels"]):
        assert trained(mine) <= trained(its)
        extra.update(tuple(tokenizer.convert_ids_to_tokens([ids[i - 1], ids[i]])) for i in trained(its) - trained(mine))
    return extra


def test_chat_assistant_only_loss_against_trls_training_templates(tmp_path):
    """Assistant-only loss on 12 FastChat conversations (39 assistant turns) where TRL has a training template with
    {% generation %} for the tokenizer's own template. Same input_ids; TRL trains every token sft trains, plus tokens
    the model never generates, where sft stops at the turn's stop token (the generation config's eos ids):
    - Qwen2.5: the "\\n" closing the generation prompt `<|im_start|>assistant\\n` and the "\\n" after `<|im_end|>`
      (2 per assistant turn);
    - Phi-3: the `<|endoftext|>` after the last turn's `<|end|>` (1 per conversation), where generation has stopped."""
    rows = rows_of("messages", 12)
    turns = sum(m["role"] == "assistant" for row in rows for m in row["messages"])
    expected = {"qwen2.5-coder-3b-instruct": Counter({("assistant", "Ċ"): turns, ("<|im_end|>", "Ċ"): turns}),
                "phi-3-mini-4k-instruct": Counter({("<|end|>", "<|endoftext|>"): len(rows)})}
    for name, extra in expected.items():
        ours = sft_data(tmp_path / name, name, rows)
        theirs = trl_trainer(tmp_path / name, name, rows, assistant_only_loss=True).train_dataset
        assert ours["input_ids"] == theirs["input_ids"], name
        assert extra_trl_tokens(ours, theirs, real_tokenizer(name)) == extra, name


@pytest.mark.parametrize("name", [pytest.param("llama-3.2-3b-instruct", marks=pytest.mark.slow),  # tiktoken: 5 s
                                  "mistral-7b-instruct-v0.1", "tinyllama-1.1b-chat-v1.0"])
def test_chat_templates_trl_cannot_mask_are_trained_by_sft(tmp_path, name):
    """TRL refuses assistant_only_loss for these publishers' templates (no {% generation %} and no training template
    of its own); sft trains each assistant turn: one trained span per turn, ending at a stop token."""
    rows = rows_of("messages", 6)
    with pytest.raises(ValueError, match="not training-compatible"):
        trl_trainer(tmp_path, name, rows, assistant_only_loss=True)
    ours = sft_data(tmp_path, name, rows)
    for row, ids, labels in zip(rows, ours["input_ids"], ours["labels"]):
        positions = sorted(trained(labels))
        ends = [i for i in positions if i + 1 not in positions]
        assert len(ends) == sum(m["role"] == "assistant" for m in row["messages"])
        assert all(ids[i] in STOPS[name] for i in ends), real_tokenizer(name).convert_ids_to_tokens(ids)


# SGD: the weights move by lr x the gradient, so they compare the gradients. AdamW's first steps move every weight by
# about +-lr whatever its gradient's size, turning float noise in near-zero gradients into +-lr differences (bf16:
# 3.3e-3 apart after 2 AdamW steps at lr 1e-3, 1.9e-4 with SGD at lr 1, where each is 1.4e-4 from its fp32 run).
TRAINING = {"per_device_train_batch_size": 2, "gradient_accumulation_steps": 2, "max_steps": 2, "learning_rate": 1.0,
            "optim": "sgd", "logging_steps": 1, "save_strategy": "no", "seed": 0, "use_cpu": True,
            "train_sampling_strategy": "sequential", "lr_scheduler_type": "constant", "warmup_steps": 0,
            "weight_decay": 0.0}



def run_sft(tmp_path: Path, name: str, rows: list[dict], **settings) -> SFTTrainer:
    config = load_recipe({"model_name_or_path": str(model_dir(tmp_path, name)), "max_length": 1024,
                          "dataset": str(write_json(tmp_path / "data.json", rows)), "output_dir": str(tmp_path / "sft"),
                          "report_to": "none", **(TRAINING | settings)})
    tokenizer = load_tokenizer(config)  # as `sft train` loads it (EOS pads where the tokenizer has no pad token)
    train = build_datasets(config, tokenizer)[0]
    if config.packing:  # as `sft train` packs (sft.training.flows.apply_packing): build_datasets leaves rows unpacked
        train = pack_dataset(train, config.max_length, config.packing_strategy, config.seed)
    trainer = SFTTrainer(model=make_llama(len(tokenizer)), args=config, processing_class=tokenizer,
                         train_dataset=train)
    trainer.train()
    return trainer


def run_trl(tmp_path: Path, name: str, rows: list[dict], **settings):
    trainer = trl_trainer(tmp_path, name, rows, **(TRAINING | settings))
    trainer.train()
    return trainer


def step_losses(trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def max_weight_difference(a, b) -> float:
    theirs = b.model.state_dict()
    return max((tensor - theirs[key]).abs().max().item() for key, tensor in a.model.state_dict().items())


def first_step_reference(name: str, train: datasets.Dataset, rows: int) -> tuple[float, torch.nn.Module]:
    """The definition: summed cross entropy of the first `rows` examples at the initial weights over their trained
    tokens (one example at a time: no padding, no packing), and the model after one SGD step of lr 1 on it."""
    model, losses = make_llama(len(real_tokenizer(name))), []
    examples = train.select(range(rows))
    count = sum(sum(label != IGNORE_INDEX for label in labels[1:]) for labels in examples["labels"])
    for example in examples:
        ids, labels = torch.tensor([example["input_ids"]]), torch.tensor([example["labels"]])
        losses.append(reference_causal_loss(model(input_ids=ids).logits, labels, count))
        losses[-1].backward()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter -= TRAINING["learning_rate"] * parameter.grad
    return sum(loss.item() for loss in losses), model


@pytest.mark.parametrize("bf16", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_loss_and_weights_equal_trls_under_gradient_accumulation(tmp_path, bf16):
    """8 Alpaca prompt/completion rows (Mistral's tokenizer: TRL's LM head is slow on Qwen's 151k vocabulary),
    micro-batches of 2 x accumulation 2, 2 SGD steps from the same random init in the same order: both normalise by
    the trained tokens of the whole accumulated batch (step 1's loss is the definition's), so the per-step losses and
    the final weights agree. Measured: fp32 9e-8 relative and 3.2e-8; bf16 CPU autocast 2.8e-7 and 2.5e-4 (each
    bf16 run is ~2e-4 from its fp32 run)."""
    name, rows = "mistral-7b-instruct-v0.1", rows_of("prompt_completion", 8)
    ours = run_sft(tmp_path / "sft", name, rows, bf16=bf16)
    theirs = run_trl(tmp_path / "trl", name, rows, bf16=bf16)
    assert len(step_losses(ours)) == 2
    assert step_losses(ours) == pytest.approx(step_losses(theirs), rel=1e-6 if not bf16 else 2e-5)
    assert step_losses(ours)[0] == pytest.approx(first_step_reference(name, ours.train_dataset, 4)[0],
                                                 rel=1e-6 if not bf16 else 2e-5)
    assert max_weight_difference(ours, theirs) < (1e-6 if not bf16 else 5e-4)


@pytest.mark.slow
def test_packing_isolates_examples_as_trl_does(tmp_path):
    """16 Alpaca prompt/completion rows packed into 512-token rows (3 rows both), one SGD step over all of them: sft's
    packing and TRL's (bfd, which turns padding_free on) give the loss of the definition (each example alone, the mean
    over all 1129 trained tokens) to 1e-6; sft's weights are the definition's step to 1e-6 (measured 1.5e-8).
    TRL's are 7.3e-5 from it (0.2% of the step's norm), unpacked too (7.4e-5 with one 16-row micro-batch, 7.4e-5 with
    4 x accumulation 4; 1.4e-4 for rows 0-3 as one 4-row micro-batch), while its own compute_loss on a 16-row batch
    at the initial weights gives the definition's gradient to 1e-7 and 2-row micro-batches (the test above) match sft
    to 3e-8: the deviation arises inside its training loop, cause not found (an open finding, not a tolerance)."""
    name, rows = "mistral-7b-instruct-v0.1", rows_of("prompt_completion", 16)
    one_step = {"per_device_train_batch_size": 16, "gradient_accumulation_steps": 1, "max_steps": 1, "max_length": 512}
    ours = run_sft(tmp_path / "sft", name, rows, packing=True, **one_step)
    theirs = run_trl(tmp_path / "trl", name, rows, packing=True, **one_step)
    assert len(ours.train_dataset) == len(theirs.train_dataset) == 3
    reference = SimpleNamespace(model=None)
    loss, reference.model = first_step_reference(name, sft_data(tmp_path / "alone", name, rows), 16)
    assert step_losses(ours)[0] == pytest.approx(loss, rel=1e-6)
    assert step_losses(theirs)[0] == pytest.approx(loss, rel=1e-6)
    assert max_weight_difference(ours, reference) < 1e-6
    assert 1e-5 < max_weight_difference(theirs, reference) < 2e-4
