"""SFTConfig: transformers.TrainingArguments plus the model, data and SFT fields a recipe can set."""

from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import TrainingArguments

# Flags that only a GPU can honour. A recipe that sets them must still load (and pass `sft check`) on a laptop,
# so they are validated when training starts, not when the recipe is read.
GPU_ONLY_FLAGS = ("bf16", "bf16_full_eval", "tf32")


def _help(text: str, default: Any = None, **kwargs: Any) -> Any:
    """A dataclass field whose help text shows in `sft train --help`."""
    return field(default=default, metadata={"help": text, **kwargs})


@dataclass
class SFTConfig(TrainingArguments):
    """Everything one fine-tuning run needs; a recipe is a flat YAML of these field names."""

    # Model
    model_name_or_path: str | None = _help("Hub id or local folder of the model to fine-tune.")
    tokenizer_name_or_path: str | None = _help("Tokenizer to use; defaults to the model's.")
    dtype: str = _help("Weights dtype: auto, bfloat16, float16 or float32.", "auto",
                       choices=("auto", "bfloat16", "float16", "float32"))
    attn_implementation: str | None = _help("Attention backend: eager, sdpa, flash_attention_2, flex_attention.")
    trust_remote_code: bool = _help("Run Python code shipped with a Hub model. Off unless you trust the repo.", False)
    revision: str | None = _help("Hub revision (branch, tag or commit) of the model and tokenizer.")
    allow_pickle: bool = _help("Allow loading .bin/.pt (pickle) weights; safetensors only otherwise.", False)
    chat_template: str | None = _help("Chat template: a preset name, a .jinja path or an inline Jinja string.")

    # Data
    dataset: Any = _help(
        "Training data: a local json/jsonl/csv/parquet file or folder, a Hub id, or a list of sources "
        "{path, split, columns, weight}."
    )
    dataset_format: str = _help(
        "auto, text, alpaca, prompt_completion or messages.", "auto",
        choices=("auto", "text", "alpaca", "prompt_completion", "messages"),
    )
    eval_dataset: Any = _help("Evaluation data, same forms as `dataset`.")
    eval_split_size: float = _help("Hold out this fraction (<1) or number (>=1) of training rows for eval.", 0.0)
    max_length: int = _help("Longest tokenized example; longer ones are truncated and counted.", 1024)
    truncation_side: str = _help("Which end to cut over-long examples from: right or left.", "right",
                                 choices=("right", "left"))
    completion_only_loss: bool | None = _help(
        "Train only on completions (default: true for alpaca and prompt_completion data)."
    )
    assistant_only_loss: bool = _help("Chat data: train only the assistant turns (and their end-of-turn tokens).", True)
    dataset_num_proc: int | None = _help("Processes for tokenization (datasets.map num_proc).")
    overwrite_output_dir: bool = _help("Replace an existing run in output_dir instead of refusing.", False)

    def __post_init__(self) -> None:
        deferred = {name: getattr(self, name) for name in GPU_ONLY_FLAGS if getattr(self, name)}
        for name in deferred:  # let TrainingArguments validate the rest on any machine
            setattr(self, name, False if name != "tf32" else None)
        super().__post_init__()
        for name, value in deferred.items():
            setattr(self, name, value)
        self._gpu_only_flags = sorted(deferred)

    def hardware_problems(self) -> list[str]:
        """GPU-only flags this machine cannot honour, each as a message saying how to fix it."""
        has_bf16 = torch.cuda.is_available() and torch.cuda.is_bf16_supported()
        return [
            f"{name}: true needs a CUDA GPU with bfloat16/TF32 support, and this machine has none. "
            f"Set {name}: false (or pass --{name} false) to run here."
            for name in self._gpu_only_flags
            if not has_bf16 and not (self.use_cpu and name.startswith("bf16"))
        ]
