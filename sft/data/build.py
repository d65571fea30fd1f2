"""build_datasets: recipe sources -> tokenized train/eval datasets with input_ids and labels (-100 = not trained)."""

import logging
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

import datasets
import numpy as np
import pyarrow.compute as pc
from datasets.fingerprint import Hasher
from transformers import PreTrainedTokenizerBase

from sft.config.arguments import SFTConfig
from sft.data.chat import ChatRenderer
from sft.data.encode import Encoding
from sft.data.formats import (
    ANSWER_FIELDS,
    CHAT_FORMATS,
    AnswerStops,
    Rendered,
    check_columns,
    check_one_format,
    check_sft_data,
    default_completion_only,
    detect_format,
    row_renderer,
)
from sft.data.seq2seq import Seq2SeqEncoding, pair_renderer
from sft.data.sources import Source, load_source, parse_sources, repeat_by_weight
from sft.data.stops import stop_tokens
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.models.loading import generation_eos, is_encoder_decoder

log = logging.getLogger(__name__)
ROW = "row"  # the source row an example came from: the examples `history: split` makes of one row share it
COUNT_COLUMNS = ["truncated", "reasoning", "split"]  # per-example counts, summed per part after the eval split


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
    dropped_rows: int  # examples with no trained token, rows that rendered none (with eval_split_size: all train's)
    truncated_rows: int  # examples of `dataset` cut to max_length, each counted once whatever its source's weight
    sources: list[SourceFormat] = field(default_factory=list)
    reasoning_tokens: int = 0  # trained tokens inside reasoning blocks (chat data)
    split_rows: int = 0  # extra examples made by `history: split` (chat data)

    def eval_warning(self, max_length: int) -> str | None:
        """One line for eval data that lost rows or had rows cut, None when neither: `sft data` reports the training
        data only, and evaluation otherwise scores the rows left without a word (DialogSum's dev set at max_length
        256 on a decoder model loses 155 of its 500 dialogues, the longest; on an encoder-decoder it keeps them all
        and cuts 153 sources)."""
        if self.dropped_rows:
            truncated = f"; {self.truncated_rows} of those kept are truncated" if self.truncated_rows else ""
            return (f"Eval data: {self.dropped_rows} of {len(self.dataset) + self.dropped_rows} rows dropped, no "
                    f"trained token fits in max_length={max_length}{truncated}. Eval loss and metrics leave them out: "
                    "raise max_length or shorten the prompts to score them.")
        if self.truncated_rows:
            return (f"Eval data: {self.truncated_rows} of {len(self.dataset)} rows are longer than "
                    f"max_length={max_length} and truncated. Eval loss and metrics score what fits (a cut source or "
                    "prompt is generated from, a cut answer is the reference): raise max_length to score them whole.")
        return None


@dataclass
class Tokenized:
    """One source's examples with something trained, before weighting: each keeps its ROW and COUNT_COLUMNS until
    the eval split is made and the counts are summed per part (combine)."""

    source: Source
    decided: SourceFormat
    raw: datasets.Dataset  # the source's rows as loaded: held-out ones are tokenized again for unpacked eval
    examples: datasets.Dataset
    dropped_rows: int  # examples with no trained token, and rows that rendered none
    dropped_split_rows: int  # how many of the dropped examples `history: split` made


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
    if config.eval_dataset is not None and config.eval_split_size:
        raise SFTError("Set either `eval_dataset` or `eval_split_size`, not both.")
    build = Build(config, load_tokenizer(config) if tokenizer is None else tokenizer, ModelFacts.of(config))
    train = [tokenize_source(source, build, config.packing) for source in parse_sources(config.dataset)]
    if config.eval_dataset is not None:
        evaluation = [tokenize_source(source, build, config.packs_eval)
                      for source in parse_sources(config.eval_dataset, "eval_dataset")]
        warn_seen_eval_rows(train, evaluation)
        return combine(train, config), combine(evaluation, config)
    if not config.eval_split_size:
        return combine(train, config), None
    train, evaluation = split_off_eval(train, config.eval_split_size, config.seed)
    warn_seen_eval_rows(train, evaluation)
    if build.encoding(config.packs_eval) != build.encoding(config.packing):  # e.g. bfd_split, eval_packing: false
        evaluation = [retokenized(part, build, config.packs_eval) for part in evaluation]
    return combine(train, config), combine(evaluation, config)


@dataclass(frozen=True)
class ModelFacts:
    """What the data needs to know of the recipe's model, read once per build (not once per source)."""

    encoder_decoder: bool
    generation_eos: int | list[int] | None  # its generation config's stop ids: chat turns end at them

    @classmethod
    def of(cls, config: SFTConfig) -> "ModelFacts":
        return cls(is_encoder_decoder(config), generation_eos(config.model_name_or_path))


@dataclass(frozen=True)
class Build:
    """What every source of one build shares: the recipe, the tokenizer and the model's facts."""

    config: SFTConfig
    tokenizer: PreTrainedTokenizerBase
    model: ModelFacts

    def renderer(self, decided: SourceFormat, raw: datasets.Dataset) -> Callable:
        """row -> Rendered (or a list of them) for a source."""
        if self.model.encoder_decoder:  # T5, BART, ...: source -> encoder input_ids, target + EOS -> labels
            stops = answer_stops(self.tokenizer, self.model.generation_eos)
            return AnswerStops(pair_renderer(decided.format), ANSWER_FIELDS[decided.format], stops)
        return make_renderer(self.config, decided, self.tokenizer, raw, self.model.generation_eos)

    def encoding(self, packed: bool) -> Encoding:
        """How rendered rows become input_ids and labels, for data that is `packed` or not."""
        config = self.config
        if self.model.encoder_decoder:
            return Seq2SeqEncoding(self.tokenizer, config.max_length, config.truncation_side)
        # bfd_split packing cuts long examples into max_length chunks, so they stay whole here; data that is not
        # packed that way (eval under eval_packing: false) reaches the model as it is, and is truncated.
        splits = packed and config.packing_strategy == "bfd_split"
        return Encoding(self.tokenizer, sys.maxsize if splits else config.max_length, config.truncation_side)


def tokenize_source(source: Source, build: Build, packed: bool) -> Tokenized:
    """One source: load it, detect its format, tokenize it in batches (`packed`: whether this data is packed)."""
    raw = load_source(source)
    if len(raw) == 0:
        raise SFTError(f"Dataset {source.label} has no rows.")
    check_sft_data(raw.column_names, raw[0], source.label)  # DPO/KTO/image rows are refused, not half-trained
    config = build.config
    fmt = resolve_format(config, raw.column_names, source.label)
    check_one_format(raw, fmt, source.label)
    # Decided per source: in `[text.jsonl, alpaca.json]` the text is trained whole, the Alpaca prompts are not.
    decided = SourceFormat(source.label, fmt, default_completion_only(fmt) if config.completion_only_loss is None
                           else config.completion_only_loss)
    part = tokenize_rows(source, decided, raw, build, packed)
    if len(part.examples) == 0:
        raise SFTError(f"Dataset {source.label}: all {len(raw)} rows were dropped because no trained token fits in "
                       f"max_length={config.max_length}. Raise max_length or shorten the prompts.")
    return part


def tokenize_rows(source: Source, decided: SourceFormat, raw: datasets.Dataset, build: Build, packed: bool,
                  rows: list[int] | None = None) -> Tokenized:
    """The `rows` of a loaded source (all when None) rendered and tokenized in batches, cached by `datasets`."""
    selected = raw if rows is None else raw.select(rows)
    encoding = build.encoding(packed)
    tokenized = selected.map(
        encode_batch, batched=True, with_indices=True, remove_columns=raw.column_names,
        num_proc=build.config.dataset_num_proc, desc=f"Tokenizing {source.label}",
        fn_kwargs={"render": build.renderer(decided, raw), "encoding": encoding, "where": source.label,
                   "rows": range(len(raw)) if rows is None else rows},
        new_fingerprint=cache_fingerprint(selected, build, decided, encoding),
    )
    # Examples are rendered rows plus the extra ones `history: split` made, counted before any is dropped: a split
    # example with nothing trained is a lost example, not a row that was never made.
    if len(tokenized) == 0:  # chat rows render one example per trained turn, so none at all: no column either
        raise SFTError(f"Dataset {source.label}: none of its {len(selected)} rows has a message to train (every "
                       "assistant message is marked train: false or weight: 0), so there is nothing to learn. Mark "
                       "the answers to learn with train: true (or drop the marks), or remove the rows.")
    split_rows = column_sum(tokenized, "split")
    examples = trained_examples(tokenized)
    return Tokenized(source, decided, raw, examples, dropped_rows=len(selected) + split_rows - len(examples),
                     dropped_split_rows=split_rows - column_sum(examples, "split"))


def retokenized(part: Tokenized, build: Build, packed: bool) -> Tokenized:
    """The rows of a part tokenized again for data that is `packed` or not: held-out rows of training data packed
    with bfd_split (tokenized whole) that eval does not pack (so they are truncated)."""
    rows = np.unique(column_values(part.examples, ROW)).tolist()
    return tokenize_rows(part.source, part.decided, part.raw, build, packed, rows)


def column_sum(dataset: datasets.Dataset, name: str) -> int:
    """The sum of a count column (0 where the encoding writes none), in Arrow: no per-row Python iteration."""
    return (pc.sum(dataset.with_format("arrow")[name]).as_py() or 0) if name in dataset.column_names else 0


def column_values(dataset: datasets.Dataset, name: str) -> np.ndarray:
    """One integer column as an array (honours a row selection)."""
    return np.asarray(dataset.with_format("arrow")[name].to_numpy())


def trained_examples(tokenized: datasets.Dataset) -> datasets.Dataset:
    """The examples with a trained token (the others teach nothing), without the `trained` column."""
    trained = column_values(tokenized, "trained")
    if not trained.all():
        tokenized = tokenized.select(np.flatnonzero(trained))
    return tokenized.remove_columns("trained")


def combine(parts: list[Tokenized], config: SFTConfig) -> Prepared:
    """Sources weighted and concatenated, with their counts summed over each source's examples before weighting."""
    weighted = [repeat_by_weight(part.examples, part.source.weight, config.seed) for part in parts]
    gone = next((part for part, data in zip(parts, weighted) if len(part.examples) and not len(data)), None)
    if gone:  # a source the recipe names must not vanish from the mix without a word
        raise SFTError(f"Dataset {gone.source.label}: weight {gone.source.weight:g} keeps none of its "
                       f"{len(gone.examples)} examples (it keeps round(weight x examples)). Raise the weight to 1/"
                       f"{len(gone.examples)} or more, or remove the source.")
    dataset = datasets.concatenate_datasets(weighted) if len(weighted) > 1 else weighted[0]
    if len(dataset) == 0:
        raise SFTError(f"No rows left in {', '.join(part.source.label for part in parts)}: every row was dropped (no "
                       f"trained token within max_length={config.max_length}) or weighted away (a `weight` below 1). "
                       "Raise max_length or the weight, or check the data.")
    dataset = dataset.remove_columns([c for c in (ROW, *COUNT_COLUMNS) if c in dataset.column_names])

    def total(name: str) -> int:
        return sum(column_sum(part.examples, name) for part in parts)

    return Prepared(dataset, sum(part.dropped_rows for part in parts), total("truncated"),
                    sources=[part.decided for part in parts], reasoning_tokens=total("reasoning"),
                    split_rows=total("split") + sum(part.dropped_split_rows for part in parts))


def split_off_eval(parts: list[Tokenized], size: float, seed: int) -> tuple[list[Tokenized], list[Tokenized]]:
    """Hold out `size` rows (a fraction of them if < 1) of the training sources for evaluation, chosen with `seed`.

    Rows, not examples, and before weighting: the examples `history: split` makes of one conversation stay on one
    side, and no copy `weight` makes of a held-out row is trained on. Only rows with a trained example count.
    """
    rows = [np.unique(column_values(part.examples, ROW)) for part in parts]
    total = sum(len(r) for r in rows)
    held = math.ceil(size * total) if size < 1 else int(size)
    if total < 2 or held >= total:
        raise SFTError(f"eval_split_size={size} leaves no training rows out of {total}.")
    chosen = np.zeros(total, dtype=bool)
    chosen[np.random.default_rng(seed).permutation(total)[:held]] = True
    starts = np.cumsum([0, *(len(r) for r in rows)])
    pairs = [hold_out(part, r[chosen[a:b]]) for part, r, a, b in zip(parts, rows, starts[:-1], starts[1:])]
    return [train for train, _ in pairs], [evaluation for _, evaluation in pairs]


def warn_seen_eval_rows(train: list[Tokenized], evaluation: list[Tokenized]) -> None:
    """Warn when eval rows are also training rows: data holding a row twice (LLaMA-Factory's glaive demo: 35 repeats
    in 300 rows; eval_split_size 0.1 held out 30 rows, 5 of them also trained) can put one copy on each side, and an
    eval_dataset may share rows with the training data. Eval loss on them measures recall, not generalisation."""
    seen = np.concatenate([example_hashes(part.examples) for part in train])
    held = [(part, np.isin(example_hashes(part.examples), seen)) for part in evaluation]
    rows = sum(len(np.unique(column_values(part.examples, ROW)[both])) for part, both in held)
    if rows:
        total = sum(len(np.unique(column_values(part.examples, ROW))) for part in evaluation)
        log.warning("The training data holds %d of the %d eval rows (the same tokens), so eval loss partly measures "
                    "recall. Deduplicate the data to evaluate on rows not trained on.", rows, total)


def example_hashes(dataset: datasets.Dataset) -> np.ndarray:
    """A 64-bit hash of each example's input_ids, vectorised: a sum of token ids mixed with their positions."""
    column = dataset.with_format("arrow")["input_ids"]  # honours a row selection
    lengths = np.asarray(pc.list_value_length(column).to_numpy(), dtype=np.int64)
    if not lengths.size:
        return np.zeros(0, dtype=np.uint64)
    ids = np.asarray(pc.list_flatten(column).to_numpy(), dtype=np.uint64)
    starts = np.cumsum(lengths) - lengths
    position = (np.arange(len(ids)) - np.repeat(starts, lengths)).astype(np.uint64)
    with np.errstate(over="ignore"):  # wrapping uint64 arithmetic is the hash
        mixed = (ids + np.uint64(1)) * (position * np.uint64(0x9E3779B97F4A7C15) + np.uint64(0xBF58476D1CE4E5B9))
        return np.add.reduceat(mixed, starts) ^ lengths.astype(np.uint64)


def hold_out(part: Tokenized, rows: np.ndarray) -> tuple[Tokenized, Tokenized]:
    """A source's examples from `rows` as eval data, the others as training data. Held-out rows are evaluated once
    each (weight 1); what was dropped stays with the training data (it was dropped before the split)."""
    held = np.isin(column_values(part.examples, ROW), rows)
    train = replace(part, examples=part.examples.select(np.flatnonzero(~held)))
    evaluation = Tokenized(replace(part.source, weight=1.0), part.decided, part.raw,
                           part.examples.select(np.flatnonzero(held)), dropped_rows=0, dropped_split_rows=0)
    return train, evaluation


CACHE_FIELDS = ("completion_only_loss", "truncation_side", "assistant_only_loss", "chat_template",
                "train_on_last_turn_only", "no_assistant_turn", "history", "chat_template_kwargs")


def cache_fingerprint(raw: datasets.Dataset, build: Build, decided: SourceFormat, encoding: Encoding) -> str:
    """Cache key of the tokenized data: the raw data, the tokenizer, the recipe fields that matter and sft's code.

    datasets would otherwise hash the mapped function with dill (the tokenizer object included), which costs more
    than re-reading a cached result; this key is cheap and changes whenever any input of the result changes.
    """
    # All of sft's data code: a list of the modules that shape a tokenized row drifts (one added later was missed).
    code = [path.read_bytes() for path in sorted(Path(__file__).parent.glob("*.py"))]
    config, tokenizer = build.config, build.tokenizer
    tok = [tokenizer.backend_tokenizer.to_str(), str(tokenizer.chat_template), str(tokenizer.special_tokens_map),
           type(tokenizer).__name__]
    # The encoding's own max_length, not the recipe's: one source is tokenized whole for bfd_split packing and
    # truncated as unpacked eval data (eval_dataset: the training file, or held-out rows).
    fields = [decided.format, decided.completion_only_loss, type(encoding).__name__, encoding.max_length,
              *(str(getattr(config, name)) for name in CACHE_FIELDS)]
    if decided.format in CHAT_FORMATS or decided.format == "prompt_completion":  # chat turns end at these stops
        fields.append(str(build.model.generation_eos))
    return Hasher.hash([raw._fingerprint, tok, fields, code])


def resolve_format(config: SFTConfig, columns: list[str], where: str) -> str:
    """The recipe's dataset_format, or the one detected from this source's columns."""
    fmt = detect_format(columns, where) if config.dataset_format == "auto" else config.dataset_format
    check_columns(fmt, columns, where)
    return fmt


def make_renderer(config: SFTConfig, decided: SourceFormat, tokenizer: PreTrainedTokenizerBase,
                  raw: datasets.Dataset, eos: int | list[int] | None) -> Callable:
    """The row -> Rendered function for this source's format; chat data renders through the chat template and ends
    turns at the stop tokens (`eos`: the model's generation-config stop ids, sft.models.loading.generation_eos)."""
    fmt = decided.format
    conversational = fmt in CHAT_FORMATS or (fmt == "prompt_completion" and isinstance(raw[0]["prompt"], list))
    chat = None
    if conversational:
        chat = ChatRenderer(tokenizer, config.chat_template, config.assistant_only_loss,
                            config.train_on_last_turn_only, config.no_assistant_turn, config.history, eos,
                            config.chat_template_kwargs)
    stops = () if conversational else answer_stops(tokenizer, eos)
    return row_renderer(fmt, decided.completion_only_loss, chat, stops)


def answer_stops(tokenizer: PreTrainedTokenizerBase, eos: int | list[int] | None) -> tuple[str, ...]:
    """The stop tokens no plain answer may hold before its end (formats.AnswerStops): those of the model's generation
    config with the tokenizer's; only the tokenizer's where plain data pairs the model with another family's
    tokenizer, whose ids the generation config does not name (chat data is refused for that, in stop_tokens)."""
    try:
        return tuple(stop_tokens(tokenizer, None, eos))
    except SFTError:
        return tuple(stop_tokens(tokenizer))


def encode_batch(batch: dict, indices: list[int], render: Callable, encoding: Encoding, where: str,
                 rows: Sequence[int]) -> dict:
    """datasets.map body: render each row, tokenize the batch, note each example's source row (ROW; `rows` maps the
    mapped rows' indices to the source's); examples with nothing trained are kept here (`trained` 0) so that they are
    counted before they are dropped (trained_examples)."""
    keys = list(batch)
    examples: list[Rendered] = []
    origins: list[int] = []
    for i, index in enumerate(indices):
        row = rows[index]
        out = render({k: batch[k][i] for k in keys}, where, row + 1)
        out = out if isinstance(out, list) else [out] if isinstance(out, Rendered) else []  # chat: 0..n examples
        examples += out
        origins += [row] * len(out)
    encoded = encoding.encode(examples)
    encoded.pop("kinds", None)  # only `sft data --show` looks at them
    encoded[ROW] = origins
    return encoded
