"""Distributed presets: the recipe key `distributed` filled into TrainingArguments' fsdp/fsdp_config/deepspeed.

Presets are defaults: whatever the recipe sets itself (fsdp_config keys, a deepspeed file, checkpointing kwargs)
wins. The preset files live in recipes/accelerate (launcher configs) and recipes/deepspeed (ZeRO configs whose
"auto" values the Trainer fills from the recipe).
"""

import base64
import dataclasses
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn
from transformers import PretrainedConfig, Trainer

from sft.config.arguments import SFTConfig
from sft.config.names import DISTRIBUTED_PRESETS
from sft.errors import SFTError
from sft.models.adapters import base_model_name, is_adapter_folder
from sft.models.architectures import model_architecture
from sft.models.families import wrap_classes
from sft.models.loading import auto_model_class
from sft.models.quantization import compute_dtype_name
from sft.training.catalog import shipped

log = logging.getLogger(__name__)
RECIPES = shipped("recipes")
PRESETS = DISTRIBUTED_PRESETS
ACCELERATE_CONFIGS = {name: RECIPES / "accelerate" / f"{name}.yaml" for name in PRESETS}
DEEPSPEED_CONFIGS = {name: RECIPES / "deepspeed" / f"{name}.json" for name in ("zero2", "zero3", "zero3_offload")}

# FSDP2, one unit per layer. Checkpoints are sharded (each rank writes its shard: fast, resumable); the final
# model is saved whole by prepare_final_save. RAM-efficient loading (rank 0 reads the weights, then broadcasts)
# stays off by default: it is the fragile path in transformers/accelerate and only pays off for 30B+ models.
FSDP_PRESETS = {
    "fsdp": {"version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "reshard_after_forward": True,
             "state_dict_type": "SHARDED_STATE_DICT", "cpu_ram_efficient_loading": False},
}
FSDP_PRESETS["fsdp_offload"] = {**FSDP_PRESETS["fsdp"], "cpu_offload": True}
# transformers 4 / Stanford Alpaca `--fsdp "full_shard auto_wrap"` words as FSDP2 fsdp_config keys.
# What a launcher sets in each process it starts: torchrun, accelerate launch and deepspeed set WORLD_SIZE and
# LOCAL_RANK; MPI launchers (mpirun) set their own, which DeepSpeed reads through mpi4py.
LAUNCHER_ENV = ("WORLD_SIZE", "LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_SIZE")
LEGACY_FSDP_OPTIONS = {"full_shard": {"reshard_after_forward": True}, "shard_grad_op": {"reshard_after_forward": False},
                       "offload": {"cpu_offload": True}, "auto_wrap": {}}


def apply_distributed(values: dict) -> dict:
    """Recipe values with the `distributed` preset (and Alpaca-style fsdp strings) as TrainingArguments settings.

    Args:
        values: validated recipe values, before SFTConfig is built; they are not modified.
    """
    values = {**values, **legacy_fsdp(values)}
    preset = values.get("distributed")
    if preset in FSDP_PRESETS:
        values.update(fsdp_settings(values, preset))
    elif preset in DEEPSPEED_CONFIGS and values.get("deepspeed") is None:
        values["deepspeed"] = str(DEEPSPEED_CONFIGS[preset])
    check_deepspeed_config(values.get("deepspeed"))
    check_combinations(values)
    check_wrap_classes(values)
    values.update(fsdp_qlora_settings(values))
    values.update(peft_zero3_settings(values))
    return values


def legacy_fsdp(values: dict) -> dict:
    """`fsdp: "full_shard auto_wrap"` (Stanford Alpaca, transformers 4) as fsdp=True plus fsdp_config keys.

    transformers 5 deprecates these strings; translating them here keeps old command lines working after removal.
    """
    fsdp = values.get("fsdp")
    if isinstance(fsdp, list) and not all(isinstance(word, str) for word in fsdp):  # transformers calls .upper()
        raise SFTError(f"fsdp: {fsdp!r} is not a list of FSDP options. Write fsdp: true (or `distributed: fsdp`), or "
                       "options such as \"full_shard auto_wrap\".")
    if not isinstance(fsdp, str):
        return {}
    words = fsdp.lower().split()
    if words in ([], ["false"], ["none"]):
        return {"fsdp": None}
    if words == ["true"]:
        return {"fsdp": True}
    user = fsdp_config_dict(values.get("fsdp_config"))
    if int(user.get("version", 2)) == 1:
        return {}  # FSDP1 (deprecated) has more options; transformers translates them itself
    unknown = [word for word in words if word not in LEGACY_FSDP_OPTIONS]
    if unknown:
        raise SFTError(f"fsdp: unknown option {unknown[0]!r}. Use full_shard, shard_grad_op, offload and auto_wrap, "
                       "or `distributed: fsdp` (see docs/distributed.md).")
    implied = {key: value for word in words for key, value in LEGACY_FSDP_OPTIONS[word].items()}
    return {"fsdp": True, "fsdp_config": {**implied, **user}}


def fsdp_config_dict(value: dict | str | None) -> dict:
    """The recipe's fsdp_config as a dict (a JSON path is read), keys without the accelerate-style fsdp_ prefix."""
    if isinstance(value, str):
        try:
            value = json.loads(Path(value).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise SFTError(f"fsdp_config: could not read {value} as JSON ({err}).") from None
    return {key.removeprefix("fsdp_"): item for key, item in (value or {}).items()}


def fsdp_settings(values: dict, preset: str) -> dict:
    """fsdp, fsdp_config (preset under the recipe's own keys) and the checkpointing settings FSDP needs."""
    user = fsdp_config_dict(values.get("fsdp_config"))
    config = dict(FSDP_PRESETS[preset])
    if values.get("save_only_model"):
        # model-only checkpoints are whole (the Trainer refuses save_only_model with sharded ones, once loaded)
        config["state_dict_type"] = "FULL_STATE_DICT"
    if "transformer_layer_cls_to_wrap" not in user:
        wrap = recipe_wrap_classes(values)
        if wrap:
            config["transformer_layer_cls_to_wrap"] = wrap
    out: dict[str, Any] = {"fsdp": values.get("fsdp") or True}
    wants_checkpointing = values.get("activation_checkpointing") or values.get("gradient_checkpointing")
    if wants_checkpointing and user.get("activation_checkpointing") is not False:
        # FSDP's own checkpointing: the Trainer's would all-gather every layer twice (transformers#30404), and the
        # Trainer refuses both at once.
        config["activation_checkpointing"] = True
        out["activation_checkpointing"] = False
    out["fsdp_config"] = {**config, **user}
    return out


def fsdp_qlora_settings(values: dict) -> dict:
    """FSDP-QLoRA (a preset, `fsdp: true` or Alpaca's fsdp strings alike): the packed 4-bit weights stored in the
    compute dtype. FSDP shards them with the float ones, so they must share a dtype; with the default uint8 accelerate
    leaves them out of sharding, and every GPU holds the whole 4-bit base."""
    if not values.get("fsdp") or not values.get("load_in_4bit") or values.get("bnb_4bit_quant_storage") is not None:
        return {}
    return {"bnb_4bit_quant_storage": compute_dtype_name(values.get("bnb_4bit_compute_dtype"), values.get("dtype"),
                                                         values.get("bf16"), values.get("fp16"))}


def recipe_wrap_classes(values: dict) -> list[str] | None:
    """The layer classes FSDP wraps for the recipe's model (sft.models.families), from its config (no weights are
    read)."""
    config = recipe_model_config(values)
    return wrap_classes(config) if config is not None else None


def recipe_model_config(values: dict, warn: bool = True) -> PretrainedConfig | None:
    """The config of the recipe's model (an adapter's base), or None when it cannot be read offline (said when
    `warn`)."""
    name = values.get("model_name_or_path")
    if not name:
        return None
    if is_adapter_folder(name):
        name = base_model_name(name)
    try:
        return model_architecture(name, values.get("revision"), values.get("cache_dir"),
                                  values.get("trust_remote_code", False))
    except SFTError as err:
        # accelerate falls back to the model's _no_split_modules when it wraps, which is what we would pick too
        if warn:
            log.warning("%s FSDP will wrap the model's _no_split_modules.", err)
        return None


def check_wrap_classes(values: dict) -> None:
    """Refuse FSDP wrap classes the model does not have, and a model FSDP would not split into units, when the recipe
    is read. accelerate reported a wrong class name only after the data was tokenized and the weights loaded, as a
    traceback ("Could not find the transformer layer class X in the model."), and wraps a model without
    _no_split_modules (BioGPT, CTRL, OpenAI GPT, XLM, ...) as one unit, gathering every weight at once."""
    fsdp = fsdp_config_dict(values.get("fsdp_config")) if values.get("fsdp") else {}
    if not values.get("fsdp") or fsdp.get("auto_wrap_policy", "TRANSFORMER_BASED_WRAP") != "TRANSFORMER_BASED_WRAP":
        return
    names = fsdp.get("transformer_layer_cls_to_wrap")
    names = names.split(",") if isinstance(names, str) else list(names or [])  # transformers joins them with ","
    config = recipe_model_config(values, warn=False)  # fsdp_settings has said so for a preset
    known = set(wrap_classes(config) or ()) if config is not None else set()
    if config is None or (set(names) <= known if names else known):
        return  # unknown model (accelerate decides), or the classes sft itself picks for it
    model = meta_model(config, values.get("trust_remote_code", False))
    if model is None:
        return
    blocks = sorted({type(block).__name__ for module in model.modules() if isinstance(module, nn.ModuleList)
                     for block in module})
    where = f"{config.model_type} model ({type(model).__name__})"
    fix = f"Set fsdp_config: {{transformer_layer_cls_to_wrap: [{', '.join(blocks) or '...'}]}}"
    missing = [n for n in names if n not in {type(m).__name__ for m in model.modules()}]
    if missing:
        raise SFTError(f"fsdp_config.transformer_layer_cls_to_wrap: {', '.join(missing)} is not a module class of the "
                       f"{where}; its repeated blocks are {', '.join(blocks) or 'none'}. {fix}.")
    if not names and not getattr(model, "_no_split_modules", None):
        raise SFTError(f"FSDP cannot tell which blocks of the {where} to shard one at a time: sft has no wrap class "
                       "for it and it defines no _no_split_modules, so FSDP would gather the whole model at once. "
                       f"{fix}.")


def meta_model(config: PretrainedConfig, trust_remote_code: bool) -> nn.Module | None:
    """The model of `config` built on the meta device (module structure, no memory, ~2 s for 70B), or None when
    transformers cannot build it from the config alone (remote code that is not trusted, a config-only class)."""
    try:
        with torch.device("meta"):
            return auto_model_class(config).from_config(config, trust_remote_code=trust_remote_code)
    except (ValueError, OSError, ImportError, TypeError, KeyError):
        return None


def check_deepspeed_config(deepspeed: dict | str | None) -> None:
    """Refuse a DeepSpeed config that cannot be read or that DeepSpeed would reject, naming the file and the key,
    before any data or weights load. TrainingArguments reported a bad JSON file as "Invalid recipe: Expecting property
    name ..." (no file, no key), a directory or a JSON list with a traceback, and an unknown or mistyped
    zero_optimization key only once the model loaded, as "Could not load the model ...: 1 validation error"."""
    if not deepspeed:
        return
    settings, where = read_deepspeed_config(deepspeed)
    zero = settings.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise SFTError(f"{where}: zero_optimization must be an object of ZeRO settings, got {zero!r}.")
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from pydantic import ValidationError

    try:
        DeepSpeedZeroConfig(**zero)  # DeepSpeed's own check of the section, as it runs when the engine is built
    except ValidationError as err:
        # "auto" values are filled from the recipe by the Trainer before DeepSpeed sees them
        problems = [f"zero_optimization.{'.'.join(map(str, e['loc']))}: {e['msg']} (got {e['input']!r})"
                    for e in err.errors() if e.get("input") != "auto"]
        if problems:
            raise SFTError(f"{where}: {'; '.join(problems)}. See DeepSpeed's ZeRO configuration (https://"
                           "www.deepspeed.ai/docs/config-json/#zero-optimizations-for-fp16-training).") from None


def read_deepspeed_config(deepspeed: dict | str) -> tuple[dict, str]:
    """The settings of a DeepSpeed config (a dict, a JSON file, or the JSON or base64 JSON TrainingArguments also
    takes) and how errors name it; an SFTError saying why it cannot be read."""
    where = "deepspeed" if isinstance(deepspeed, dict) else f"deepspeed: {deepspeed}"
    if isinstance(deepspeed, str):
        path = Path(deepspeed).expanduser()
        # os.path.exists, not Path.exists: a base64 config longer than a file name raises ENAMETOOLONG there
        inline = None if os.path.exists(path) else _inline_json(deepspeed)
        if inline is not None:
            deepspeed, where = inline, "deepspeed"
        elif not os.path.exists(path):
            raise SFTError(f"{where} does not exist. Give the path of a DeepSpeed JSON config, or a `distributed` "
                           f"preset ({', '.join(DEEPSPEED_CONFIGS)}).")
        else:
            try:
                deepspeed = json.loads(path.read_text(encoding="utf-8"))
            except OSError as err:  # a folder, no permission
                raise SFTError(f"{where} could not be read: {err.strerror or err}. Give the path of a DeepSpeed JSON "
                               "config file.") from None
            except ValueError as err:  # json.JSONDecodeError, UnicodeDecodeError
                raise SFTError(f"{where} is not valid JSON: {err}.") from None
    if not isinstance(deepspeed, dict):
        raise SFTError(f"{where} must hold a JSON object of DeepSpeed settings, got a {type(deepspeed).__name__}.")
    return deepspeed, where


def _inline_json(text: str) -> dict | None:
    """`text` as a JSON object, written out or base64-encoded (TrainingArguments takes a DeepSpeed config either way
    besides a path), else None."""
    for decode in (lambda: text, lambda: base64.urlsafe_b64decode(text).decode("utf-8")):
        try:
            value = json.loads(decode())
        except ValueError:  # json.JSONDecodeError, binascii.Error, UnicodeDecodeError
            continue
        return value if isinstance(value, dict) else None
    return None


def zero_stage(deepspeed: dict | str | None) -> int | None:
    """The ZeRO stage of a DeepSpeed config (read_deepspeed_config); None when unset or unreadable (which
    check_deepspeed_config reports)."""
    if not deepspeed:
        return None
    try:
        zero = read_deepspeed_config(deepspeed)[0].get("zero_optimization", {})
    except SFTError:
        return None
    return zero.get("stage") if isinstance(zero, dict) else None


def check_combinations(values: dict) -> None:
    """Refuse sharding setups that cannot work, before any data or weights load."""
    fsdp, stage = bool(values.get("fsdp")), zero_stage(values.get("deepspeed"))
    if fsdp and values.get("deepspeed"):
        raise SFTError("Both FSDP (fsdp / distributed: fsdp) and DeepSpeed (deepspeed / distributed: zero*) are set; "
                       "choose one.")
    if stage == 3 and (values.get("load_in_4bit") or values.get("load_in_8bit")):
        raise SFTError("QLoRA (load_in_4bit / load_in_8bit) does not work with DeepSpeed ZeRO-3 in sft: ZeRO-3 "
                       "partitions the packed bitsandbytes weights as if they were plain tensors. Use FSDP-QLoRA "
                       "(`distributed: fsdp` with load_in_4bit: it shards the 4-bit base across GPUs), `distributed: "
                       "zero2`, or a single GPU. See docs/distributed.md.")
    sharded_checkpoints = "SHARDED" in str(fsdp_config_dict(values.get("fsdp_config")).get("state_dict_type", "FULL"))
    # The Trainer refuses both only once the data is tokenized and the model loaded.
    if fsdp and values.get("save_only_model") and sharded_checkpoints:
        raise SFTError("save_only_model with FSDP needs whole-model checkpoints: remove fsdp_config.state_dict_type: "
                       "SHARDED_STATE_DICT (the fsdp presets then save whole ones), or save_only_model.")
    if fsdp and values.get("save_only_model") and values.get("load_best_model_at_end"):
        raise SFTError("save_only_model cannot be combined with FSDP and load_best_model_at_end (the best checkpoint "
                       "would hold no optimizer state to go on from); remove one of them.")
    if fsdp and values.get("load_in_8bit"):
        raise SFTError("load_in_8bit cannot be sharded by FSDP; use load_in_4bit (FSDP-QLoRA) or `distributed: ddp`.")


def peft_zero3_settings(values: dict) -> dict:
    """PEFT under ZeRO-3 recomputes with reentrant activation checkpointing.

    Non-reentrant checkpointing checks that recomputed tensors match the forward pass, and DeepSpeed releases the
    frozen base weights to shape [0] before the recompute (transformers#47254, DeepSpeed#4332); recent DeepSpeed
    re-gathers them, older versions fail the backward pass.
    """
    if not values.get("use_peft") or zero_stage(values.get("deepspeed")) != 3:
        return {}
    kwargs = values.get("activation_checkpointing_kwargs") or values.get("gradient_checkpointing_kwargs") or {}
    if not isinstance(kwargs, dict):
        return {}  # a JSON string: TrainingArguments parses it, and reports it if it is malformed
    if kwargs.get("use_reentrant") is False and (values.get("activation_checkpointing")
                                                 or values.get("gradient_checkpointing")):
        log.warning("use_reentrant: false with PEFT on ZeRO-3 fails the backward pass on older DeepSpeed "
                    "(transformers#47254); remove it to use the reentrant default sft sets.")
    return {"activation_checkpointing_kwargs": {"use_reentrant": True, **kwargs}}


def shards(config: SFTConfig) -> bool:
    """Whether the run shards over processes (FSDP or DeepSpeed, from a preset or the recipe's own keys); `ddp`
    sets neither and runs as one plain process too."""
    return bool(config.fsdp or config.deepspeed)


def warn_half_precision_masters(model: Any, config: SFTConfig) -> None:
    """A full fine-tune of bfloat16/float16 weights on one GPU or DDP keeps no float32 copy, so AdamW steps below the
    16-bit precision of a weight (about 1/256 of it in bf16: most steps at fine-tuning learning rates) round away.
    FSDP (accelerate upcasts trainable weights) and DeepSpeed keep float32 masters; LoRA adapters train in float32."""
    half = [p for p in model.parameters() if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)]
    if half and not shards(config):
        log.warning("%s of the trainable parameters are %s with no float32 copy: AdamW updates smaller than their "
                    "precision are lost (most at learning_rate %g). Set dtype: float32 with bf16: true for mixed "
                    "precision (float32 master weights, bf16 compute, 2x weight memory), or distributed: fsdp / zero2 "
                    "/ zero3, or use_peft: true.", f"{sum(p.numel() for p in half):,}", half[0].dtype,
                    config.learning_rate)


def check_launcher(config: SFTConfig, verb: str = "train") -> None:
    """A sharded run needs the processes a launcher starts. As one plain process the Trainer fails only after the
    data is tokenized and the model loaded: FSDP with "only works in distributed training", DeepSpeed looking for
    MPI. One process under a launcher is fine (one GPU with fsdp_offload / zero3_offload). `sft launch` runs
    `sft train` only, so `sft eval` is pointed at torchrun. SLURM tasks must be the run's processes
    (check_slurm_tasks)."""
    check_slurm_tasks(config.world_size, verb)
    if not shards(config) or any(name in os.environ for name in LAUNCHER_ENV):
        return
    what = (f"distributed: {config.distributed}" if config.distributed in (*FSDP_PRESETS, *DEEPSPEED_CONFIGS)
            else "fsdp" if config.fsdp else "deepspeed")
    launch = "`sft launch RECIPE --num_processes N` (N GPUs; 1 on one GPU) or " if verb == "train" else ""
    raise SFTError(f"{what} shards the run over processes that a launcher starts, and this is one plain process. "
                   f"Run {launch}`torchrun --nproc_per_node N -m sft {verb} RECIPE`.")


def check_slurm_tasks(world_size: int, verb: str = "train") -> None:
    """srun starts each of its tasks as a plain process and sets up no torch.distributed: N tasks of `sft train` are N
    one-process runs training the same model into the same output_dir. The tasks are one run only when the processes
    the run sees (world_size: torchrun inside srun, or DeepSpeed's MPI discovery) are at least as many."""
    tasks = int(os.environ.get("SLURM_STEP_NUM_TASKS") or 1)
    if tasks <= world_size:
        return
    raise SFTError(f"srun started {tasks} tasks (SLURM_STEP_NUM_TASKS={tasks}), and each is a separate {world_size}-"
                   f"process run: srun does not connect them, so they would all write {verb} results to the same "
                   "output_dir. Run one task per node that starts the processes: `srun --ntasks-per-node 1 torchrun "
                   "--nnodes $SLURM_NNODES --nproc_per_node GPUS_PER_NODE --rdzv_backend c10d --rdzv_endpoint "
                   f"HEAD_NODE:29500 -m sft {verb} RECIPE` (HEAD_NODE: the first of `scontrol show hostnames "
                   "$SLURM_JOB_NODELIST`), or `srun --ntasks 1` for one process.")


def evaluation_config(config: SFTConfig) -> SFTConfig:
    """The recipe as `sft eval` runs it. transformers evaluates under DeepSpeed only with ZeRO-3 ("ZeRO inference
    only makes sense with ZeRO Stage 3"); ZeRO-0/1/2 keep whole weights on every process, so their eval runs as plain
    data parallelism, with the same result (ZeRO-3 and FSDP stay). push_to_hub is off: eval uploads nothing, yet the
    Trainer creates the Hub repository when built (a traceback without a Hub)."""
    stage = zero_stage(config.deepspeed)
    changes = {"deepspeed": None, "distributed": None} if config.deepspeed and stage != 3 else {}
    changes.update({"push_to_hub": False} if config.push_to_hub else {})
    if not changes:
        return config
    if "deepspeed" in changes:
        log.info("sft eval: DeepSpeed ZeRO-%s keeps whole weights on each process; evaluating without it.", stage)
    resolved = dataclasses.replace(config, **changes)  # TrainingArguments set up again
    resolved.recipe_keys, resolved.cpu_by_default = config.recipe_keys, config.cpu_by_default  # not init fields
    return resolved


def prepare_final_save(trainer: Trainer) -> None:
    """Make the final save a whole model that from_pretrained loads (FSDP checkpoints are sharded). A ZeRO-3 config
    without stage3_gather_16bit_weights_on_model_save (DeepSpeed's default is false) saved no model at all: the
    Trainer wrote DeepSpeed's shards into output_dir with a warning, and `sft generate RUN` or from_pretrained found
    no weights; its checkpoints stay shards, resumable as before."""
    if trainer.is_fsdp_enabled:
        trainer.accelerator.state.fsdp_plugin.set_state_dict_type("FULL_STATE_DICT")
    engine = getattr(trainer, "deepspeed", None)
    if trainer.is_deepspeed_enabled and engine is not None and zero_stage(trainer.args.deepspeed) == 3:
        engine._config.zero_config.gather_16bit_weights_on_model_save = True
