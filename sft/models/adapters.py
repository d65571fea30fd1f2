"""LoRA / DoRA / rsLoRA adapters from a recipe (peft), and the preparation a quantized base needs (QLoRA)."""

import contextlib
import difflib
import functools
import logging
import re
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch
from peft import (
    LoraConfig,
    PeftConfig,
    PeftModel,
    get_peft_model,
    prepare_model_for_kbit_training,
)
from peft.tuners.trainable_tokens.layer import TrainableTokensLayer
from peft.utils.integrations import gather_params_ctx
from peft.utils.other import ModulesToSaveWrapper, TrainableTokensWrapper
from safetensors import safe_open
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase
from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.families import non_text_towers
from sft.models.precision import adapter_inputs_as_they_come, upcast_trained_copies, upcasts_quantized_base

log = logging.getLogger(__name__)
# peft 0.21 reads transformers 5's deprecated `is_gradient_checkpointing` on every adapter it builds or loads.
warnings.filterwarnings("ignore", message="`is_gradient_checkpointing` is deprecated", category=FutureWarning)
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head


def lora_config(config: SFTConfig, model: PreTrainedModel, new_rows: range = range(0)) -> LoraConfig:
    """The peft LoraConfig for the recipe; `new_rows` are embedding rows added for new tokens, trained as well.

    Args:
        config: the recipe (lora_* keys, use_dora, use_rslora).
        model: the base model the adapter goes on.
        new_rows: embedding rows beyond the base vocabulary (added tokens and their padding).
    """
    return LoraConfig(
        task_type="SEQ_2_SEQ_LM" if model.config.is_encoder_decoder else "CAUSAL_LM",
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=target_modules(config.lora_target_modules),
        use_dora=config.use_dora,
        use_rslora=config.use_rslora,
        modules_to_save=config.lora_modules_to_save,
        trainable_token_indices=new_token_targets(model, new_rows, config.lora_modules_to_save or []),
        # a vision tower's q_proj/v_proj match the recipe's names too; text never runs through it
        exclude_modules="|".join(rf"{re.escape(name)}(\..*)?" for name in non_text_towers(model)) or None,
    )


def target_modules(names: list[str] | None) -> list[str] | str:
    """lora_target_modules as peft takes it: unset or [all-linear] means peft's all-linear shorthand."""
    return ALL_LINEAR if not names or names == [ALL_LINEAR] else names


def new_token_targets(model: PreTrainedModel, new_rows: range, fully_trained: list[str]) -> dict[str, list[int]] | None:
    """Input and output embedding layers mapped to the new rows to train, or None when no rows were added.

    A frozen base would otherwise keep the new tokens at their initial values: the model could neither read
    nor write them. Only those rows are trained and saved (peft trainable tokens), not the whole matrix.
    """
    if not new_rows:
        return None
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = [name for name, module in model.named_modules() if any(module is layer for layer in layers)]
    # A layer listed in lora_modules_to_save is trained whole already; peft refuses both on one layer.
    return {name: list(new_rows) for name in names if name.rsplit(".", 1)[-1] not in fully_trained} or None


def adapter_embedding_rows(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                           folder: str | Path | None = None) -> int:
    """The embedding rows an adapter is trained or loaded on: one per token of `tokenizer` for a new adapter; for
    the adapter saved in `folder`, as many as its saved whole embedding has, else as its new-token indices reach.

    Not padded to a multiple of 64 as full fine-tunes are: peft's own loaders (AutoPeftModelForCausalLM, or the
    documented `base.resize_token_embeddings(len(tokenizer))` before PeftModel.from_pretrained) grow the base to
    len(tokenizer) exactly, and an adapter trained on more rows than that fails to load there (its new-token
    indices point past the table, its saved embedding shape differs). A saved folder keeps the rows it has, so
    adapters saved padded still load in sft.
    """
    if folder is None:
        return len(tokenizer)
    path = Path(folder) / ADAPTER_WEIGHTS
    # Every name of the input embedding (T5 shares one as shared, encoder.embed_tokens, decoder.embed_tokens)
    names = [name for name, module in model.named_modules(remove_duplicate=False)
             if module is model.get_input_embeddings()]
    if names and path.is_file():
        with safe_open(str(path), framework="pt") as weights:
            # An embedding saved whole (a modules_to_save copy, or a base layer saved by earlier versions)
            shapes = [weights.get_slice(key).get_shape() for key in weights.keys()  # noqa: SIM118 (no __iter__)
                      if key.endswith(".weight") and any(f".{name}." in f".{key}" for name in names)]
        if shapes:
            return max(shape[0] for shape in shapes)
    # Else the rows its new-token indices reach (a list, or lists by layer name)
    indices = saved_adapter_config(folder).trainable_token_indices or []
    lists = indices.values() if isinstance(indices, dict) else [indices]
    return max([len(tokenizer), *(max(rows) + 1 for rows in lists if rows)])


def add_adapter(model: PreTrainedModel, config: SFTConfig, new_token_ids: list[int] | None = None) -> PeftModel:
    """Freeze `model` and wrap it in the recipe's trainable LoRA adapter (after k-bit preparation if quantized).

    Args:
        model: the loaded base model, embeddings already resized for the tokenizer.
        config: the recipe.
        new_token_ids: ids of tokens added to the vocabulary (sft.models.loading.fit_embeddings); their rows get
            trained.
    """
    quantized = config.load_in_4bit or config.load_in_8bit
    if quantized:
        prepare_quantized_base(model, config)
    # Train every row past the old vocabulary (grown to adapter_embedding_rows): saved with the adapter.
    rows = model.get_input_embeddings().num_embeddings  # not weight.shape: (0,) once ZeRO-3 partitions it
    new_rows = range(new_token_ids[0], rows) if new_token_ids else range(0)
    check_module_names(model, config)
    # peft keeps adapter weights (DoRA magnitudes included) in float32 even on a bf16 base; never downcast
    # them: bf16 rounds the small updates of DoRA magnitudes to zero and silently freezes them.
    try:
        with token_rows_gathered_on_any_device():
            peft_model = get_peft_model(model, lora_config(config, model, new_rows))
    except ValueError as err:  # e.g. a target module name the model does not have
        # peft adapts a mixture of experts' 3D expert stacks (all-linear) as bare parameters, without dropout
        fix = ("Set lora_dropout: 0, or name lora_target_modules without the experts (e.g. [q_proj, k_proj, "
               "v_proj, o_proj])." if "lora_dropout" in str(err) else "Check lora_target_modules and "
               "lora_modules_to_save against the model's module names (e.g. q_proj, v_proj).")
        raise SFTError(f"Cannot add the LoRA adapter: {str(err).splitlines()[0]} {fix}") from None
    if quantized:
        upcast_trained_copies(peft_model)
    adapter_inputs_as_they_come(peft_model)
    if new_rows:
        save_new_rows_only(peft_model)
    # adapter_config.json names the base; a local one by absolute path, so merge/generate work from any folder
    if Path(model.name_or_path).exists():
        peft_model.peft_config["default"].base_model_name_or_path = str(Path(model.name_or_path).resolve())
    log_trainable_parameters(peft_model)
    return peft_model


@contextlib.contextmanager
def token_rows_gathered_on_any_device() -> Iterator[None]:
    """Let peft set up trainable new-token rows under ZeRO-3 without CUDA (CPU gloo runs: `sft check --prove`, the
    CPU test-suite; other accelerators).

    Under ZeRO-3 peft 0.21 reads the new tokens' starting rows into a buffer it builds on CUDA whatever the device
    (TrainableTokensLayer._collect_token_weights: "right now, only CUDA is implemented"), so a LoRA run whose chat
    template adds tokens died on CPU with "Torch not compiled with CUDA enabled" while the adapter was built. Every
    rank gathers the whole embedding there (modifier_rank=None), so each can take the rows itself, on any device.
    """
    if not is_deepspeed_zero3_enabled() or torch.cuda.is_available():
        yield  # peft's own code, on the device it was written for
        return
    original = TrainableTokensLayer._collect_token_weights
    TrainableTokensLayer._collect_token_weights = _gathered_token_rows
    try:
        yield
    finally:
        TrainableTokensLayer._collect_token_weights = original


def _gathered_token_rows(self: TrainableTokensLayer, weight: torch.Tensor, rows: list[int],
                         embed_dim: int) -> torch.Tensor:
    """The ZeRO-3-partitioned `weight`'s `rows`, identical on every rank (see token_rows_gathered_on_any_device)."""
    with gather_params_ctx([weight], modifier_rank=None):
        return weight[rows].clone()


def check_module_names(model: PreTrainedModel, config: SFTConfig) -> None:
    """Refuse a lora_target_modules or lora_modules_to_save name that matches no module of the model.

    peft refuses target names only when none of them matches, and modules_to_save names never: a typo beside a
    valid name ([q_proj, v_prj]) or in modules_to_save ([lm_heads]) would silently train less than asked. Names
    match as peft matches them: a target is a module's full name or its last dotted part(s), a module to save
    any end of a module's name.
    """
    names = [name for name, _ in model.named_modules(remove_duplicate=False)]
    targets = target_modules(config.lora_target_modules)
    checks = (("lora_target_modules", [] if targets == ALL_LINEAR else targets,
               lambda wanted: any(n == wanted or n.endswith(f".{wanted}") for n in names)),
              ("lora_modules_to_save", config.lora_modules_to_save or [],
               lambda wanted: any(n.endswith(wanted) for n in names)))
    for key, wanted, matches in checks:
        missing = [name for name in wanted if not matches(name)]
        if missing:
            leaves = sorted({leaf for leaf in (name.rsplit(".", 1)[-1] for name in names)
                             if leaf and not leaf.isdigit()})
            near = difflib.get_close_matches(missing[0], leaves, n=1)
            raise SFTError(f"{key}: {', '.join(missing)} matches no module of the model"
                           + (f". Did you mean {near[0]}?" if near else "")
                           + f" Its module names include: {', '.join(leaves)}.")


def prepare_quantized_base(model: PreTrainedModel, config: SFTConfig) -> None:
    """Freeze the quantized base; upcast its other 16-bit weights (norms, embeddings, head) to float32 where needed.

    Under bf16 autocast they stay as loaded, as in QLoRA's reference code, TRL and axolotl: every matmul runs in bf16
    anyway, the norms compute their statistics in float32 themselves, and bf16 has float32's range. peft's k-bit
    preparation (the float32 upcast) cost Llama-3.1-8B at 2 x 2048 tokens 4.3 GB more peak memory than TRL and 11%
    of its speed on an H100 (BENCHMARKS.md). fp16 (whose range a residual stream can overflow), float32 and DoRA runs
    keep it (precision.upcasts_quantized_base). What trains is float32 either way (peft's adapters;
    `upcast_trained_copies`).
    """
    if upcasts_quantized_base(config):
        prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    else:
        model.requires_grad_(False)
    keep_cpu_4bit_layers_differentiable(model)


def keep_cpu_4bit_layers_differentiable(model: PreTrainedModel) -> None:
    """Stop bitsandbytes repacking 4-bit weights for its CPU inference kernel during evaluation.

    On CPUs with AVX512-BF16, bitsandbytes 0.50 repacks a Linear4bit's weights the first time it runs in eval
    mode and keeps using that kernel afterwards, which has no backward: training after the first evaluation
    would silently get wrong gradients through every quantized layer. Inference needs it too: peft's DoRA
    dequantizes the packed weights itself for its weight norms, and read the repacked ones as NF4 (`sft generate`
    of a QDoRA run: logits off by up to 7.9 where the adapter moves them by 12; the merged model's within 1e-5).
    """
    import bitsandbytes as bnb  # only quantized runs pay for the import

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def unwrapped(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper (the model itself when there is none)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def head_layer(head: nn.Module) -> nn.Module:
    """The layer an output head computes with under peft's wrappers: lm_head in lora_modules_to_save is trained as a
    copy (ModulesToSaveWrapper); with new tokens its base layer gets trainable rows (TrainableTokensWrapper)."""
    if isinstance(head, ModulesToSaveWrapper):
        active = not head.disable_adapters and head.active_adapters
        return head.modules_to_save[head.active_adapters[0]] if active else head.original_module
    if isinstance(head, TrainableTokensWrapper):
        return head.token_adapter.get_base_layer()
    return head


def head_weight(head: nn.Module) -> torch.Tensor:
    """The weight matrix `head`'s forward multiplies by: with trainable new-token rows (added by sft for the tokens a
    chat template brings, see new_token_targets), the base weight with those rows replaced, differentiable in them."""
    if isinstance(head, TrainableTokensWrapper):
        tokens = head.token_adapter
        active = [] if head.disable_adapters or tokens.merged else tokens.active_adapters
        return tokens.get_merged_weights(active) if active else tokens.get_base_layer().weight
    return head_layer(head).weight


def is_adapter_folder(name: str | Path) -> bool:
    """Whether `name` is a local folder holding a peft adapter (a use_peft run or one of its checkpoints)."""
    return (Path(name).expanduser() / ADAPTER_CONFIG).is_file()


def base_model_name(folder: str | Path) -> str:
    """The base model recorded in an adapter folder's adapter_config.json."""
    name = saved_adapter_config(folder).base_model_name_or_path
    if not name:
        raise SFTError(f"{Path(folder) / ADAPTER_CONFIG} names no base model; pass --base_model PATH_OR_HUB_ID.")
    return name


def saved_adapter_config(folder: str | Path) -> PeftConfig:
    """An adapter folder's adapter_config.json as peft reads it."""
    try:
        return PeftConfig.from_pretrained(str(folder))
    except (OSError, ValueError, TypeError) as err:
        raise SFTError(f"{Path(folder) / ADAPTER_CONFIG} is not a valid peft adapter config: {err}") from None


def check_adapter_training(config: SFTConfig) -> None:
    """Training on an adapter folder trains that adapter further, as saved: refuse it without use_peft (peft would load
    it frozen on a frozen base, nothing to train) and refuse recipe lora_* values the saved adapter contradicts
    (peft builds the adapter from its adapter_config.json, so they could not apply)."""
    folder = config.model_name_or_path
    if not folder or not is_adapter_folder(folder):
        return
    if not config.use_peft:
        raise SFTError(f"model_name_or_path {folder} is a LoRA adapter, and with use_peft off nothing would train. "
                       f"Add --use_peft true to keep training the adapter, or `sft merge {folder} MERGED_DIR` first "
                       "and train MERGED_DIR to fine-tune all weights.")
    saved = saved_lora_settings(saved_adapter_config(folder))
    for key, value in saved.items():
        if key in config.recipe_keys and not same_setting(key, getattr(config, key), value):
            raise SFTError(f"`{key}: {getattr(config, key)}` differs from the adapter in {folder}, which has {value} "
                           f"({Path(folder) / ADAPTER_CONFIG}). Training an adapter further keeps its saved settings: "
                           f"remove {key} from the recipe, or `sft merge` the adapter and train a new one on that.")
    log.info("Training the adapter in %s further with its saved settings: %s", folder,
             ", ".join(f"{key} {value}" for key, value in saved.items()))


def saved_lora_settings(saved: PeftConfig) -> dict:
    """A saved adapter's settings under the recipe keys that would set them (module sets as sorted lists)."""
    modules = {key: sorted(value) if isinstance(value, (set, list)) else value
               for key, value in (("lora_target_modules", saved.target_modules),
                                  ("lora_modules_to_save", saved.modules_to_save))}
    return {"lora_r": saved.r, "lora_alpha": saved.lora_alpha, "lora_dropout": saved.lora_dropout,
            "use_dora": saved.use_dora, "use_rslora": saved.use_rslora, **modules}


def same_setting(key: str, recipe: object, saved: object) -> bool:
    """Whether the recipe's value of `key` matches the saved one; module lists in any order."""
    if key == "lora_target_modules" and target_modules(recipe) == ALL_LINEAR:
        return True  # saved expanded to module names, which only the model could check; the log line names them
    if isinstance(recipe, list) or isinstance(saved, list):
        return set(recipe or []) == set(saved or [])
    return recipe == saved


def load_trained_adapter(model: PreTrainedModel, folder: str | Path, config: SFTConfig) -> PeftModel:
    """A saved adapter on its loaded base: trainable (to train on) when use_peft, else frozen (to evaluate)."""
    quantized = config.use_peft and (config.load_in_4bit or config.load_in_8bit)
    if quantized:
        prepare_quantized_base(model, config)
    peft_model = load_saved_adapter(model, folder, is_trainable=config.use_peft)
    if quantized:
        upcast_trained_copies(peft_model)
    adapter_inputs_as_they_come(peft_model)
    if peft_model.peft_config["default"].trainable_token_indices:
        save_new_rows_only(peft_model)
    log_trainable_parameters(peft_model)
    return peft_model


def save_new_rows_only(peft_model: PeftModel) -> None:
    """Make the adapter's saves (final and checkpoints) hold the new tokens' trained rows, not whole embeddings.

    Once the vocabulary grew, peft's save_embedding_layers="auto" also saves both whole embedding matrices: on
    Llama-3-8B with 2 new tokens, 2 x 128256 x 4096 float32 after k-bit preparation, 4.2 GB a checkpoint beside a
    ~170 MB adapter. Every row past the base vocabulary is a trainable token (or in modules_to_save) and saved as
    such, the other rows are the base model's, so a reload (sft, AutoPeftModelForCausalLM) needs nothing more.
    """
    peft_model.save_pretrained = functools.partial(peft_model.save_pretrained, save_embedding_layers=False)


def load_saved_adapter(model: PreTrainedModel, folder: str | Path, is_trainable: bool = False,
                       base_origin: str = "") -> PeftModel:
    """peft's PeftModel.from_pretrained, or an SFTError when the adapter does not fit `model`.

    A base of another architecture or size (a wrong --base_model, or a base folder replaced since training) makes
    peft raise a ValueError (target modules not found) or a RuntimeError listing every mismatched tensor.

    Args:
        model: the base model, embeddings already grown for the adapter's tokenizer.
        folder: the adapter folder.
        is_trainable: load the adapter trainable (to train it further) rather than frozen.
        base_origin: where the base's name came from, for the message (e.g. " (--base_model)").
    """
    try:
        with token_rows_gathered_on_any_device():
            return PeftModel.from_pretrained(model, str(folder), is_trainable=is_trainable)
    except (ValueError, RuntimeError) as err:
        lines = [line.strip() for line in str(err).splitlines() if line.strip()]
        # load_state_dict's message starts with a header line; its first "size mismatch" line says what differs
        detail = next((line for line in lines if line.startswith("size mismatch")), lines[0] if lines else repr(err))
        raise SFTError(f"The adapter in {folder} does not fit the base model {model.name_or_path}{base_origin}: "
                       f"{detail} Use the base model the adapter was trained on.") from None


def log_trainable_parameters(model: PeftModel) -> tuple[int, int]:
    """Log and return (trainable, total) parameter counts; 4-bit weights count as unpacked parameters."""
    trainable, total = model.get_nb_trainable_parameters()
    log.info("Trainable parameters: %s of %s (%.4f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1))
    return trainable, total

