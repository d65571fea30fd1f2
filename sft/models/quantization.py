"""bitsandbytes quantized loading (4-bit NF4/FP4 for QLoRA, 8-bit LLM.int8) from a recipe's keys."""

from pathlib import Path

import torch
import yaml
from transformers import BitsAndBytesConfig, PreTrainedModel

from sft import rundir
from sft.config.arguments import SFTConfig
from sft.config.names import DTYPE_NAMES
from sft.errors import SFTError

DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES if name != "auto"}  # recipe name -> torch dtype
# Recipe keys that decide how a run quantized its base (bf16/fp16/dtype pick bnb_4bit_compute_dtype: auto).
QUANTIZATION_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                     "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "dtype", "bf16", "fp16")


def check_quantized_training(config: SFTConfig) -> None:
    """Refuse quantization settings that cannot train, before any data or weights load (training only: `sft eval`
    of a 4- or 8-bit base without an adapter trains nothing and is a legitimate measurement)."""
    check_quantization(config)
    if (config.load_in_4bit or config.load_in_8bit) and not config.use_peft:
        bits = 4 if config.load_in_4bit else 8
        raise SFTError(f"load_in_{bits}bit: quantized weights cannot be trained directly. Set use_peft: true to "
                       f"train a LoRA adapter on the {bits}-bit base (QLoRA), or drop load_in_{bits}bit.")
    if config.load_in_8bit and config.use_peft and config.use_dora and not config.on_cuda:
        # peft's DoRA dequantizes the weight each forward and, on the CPU only, moves it back with Int8Params.to(),
        # which drops its scales (SCB): bitsandbytes' next forward then fails on state.SCB being None.
        raise SFTError("load_in_8bit with use_dora cannot train on the CPU: peft's DoRA hands bitsandbytes back the "
                       "8-bit weight without its scales there, and the second step fails. Set load_in_4bit: true "
                       "instead of load_in_8bit (QDoRA trains on CPU), or use_dora: false, or train on a CUDA GPU.")


def check_quantization(config: SFTConfig) -> None:
    """Refuse quantization settings no command can load with."""
    if config.load_in_4bit and config.load_in_8bit:
        raise SFTError("load_in_4bit and load_in_8bit are both true; choose one (4 bit for QLoRA uses less memory).")
    storage = config.bnb_4bit_quant_storage
    if storage is not None and storage not in (*DTYPES, "uint8"):
        raise SFTError(f"bnb_4bit_quant_storage: {storage!r} is not one of uint8, {', '.join(DTYPES)}.")


def quantization_config(config: SFTConfig) -> BitsAndBytesConfig | None:
    """The BitsAndBytesConfig the recipe asks for, or None for an unquantized model."""
    check_quantization(config)
    if config.load_in_8bit:
        return BitsAndBytesConfig(load_in_8bit=True)
    if not config.load_in_4bit:
        return None
    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=config.bnb_4bit_quant_type,
        bnb_4bit_use_double_quant=config.bnb_4bit_use_double_quant,
        bnb_4bit_compute_dtype=compute_dtype(config),
        bnb_4bit_quant_storage=config.bnb_4bit_quant_storage,
    )


def compute_dtype(config: SFTConfig) -> torch.dtype:
    """The 4-bit compute dtype of a built recipe (compute_dtype_name)."""
    return DTYPES[compute_dtype_name(config.bnb_4bit_compute_dtype, config.dtype, config.bf16, config.fp16)]


def compute_dtype_name(compute: str | None, dtype: str | None, bf16: bool | None, fp16: bool | None) -> str:
    """bnb_4bit_compute_dtype, where auto means the recipe's dtype, else its bf16/fp16 training flag, else float32."""
    for name in (compute, dtype):
        if name in DTYPES:
            return name
    # bitsandbytes' own default is float32, which makes every 4-bit matmul of a bf16 run needlessly slow
    return "bfloat16" if bf16 else "float16" if fp16 else "float32"


def quantized_loading(config: SFTConfig) -> dict:
    """from_pretrained keyword arguments for the recipe's quantization ({} when it has none)."""
    bnb = quantization_config(config)
    if bnb is None:
        return {}
    # bitsandbytes quantizes while placing the weights: put them on this process's device (its own GPU under DDP)
    return {"quantization_config": bnb, "device_map": {"": config.device}}


def is_quantized(model: PreTrainedModel) -> bool:
    """Whether a quantizer (bitsandbytes, or a pre-quantized checkpoint's) holds the model's weights."""
    return "quantization_config" in model.config.to_dict()


def run_quantization(folder: Path) -> dict:
    """from_pretrained quantization arguments of the run that trained the adapter (from its recipe.yaml): its
    quantization config and the dtype it loaded the base in.

    bitsandbytes quantizes the weights as loaded in that dtype: a float32 checkpoint trained with dtype bfloat16 got
    other 4-bit codes for ~0.5% of its weights (one NF4 step, up to 22% of a layer's largest weight) when loaded in
    float32, so `sft merge` and `sft generate` with their default dtype (auto: as saved) used another base than the
    adapter trained on.
    """
    recipe = rundir.run_file(folder, rundir.RECIPE)  # a checkpoint's is its run's
    if recipe is None:
        return {}
    values = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
    if not (values.get("load_in_4bit") or values.get("load_in_8bit")):
        return {}
    keys = {key: values[key] for key in QUANTIZATION_KEYS if values.get(key) is not None}
    # The values were validated when the run trained; SFTConfig gives the keys the file lacks their defaults.
    settings = SFTConfig(output_dir=str(folder), use_peft=True, **keys)
    return {"quantization_config": quantization_config(settings), "dtype": DTYPES.get(settings.dtype, "auto")}
