"""The bench the proofs run on: the recipe's settings, its data sample and tokenizer, a tiny model of its
architecture (all through `sft check`'s pieces), and the trainers the proofs drive."""

import dataclasses
import functools
from pathlib import Path
from typing import Any, Callable

import datasets
import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sft.check.smoke import SAMPLE_ROWS, CheckReport, tiny_recipe
from sft.config.arguments import SFTConfig
from sft.data.build import SourceFormat, make_renderer, prepare_splits, resolve_format
from sft.data.encode import Encoding
from sft.data.formats import default_completion_only
from sft.data.packing import pack_dataset
from sft.data.seq2seq import Seq2SeqEncoding, pair_renderer
from sft.data.sources import load_source, parse_sources
from sft.data.tokenizer import load_tokenizer
from sft.models.loading import generation_eos, is_encoder_decoder, load_model
from sft.training.recipe import load_recipe
from sft.training.trainer import trainer_class

# What every proof run sets: no logging or evaluation side effects, a deterministic single-process loop.
QUIET = {"report_to": "none", "logging_steps": 1, "eval_strategy": "no",
         "save_strategy": "no", "dataloader_drop_last": False, "load_best_model_at_end": False}


@dataclasses.dataclass
class Bench:
    """The recipe as the proofs see it. `values` are the recipe's keys with `sft check`'s CPU/tiny overrides."""

    recipe: SFTConfig  # the recipe as written (batch sizes, accumulation, distributed preset)
    values: dict
    report: CheckReport
    folder: Path
    mask_rows: int = SAMPLE_ROWS  # rows the mask proof may sample from
    runs: dict = dataclasses.field(default_factory=dict)  # training runs shared by proofs, by name

    @classmethod
    def build(cls, path: str, flags: list[str] | None, folder: Path, mask_rows: int = SAMPLE_ROWS) -> "Bench":
        recipe, values, report = tiny_recipe(path, flags, folder)
        return cls(recipe, values | QUIET, report, folder, mask_rows)

    def config(self, **overrides: Any) -> SFTConfig:
        """The bench recipe with `overrides`, validated like any recipe."""
        return load_recipe({**self.values, **overrides})

    @functools.cached_property
    def base(self) -> SFTConfig:
        return self.config()

    @functools.cached_property
    def tokenizer(self) -> PreTrainedTokenizerBase:
        return load_tokenizer(self.base)

    @functools.cached_property
    def splits(self) -> tuple[datasets.Dataset, datasets.Dataset | None]:
        """Tokenized (unpacked) train and eval rows of the sample, exactly as `sft train` prepares them."""
        train, evaluation = prepare_splits(self.base, self.tokenizer)
        return train.dataset, evaluation.dataset if evaluation else None

    @functools.cached_property
    def train_rows(self) -> datasets.Dataset:
        """The train rows `sft train` feeds the trainer: packed when the recipe packs."""
        return self.packed(self.splits[0], self.base.packing)

    def packed(self, rows: datasets.Dataset, packs: bool) -> datasets.Dataset:
        config = self.base
        return pack_dataset(rows, config.max_length, config.packing_strategy, config.seed) if packs else rows

    @functools.cached_property
    def encoder_decoder(self) -> bool:
        return is_encoder_decoder(self.base)

    @functools.cached_property
    def raw(self) -> tuple[datasets.Dataset, SourceFormat]:
        """The first source's first `mask_rows` raw rows (at least the sample's) and what sft decides for it."""
        source = parse_sources(self.base.dataset)[0]
        if self.mask_rows > SAMPLE_ROWS:  # the sample is `split[:64]` of the recipe's own split
            source.split = source.split.replace(f"[:{SAMPLE_ROWS}]", f"[:{self.mask_rows}]")
        raw = load_source(source)
        fmt = resolve_format(self.base, raw.column_names, source.label)
        completion_only = self.base.completion_only_loss
        return raw, SourceFormat(source.label, fmt, default_completion_only(fmt) if completion_only is None
                                 else completion_only)

    def row_encoder(self) -> Callable[[dict, int], list[dict]]:
        """sft's own row -> examples {input_ids, labels, truncated, ...} (render + tokenize): what the mask proof
        checks. A chat row gives several examples under `history: split`, none when it is dropped."""
        raw, decided = self.raw
        if self.encoder_decoder:
            render = pair_renderer(decided.format)
            encoding = Seq2SeqEncoding(self.tokenizer, self.base.max_length, self.base.truncation_side)
        else:
            render = make_renderer(self.base, decided, self.tokenizer, raw,
                                   generation_eos(self.base.model_name_or_path))
            encoding = Encoding(self.tokenizer, self.base.max_length, self.base.truncation_side)

        def encode(row: dict, number: int) -> list[dict]:
            rendered = render(row, decided.source, number)
            rendered = rendered if isinstance(rendered, list) else [rendered] if rendered is not None else []
            out = encoding.encode(rendered) if rendered else {}
            return [{key: values[i] for key, values in out.items()} for i in range(len(rendered))]

        return encode

    def model(self, config: SFTConfig | None = None) -> PreTrainedModel:
        """A fresh copy of the tiny model as `sft train` loads it (dtype, quantization, LoRA)."""
        torch.manual_seed(0)  # LoRA initialisation: every copy starts from the same weights
        return load_model(config or self.base, self.tokenizer)

    def trainer(self, config: SFTConfig, model: nn.Module | None = None, train_set: Any = None,
                eval_set: Any = None, trainer_cls: type | None = None) -> Any:
        """The trainer `sft train` would build for `config` (the recipe's collator, loss and callbacks)."""
        model = model if model is not None else self.model(config)
        cls = trainer_cls or trainer_class(model)
        return cls(model=model, args=config, processing_class=self.tokenizer, train_dataset=train_set,
                   eval_dataset=eval_set)


def exact_mode(model: nn.Module) -> nn.Module:
    """Train mode without dropout: bitsandbytes' exact fp32 kernels (its CPU eval kernels are bf16), no noise."""
    return no_dropout(model).train()


def no_dropout(model: nn.Module) -> nn.Module:
    """Zero every dropout rate, modules and the rates attention layers pass to functional dropout (T5, Llama)."""
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        for name in ("dropout", "attention_dropout", "dropout_rate"):
            if isinstance(getattr(module, name, None), float):
                setattr(module, name, 0.0)
    return model


def weights(model: nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """A detached copy of the model's parameters (all, or those being trained)."""
    return {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad or not trainable_only}
