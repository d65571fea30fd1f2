"""Generation-based evaluation: prompts cut out of eval batches, batched generate(), decoded predictions.

Decoder-only models generate from the tokens before an example's first trained label (the prompt), left-padded so
every prompt ends where generation starts; the reference is the first run of trained labels (the answer and its
EOS / end-of-turn). Encoder-decoder models generate from the whole encoder input; the reference is the labels.
Either way generate() never sees a reference token: transformers' Seq2SeqTrainer would hand a decoder-only model
prompt and answer together.

Where the first trained token merges the prompt's last characters with the answer's first (Qwen and Llama-3 tokenize
Alpaca's `### Response:` + answer with the colon inside the answer's first token), the tokenized data records how
many characters of that token are prompt (`answer_offset`): generate() then gets the prompt text exactly (ending in
the colon) and the reference is the answer text exactly.
"""

import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import datasets
import torch
from accelerate import Accelerator
from torch import nn
from transformers import (
    GenerationConfig,
    PreTrainedTokenizerBase,
    Seq2SeqTrainer,
    Seq2SeqTrainingArguments,
)
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
from transformers.integrations.fsdp import is_fsdp_managed_module

from sft import rundir
from sft.config.arguments import SFTConfig
from sft.data.boundaries import spans
from sft.data.encode import IGNORE_INDEX
from sft.errors import SFTError
from sft.evaluation.generation import GREEDY, decode_reply, decoding_config, dropped_ids, reply_tokens
from sft.evaluation.metrics import compute_metrics, resolve_metrics

DEFAULT_MAX_NEW_TOKENS = 128


@dataclass
class Example:
    """One eval example as token ids: what generate() gets, and the answer it should produce."""

    prompt: list[int]
    reference: list[int]
    prompt_chars: int = 0  # characters of reference[0] that belong to the prompt (see the module docstring)


def causal_example(ids: torch.Tensor, labels: torch.Tensor, offsets: dict[tuple, int] | None = None) -> Example | None:
    """Split one unpadded example at its first trained label; None when nothing in it is trained.

    `offsets` maps an example's token ids to its answer_offset where that is not 0 (see answer_offsets).
    """
    trained = labels != IGNORE_INDEX
    if not trained.any():
        return None
    first = int(trained.nonzero()[0])
    untrained_after = (~trained[first:]).nonzero()
    end = first + int(untrained_after[0]) if len(untrained_after) else len(labels)
    split = offsets.get(tuple(ids.tolist()), 0) if offsets else 0
    return Example(ids[:first].tolist(), labels[first:end].tolist(), split)


def answer_offsets(dataset: Any) -> dict[tuple, int]:
    """{token ids: answer_offset} of the tokenized (unpacked) examples whose answer starts inside a token."""
    if not isinstance(dataset, datasets.Dataset) or "answer_offset" not in dataset.column_names:
        return {}
    table = dataset.select_columns(["input_ids", "answer_offset"]).with_format("arrow")[:]
    offsets = table.column("answer_offset").to_pylist()
    rows = [i for i, offset in enumerate(offsets) if offset]
    ids = table.column("input_ids").take(rows).to_pylist() if rows else []
    return {tuple(row): offsets[i] for i, row in zip(rows, ids)}


def causal_examples(inputs: dict[str, Any], offsets: dict[tuple, int] | None = None) -> list[list[Example]]:
    """The examples of a causal eval batch, grouped by dataset row (a packed row holds several).

    Plain batches drop padding with the attention mask; packed and padding-free batches (position_ids) are split
    into the examples sft.data.boundaries finds. A padding-free batch is one flattened row, so there each example
    is its own group.
    """
    ids, labels = inputs["input_ids"], inputs["labels"]
    if "position_ids" not in inputs:
        mask = inputs.get("attention_mask")
        keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
        rows = [[causal_example(ids[i][keep[i]], labels[i][keep[i]], offsets)] for i in range(ids.shape[0])]
    else:
        rows = [[causal_example(ids[i, a:b], labels[i, a:b], offsets)
                 for a, b in spans(inputs["position_ids"][i])] for i in range(ids.shape[0])]
        if "cu_seq_lens_q" in inputs:  # flattened by the padding-free collator: one example per dataset row
            rows = [[example] for example in rows[0]]
    return [[e for e in row if e is not None] for row in rows]


def seq2seq_examples(inputs: dict[str, Any]) -> list[list[Example]]:
    """The examples of an encoder-decoder eval batch: encoder input (padding dropped) and target labels."""
    ids, labels = inputs["input_ids"], inputs["labels"]
    mask = inputs.get("attention_mask")
    keep = mask.bool() if mask is not None else torch.ones_like(ids, dtype=torch.bool)
    return [[Example(ids[i][keep[i]].tolist(), labels[i][labels[i] != IGNORE_INDEX].tolist())]
            for i in range(ids.shape[0])]


def pad_prompts(prompts: list[list[int]], pad_id: int, left: bool,
                device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids and attention_mask for a batch of prompts, padded on the left or the right."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        span = slice(width - len(prompt), width) if left else slice(0, len(prompt))
        ids[row, span] = torch.tensor(prompt, dtype=torch.long)
        mask[row, span] = 1
    return ids.to(device), mask.to(device)


def read_generation_config(source: str | GenerationConfig) -> GenerationConfig:
    """The recipe's generation_config (a folder holding generation_config.json, that file, or a Hub id), read as
    Seq2SeqTrainer reads it when it is built; what it cannot read is a recipe error, not a traceback."""
    try:
        return Seq2SeqTrainer.load_generation_config(source)
    except (OSError, ValueError) as err:  # missing file or folder, bad Hub id, invalid JSON or settings
        reason = next((line for line in str(err).splitlines() if line.strip()), type(err).__name__)
        if isinstance(source, str) and source.startswith(("/", ".", "~")) and not Path(source).expanduser().exists():
            reason = "no such file or folder"  # not the Hub's complaint about a repo id
        raise SFTError(f"Bad value for `generation_config`: cannot read a generation config from {str(source)!r} "
                       f"({reason}). Give a folder holding generation_config.json, that JSON file, or a Hub model "
                       "id.") from None


def eval_generation_config(model: nn.Module, tokenizer: PreTrainedTokenizerBase, args: Seq2SeqTrainingArguments,
                           overrides: dict[str, Any] | None = None) -> GenerationConfig:
    """Decoding settings for evaluation: the recipe's generation_config (greedy unless it sets do_sample or
    num_beams), else the model's made greedy.

    max_new_tokens (see eval_max_new_tokens) and generation_num_beams apply on top; generation stops at the
    tokenizer's EOS, the config's EOS ids and the chat template's end-of-turn token. `overrides` are generate()
    keyword arguments given to evaluate().
    """
    own = None if args.generation_config is None else read_generation_config(args.generation_config)
    # generate() fills what a config leaves unset (None) from the model's own: a recipe file that does not name
    # do_sample sampled with a model's do_sample/temperature (metrics changing from run to run). Greedy unless asked.
    greedy = GREEDY if own is None else {key: value for key, value in GREEDY.items() if getattr(own, key) is None}
    config = decoding_config(model, tokenizer, own, **greedy, max_length=None,
                             max_new_tokens=eval_max_new_tokens(args, own))
    if args.generation_num_beams is not None:
        config.num_beams = args.generation_num_beams
    config.update(**(overrides or {}))
    return config


def eval_max_new_tokens(args: Seq2SeqTrainingArguments, own: GenerationConfig | None) -> int:
    """The recipe's max_new_tokens, else generation_max_length, else the recipe generation_config's max_new_tokens or
    max_length (as Seq2SeqTrainer reads it when generation_max_length is unset; a length read as new tokens, like
    generation_max_length, so long prompts still get an answer), else DEFAULT_MAX_NEW_TOKENS."""
    recipe = args.max_new_tokens if isinstance(args, SFTConfig) else None
    from_file = None if own is None else own.max_new_tokens or own.max_length
    return recipe or args.generation_max_length or from_file or DEFAULT_MAX_NEW_TOKENS


@dataclass
class PromptGenerator:
    """Batched generation from prompts; returns {prompt, reference, prediction} texts per example."""

    model: nn.Module  # the model whose .generate() runs (the Trainer's, so FSDP/ZeRO-3 wrappers are honoured)
    tokenizer: PreTrainedTokenizerBase
    config: GenerationConfig
    encoder_decoder: bool
    synced_gpus: bool = False  # ZeRO-3 / FSDP: every rank keeps stepping until all have finished
    offsets: dict[tuple, int] = field(default_factory=dict)  # answer_offsets of the eval set
    dropped: set[int] = field(init=False)  # generation.dropped_ids, found once

    def __post_init__(self) -> None:
        self.dropped = dropped_ids(self.tokenizer)

    def examples(self, inputs: dict[str, Any]) -> list[list[Example]]:
        """The batch's examples grouped by dataset row."""
        return seq2seq_examples(inputs) if self.encoder_decoder else causal_examples(inputs, self.offsets)

    def prompt_ids(self, example: Example) -> list[int]:
        """The prompt's tokens; a prompt ending inside the first answer token gets its own last characters back."""
        if not example.prompt_chars:
            return example.prompt
        tail = self.tokenizer.decode(example.reference[:1])[:example.prompt_chars]
        return example.prompt + self.tokenizer.encode(tail, add_special_tokens=False)

    def generate(self, examples: list[Example], device: torch.device | str) -> list[dict[str, str]]:
        """Generate for every example in one batched call and decode prompt, reference and prediction."""
        if not examples:
            return []
        prompts = [self.prompt_ids(e) for e in examples]
        ids, mask = pad_prompts(prompts, self.tokenizer.pad_token_id,
                                left=not self.encoder_decoder, device=device)
        # Eager even where torch_compile compiled the blocks: a KV cache that grows each token would recompile them.
        with torch.no_grad(), full_parameters(self.model), torch.compiler.set_stance("force_eager"):
            output = self.model.generate(input_ids=ids, attention_mask=mask, generation_config=self.config,
                                         synced_gpus=self.synced_gpus)
        per_prompt = self.config.num_return_sequences or 1
        output = output.view(len(examples), per_prompt, -1)[:, 0]  # the best sequence of each prompt
        new_tokens = reply_tokens(output, ids, self.encoder_decoder)
        return [self.record(e, p, tokens.tolist()) for e, p, tokens in zip(examples, prompts, new_tokens)]

    def record(self, example: Example, prompt: list[int], generated: list[int]) -> dict[str, str]:
        """One predictions.jsonl line; reference and prediction end at the first stop token."""
        return {"prompt": self.tokenizer.decode(prompt, skip_special_tokens=False),
                "reference": self.decode_answer(example.reference)[example.prompt_chars:],
                "prediction": self.decode_answer(generated)}

    def decode_answer(self, tokens: list[int]) -> str:
        """Text of the tokens before the first EOS / end-of-turn id, as a reply is decoded (generation.decode_reply:
        special tokens dropped, `<unk>` and reasoning markup kept)."""
        stops = self.config.eos_token_id if isinstance(self.config.eos_token_id, list) else [self.config.eos_token_id]
        end = next((i for i, t in enumerate(tokens) if t in stops), len(tokens))
        return decode_reply(self.tokenizer, tokens[:end], self.dropped)


def full_parameters(model: nn.Module) -> contextlib.AbstractContextManager:
    """FSDP (v1) shards must be gathered for generate(); FSDP2 and ZeRO-3 gather per layer with synced_gpus."""
    if torch.distributed.is_available():
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return FullyShardedDataParallel.summon_full_params(model)
    return contextlib.nullcontext()


def write_predictions(records: list[dict[str, str]], path: Path) -> None:
    """predictions.jsonl: one {prompt, reference, prediction} object per line, written whole then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rundir.write_staged(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))


class GenerationEval:
    """Generation-based evaluation for one trainer: a PromptGenerator per evaluation, the predictions it collects,
    and their metrics (plus predictions.jsonl)."""

    def __init__(self, args: Seq2SeqTrainingArguments, accelerator: Accelerator, eval_dataset: Any) -> None:
        self.args, self.accelerator = args, accelerator
        # Unknown metric names or a bad import path fail here, before any training step.
        self.metric_fns = resolve_metrics(args.metrics if isinstance(args, SFTConfig) else None)
        # Where answers start inside a token; set from the unpacked eval set (use_offsets_of) when eval is packed.
        self.offsets = answer_offsets(eval_dataset)
        self.overrides: dict[str, Any] = {}  # evaluate()'s generate() keyword arguments
        self.generator: PromptGenerator | None = None  # set during an evaluation
        self.predictions: list[dict[str, str]] = []

    def use_offsets_of(self, dataset: Any) -> None:
        """Take the answer offsets of the unpacked eval set (a packed one no longer carries them)."""
        self.offsets = answer_offsets(dataset)

    @contextlib.contextmanager
    def overriding(self, gen_kwargs: dict[str, Any]) -> Iterator[None]:
        """evaluate()'s gen_kwargs on top of the recipe's decoding settings (nested: an eval dict evaluates each)."""
        previous, self.overrides = self.overrides, {**self.overrides, **gen_kwargs}
        try:
            yield
        finally:
            self.overrides = previous

    @contextlib.contextmanager
    def evaluating(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase) -> Iterator[None]:
        """One evaluation: decoding settings from the recipe, a generator for `model` (the Trainer's, wrapped)."""
        unwrapped = self.accelerator.unwrap_model(model)
        config = eval_generation_config(unwrapped, tokenizer, self.args, self.overrides)
        # Sharded parameters are gathered layer by layer on every rank: all ranks must keep stepping together.
        synced = is_deepspeed_zero3_enabled() or is_fsdp_managed_module(model)
        self.generator = PromptGenerator(model, tokenizer, config, unwrapped.config.is_encoder_decoder, synced,
                                         self.offsets)
        self.predictions = []
        try:
            yield
        finally:
            self.generator = None

    def step(self, inputs: dict[str, Any]) -> None:
        """Generate from each example's prompt in a (device-ready) batch and collect the records of all ranks."""
        rows = self.generator.examples(inputs)
        texts = iter(self.generator.generate([e for row in rows for e in row], self.args.device))
        grouped = [[next(texts) for _ in row] for row in rows]
        if self.accelerator.num_processes > 1:  # gather_for_metrics drops the rows repeated to even out batches
            grouped = self.accelerator.gather_for_metrics(grouped, use_gather_object=True)
        self.predictions.extend(record for row in grouped for record in row)

    def metrics(self, prefix: str, main_process: bool) -> dict[str, float]:
        """Metrics of the collected predictions (prefixed); predictions.jsonl written by the main process."""
        if main_process:
            name = rundir.PREDICTIONS if prefix == "eval" else f"{prefix}_{rundir.PREDICTIONS}"
            out = Path(self.args.output_dir)
            write_predictions(self.predictions, out / name)
            if rundir.is_run(out):  # written at every evaluation during training: sft's even if the run is killed
                rundir.claim(out, [name])
        predictions = [r["prediction"] for r in self.predictions]
        references = [r["reference"] for r in self.predictions]
        values = compute_metrics(self.metric_fns, predictions, references)
        return {f"{prefix}_{key}": value for key, value in values.items()}
