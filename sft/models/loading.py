"""Loading the model a recipe names: dtype, attention backend, safe defaults, new tokens; what names a model;
the stop ids its generation config lists."""

import copy
import logging
from pathlib import Path

from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoModelForSeq2SeqLM,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers.integrations.deepspeed import unset_hf_deepspeed_config
from transformers.trainer_utils import get_last_checkpoint

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.adapters import (
    adapter_embedding_rows,
    add_adapter,
    base_model_name,
    is_adapter_folder,
    load_trained_adapter,
)
from sft.models.architectures import model_architecture
from sft.models.attention import VARLEN, attention_problem, fastest_attention, gpu_attention, varlen_problem
from sft.models.attention import register as register_varlen
from sft.models.families import non_text_towers
from sft.models.hub import local_files_only, model_hub_kwargs
from sft.models.quantization import DTYPES, quantized_loading, run_quantization
from sft.models.weights import RECIPE_ALLOW, pickle_problem, safetensors_kwargs, unloadable_hint

log = logging.getLogger(__name__)
DEFAULT_ATTENTION = "sdpa, transformers' default"
EMBEDDING_MULTIPLE = 64  # padded vocab sizes keep matmuls on fast tensor-core shapes
# More new rows than a chat template's or a user's few added tokens: the tokenizer belongs to another vocabulary.
FOREIGN_TOKENIZER_ROWS = 256
FOREIGN_TOKENIZER_FRACTION = 0.5  # fewer tokens than this share of the rows: another family's (Llama 2's on Llama 3)
TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "spiece.model")


def looks_local(name: str) -> bool:
    """Whether `name` is meant as a local path rather than a Hub id (`name` or `org/name`): it starts with . / ~,
    has more than one slash, or its first part is a folder here (`data/alpaca_smaple` is a typo, not a Hub id)."""
    first = Path(name).parts[0] if Path(name).parts else ""
    return name.startswith((".", "/", "~")) or name.count("/") > 1 or ("/" in name and Path(first).is_dir())


def check_model_reference(name: str | None, key: str = "model_name_or_path") -> str:
    """`name` as given, or an error when it is unset or a local path that does not exist."""
    if not name:
        raise SFTError(f"`{key}` is not set: give a Hub id (e.g. Qwen/Qwen2.5-0.5B) or a local model folder.")
    if looks_local(name) and not Path(name).expanduser().exists():
        raise SFTError(f"`{key}`: {name} does not exist. Give an existing folder or a Hub id like org/name.")
    problem = not_a_model_folder(Path(name).expanduser(), key) if looks_local(name) else None
    if problem:  # transformers' own words here were "Unrecognized model ... Should have a `model_type` key"
        raise SFTError(f"`{key}`: {problem}")
    return str(Path(name).expanduser()) if name.startswith("~") else name


def not_a_model_folder(folder: Path, key: str = "model_name_or_path") -> str | None:
    """Why local `folder` holds no model (for `key` tokenizer_name_or_path: no tokenizer) and what to give instead,
    or None when it does: an interrupted run (checkpoints only), an empty folder, a tokenizer-only folder, a file."""
    if not folder.is_dir():
        return f"{folder} is a file; give the folder that holds the model (its config.json and weights)."
    if key == "tokenizer_name_or_path":
        if any((folder / file).is_file() for file in TOKENIZER_FILES):
            return None
        return f"{folder} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...). Give a model's folder."
    if is_adapter_folder(folder) or (folder / "config.json").is_file():
        return None
    last = get_last_checkpoint(str(folder))
    if last:
        return (f"{folder} holds no final model, only checkpoints: its run stopped before the end. Give its last "
                f"checkpoint, {last}, or finish the run: sft train RECIPE --output_dir {folder} "
                "--resume_from_checkpoint true.")
    held = sorted(path.name for path in folder.iterdir())
    contents = f"it holds {', '.join(held[:5])}{', ...' if len(held) > 5 else ''}" if held else "it is empty"
    return (f"{folder} holds neither a model (config.json) nor a LoRA adapter (adapter_config.json); {contents}. "
            "Give a folder that save_pretrained wrote (config.json and model.safetensors), or a run's output_dir or "
            "one of its checkpoint-N folders.")


def load_model(config: SFTConfig, tokenizer: PreTrainedTokenizerBase) -> PreTrainedModel:
    """The recipe's causal or encoder-decoder LM (dtype or bitsandbytes quantization), embeddings fit to the
    tokenizer, LoRA if use_peft."""
    if not config.deepspeed:
        # Building any ZeRO-3 TrainingArguments in this process (e.g. validating another recipe) leaves a global
        # that makes from_pretrained partition weights; a model for a run without DeepSpeed must not inherit it.
        unset_hf_deepspeed_config()
    adapter = check_model_reference(config.model_name_or_path)  # a use_peft run: its base, then the adapter on it
    adapter = adapter if is_adapter_folder(adapter) else None
    name = base_model(config)
    for folder in (adapter, name):  # the adapter's weights are loaded (by peft) as its base's are
        problem = folder and pickle_problem(folder, config.allow_pickle, RECIPE_ALLOW)
        if problem:
            raise SFTError(problem)
    kwargs = dict(revision=config.revision, cache_dir=config.cache_dir, trust_remote_code=config.trust_remote_code,
                  dtype=DTYPES.get(config.dtype, "auto"), **safetensors_kwargs(config.allow_pickle),
                  **model_hub_kwargs(name))
    if config.attn_implementation:
        kwargs["attn_implementation"] = attention(config)
    kwargs.update(quantized_loading(config))
    try:
        model = auto_model_class(load_model_config(config, name)).from_pretrained(name, **kwargs)
    except (OSError, ValueError) as err:
        raise SFTError(f"Could not load the model {name}: {str(err).splitlines()[0]}"
                       + unloadable_hint(err, config.allow_pickle, RECIPE_ALLOW)) from None
    model.config.use_cache = False  # a KV cache during training defeats packed-sequence isolation and wastes memory
    # An adapter grows the embeddings as peft's loaders will (exactly, no padding) or as its saved weights say.
    rows = adapter_embedding_rows(model, tokenizer, adapter) if adapter or config.use_peft else None
    new_ids = fit_embeddings(model, tokenizer, rows)
    towers = freeze_non_text_towers(model)
    if towers:
        count = sum(p.numel() for name in towers for p in model.get_submodule(name).parameters())
        log.info("Frozen, as text never runs through them: %s (%s parameters).", ", ".join(towers), f"{count:,}")
    if adapter:
        warn_unquantized_base(config, adapter)
        return load_trained_adapter(model, adapter, config)
    if config.use_peft:
        return add_adapter(model, config, new_ids)
    return model


def freeze_non_text_towers(model: PreTrainedModel) -> list[str]:
    """A multimodal model's vision/audio towers (families.non_text_towers) get no gradient from text: frozen, DDP
    does not wait for their gradients (Gemma-3 4B under torchrun with gradient checkpointing failed at step 2:
    "Expected to have finished reduction in the prior iteration") and the optimizer keeps no state for them."""
    towers = non_text_towers(model)
    for name in towers:
        model.get_submodule(name).requires_grad_(False)
    return towers


def warn_unquantized_base(config: SFTConfig, adapter: str) -> None:
    """An adapter trained on a 4- or 8-bit base (QLoRA) learnt to correct that base's rounding; on a recipe that
    loads the base unquantized it is evaluated (or trained further) on other weights than it was trained on.
    `sft generate`, `chat` and `merge` quantize as the run did (run_quantization); a recipe decides for itself,
    so it is told."""
    trained = run_quantization(Path(adapter)).get("quantization_config")
    if trained is None or config.load_in_4bit or config.load_in_8bit:
        return
    bits = 4 if trained.load_in_4bit else 8
    log.warning("The adapter in %s was trained on a %d-bit base (its run's recipe.yaml sets load_in_%dbit: true), "
                "and this recipe loads the base unquantized, so the results are of other weights than the adapter "
                "was trained on. Set load_in_%dbit: true (with the run's bnb_4bit_* keys) to use the trained model.",
                adapter, bits, bits, bits)


def auto_model_class(model_config: PretrainedConfig) -> type[AutoModelForCausalLM] | type[AutoModelForSeq2SeqLM]:
    """The transformers auto class that loads a model with this config: Seq2Seq for encoder-decoders (T5, BART),
    causal otherwise. Training, `sft generate`/`chat` and `sft merge` all pick it here."""
    return AutoModelForSeq2SeqLM if model_config.is_encoder_decoder else AutoModelForCausalLM


def check_loadable(model_config: PretrainedConfig) -> None:
    """Refuse, before any data is read, a model auto_model_class has no class for: image-text models such as
    Qwen2.5-VL or LLaVA load as AutoModelForImageTextToText, and `sft train` failed only after tokenizing. Remote-code
    models (auto_map) bring their own class."""
    auto = auto_model_class(model_config)
    if type(model_config) in auto._model_mapping or getattr(model_config, "auto_map", None):
        return
    raise SFTError(f"sft cannot train {model_config.model_type} models: transformers has no {auto.__name__} class "
                   "for them (image-text models such as Qwen2.5-VL or LLaVA load as AutoModelForImageTextToText, "
                   "which sft does not train). Choose a text model, or a multimodal one with a causal-LM class "
                   "(Gemma-3).")


def check_attention(config: SFTConfig, training: bool) -> None:
    """Refuse an attn_implementation this run cannot use (attention_problem), before data or weights load."""
    if not config.attn_implementation:
        return
    problem = attention_problem(config.attn_implementation, config.on_cuda, cpu_training=training and config.use_cpu)
    if problem:
        raise SFTError(problem)


def with_attention(config: SFTConfig, model_config: PretrainedConfig | None) -> SFTConfig:
    """The recipe with the attention its run computes: `varlen` checked against the model (varlen_problem); unset,
    with packed or padding-free batches, the fastest that keeps their examples apart (fastest_attention: varlen on a
    CUDA GPU in 16-bit, else transformers' default). A copy where it changes; the choice is logged."""
    if model_config is None or model_config.is_encoder_decoder:
        return config
    check_varlen(config, model_config)
    if config.attn_implementation or not packed_batches(config):
        return config
    choice, why = fastest_attention(model_config, config.device if config.on_cuda else None,
                                    half_activations(config, model_config), config.max_length)
    (log.info if config.on_cuda else log.debug)("attn_implementation: %s (unset; %s). Set it in the recipe to choose.",
                                                choice or DEFAULT_ATTENTION, why)
    if choice is None:
        return config
    resolved = copy.copy(config)
    resolved.attn_implementation = choice
    return resolved


def check_varlen(config: SFTConfig, model_config: PretrainedConfig) -> None:
    """Refuse an explicit `varlen` the model's attention defeats (varlen_problem), before any weights load."""
    problem = varlen_problem(model_config, config.max_length) if config.attn_implementation == VARLEN else None
    if problem:
        raise SFTError(f"attn_implementation {VARLEN} cannot run this {model_config.model_type} model: it "
                       f"{problem}. Use attn_implementation: sdpa.")


def attention_on_a_gpu(config: SFTConfig, model_config: PretrainedConfig) -> str:
    """The attention this recipe's run gets on an Ampere or newer GPU, and why (`sft check` reports it on any
    machine: its smoke run's is sdpa)."""
    if config.attn_implementation:
        return f"{config.attn_implementation} (the recipe's)"
    if not packed_batches(config):
        return f"{DEFAULT_ATTENTION} (batches are not packed or padding-free)"
    choice, why = gpu_attention(model_config, half_activations(config, model_config), config.max_length)
    return f"{choice or DEFAULT_ATTENTION} ({why})"


def packed_batches(config: SFTConfig) -> bool:
    """Whether some split's batches are packed or padding-free (what an unset attention is chosen for)."""
    return bool(config.packing or config.padding_free or config.packs_eval)


def half_activations(config: SFTConfig, model_config: PretrainedConfig) -> bool:
    """Whether the run computes in 16 bits: bf16/fp16 autocast, or 16-bit weights (the dtype key, or under `auto`
    the checkpoint's)."""
    weights = config.dtype if config.dtype != "auto" else str(getattr(model_config, "dtype", None))
    return bool(config.bf16 or config.fp16) or weights.removeprefix("torch.") in ("bfloat16", "float16")


def attention(config: SFTConfig) -> str:
    """The recipe's attn_implementation, with sft's own `varlen` registered with transformers first."""
    if config.attn_implementation == VARLEN:
        register_varlen()
        if not (config.packing or config.padding_free):
            log.warning("attn_implementation %s speeds up packed or padding-free batches; this run's padded batches "
                        "carry an attention mask and run sdpa. Set packing: true or padding_free: true.", VARLEN)
    return config.attn_implementation


def fit_embeddings(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, rows: int | None = None) -> list[int]:
    """Grow embeddings for added tokens (mean-initialised rows); returns the new ids.

    Args:
        model: the loaded model.
        tokenizer: the run's tokenizer, with any tokens it added.
        rows: the exact number of rows to grow to (an adapter's, see adapter_embedding_rows); default: the
            tokenizer's length padded to a multiple of 64.
    """
    old_rows = model.get_input_embeddings().num_embeddings  # not weight.shape: (0,) once ZeRO-3 partitions it
    problem = tokenizer_mismatch(len(tokenizer), old_rows)
    if problem:
        log.warning("THE TOKENIZER DOES NOT FIT THE MODEL: %s", problem)
    if max(len(tokenizer), rows or 0) <= old_rows:
        return []
    if rows:
        model.resize_token_embeddings(rows, mean_resizing=True)
    else:
        model.resize_token_embeddings(len(tokenizer), pad_to_multiple_of=EMBEDDING_MULTIPLE, mean_resizing=True)
    log.info("Resized embeddings from %d to %d rows for %d new tokens.", old_rows,
             model.get_input_embeddings().num_embeddings, len(tokenizer) - old_rows)
    return list(range(old_rows, len(tokenizer)))


def tokenizer_mismatch(tokens: int, rows: int) -> str | None:
    """Why a tokenizer of `tokens` tokens cannot be the own tokenizer of a model with `rows` embedding rows, or None.

    Far more tokens than rows (beyond a chat template's or a user's few added ones) or fewer than half the rows
    (models pad their vocabulary by hundreds of rows at most): the ids then name other tokens' embeddings, and the
    run trains on noise without any error.
    """
    if tokens - rows > FOREIGN_TOKENIZER_ROWS:
        effect = f"so {tokens - rows} new untrained rows are added"
    elif tokens < rows * FOREIGN_TOKENIZER_FRACTION:
        effect = "so its ids name other tokens' embeddings"
    else:
        return None
    return (f"it has {tokens} tokens, the model's embeddings {rows} rows, {effect}. tokenizer_name_or_path is "
            "probably from another model family; use the model's own tokenizer.")


def base_model(config: SFTConfig) -> str:
    """The model the recipe names, checked; for an adapter folder (a use_peft run or checkpoint), its base model."""
    name = check_model_reference(config.model_name_or_path)
    return base_model_name(name) if is_adapter_folder(name) else name


def load_model_config(config: SFTConfig, name: str | None = None) -> PretrainedConfig:
    """The config of the recipe's model (an adapter folder's base) or of model `name`, read without weights."""
    name = name or base_model(config)
    try:
        return AutoConfig.from_pretrained(name, revision=config.revision, cache_dir=config.cache_dir,
                                          trust_remote_code=config.trust_remote_code,
                                          local_files_only=local_files_only(name))
    except (OSError, ValueError) as err:
        raise SFTError(f"Could not read the config of {name}: {str(err).splitlines()[0]}") from None


def is_encoder_decoder(config: SFTConfig) -> bool:
    """Whether the recipe's model (an adapter folder's base) is an encoder-decoder such as T5 or BART."""
    if config.model_name_or_path is None:
        return False  # data prepared with an explicit tokenizer and no model
    return recipe_architecture(config).is_encoder_decoder


def recipe_architecture(config: SFTConfig) -> PretrainedConfig:
    """The config of the recipe's model (an adapter folder's base), offline first: a local folder, the HF cache,
    sft's built-in table of common models, then the Hub; so `sft data`, `sft plan` and `sft check` need no Hub for a
    known model (load_model_config reads the model's own files, as loading the weights will)."""
    return model_architecture(base_model(config), config.revision, config.cache_dir, config.trust_remote_code)


def generation_eos(model: str | None) -> int | list[int] | None:
    """eos_token_id of the model's generation_config.json (a local folder or a cached Hub id), if it has one; for a
    LoRA adapter folder (a use_peft run or checkpoint), its base model's, which the run's masks were built with."""
    if not model:
        return None
    if is_adapter_folder(model):  # the base the run's masks were built with (its checkpoints hold no such file)
        model = base_model_name(model)
    try:
        return GenerationConfig.from_pretrained(model, local_files_only=local_files_only(model)).eos_token_id
    except (OSError, ValueError):  # no generation config: the tokenizer's EOS and the template decide
        return None
