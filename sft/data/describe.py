"""What `sft data` reports: statistics of a recipe's training data and, on request, rendered examples."""

import logging

from sft.config.arguments import SFTConfig
from sft.data.build import Prepared, SourceFormat, make_renderer, prepare_splits, resolve_format
from sft.data.encode import Encoding
from sft.data.formats import CHAT_FORMATS, Rendered
from sft.data.sources import load_source, parse_sources
from sft.data.stats import DataStats, compute_stats
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.models.loading import generation_eos, is_encoder_decoder

log = logging.getLogger(__name__)


def describe_data(config: SFTConfig, show: int = 0, color: bool = False) -> tuple[DataStats, str]:
    """Training-data stats and (when show > 0) the first `show` examples with trained tokens marked."""
    tokenizer = load_tokenizer(config)
    train, _ = prepare_splits(config, tokenizer)
    stats = training_stats(train, config, config.packing_strategy if config.packing else None)
    if not show:
        return stats, ""
    from sft.data.show import show_examples

    encoder_decoder = is_encoder_decoder(config)
    examples = None if encoder_decoder else _chat_examples(config, tokenizer, show)
    return stats, show_examples(examples or train.dataset, tokenizer, show, color, encoder_decoder)


def training_stats(train: Prepared, config: SFTConfig, packing_strategy: str | None = None) -> DataStats:
    """The training data's statistics, with the chat fields (reasoning tokens, the history policy, split rows) for
    chat data: what `sft data` prints and what a run writes to data_stats.json."""
    stats = compute_stats(train.dataset, config.max_length, train.dropped_rows, train.truncated_rows, packing_strategy)
    stats.formats = ", ".join(sorted({s.format for s in train.sources}))
    if any(s.format in CHAT_FORMATS for s in train.sources) or train.reasoning_tokens or train.split_rows:
        stats.reasoning_tokens, stats.history, stats.split_rows = (train.reasoning_tokens, config.history,
                                                                   train.split_rows)
        stats.chat_template_kwargs = config.chat_template_kwargs or None
    warning = stats.fit_warning(what_truncation_cuts(config)) if stats.dropped_rows + stats.truncated_rows else None
    if warning:  # logged by `sft train` and `sft data` alike, before any training
        log.warning(warning)
    return stats


def what_truncation_cuts(config: SFTConfig) -> str:
    """What a row cut to max_length loses: an encoder-decoder's source or target tail (targets keep their EOS,
    sft.data.seq2seq), else a decoder row's end (its last answer's, EOS included) or start."""
    try:
        seq2seq = is_encoder_decoder(config)
    except SFTError:  # the model's config is out of reach here (`sft data` needs only the tokenizer)
        seq2seq = False
    if seq2seq:
        return "the tail of its source or target (the target keeps its EOS)"
    if config.truncation_side == "right":
        return "the end of its answer, EOS or end of turn included, which the model then never learns to write"
    return "the start of its prompt or answer"


def _chat_examples(config: SFTConfig, tokenizer, count: int) -> list[dict] | None:
    """The first `count` examples of the first source when it is chat data, with the kind of each trained piece
    (reasoning, channel, tool call), which the tokenized dataset does not keep; None for other formats."""
    source = parse_sources(config.dataset)[0]
    raw = load_source(source)
    fmt = resolve_format(config, raw.column_names, source.label)
    if fmt not in CHAT_FORMATS:
        return None
    render = make_renderer(config, SourceFormat(source.label, fmt, False), tokenizer, raw,
                           generation_eos(config.model_name_or_path))
    encoding = Encoding(tokenizer, config.max_length, config.truncation_side)
    rows: list[Rendered] = []
    for number in range(len(raw)):
        if len(rows) >= count:
            break
        rows += render(raw[number], source.label, number + 1)
    encoded = encoding.encode(rows[:count])
    return [{"input_ids": ids, "labels": labels, "kinds": kinds}
            for ids, labels, kinds in zip(encoded["input_ids"], encoded["labels"], encoded["kinds"])]
