"""Build data/models/tiny-t5: a randomly initialised 2+2-layer T5 (d_model 64, under 1 MB) for the seq2seq quickstart.

It uses the project's own byte-level BPE tokenizer (the one scripts/make_tiny_model.py trains for tiny-llama, rebuilt
here from the same sample text, so the two models share a vocabulary), without the chat template. T5 starts decoding
from the pad token. Deterministic per seed; seconds on a CPU.

    python scripts/make_tiny_t5.py [--output data/models/tiny-t5] [--seed S]
"""

import argparse
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything is built locally; never reach a hub

import torch  # noqa: E402
from make_tiny_model import DATA, folder_size, tokenizer_corpus, train_tokenizer  # noqa: E402  (same folder)
from transformers import (  # noqa: E402
    GenerationConfig,
    PreTrainedTokenizerFast,
    T5Config,
    T5ForConditionalGeneration,
)

SIZE_LIMIT = 2 * 1024 * 1024  # the embedded model must stay small enough to live in the repository


def build_t5(tokenizer: PreTrainedTokenizerFast, seed: int) -> T5ForConditionalGeneration:
    """A T5 v1.0-style model (ReLU feed-forward, tied embeddings) sized to the tokenizer."""
    torch.manual_seed(seed)
    config = T5Config(vocab_size=len(tokenizer), d_model=64, d_ff=128, d_kv=16, num_heads=4, num_layers=2,
                      num_decoder_layers=2, pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                      decoder_start_token_id=tokenizer.pad_token_id)
    model = T5ForConditionalGeneration(config).float()
    model.generation_config = GenerationConfig(decoder_start_token_id=tokenizer.pad_token_id,
                                               eos_token_id=tokenizer.eos_token_id,
                                               pad_token_id=tokenizer.pad_token_id)
    return model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", type=Path, default=DATA / "models" / "tiny-t5")
    parser.add_argument("--data", type=Path, default=DATA, help="folder with the sample datasets")
    parser.add_argument("--seed", type=int, default=1234)
    args = parser.parse_args()
    tokenizer = train_tokenizer(tokenizer_corpus(args.data))
    tokenizer.chat_template = None  # seq2seq data has no conversations
    model = build_t5(tokenizer, args.seed)
    args.output.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.output)
    tokenizer.save_pretrained(args.output)
    size = folder_size(args.output)
    print(f"tiny-t5: {model.num_parameters():,} parameters, vocabulary {len(tokenizer)}, {size / 1e6:.2f} MB "
          f"-> {args.output}")
    if size > SIZE_LIMIT:
        raise SystemExit(f"{args.output} is {size / 1e6:.1f} MB, over the {SIZE_LIMIT / 1e6:.0f} MB limit")


if __name__ == "__main__":
    main()
