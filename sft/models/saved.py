"""Loading a saved run for inference: a model folder, or an adapter folder on its base (quantized as it trained),
with the tokenizer saved beside it."""

import logging
from pathlib import Path

import torch
from peft import PeftModel
from transformers import (
    AutoConfig,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from sft.errors import SFTError
from sft.models.adapters import (
    ADAPTER_CONFIG,
    adapter_embedding_rows,
    base_model_name,
    is_adapter_folder,
    keep_cpu_4bit_layers_differentiable,
    load_saved_adapter,
)
from sft.models.hub import local_files_only, model_hub_kwargs
from sft.models.loading import (
    TOKENIZER_FILES,
    auto_model_class,
    check_model_reference,
    fit_embeddings,
    not_a_model_folder,
)
from sft.models.quantization import DTYPES, is_quantized, run_quantization
from sft.models.weights import FLAG_ALLOW, pickle_problem, safetensors_kwargs, unloadable_hint

log = logging.getLogger(__name__)
# What a saved tokenizer consists of: any one of these (fast, sentencepiece or BPE files) lets AutoTokenizer try


def load_for_inference(path: str | Path, dtype: str = "auto", base_model: str | None = None,
                       device: str | None = None,
                       allow_pickle: bool = False) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """A model folder, or an adapter folder on its base model, with the tokenizer saved beside it, in eval mode.

    Args:
        path: a `save_pretrained` model folder or a LoRA adapter folder (a use_peft run or one of its checkpoints).
        dtype: auto (as saved), bfloat16, float16 or float32.
        base_model: for adapters, load this base instead of the one named in adapter_config.json.
        device: where to run; default cuda when available, else cpu.
        allow_pickle: also load pickled (.bin) weights, model's or adapter's, where there are no safetensors.
    """
    folder = check_folder(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_saved_tokenizer(folder)
    if is_adapter_folder(folder):
        model = load_adapter(folder, tokenizer, dtype, base_model, device, allow_pickle=allow_pickle)
    else:
        model = load_pretrained(str(folder), dtype, device, allow_pickle=allow_pickle)
    model.eval()
    return model, tokenizer


def check_folder(path: str | Path) -> Path:
    """`path` as a folder holding a model (config.json) or an adapter (adapter_config.json), or an error."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SFTError(f"{path} does not exist or is not a folder. Give the output_dir of a run, one of its "
                       "checkpoint-N folders, or a saved model folder.")
    if any(folder.glob("pytorch_model_fsdp_*")) and not any(folder.glob("*.safetensors")):
        raise SFTError(f"{path} is an FSDP checkpoint: its weights are shards, one per rank, which only resuming the "
                       "run reads. Give the run's output_dir (its final save is whole), or put the shards together "
                       f"first: accelerate merge-weights {folder / 'pytorch_model_fsdp_0'} OUT.")
    problem = not_a_model_folder(folder)
    if problem:
        raise SFTError(problem)
    return folder


def load_saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the run (it carries added tokens and the chat template)."""
    if not any((folder / name).is_file() for name in TOKENIZER_FILES):
        # transformers' own error here is a list of backends it could not build ("Couldn't instantiate ... from")
        raise SFTError(f"{folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...): every sft run "
                       f"and checkpoint saves its tokenizer beside the model. Copy the run's tokenizer files into "
                       f"{folder} (the base model's do when the run added no tokens and no chat template).")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise SFTError(f"No usable tokenizer in {folder}: {str(err).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    keep_legacy_on_save(tokenizer)  # sft merge saves it again
    return tokenizer


def keep_legacy_on_save(tokenizer: PreTrainedTokenizerBase) -> None:
    """Save the sentencepiece `legacy` setting with the tokenizer, as the run's data was tokenized with it.

    transformers 5 builds a Llama-family tokenizer (Mistral, Zephyr, Llama-2) from tokenizer_config's `legacy` but
    leaves it out of what save_pretrained writes, and a tokenizer loaded without it is non-legacy: a run on Zephyr
    or Mistral v0.2 (legacy: true) saved a tokenizer that drops the '▁' after every </s> and writes '[' for '▁['
    after <s>, so sft eval, sft generate and any server fed every one of its rows other ids than training did.
    """
    legacy = getattr(tokenizer, "legacy", None)
    if isinstance(legacy, bool):
        tokenizer.init_kwargs.setdefault("legacy", legacy)


def load_adapter(folder: Path, tokenizer: PreTrainedTokenizerBase, dtype: str, base_model: str | None,
                 device: str, dequantize: bool = False, allow_pickle: bool = False) -> PeftModel:
    """The adapter in `folder` on its base model, quantized as in training unless `dequantize`; pickled weights
    (adapter's or base's) only when `allow_pickle`."""
    problem = pickle_problem(folder, allow_pickle, FLAG_ALLOW)  # before the base's slow load
    if problem:
        raise SFTError(problem)
    # a local path that is not there (a typo, or a base moved since training) is named as such, not as a bad Hub id
    hint = "Check the path or Hub id and network access"
    if base_model:
        name, origin = check_model_reference(base_model, "--base_model"), " (--base_model)"
    else:
        config_file = folder / ADAPTER_CONFIG
        name = check_model_reference(base_model_name(folder), f"base_model_name_or_path in {config_file} (or pass "
                                     "--base_model)")
        origin = f" (the base model named in {config_file})"
        hint += ", or pass --base_model with a local copy"
    log.info("Loading the base model %s for the adapter in %s", name, folder)
    base = load_pretrained(name, dtype, device, run_quantization(folder), origin, hint, allow_pickle)
    if dequantize and is_quantized(base):
        # loaded in the run's dtype (run_quantization); auto still means the dtype the base is saved in
        target = DTYPES.get(dtype) or saved_dtype(name)
        base = base.dequantize(dtype=target)
        if target is not None:
            base = base.to(target)  # dequantize casts the quantized layers only, not norms and embeddings
    elif is_quantized(base):
        keep_cpu_4bit_layers_differentiable(base)  # QDoRA reads the packed weights itself, see there
    fit_embeddings(base, tokenizer, adapter_embedding_rows(base, tokenizer, folder))  # as the run grew it
    return load_saved_adapter(base, folder, base_origin=origin)


def saved_dtype(name: str) -> torch.dtype | None:
    """The dtype model `name`'s weights are saved in (its config's), or None when the config names none."""
    saved = AutoConfig.from_pretrained(name, local_files_only=local_files_only(name)).dtype
    return DTYPES.get(saved) if isinstance(saved, str) else saved


def load_pretrained(name: str, dtype: str, device: str, quantization: dict | None = None, origin: str = "",
                    unreachable_hint: str = "", allow_pickle: bool = False) -> PreTrainedModel:
    """A causal or encoder-decoder LM (as its config says) for inference, or an SFTError naming what could not be
    loaded, where `name` came from (`origin`) and, when its files could not be found or fetched, `unreachable_hint`;
    pickled weights only when `allow_pickle`."""
    problem = pickle_problem(name, allow_pickle, FLAG_ALLOW, origin)
    if problem:
        raise SFTError(problem)
    try:
        auto = auto_model_class(AutoConfig.from_pretrained(name, local_files_only=local_files_only(name)))
        # a quantized base loads in the dtype its run loaded it in (quantization["dtype"]): it decides the 4-bit codes
        settings = {"dtype": DTYPES.get(dtype, "auto"), **safetensors_kwargs(allow_pickle), **(quantization or {})}
        return auto.from_pretrained(name, device_map={"": device}, **model_hub_kwargs(name), **settings)
    except (OSError, ValueError) as err:
        # A ValueError is a model transformers cannot build (e.g. an unknown architecture): no path or network check
        # would fix it, so it gets no such hint.
        hint = f". {unreachable_hint}" if unreachable_hint and isinstance(err, OSError) else ""
        raise SFTError(f"Could not load the model {name}{origin}{hint}: {str(err).splitlines()[0]}"
                       + unloadable_hint(err, allow_pickle, FLAG_ALLOW)) from None
