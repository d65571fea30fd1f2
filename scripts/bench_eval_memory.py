"""Peak memory of one eval batch through SFTTrainer.evaluate, chunked eval loss vs full-vocabulary logits.

    python scripts/bench_eval_memory.py chunked    # then: python scripts/bench_eval_memory.py plain

4 rows x 512 tokens, a 128k vocabulary (Llama 3) and a 2-layer model: the head's logits dominate. Each mode runs in
its own process because peak RSS never goes down.
"""

import resource
import sys
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from sft import SFTConfig, SFTTrainer

VOCAB, LENGTH, ROWS = 128256, 512, 4


def main(mode: str) -> None:
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    ids = torch.randint(0, VOCAB, (ROWS, LENGTH)).tolist()
    data = datasets.Dataset.from_list([{"input_ids": row, "labels": row} for row in ids])
    tokenizer = AutoTokenizer.from_pretrained(Path(__file__).resolve().parents[1] / "data" / "models" / "tiny-llama")
    args = SFTConfig(output_dir="outputs/bench_eval_memory", per_device_eval_batch_size=ROWS, report_to="none",
                     chunked_loss=mode == "chunked")
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, eval_dataset=data)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    loss = trainer.evaluate()["eval_loss"]
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024
    print(f"{mode}: eval_loss {loss:.5f}, peak RSS grew {grown} MB during evaluate()")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chunked")
