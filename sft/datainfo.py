"""What `sft data` reports: statistics of a recipe's training data and, on request, rendered examples."""

from sft.config import SFTConfig
from sft.dataset import prepare_splits
from sft.model import is_encoder_decoder, load_tokenizer
from sft.stats import DataStats, compute_stats


def describe_data(config: SFTConfig, show: int = 0, color: bool = False) -> tuple[DataStats, str]:
    """Training-data stats and (when show > 0) the first `show` examples with trained tokens marked."""
    tokenizer = load_tokenizer(config)
    train, _ = prepare_splits(config, tokenizer)
    stats = compute_stats(train.dataset, config.max_length, train.dropped_rows, train.truncated_rows,
                          config.packing_strategy if config.packing else None)
    if not show:
        return stats, ""
    from sft.masks import show_examples

    return stats, show_examples(train.dataset, tokenizer, show, color, is_encoder_decoder(config))
