"""Value checks on a built recipe: ranges and combinations TrainingArguments leaves to fail later, with a traceback,
after tokenization and model loading. Each failure is one SFTError saying which key, what it got and what it takes."""

import dataclasses
import difflib
import inspect
import math
import re
from pathlib import Path

from sft.config.arguments import SFTConfig
from sft.config.names import CHUNKED_LOSS_KERNELS
from sft.errors import SFTError

# key: the smallest value that makes sense (None values mean "unset" and are not checked).
AT_LEAST_ONE = ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps",
                "max_length", "lora_r", "max_new_tokens", "generation_num_beams", "generation_max_length",
                "dataset_num_proc", "save_total_limit", "early_stopping_patience")
NOT_NEGATIVE = ("learning_rate", "weight_decay", "max_grad_norm", "num_train_epochs", "neftune_noise_alpha",
                "lora_alpha", "lora_dropout", "eval_split_size", "warmup_steps", "early_stopping_threshold",
                "adam_epsilon", "eval_delay")
# key: a share from 0 up to, not including, 1 (torch's AdamW and cross-entropy refuse others once training starts).
BELOW_ONE = ("lora_dropout", "adam_beta1", "adam_beta2", "label_smoothing_factor")
# The adapter's settings: read only when use_peft builds one.
PEFT_KEYS = ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules", "use_dora", "use_rslora",
             "lora_modules_to_save")


def check_values(config: SFTConfig) -> None:
    """Raise SFTError for the first value no run could use."""
    for key in AT_LEAST_ONE:
        value = getattr(config, key, None)
        if value is not None and value < 1:
            raise SFTError(f"Bad value for `{key}`: {value!r}; it must be at least 1.")
    for key in NOT_NEGATIVE:
        value = getattr(config, key, None)
        if value is not None and not (value >= 0 and math.isfinite(value)):  # NaN fails `>= 0` too
            raise SFTError(f"Bad value for `{key}`: {value!r}; it must be a finite number >= 0.")
    if config.max_steps == 0 or config.max_steps < -1:
        raise SFTError(f"Bad value for `max_steps`: {config.max_steps}; give a positive number of optimizer steps, "
                       "or -1 to train for num_train_epochs.")
    for key in ("logging_steps", "save_steps", "eval_steps"):  # a float below 1 is a ratio of the total steps
        value = getattr(config, key)
        if value is not None and not value > 0:
            raise SFTError(f"Bad value for `{key}`: {value!r}; give a positive number of steps (or a ratio below 1).")
    if config.num_train_epochs == 0 and config.max_steps == -1:
        raise SFTError("num_train_epochs is 0 and max_steps unset: the run would train nothing. Set num_train_epochs "
                       "or max_steps.")
    if not 0 <= config.seed < 2**32:
        raise SFTError(f"Bad value for `seed`: {config.seed}; give a number from 0 to 4294967295.")
    for key in BELOW_ONE:
        if not 0 <= getattr(config, key) < 1:
            raise SFTError(f"Bad value for `{key}`: {getattr(config, key)}; give a number from 0 up to (not "
                           "including) 1.")
    check_peft_keys(config)
    check_cpu_fp16(config)
    if config.loss_kernel in CHUNKED_LOSS_KERNELS and not config.chunked_loss:
        raise SFTError(f"loss_kernel: {config.loss_kernel} computes the chunked loss, but chunked_loss is false. Set "
                       "chunked_loss: true to use that kernel, or loss_kernel: auto for the plain full-logits loss.")
    check_memory_budget(config.activation_memory_budget, config.torch_compile)
    check_compile_settings(config.torch_compile_backend, config.torch_compile_mode)
    check_eval_split(config.eval_split_size)
    check_reporting(config.report_to)
    check_eval_plan(config)
    check_best_saves(config)
    check_early_stopping(config)
    check_scheduler_kwargs(config)
    problem = template_kwargs_problem(config.chat_template_kwargs or {})
    if problem:
        raise SFTError(f"Bad value for `chat_template_kwargs`: {problem}.")
    if not str(config.output_dir or "").strip():
        raise SFTError("`output_dir` is empty: give the folder the run should write to, e.g. outputs/my-run.")
    check_shell_variables(config)


def check_shell_variables(config: SFTConfig) -> None:
    """A shell expands $HOME on its command line, and nothing expands it in a recipe: `output_dir: $SCRATCH/run` ran
    and wrote into a folder named `$SCRATCH` under the current one."""
    for key in ("model_name_or_path", "tokenizer_name_or_path", "dataset", "eval_dataset", "deepspeed", "output_dir",
                "logging_dir", "resume_from_checkpoint"):
        value = getattr(config, key, None)
        found = re.search(r"\$\{?[A-Za-z_]\w*\}?", value) if isinstance(value, str) else None
        if found and not Path(value).exists():
            raise SFTError(f"`{key}`: {value} holds the shell variable {found.group()}, which sft does not expand (a "
                           f"recipe is no shell script), so it would be a folder named {found.group()}. Write the "
                           f"path out, or pass it on the command line, where the shell expands it: --{key} {value}")


def check_peft_keys(config: SFTConfig) -> None:
    """LoRA settings the user gave need use_peft: without it they are ignored and a full fine-tune runs instead.

    Only keys the recipe or command line set (recipe_keys) with a value other than the default count: the
    recipe.yaml of a full fine-tune lists every SFT field, LoRA ones included, at its default.
    """
    if config.use_peft:
        return
    defaults = {f.name: f.default for f in dataclasses.fields(config) if f.name in PEFT_KEYS}
    given = [key for key in PEFT_KEYS if key in config.recipe_keys and getattr(config, key) != defaults[key]]
    if given:
        raise SFTError(f"{given[0]} is set but use_peft is false, so no LoRA adapter would be trained: the run "
                       "would silently fine-tune every weight instead. Set use_peft: true (or pass --use_peft true) "
                       f"to train an adapter, or remove {', '.join(given)} for a full fine-tune.")


def check_cpu_fp16(config: SFTConfig) -> None:
    """fp16 with use_cpu asked for cannot run on any machine: accelerate enables fp16 autocast (and its loss scaler)
    only on accelerators, so the steps would run in fp32. Without a GPU and without use_cpu asked for, the
    machine is what lacks it: hardware_problems reports that when training starts."""
    if config.fp16 and config.use_cpu and not config.cpu_by_default:
        raise SFTError("fp16: true cannot run with use_cpu: true: the Trainer has no fp16 autocast on CPU and would "
                       "silently train in fp32. Set fp16: false to train in fp32, or use bf16: true (CPU bf16 "
                       "autocast) instead.")


def check_accelerator_config(value: object) -> None:
    """TrainingArguments reads a string accelerator_config as a JSON file: one that is not there ended in a
    FileNotFoundError traceback naming neither the key nor what it takes."""
    if isinstance(value, str) and not Path(value).expanduser().is_file():
        raise SFTError(f"Bad value for `accelerator_config`: {value!r} is not a file. Give the path of a JSON file of "
                       "accelerate settings, or the settings themselves, e.g. accelerator_config: {split_batches: "
                       "true}.")


def check_memory_budget(budget: float | None, compiled: bool) -> None:
    """activation_memory_budget is a share in (0, 1] and steers torch_compile's partitioner only."""
    if budget is None:
        return
    if not 0 < budget <= 1:
        raise SFTError(f"Bad value for `activation_memory_budget`: {budget!r}; give a share of activation memory "
                       "above 0 and at most 1 (e.g. 0.8: recompute elementwise ops only).")
    if not compiled:
        raise SFTError("activation_memory_budget steers torch_compile's choice of what to recompute, and "
                       "torch_compile is off. Set torch_compile: true, or remove activation_memory_budget.")


def check_compile_settings(backend: str | None, mode: str | None) -> None:
    """torch_compile_backend and torch_compile_mode as accelerate and inductor take them: a misspelt backend failed
    with accelerate's ValueError traceback once the Trainer was built, a misspelt mode with inductor's RuntimeError
    at the first step, both after tokenization and model loading."""
    from accelerate.utils import DynamoBackend
    from torch._inductor import list_mode_options

    backends = [name.lower() for name in DynamoBackend.__members__ if name != "NO"]
    if backend is not None and backend.lower() not in backends:
        raise SFTError(f"Bad value for `torch_compile_backend`: {backend!r}; give one of {', '.join(backends)} "
                       "(inductor, the default, is what torch_compile is built around).")
    modes = list(list_mode_options())
    if mode is not None and (backend or "inductor").lower() == "inductor" and mode not in modes:
        raise SFTError(f"Bad value for `torch_compile_mode`: {mode!r}; give one of {', '.join(modes)}.")


def check_eval_split(size: float) -> None:
    """eval_split_size is a fraction below 1 or a whole number of rows (see sft.data.build.split_off_eval)."""
    if size >= 1 and not float(size).is_integer():
        raise SFTError(f"Bad value for `eval_split_size`: {size}; give a fraction below 1 (0.1 = 10% of the rows) "
                       "or a whole number of rows (e.g. 100).")


def check_reporting(report_to: list[str] | None) -> None:
    """Every logger in report_to is installed; the Trainer would otherwise fail after the model has loaded."""
    from transformers.integrations import get_available_reporting_integrations

    missing = [name for name in report_to or [] if name not in ("none", "all")
               and name not in get_available_reporting_integrations()]
    if missing:
        raise SFTError(f"report_to: {missing[0]} is not installed here (available: "
                       f"{', '.join(get_available_reporting_integrations()) or 'none'}). Install it "
                       f"(pip install {missing[0]}) or set report_to: none.")


def check_eval_plan(config: SFTConfig) -> None:
    """Evaluating during training needs eval data; say so now rather than when the Trainer is built."""
    has_eval = config.eval_dataset is not None or bool(config.eval_split_size)
    if option(config.eval_strategy) != "no" and not has_eval:
        raise SFTError(f"eval_strategy is {option(config.eval_strategy)} but the "
                       "recipe has no eval data: set `eval_dataset`, or `eval_split_size` (e.g. 0.1), or "
                       "eval_strategy: 'no'.")


def check_best_saves(config: SFTConfig) -> None:
    """save_strategy: best saves a checkpoint at each evaluation that improves metric_for_best_model. Without
    evaluations during training it would silently save none; without the metric the Trainer raises when it is built,
    after tokenization and model loading (load_best_model_at_end alone gets "loss" from TrainingArguments)."""
    if option(config.save_strategy) != "best":
        return
    if option(config.eval_strategy) == "no":
        raise SFTError("save_strategy is best, which saves a checkpoint when an evaluation improves "
                       "metric_for_best_model, but eval_strategy is 'no', so no checkpoint would ever be saved. Set "
                       "eval_strategy: steps (with eval_steps) or epoch, or save_strategy: steps or epoch.")
    if config.metric_for_best_model is None:
        raise SFTError("save_strategy is best, which saves a checkpoint when an evaluation improves "
                       "metric_for_best_model, and metric_for_best_model is not set. Set metric_for_best_model: loss "
                       "(or another key evaluation reports), or save_strategy: steps or epoch.")


def check_best_model_at_end(values: dict) -> None:
    """load_best_model_at_end loads a checkpoint saved where an evaluation ran. Checked on the recipe's values, before
    TrainingArguments, whose own error named its enums ("Evaluation strategy: IntervalStrategy.NO")."""
    if not values.get("load_best_model_at_end"):
        return
    fields = SFTConfig.__dataclass_fields__
    evals, saves = (option(values.get(key, fields[key].default)) for key in ("eval_strategy", "save_strategy"))
    if evals == "no":
        raise SFTError("load_best_model_at_end loads the checkpoint with the best evaluation, but eval_strategy is "
                       "'no', so no evaluation runs during training. Set eval_strategy: steps (with eval_steps) or "
                       "epoch, with eval data (eval_split_size or eval_dataset), or remove load_best_model_at_end.")
    if saves not in (evals, "best"):
        raise SFTError(f"load_best_model_at_end loads a checkpoint saved where an evaluation ran, but save_strategy "
                       f"is {saves} and eval_strategy is {evals}. Set save_strategy: {evals} (or best).")


def check_early_stopping(config: SFTConfig) -> None:
    """Early stopping compares evaluations made during training: without any it would never stop (the Trainer's
    callback asserts, after tokenization and model loading)."""
    if config.early_stopping_patience is not None and option(config.eval_strategy) == "no":
        raise SFTError(f"early_stopping_patience is {config.early_stopping_patience}, which stops training when "
                       "evaluations stop improving, but eval_strategy is 'no'. Set eval_strategy: steps (with "
                       "eval_steps) or epoch, and eval data (eval_split_size or eval_dataset).")


# What apply_chat_template passes the template itself: a chat_template_kwargs variable of that name would clash.
TEMPLATE_ARGUMENTS = ("messages", "tools", "documents", "add_generation_prompt")


def template_kwargs_problem(value: object) -> str | None:
    """What is wrong with a chat_template_kwargs value (the recipe's, a row's column, `sft chat`'s flag), or None:
    it must map variable names (strings, not apply_chat_template's own arguments) to values."""
    if not isinstance(value, dict):
        return f"{value!r} is not a mapping of template variables to values; write e.g. {{enable_thinking: false}}"
    bad = next((key for key in value if not isinstance(key, str) or key in TEMPLATE_ARGUMENTS), None)
    if bad is None:
        return None
    if isinstance(bad, str):
        return f"`{bad}` is what sft passes the template itself ({', '.join(TEMPLATE_ARGUMENTS)}); remove it"
    return f"its key {bad!r} is not a string; template variables are names, so quote it"


# What transformers' get_scheduler passes each schedule function itself (lr_scheduler_kwargs may not repeat them).
SCHEDULER_ARGUMENTS = ("optimizer", "num_warmup_steps", "num_training_steps")


def check_scheduler_kwargs(config: SFTConfig) -> None:
    """lr_scheduler_kwargs fit the schedule lr_scheduler_type builds: its required settings are given
    (cosine_with_min_lr and cosine_warmup_with_min_lr: one of min_lr / min_lr_rate; warmup_stable_decay:
    num_decay_steps), every key is one it takes, and numbers are numbers. The Trainer builds the schedule when
    training starts, after tokenization and model loading, and raised a TypeError or ValueError traceback there."""
    from transformers.optimization import TYPE_TO_SCHEDULER_FUNCTION
    from transformers.trainer_utils import SchedulerType

    kind = SchedulerType(config.lr_scheduler_type)
    if kind in (SchedulerType.CONSTANT, SchedulerType.CONSTANT_WITH_WARMUP):
        return  # get_scheduler passes these no lr_scheduler_kwargs
    given = config.lr_scheduler_kwargs or {}
    if not isinstance(given, dict):
        raise SFTError(f"Bad value for `lr_scheduler_kwargs`: {given!r}; give a mapping, e.g. "
                       "--lr_scheduler_kwargs '{min_lr_rate: 0.1}'.")
    params = inspect.signature(TYPE_TO_SCHEDULER_FUNCTION[kind]).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return  # reduce_lr_on_plateau, greedy: the keys go on to the scheduler class
    settings = [name for name in params if name not in SCHEDULER_ARGUMENTS]
    for key in given:
        if key in SCHEDULER_ARGUMENTS:
            raise SFTError(f"Bad key `{key}` in `lr_scheduler_kwargs`: the Trainer sets it from the recipe "
                           "(warmup_steps; max_steps or num_train_epochs). Remove it from lr_scheduler_kwargs.")
        if key not in settings:
            close = difflib.get_close_matches(key, settings, n=1, cutoff=0.6)
            hint = f" Did you mean `{close[0]}`?" if close else ""
            raise SFTError(f"Bad key `{key}` in `lr_scheduler_kwargs`: lr_scheduler_type {kind.value} takes "
                           f"{', '.join(settings)}.{hint}")
        if isinstance(given[key], str) and takes_only_numbers(params[key]):
            # YAML 1.1 reads an exponent without a decimal point (1e-5) as text
            fix = re.sub(r"^([+-]?\d+)([eE])", r"\1.0\2", given[key].strip())
            hint = f" YAML reads 1e-5 as text and 1.0e-5 as a number: write {key}: {fix}." if fix != given[key] else ""
            raise SFTError(f"Bad value for `{key}` in `lr_scheduler_kwargs`: {given[key]!r} is text, and it takes a "
                           f"number.{hint}")
    missing = [name for name in settings if params[name].default is inspect.Parameter.empty and name not in given]
    if missing:
        raise SFTError(f"lr_scheduler_type {kind.value} needs {missing[0]} in `lr_scheduler_kwargs`, e.g. "
                       f"--lr_scheduler_kwargs '{{{missing[0]}: 100}}'.")
    # the cosine schedules with a floor take exactly one of min_lr (absolute) or min_lr_rate (a share of learning_rate)
    if {"min_lr", "min_lr_rate"} <= set(settings) and len({"min_lr", "min_lr_rate"} & set(given)) != 1:
        raise SFTError(f"lr_scheduler_type {kind.value} needs exactly one of min_lr or min_lr_rate in "
                       "`lr_scheduler_kwargs`, e.g. --lr_scheduler_kwargs '{min_lr_rate: 0.1}'.")


def takes_only_numbers(param: inspect.Parameter) -> bool:
    """Whether a schedule function's parameter takes a number: annotated int/float (maybe None) and not text, or,
    unannotated, a numeric default."""
    if param.annotation is inspect.Parameter.empty:
        return isinstance(param.default, (int, float)) and not isinstance(param.default, bool)
    annotation = str(param.annotation)
    return ("float" in annotation or "int" in annotation) and "str" not in annotation


def option(value: object) -> str:
    """A TrainingArguments choice (an enum once TrainingArguments has set up, else the recipe's text) as text."""
    return str(getattr(value, "value", value))
