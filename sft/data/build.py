"""build_datasets: recipe sources -> tokenized train/eval datasets with input_ids and labels (-100 = not trained)."""

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from sft.config.arguments import SFTConfig
from sft.data import chat as chat_module
from sft.data import chat_templates as templates_module
from sft.data import encode as encode_module
from sft.data import formats as formats_module
from sft.data import messages as messages_module
from sft.data import seq2seq as seq2seq_module
from sft.data.chat import ChatRenderer
from sft.data.chat_templates import generation_eos
from sft.data.encode import Encoding
from sft.data.formats import (
    CHAT_FORMATS,
    Rendered,
    check_columns,
    check_sft_data,
    default_completion_only,
    detect_format,
    row_renderer,
)
from sft.data.seq2seq import Seq2SeqEncoding, pair_renderer
from sft.data.sources import Source, load_source, parse_sources, repeat_by_weight
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.models.loading import is_encoder_decoder

COUNT_COLUMNS = ["truncated", "reasoning", "split"]  # per-example counts summed into Prepared, then removed


@dataclass
class SourceFormat:
    """What data building decided for one source: its format and whether only its completions are trained."""

    source: str
    format: str
    completion_only_loss: bool

    def __str__(self) -> str:
        return f"{self.source}: {self.format}" + (", completion only" if self.completion_only_loss else "")


@dataclass
class Prepared:
    """A tokenized dataset, how many rows were dropped or truncated on the way, and each source's format."""

    dataset: datasets.Dataset
    dropped_rows: int
    truncated_rows: int
    sources: list[SourceFormat] = field(default_factory=list)
    reasoning_tokens: int = 0  # trained tokens inside reasoning blocks (chat data)
    split_rows: int = 0  # extra examples made by `history: split` (chat data)


def build_datasets(config: SFTConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                   ) -> tuple[datasets.Dataset, datasets.Dataset | None]:
    """Tokenized (train, eval) datasets for a recipe; eval is None when the recipe asks for none.

    Args:
        config: the validated recipe (see load_recipe).
        tokenizer: the tokenizer to use; loaded from the recipe when omitted.
    """
    train, evaluation = prepare_splits(config, tokenizer)
    return train.dataset, evaluation.dataset if evaluation else None


def prepare_splits(config: SFTConfig, tokenizer: PreTrainedTokenizerBase | None = None,
                   ) -> tuple[Prepared, Prepared | None]:
    """Train and eval data with their drop/truncation counts."""
    if tokenizer is None:
        tokenizer = load_tokenizer(config)
    model = ModelFacts.of(config)
    train = prepare(parse_sources(config.dataset), config, tokenizer, model)
    if config.eval_dataset is not None:
        if config.eval_split_size:
            raise SFTError("Set either `eval_dataset` or `eval_split_size`, not both.")
        return train, prepare(parse_sources(config.eval_dataset, "eval_dataset"), config, tokenizer, model)
    if not config.eval_split_size:
        return train, None
    return split_off_eval(train, config.eval_split_size, config.seed)


@dataclass(frozen=True)
class ModelFacts:
    """What the data needs to know of the recipe's model, read once per build (not once per source)."""

    encoder_decoder: bool
    generation_eos: int | list[int] | None  # its generation config's stop ids: chat turns end at them

    @classmethod
    def of(cls, config: SFTConfig) -> "ModelFacts":
        return cls(is_encoder_decoder(config), generation_eos(config.model_name_or_path))


def prepare(sources: list[Source], config: SFTConfig, tokenizer: PreTrainedTokenizerBase,
            model: ModelFacts) -> Prepared:
    """Load, render, tokenize and weight every source, then concatenate them."""
    parts = [prepare_source(s, config, tokenizer, model) for s in sources]
    dataset = datasets.concatenate_datasets([p.dataset for p in parts]) if len(parts) > 1 else parts[0].dataset
    if len(dataset) == 0:
        raise SFTError(f"No training rows left in {', '.join(s.label for s in sources)}: every row was dropped "
                       f"(no trained token within max_length={config.max_length}). Raise max_length or check the data.")
    return Prepared(dataset, sum(p.dropped_rows for p in parts), sum(p.truncated_rows for p in parts),
                    sources=[decided for p in parts for decided in p.sources],
                    reasoning_tokens=sum(p.reasoning_tokens for p in parts),
                    split_rows=sum(p.split_rows for p in parts))


def prepare_source(source: Source, config: SFTConfig, tokenizer: PreTrainedTokenizerBase,
                   model: ModelFacts) -> Prepared:
    """One source: detect its format, tokenize it in batches, count what was dropped or truncated."""
    raw = load_source(source)
    if len(raw) == 0:
        raise SFTError(f"Dataset {source.label} has no rows.")
    check_sft_data(raw.column_names, raw[0], source.label)  # DPO/KTO/image rows are refused, not half-trained
    fmt = resolve_format(config, raw.column_names, source.label)
    # Decided per source: in `[text.jsonl, alpaca.json]` the text is trained whole, the Alpaca prompts are not.
    decided = SourceFormat(source.label, fmt, default_completion_only(fmt) if config.completion_only_loss is None
                           else config.completion_only_loss)
    if model.encoder_decoder:  # T5, BART, ...: source -> encoder input_ids, target + EOS -> labels
        render, encoding = pair_renderer(fmt), Seq2SeqEncoding(tokenizer, config.max_length, config.truncation_side)
    else:
        render = make_renderer(config, decided, tokenizer, raw, model.generation_eos)
        splits = config.packing and config.packing_strategy == "bfd_split"  # the packer cuts long examples into chunks
        encoding = Encoding(tokenizer, sys.maxsize if splits else config.max_length, config.truncation_side)
    tokenized = raw.map(
        encode_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
        num_proc=config.dataset_num_proc, desc=f"Tokenizing {source.label}",
        fn_kwargs={"render": render, "encoding": encoding, "where": source.label},
        new_fingerprint=cache_fingerprint(raw, tokenizer, config, decided, encoding, model),
    )
    # Examples are rendered rows plus the extra ones `history: split` made, counted before any is dropped: a split
    # example with nothing trained is a lost example, not a row that was never made.
    split_rows = column_sum(tokenized, "split")
    tokenized = trained_examples(tokenized)
    if len(tokenized) == 0:
        raise SFTError(f"Dataset {source.label}: all {len(raw)} rows were dropped because no trained token fits in "
                       f"max_length={config.max_length}. Raise max_length or shorten the prompts.")
    truncated, reasoning = column_sum(tokenized, "truncated"), column_sum(tokenized, "reasoning")
    tokenized = tokenized.remove_columns([c for c in COUNT_COLUMNS if c in tokenized.column_names])
    dropped = len(raw) + split_rows - len(tokenized)  # examples with nothing trained, rows that rendered none
    return Prepared(repeat_by_weight(tokenized, source.weight, config.seed), dropped, truncated,
                    sources=[decided], reasoning_tokens=reasoning, split_rows=split_rows)


def column_sum(dataset: datasets.Dataset, name: str) -> int:
    """The sum of a count column (0 where the encoding writes none), in Arrow: no per-row Python iteration."""
    return (pc.sum(dataset.with_format("arrow")[name]).as_py() or 0) if name in dataset.column_names else 0


def trained_examples(tokenized: datasets.Dataset) -> datasets.Dataset:
    """The examples with a trained token (the others teach nothing), without the `trained` column."""
    trained = np.asarray(tokenized.with_format("arrow")["trained"].to_numpy())
    if not trained.all():
        tokenized = tokenized.select(np.flatnonzero(trained))
    return tokenized.remove_columns("trained")


CACHE_FIELDS = ("completion_only_loss", "max_length", "truncation_side", "assistant_only_loss", "chat_template",
                "train_on_last_turn_only", "no_assistant_turn", "history", "packing", "packing_strategy")


def cache_fingerprint(raw: datasets.Dataset, tokenizer: PreTrainedTokenizerBase, config: SFTConfig,
                      decided: SourceFormat, encoding: Encoding | Seq2SeqEncoding, model: ModelFacts) -> str:
    """Cache key of the tokenized data: the raw data, the tokenizer, the recipe fields that matter and sft's code.

    datasets would otherwise hash the mapped function with dill (the tokenizer object included), which costs more
    than re-reading a cached result; this key is cheap and changes whenever any input of the result changes.
    """
    modules = (encode_module, formats_module, seq2seq_module, chat_module, messages_module, templates_module,
               sys.modules[__name__])
    code = [Path(module.__file__).read_bytes() for module in modules]
    tok = [tokenizer.backend_tokenizer.to_str(), str(tokenizer.chat_template), str(tokenizer.special_tokens_map),
           type(tokenizer).__name__]
    fields = [decided.format, decided.completion_only_loss, type(encoding).__name__,
              *(str(getattr(config, name)) for name in CACHE_FIELDS)]
    if decided.format in CHAT_FORMATS or decided.format == "prompt_completion":  # chat turns end at these stops
        fields.append(str(model.generation_eos))
    return Hasher.hash([raw._fingerprint, tok, fields, code])


def resolve_format(config: SFTConfig, columns: list[str], where: str) -> str:
    """The recipe's dataset_format, or the one detected from this source's columns."""
    fmt = detect_format(columns, where) if config.dataset_format == "auto" else config.dataset_format
    check_columns(fmt, columns, where)
    return fmt


def make_renderer(config: SFTConfig, decided: SourceFormat, tokenizer: PreTrainedTokenizerBase,
                  raw: datasets.Dataset, eos: int | list[int] | None) -> Callable:
    """The row -> Rendered function for this source's format; chat data renders through the chat template and ends
    turns at the stop tokens (`eos`: the model's generation-config stop ids, chat_templates.generation_eos)."""
    fmt = decided.format
    conversational = fmt in CHAT_FORMATS or (fmt == "prompt_completion" and isinstance(raw[0]["prompt"], list))
    chat = None
    if conversational:
        chat = ChatRenderer(tokenizer, config.chat_template, config.assistant_only_loss,
                            config.train_on_last_turn_only, config.no_assistant_turn, config.history, eos)
    return row_renderer(fmt, decided.completion_only_loss, chat)


def encode_batch(batch: dict, indices: list[int], render: Callable, encoding: Encoding, where: str) -> dict:
    """datasets.map body: render each row, tokenize the batch; examples with nothing trained are kept here (with
    `trained` 0) so that they are counted before they are dropped (trained_examples)."""
    keys = list(batch)
    rows: list[Rendered] = []
    for i, index in enumerate(indices):
        out = render({k: batch[k][i] for k in keys}, where, index + 1)
        rows += out if isinstance(out, list) else [out] if isinstance(out, Rendered) else []  # chat: 0..n examples
    encoded = encoding.encode(rows)
    encoded.pop("kinds", None)  # only `sft data --show` looks at them
    return encoded


def split_off_eval(train: Prepared, size: float, seed: int) -> tuple[Prepared, Prepared]:
    """Hold out `size` rows (a fraction if < 1) of the tokenized training data for evaluation."""
    test_size = size if size < 1 else int(size)
    if len(train.dataset) < 2 or (test_size >= 1 and test_size >= len(train.dataset)):
        raise SFTError(f"eval_split_size={size} leaves no training rows out of {len(train.dataset)}.")
    parts = train.dataset.train_test_split(test_size=test_size, seed=seed, shuffle=True)
    kept = Prepared(parts["train"], train.dropped_rows, train.truncated_rows, sources=train.sources,
                    reasoning_tokens=train.reasoning_tokens, split_rows=train.split_rows)
    return kept, Prepared(parts["test"], 0, 0, sources=train.sources)
