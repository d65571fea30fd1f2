"""sft: supervised fine-tuning of language models from YAML recipes, on transformers.Trainer."""

import logging
import os

import torch

# DeepSpeed (imported by transformers) warns on every import when it finds no GPU; tell it up front instead.
if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")

# bitsandbytes logs a warning about optional CPU kernels at import time; it is noise for every sft user.
logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)

from sft.config import SFTConfig  # noqa: E402
from sft.dataset import build_datasets  # noqa: E402
from sft.errors import SFTError  # noqa: E402
from sft.recipe import load_recipe  # noqa: E402
from sft.trainer import Seq2SeqSFTTrainer, SFTTrainer  # noqa: E402
from sft.training import train  # noqa: E402

__all__ = ["SFTConfig", "SFTError", "SFTTrainer", "Seq2SeqSFTTrainer", "build_datasets", "load_recipe", "train"]
__version__ = "0.1.0"
