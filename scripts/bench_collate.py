"""Host time per training batch for the issue-19 job shape: fetching 8 packed rows of 2048 tokens from the dataset
and collating them (PackedCollator, PaddingFreeCollator, each also under HostCount as SFTTrainer runs them).

With dataloader_num_workers 0 this runs in the training process between steps, while the GPU waits for the next
batch; compare the numbers with the step time (a 0.5B full fine-tune step of 8x2048 tokens on an H100 is roughly
0.3-0.5 s).

`--trainer` times instead what the host does between two optimizer steps of SFTTrainer on the same batches: from
one step's end (on_step_end) to the next forward's start: the batch, the Trainer's bookkeeping, callbacks and
progress bar. A model 16 wide with 24 layers and Qwen2.5's vocabulary keeps the CPU's compute out of that window
(it lies outside it anyway). Where the host waits for the GPU at each step's end, the GPU is idle that long.

Usage: python scripts/bench_collate.py [--rows 8] [--max_length 2048] [--repeats 30] [--trainer]
Needs ../shared/fixtures or $SFT_FIXTURES (the 1k Alpaca sample and the Qwen2.5 tokenizer folder; both are in
scripts/gpu_carry.py's .gpu/fixtures).
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import datasets
from transformers import DataCollatorWithFlattening

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench_packing import FIXTURES, load_tokenized

from sft.data.boundaries import spans
from sft.data.collators import HostCount, PackedCollator, PaddingFreeCollator, example_row
from sft.data.packing import pack_dataset

datasets.disable_progress_bars()

TOKENIZER = FIXTURES / "tokenizers" / "qwen2.5-coder-3b-instruct"


def packed_rows(max_length: int) -> datasets.Dataset:
    """The 1k Alpaca rows (x4), rendered with the Stanford templates, tokenized with completion-only labels and
    packed into rows of max_length; the columns the Trainer keeps (seq_lengths is not a forward argument)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    tokenized = load_tokenized(4000, max_length, tokenizer)
    return pack_dataset(tokenized, max_length).remove_columns("seq_lengths"), tokenizer.pad_token_id


def per_call_ms(fn, batches: list, repeats: int) -> tuple[float, float]:
    """(median, min) milliseconds of fn(batch) over repeats passes through the batches."""
    times = []
    for _ in range(repeats):
        for batch in batches:
            start = time.perf_counter()
            fn(batch)
            times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times), min(times)


def library_flattening(features: list[dict]) -> dict:
    """What PaddingFreeCollator did before it built tensors itself: split rows into examples, then transformers'
    DataCollatorWithFlattening (Python lists per token); the output is the same."""
    examples = []
    for feature in features:
        ids, labels, pos = example_row(feature)
        examples += [{"input_ids": ids[a:b], "labels": labels[a:b]} for a, b in spans(pos)]
    return DataCollatorWithFlattening(return_flash_attn_kwargs=True)(examples)


def trainer_gaps(ds: datasets.Dataset, rows: int, max_length: int, steps: int = 12) -> None:
    """Print the milliseconds from each optimizer step's end to the next forward's start (after 2 warm-up steps)."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, TrainerCallback

    from sft import SFTConfig, SFTTrainer

    config = Qwen2Config(vocab_size=151936, hidden_size=16, intermediate_size=32, num_hidden_layers=24,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=max_length)
    model = Qwen2ForCausalLM(config)
    ends, starts = [], []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    model.register_forward_pre_hook(lambda module, inputs: starts.append(time.perf_counter()))
    args = SFTConfig(output_dir=tempfile.mkdtemp(prefix="sft-gaps-"), per_device_train_batch_size=rows,
                     max_steps=steps, logging_steps=10, save_strategy="no", report_to="none", use_cpu=True,
                     packing=True, max_length=max_length)
    trainer = SFTTrainer(model=model, args=args, processing_class=AutoTokenizer.from_pretrained(TOKENIZER),
                         train_dataset=ds, callbacks=[StepEnds()])
    trainer.train()
    gaps = [(start - end) * 1e3 for end, start in zip(ends[2:], starts[3:])]
    print(f"host time from a step's end to the next forward, {len(gaps)} steps of {rows} x {max_length} tokens: "
          f"median {statistics.median(gaps):.1f} ms, min {min(gaps):.1f}, max {max(gaps):.1f}")


def busy(seconds: float) -> None:
    """Keep this core busy (a training process launching kernels), unlike sleep, which lets the CPU clock down."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def next_ms(ds: datasets.Dataset, collator, rows: int, workers: int, step_s: float, batches: int) -> float:
    """Median milliseconds the training process waits in next() for a batch from a DataLoader with `workers`
    worker processes, while a simulated GPU step of step_s seconds runs between batches."""
    from torch.utils.data import DataLoader

    loader = DataLoader(ds, batch_size=rows, collate_fn=collator, num_workers=workers,
                        persistent_workers=workers > 0, shuffle=True)
    waits = []
    for _ in range(2):  # the second epoch shows persistent workers (no restart)
        it = iter(loader)
        for _ in range(min(batches, len(loader))):
            start = time.perf_counter()
            next(it)
            waits.append((time.perf_counter() - start) * 1e3)
            busy(step_s)
    return statistics.median(waits[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=8, help="packed rows per batch")
    parser.add_argument("--max_length", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--step_s", type=float, default=0.05, help="simulated GPU step between batches (DataLoader)")
    parser.add_argument("--trainer", action="store_true", help="time the host's gap between SFTTrainer's steps")
    args = parser.parse_args()
    ds, pad_id = packed_rows(args.max_length)
    if args.trainer:
        return trainer_gaps(ds, args.rows, args.max_length)
    starts = range(0, len(ds) - args.rows + 1, args.rows)
    index_batches = [list(range(s, s + args.rows)) for s in starts]
    feature_batches = [ds.__getitems__(idx) for idx in index_batches]
    tokens = sum(len(f["input_ids"]) for f in feature_batches[0])
    print(f"{len(ds)} packed rows of <= {args.max_length} tokens; batches of {args.rows} rows "
          f"({tokens} tokens in the first); {len(index_batches)} batches x {args.repeats} repeats")
    print(f"{'step':44s} {'median ms':>10s} {'min ms':>8s}")
    median, best = per_call_ms(ds.__getitems__, index_batches, args.repeats)
    print(f"{'fetch rows (Dataset.__getitems__)':44s} {median:10.2f} {best:8.2f}")
    collators = {
        "DataCollatorWithFlattening (library)": library_flattening,
        "PackedCollator": PackedCollator(pad_id),
        "HostCount(PackedCollator)": HostCount(PackedCollator(pad_id)),
        "PaddingFreeCollator": PaddingFreeCollator(),
        "HostCount(PaddingFreeCollator)": HostCount(PaddingFreeCollator()),
    }
    for name, collator in collators.items():
        median, best = per_call_ms(collator, feature_batches, args.repeats)
        print(f"{'collate ' + name:44s} {median:10.2f} {best:8.2f}")
    print(f"DataLoader, fetch + collate, {args.step_s * 1e3:.0f} ms of simulated GPU work between batches: "
          "median ms the training process waits in next()")
    for name in ("PackedCollator", "PaddingFreeCollator"):
        collator = HostCount(PackedCollator(pad_id) if name == "PackedCollator" else PaddingFreeCollator())
        for workers in (0, 1, 2):
            wait = next_ms(ds, collator, args.rows, workers, args.step_s, batches=12)
            print(f"{f'  HostCount({name}), num_workers={workers}':44s} {wait:10.2f}")


if __name__ == "__main__":
    main()
