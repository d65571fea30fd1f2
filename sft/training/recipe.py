"""Recipes: flat YAML whose keys are SFTConfig field names, plus command-line overrides, strictly validated."""

import copy
import dataclasses
import difflib
import enum
import math
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from sft.config.arguments import SFTConfig
from sft.config.validate import check_accelerator_config, check_best_model_at_end, check_values
from sft.errors import SFTError
from sft.training.presets import apply_distributed

FIELDS = {f.name: f for f in dataclasses.fields(SFTConfig) if f.init}
# Not Field.type: HfArgumentParser (`sft train --help`) rewrites it in place, e.g. fsdp_config's dict | str to str.
TYPES = typing.get_type_hints(SFTConfig)
# Keys that must never be written to recipe.yaml, model cards or logs.
SECRET_KEYS = ("hub_token", "token", "push_to_hub_token")
# Names that older transformers / TRL / Stanford Alpaca used for what is now another key.
RENAMED = {
    "evaluation_strategy": "eval_strategy",
    "warmup_ratio": "warmup_steps",  # a value below 1 is a ratio of the total steps
    "max_seq_length": "max_length",
    "model_max_length": "max_length",
    "data_path": "dataset",
    "dataset_name": "dataset",
    "torch_dtype": "dtype",
    "per_gpu_train_batch_size": "per_device_train_batch_size",
    "per_gpu_eval_batch_size": "per_device_eval_batch_size",
    "fsdp_transformer_layer_cls_to_wrap": "fsdp_config: {transformer_layer_cls_to_wrap: [...]}",
}
# Other tools' recipe keys (axolotl, alpaca-lora's finetune.py, LLaMA-Factory) for what sft names otherwise, with
# how to say it here: their spelling gets the sft key, not a "did you mean" guess from the spelling alone.
PEER_KEYS = {
    "base_model": "model_name_or_path",
    "sequence_len": "max_length", "cutoff_len": "max_length",
    "micro_batch_size": "per_device_train_batch_size",
    "num_epochs": "num_train_epochs",
    "val_set_size": "eval_split_size", "val_size": "eval_split_size",
    "sample_packing": "packing",
    "lr_scheduler": "lr_scheduler_type",
    "lora_rank": "lora_r", "lora_target": "lora_target_modules",
    "train_on_inputs": "completion_only_loss (the opposite: train_on_inputs: false is completion_only_loss: true)",
    "adapter": "use_peft: true (and load_in_4bit: true for QLoRA)",
    "finetuning_type": "use_peft: true for lora (leave it out for a full fine-tune)",
    "quantization_bit": "load_in_4bit: true or load_in_8bit: true",
    "template": "chat_template",
    "flash_attention": "attn_implementation: flash_attention_2",
    "group_by_length": "train_sampling_strategy: group_by_length",
    "save_safetensors": "nothing: sft always saves safetensors (drop the key)",
}
PATH_KEYS = ("model_name_or_path", "tokenizer_name_or_path", "dataset", "eval_dataset", "chat_template", "deepspeed")
_TRUE, _FALSE = ("true", "yes", "1", "on"), ("false", "no", "0", "off")


def load_recipe(source: str | Path | dict | None = None, flags: list[str] | None = None, **overrides: Any) -> SFTConfig:
    """Read a recipe (YAML path or dict), apply `--key value` flags and keyword overrides, and validate it.

    Args:
        source: path to a YAML recipe, a dict of recipe keys, or None for defaults only.
        flags: command-line style overrides, e.g. ["--learning_rate", "1e-4", "--packing=true"].
        **overrides: Python-side overrides, e.g. learning_rate=1e-4.
    """
    if source is not None and not isinstance(source, (str, Path, dict)):  # dict() of a list or number: a TypeError
        raise SFTError(f"load_recipe takes a recipe file's path, a dict of recipe keys or None, got "
                       f"{type(source).__name__} {source!r:.80}.")
    if isinstance(flags, str):  # iterated character by character: "Unexpected argument '-'"
        raise SFTError(f"load_recipe's flags are a list of strings, e.g. {flags.split()!r:.80}, not one string.")
    values = read_recipe_file(source) if isinstance(source, (str, Path)) else dict(source or {})
    origin = str(source) if isinstance(source, (str, Path)) else "recipe"
    values = {key: coerce(key, value, origin) for key, value in values.items()}
    values.update({key: coerce(key, value, "command line", from_text=True) for key, value in parse_flags(flags or []).items()})
    values.update({key: coerce(key, value, "load_recipe()") for key, value in overrides.items()})
    return build_config(values)


def read_recipe_file(path: str | Path) -> dict:
    """The key/value mapping in a YAML recipe file."""
    path = Path(path)
    if not path.is_file():
        from sft.training.catalog import rebase_shipped_data, shipped_recipe

        shipped = shipped_recipe(path)
        if shipped is None:
            raise SFTError(f"Recipe {path} does not exist. Pass the path to a .yaml recipe, or the name of a "
                           "shipped one (see `sft recipes`).")
        return rebase_shipped_data(read_recipe_file(shipped))
    try:
        values = yaml.load(path.read_text(encoding="utf-8"), Loader=StrictLoader)  # noqa: S506 (a SafeLoader)
    except DuplicateKey as err:
        raise SFTError(f"Recipe {path}: {err}") from None
    except yaml.YAMLError as err:
        raise SFTError(f"Recipe {path} is not valid YAML: {yaml_problem(err)}") from None
    if values is None:
        return {}
    if not isinstance(values, dict):
        raise SFTError(f"Recipe {path} must be a mapping of keys to values, got a {type(values).__name__}.")
    return values


def yaml_problem(err: yaml.YAMLError) -> str:
    """PyYAML's multi-line report as one line: the problem and where it was found."""
    mark = getattr(err, "problem_mark", None)
    problem = getattr(err, "problem", None) or str(err).splitlines()[0]
    return f"line {mark.line + 1}, column {mark.column + 1}: {problem}" if mark else problem


class DuplicateKey(yaml.YAMLError):
    """A key given twice in one mapping: YAML keeps the last silently, which hides a mistyped override."""


class StrictLoader(yaml.SafeLoader):
    """safe_load that refuses duplicate keys, naming both lines."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *base` merges are YAML's own override mechanism
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if isinstance(key, str) and key in seen:
                raise DuplicateKey(f"key `{key}` is set twice, on lines {seen[key]} and {line}; keep one of them")
            seen[key] = line
        return super().construct_mapping(node, deep=deep)


def parse_flags(argv: list[str]) -> dict[str, str]:
    """`--key value` / `--key=value` pairs as raw strings; a bare `--flag` means true."""
    values: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("--") or arg == "--":
            raise SFTError(f"Unexpected argument {arg!r}: options look like --key value or --key=value.")
        key, eq, value = arg[2:].partition("=")
        key = key.replace("-", "_")
        if not eq:
            has_value = i + 1 < len(argv) and not argv[i + 1].startswith("--")
            value = argv[i + 1] if has_value else "true"
            i += has_value
        values[key] = value
        i += 1
    return values


def check_key(key: str, origin: str) -> dataclasses.Field:
    """The SFTConfig field for `key`, or an error naming the nearest valid key."""
    if key in FIELDS:
        return FIELDS[key]
    if key in RENAMED:
        raise SFTError(f"Key `{key}` in {origin} was renamed: use `{RENAMED[key]}`.")
    if key in PEER_KEYS:
        raise SFTError(f"Unknown key `{key}` in {origin}: that is another tool's name (axolotl, alpaca-lora, "
                       f"LLaMA-Factory); sft's is {PEER_KEYS[key]}.")
    close = difflib.get_close_matches(key, FIELDS, n=1, cutoff=0.6)
    hint = f" Did you mean `{close[0]}`?" if close else " Run `sft train --help` for the valid keys."
    raise SFTError(f"Unknown key `{key}` in {origin}.{hint}")


def coerce(key: str, value: Any, origin: str, from_text: bool = False) -> Any:
    """`value` converted to the type of field `key`, or an error saying what was expected."""
    field = check_key(key, origin)
    try:
        value = _convert(value, TYPES[key], from_text)
    except (TypeError, ValueError) as err:
        raise SFTError(f"Bad value for `{key}` in {origin}: {err}.") from None
    except yaml.YAMLError as err:  # a flag value such as --dataset "[{path: x"
        raise SFTError(f"Bad value for `{key}` in {origin}: not valid YAML ({yaml_problem(err)}).") from None
    choices = field.metadata.get("choices")
    if choices and value is not None and value not in choices:
        raise SFTError(f"Bad value for `{key}` in {origin}: {value!r} is not one of {', '.join(choices)}.")
    return value


def _convert(value: Any, annotation: Any, from_text: bool) -> Any:
    """Convert one value to `annotation`; strings from the command line are parsed."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any or annotation is dataclasses.MISSING:
        return yaml.safe_load(value) if from_text and isinstance(value, str) else value
    if origin in (typing.Union, types.UnionType):
        return _convert_union(value, args, from_text)
    if origin is None and isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return annotation(value).value if not isinstance(value, annotation) else value
    if typing.get_origin(annotation) is typing.Literal:
        if value not in args:
            raise ValueError(f"expected one of {', '.join(map(str, args))}, got {value!r}")
        return value
    if annotation is bool:
        return _to_bool(value)
    if annotation is int:
        return _to_int(value)
    if annotation is float:
        return _to_float(value)
    if annotation is str:
        return _to_str(value)
    if origin in (list, tuple) or annotation in (list, tuple):
        return _to_list(value, args[0] if args else Any, from_text)
    if origin is dict or annotation is dict:
        return _to_dict(value, from_text)
    return value


def _convert_union(value: Any, args: tuple, from_text: bool) -> Any:
    """Try each member of a Union in order, None first when the value spells it."""
    # On the command line "null" means None; "none" too, unless the field takes strings ("report_to none").
    spelled_none = from_text and isinstance(value, str) and (
        value.lower() == "null" or (value.lower() == "none" and str not in args))
    if (value is None or spelled_none) and type(None) in args:
        return None
    errors = []
    for arm in (a for a in args if a is not type(None)):
        try:
            return _convert(value, arm, from_text)
        except (TypeError, ValueError) as err:
            errors.append(str(err))
    raise ValueError(" or ".join(errors) if errors else f"got {value!r}")


def _to_bool(value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in _TRUE + _FALSE:
        return value.lower() in _TRUE
    raise ValueError(f"expected true or false, got {value!r}")


def _to_int(value: Any) -> int:
    if isinstance(value, bool):
        raise ValueError(f"expected an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    raise ValueError(f"expected an integer, got {value!r}")


def _to_float(value: Any) -> float:
    # YAML 1.1 reads `1e-4` (no dot) as a string, so numeric strings are accepted here on purpose.
    number = None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value)
        except ValueError:
            pass
    if number is None:
        raise ValueError(f"expected a number, got {value!r}")
    if not math.isfinite(number):  # inf steps crashed TrainingArguments (OverflowError); nan or inf betas, eps,
        raise ValueError(f"expected a finite number, got {value!r}")  # rates train on nothing or NaN
    return number


def _to_str(value: Any) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return str(value)
    raise ValueError(f"expected a string, got {value!r}")


def _to_list(value: Any, item: Any, from_text: bool) -> list:
    if from_text and isinstance(value, str):
        parsed = yaml.safe_load(value)
        value = parsed if isinstance(parsed, list) else [v.strip() for v in value.split(",") if v.strip()]
    if isinstance(value, str):  # a recipe's `metrics: exact_match,rouge` is two items, as on the command line
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)):
        raise ValueError(f"expected a list, got {value!r}")
    return [_convert(v, item, from_text) for v in value]


def _to_dict(value: Any, from_text: bool) -> dict:
    if from_text and isinstance(value, str):
        value = yaml.safe_load(value)
    if not isinstance(value, dict):
        raise ValueError(f"expected a mapping, got {value!r}")
    return value


def build_config(values: dict) -> SFTConfig:
    """SFTConfig from validated values; TrainingArguments' own checks become SFTErrors."""
    values.setdefault("output_dir", "outputs/run")
    user_keys = sorted(values)
    if values.get("early_stopping_patience") is not None and values.get("metric_for_best_model") is None:
        values["metric_for_best_model"] = "loss"  # what early stopping watches unless told (as load_best does)
    values = apply_distributed(values)  # before TrainingArguments, which sets up FSDP/DeepSpeed as it is built
    check_best_model_at_end(values)
    check_accelerator_config(values.get("accelerator_config"))
    try:
        config = SFTConfig(**values)
    except (ValueError, TypeError) as err:
        raise SFTError(f"Invalid recipe: {err}") from None
    config.recipe_keys = user_keys  # recipe.yaml keeps `distributed`, not what it expanded to
    check_values(config)
    return config


def with_model_limits(config: SFTConfig, max_length: int) -> SFTConfig:
    """The recipe as a run uses it once the model's limits are known (max_length lowered to its positions).

    A copy: the caller's config is left as given, and TrainingArguments' set-up (__post_init__) does not run twice.
    """
    if max_length == config.max_length:
        return config
    resolved = copy.copy(config)
    resolved.max_length = max_length
    return resolved


def resolved_recipe(config: SFTConfig) -> dict:
    """The recipe keys that define this run (user-set and SFT fields), without secrets, for recipe.yaml."""
    sft_fields = [f.name for f in dataclasses.fields(SFTConfig) if f.name not in _TRAINING_ARGUMENT_FIELDS]
    keys = dict.fromkeys([*config.recipe_keys, *sft_fields, "seed", "output_dir"])
    out = {}
    for key in keys:
        if key in SECRET_KEYS or key not in FIELDS:
            continue
        out[key] = _plain(getattr(config, key))
    for key in PATH_KEYS:
        if out.get(key) is not None:
            out[key] = _absolute(out[key])
    return out


def _plain(value: Any) -> Any:
    """Enums (also inside lists, e.g. `debug`) as their YAML-writable values."""
    if isinstance(value, list):
        return [_plain(v) for v in value]
    return value.value if isinstance(value, enum.Enum) else value


def _absolute(value: Any) -> Any:
    """Local paths (also inside source lists) made absolute so the recipe runs from any directory."""
    if isinstance(value, list):
        return [_absolute(v) for v in value]
    if isinstance(value, dict) and "path" in value:
        return {**value, "path": _absolute(value["path"])}
    if isinstance(value, str) and Path(value).expanduser().exists():
        return str(Path(value).expanduser().resolve())
    return value


def save_recipe(config: SFTConfig, path: Path) -> None:
    """Write the resolved recipe so `sft train path` reproduces the run."""
    text = yaml.safe_dump(resolved_recipe(config), sort_keys=False, allow_unicode=True)
    header = ("# Resolved recipe written by sft. Reproduce the run with:\n"
              "#   sft train THIS_FILE --output_dir NEW_DIR   (or --overwrite_output_dir true)\n")
    path.write_text(header + text, encoding="utf-8")


_TRAINING_ARGUMENT_FIELDS = {f.name for f in dataclasses.fields(SFTConfig.__mro__[1])}
