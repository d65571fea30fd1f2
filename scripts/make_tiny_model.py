"""Build the embedded default model data/models/tiny-llama: a byte-level BPE tokenizer with a ChatML template and a
tiny Llama, both trained in-process on the project's own sample text (CPU, a few minutes, deterministic per seed).

    python scripts/make_sample_data.py          # (re)generate data/*.json[l] and data/pretrain_sample.txt first
    python scripts/make_tiny_model.py [--output data/models/tiny-llama] [--steps N] [--seed S]
"""

import argparse
import json
import math
import os
import random
import shutil
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach a hub
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
from transformers import (  # noqa: E402
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
)

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "data"
BOS, EOS, PAD, UNK = "<s>", "</s>", "<pad>", "<unk>"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# Order fixes the ids: unk 0, bos 1, eos 2 (the Llama convention), pad 3, then the chat tokens.
SPECIAL_TOKENS = [UNK, BOS, EOS, PAD, IM_START, IM_END]
VOCAB_SIZE = 2048  # a multiple of 64, so the model's embedding rows need no padding
MAX_LENGTH = 1024
# Jinja sees the two characters backslash-n, so the saved chat_template.jinja stays one readable line.
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# Only for the tokenizer's training text, so these recurring prompt words get their own tokens; the model's
# pretraining text does not use these templates, so fine-tuning on them visibly changes its behaviour.
ALPACA_HEADER = ("Below is an instruction that describes a task, paired with an input that provides further context. "
                 "Write a response that appropriately completes the request.")


def read_lines(path: Path) -> list[str]:
    """Non-empty lines of a text file."""
    return [line for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def read_jsonl(path: Path) -> list[dict]:
    """Rows of a JSON Lines file."""
    return [json.loads(line) for line in read_lines(path)]


def chatml(messages: list[dict]) -> str:
    """A conversation rendered like CHATML_TEMPLATE does."""
    return "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)


def tokenizer_corpus(data: Path) -> list[str]:
    """The general text plus every sample dataset in the form it will be trained in."""
    texts = read_lines(data / "pretrain_sample.txt")
    for row in json.loads((data / "alpaca_sample.json").read_text(encoding="utf-8")):
        extra = f"### Input:\n{row['input']}\n\n" if row["input"] else ""
        texts.append(f"{ALPACA_HEADER}\n\n### Instruction:\n{row['instruction']}\n\n{extra}### Response:{row['output']}")
    texts += [chatml(row["messages"]) for row in read_jsonl(data / "chat_sample.jsonl")]
    texts += [f"{row['source']}\n{row['target']}" for row in read_jsonl(data / "seq2seq_sample.jsonl")]
    return texts


def train_tokenizer(texts: list[str]) -> PreTrainedTokenizerFast:
    """Byte-level BPE with single-digit numbers, <s> prepended, no EOS appended, and exact character offsets."""
    tok = Tokenizer(models.BPE())
    # Single digits (as Llama does) let a tiny model learn arithmetic digit by digit instead of memorising numbers.
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, min_frequency=2, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    # trim_offsets=False: a token's offsets cover exactly the characters it decodes to, leading space included
    # (trimming would drop the space from " Paris" while the token still carries it).
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B",
                                      special_tokens=[(BOS, tok.token_to_id(BOS))]),
    ])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
                                        unk_token=UNK, additional_special_tokens=[IM_START, IM_END],
                                        model_max_length=MAX_LENGTH)
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def build_model(tokenizer: PreTrainedTokenizerFast, seed: int) -> LlamaForCausalLM:
    """A 4-layer Llama (hidden 128, GQA 4/2 heads) sized to the tokenizer, initialised from `seed`."""
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=MAX_LENGTH, rope_theta=10000.0,
        tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, use_cache=True,
    )
    model = LlamaForCausalLM(config).float()
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, pad_token_id=tokenizer.pad_token_id,
        # Plain-text answers end with </s>, ChatML turns with <|im_end|>; generation stops at either.
        eos_token_id=[tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids(IM_END)],
    )
    return model


def pretrain_blocks(tokenizer: PreTrainedTokenizerFast, data: Path, block: int, seed: int) -> torch.Tensor:
    """The general text as <s> doc </s> token stream cut into (n, block) rows; docs are 1-4 lines joined by newlines."""
    lines = read_lines(data / "pretrain_sample.txt")
    rng = random.Random(seed)
    docs, i = [], 0
    while i < len(lines):
        n = rng.randint(1, 4)  # multi-line documents teach the model what a newline is
        docs.append("\n".join(lines[i:i + n]))
        i += n
    ids: list[int] = []
    for enc in tokenizer(docs, add_special_tokens=True)["input_ids"]:
        ids += enc + [tokenizer.eos_token_id]
    usable = len(ids) // block * block
    return torch.tensor(ids[:usable]).view(-1, block)


def lr_at(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup then cosine decay to 10% of the peak."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def pretrain(model: LlamaForCausalLM, blocks: torch.Tensor, steps: int, batch_size: int, lr: float,
             seed: int) -> float:
    """AdamW over shuffled blocks for `steps` steps; returns the mean loss of the last 20 steps."""
    gen = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    order, cursor, recent = torch.randperm(len(blocks), generator=gen), 0, []
    model.train()
    start = time.time()
    for step in range(steps):
        if cursor + batch_size > len(order):  # next epoch: reshuffle
            order, cursor = torch.randperm(len(blocks), generator=gen), 0
        batch = blocks[order[cursor:cursor + batch_size]]
        cursor += batch_size
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, lr, warmup=max(1, steps // 20))
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        recent = (recent + [loss.item()])[-20:]
        if step % 25 == 0 or step == steps - 1:
            print(f"step {step + 1}/{steps}  loss {loss.item():.3f}  lr {group['lr']:.2e}  "
                  f"{time.time() - start:.0f}s", flush=True)
    model.eval()
    return sum(recent) / len(recent)


def show_samples(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast) -> None:
    """Greedy continuations of a few prompts, to eyeball what the base model learned."""
    prompts = ["Question: What is the capital of France? Answer:", "On Monday, Anna went to the",
               "The opposite of hot is", "Question: Reverse the word: planet Answer:"]
    for prompt in prompts:
        enc = tokenizer(prompt, return_tensors="pt")
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=20, do_sample=False)
        print(f"  {prompt!r} -> {tokenizer.decode(out[0, enc['input_ids'].shape[1]:])!r}")


def folder_size(path: Path) -> int:
    """Total bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DATA / "models" / "tiny-llama")
    parser.add_argument("--data", type=Path, default=DATA, help="folder with the sample datasets")
    parser.add_argument("--steps", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--block-size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args()
    random.seed(args.seed)
    torch.manual_seed(args.seed)

    start = time.time()
    tokenizer = train_tokenizer(tokenizer_corpus(args.data))
    print(f"tokenizer: {len(tokenizer)} tokens (bos {tokenizer.bos_token_id}, eos {tokenizer.eos_token_id}, "
          f"pad {tokenizer.pad_token_id})")
    model = build_model(tokenizer, args.seed)
    blocks = pretrain_blocks(tokenizer, args.data, args.block_size, args.seed)
    print(f"model: {model.num_parameters():,} parameters; pretraining text: {blocks.numel():,} tokens "
          f"in {len(blocks)} blocks of {args.block_size}")
    final = pretrain(model, blocks, args.steps, args.batch_size, args.lr, args.seed)
    show_samples(model, tokenizer)

    if args.output.exists():
        shutil.rmtree(args.output)  # no stale files (e.g. an old tokenizer.model) may survive a rebuild
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    print(f"final loss {final:.3f}; {time.time() - start:.0f}s; saved {args.output} "
          f"({folder_size(args.output) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
