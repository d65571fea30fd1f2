"""What a Trainer built from Python (README's Python API: sft.SFTTrainer used like transformers' Trainer) is given:
rows it could not train as asked are refused, and rows the recipe packs are packed, as train() would have."""

from typing import Any

from torch import nn

from sft.data.collators import check_tokenized_rows
from sft.data.packing import packed_as_asked
from sft.errors import SFTError
from sft.models.families import check_packing_supported, flattened_batches


def trainer_datasets(model: nn.Module, args: Any, data_collator: Any, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The train and eval datasets the Trainer is built with: checked (check_trainer_inputs) and packed as `args`
    ask. Rows from build_datasets under packing: true were batched one example per row (100 Alpaca rows at
    max_length 512: 50 steps of 2 rows instead of 14), since only train() packed them."""
    check_trainer_inputs(args, data_collator, kwargs)
    train, evaluated = kwargs.get("train_dataset"), kwargs.get("eval_dataset")
    packed = {"train_dataset": packed_as_asked(train, args, train=True),
              "eval_dataset": packed_as_asked(evaluated, args, train=False)}
    if packed["train_dataset"] is not train or packed["eval_dataset"] is not evaluated:
        check_packed_model(model, args)
    return packed


def check_trainer_inputs(args: Any, data_collator: Any, kwargs: dict[str, Any]) -> None:
    """What a Trainer built from Python is given that it would not train as asked: rows sft's collator cannot batch
    into a loss (raw text: the Trainer's own error, after it dropped every column, suggested remove_unused_columns),
    and a compute_metrics that generation-based evaluation would never call (it scores texts with `metrics`)."""
    if data_collator is None:  # a user's collator may make input_ids or labels itself
        evaluated = kwargs.get("eval_dataset")
        named = evaluated.items() if isinstance(evaluated, dict) else [("eval_dataset", evaluated)]
        for name, dataset in [("train_dataset", kwargs.get("train_dataset")), *named]:
            check_tokenized_rows(dataset, name)
    if getattr(args, "predict_with_generate", False) and kwargs.get("compute_metrics") is not None:
        raise SFTError("compute_metrics is not called with predict_with_generate: evaluation generates each answer "
                       "from its prompt and scores the texts with the `metrics` setting (exact_match, rouge, bleu, "
                       "or 'my_module:score', called as score(predictions, references) on lists of strings). Pass "
                       "SFTConfig(metrics=[...]) instead, or predict_with_generate=False for compute_metrics on "
                       "logits.")


def check_packed_model(model: nn.Module, args: Any) -> None:
    """The check train() makes before it packs (check_packing_model), on the model the trainer is given."""
    try:
        check_packing_supported(model.config, args.attn_implementation,
                                flattened_batches(args.attn_implementation, args.padding_free, packing=True))
    except ValueError as err:
        raise SFTError(str(err)) from None
