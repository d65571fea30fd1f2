"""Model families: what sft knows about each transformers model_type, in one table.

Three facts decide how a family trains, and each is read from `FAMILIES` only: the block FSDP wraps
(sft.training.presets), whether the logits are a plain head so the chunked loss applies (sft.training.loss and the
planner), and whether packed examples stay apart (packing and padding-free batches, sft.training.flows). A family
missing from the table gets the cautious answer: its model class's `_no_split_modules`, the model's own loss, and
packing refused as unverified.
"""

from dataclasses import dataclass

from torch import nn
from transformers import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING,
    PretrainedConfig,
)

from sft.errors import SFTError
from sft.models.architectures import model_architecture


@dataclass(frozen=True)
class Family:
    """What sft knows about one model_type."""

    wrap: tuple[str, ...] = ()
    """The block FSDP shards and checkpoints as one unit; empty: the model class's _no_split_modules."""
    plain_head: bool = False
    """Logits are exactly lm_head(decoder(x)): no soft-capping or scaling after the head (the chunked loss applies)."""
    packing: bool | None = None
    """True: the decoder hands position_ids to transformers' mask builders (create_causal_mask & co.), so restarting
    positions isolate packed examples, checked on a tiny model by tests/test_packing.py (mark a family True only
    with such a check). False: it builds its causal mask without position_ids (several also add ALiBi from the
    attention mask), so packed examples would attend to each other. None: not verified."""


def _decoder(layer: str | None = None, plain_head: bool = False) -> Family:
    """A decoder whose packed examples are verified to stay apart."""
    return Family(wrap=(layer,) if layer else (), plain_head=plain_head, packing=True)


FAMILIES = {
    "llama": _decoder("LlamaDecoderLayer", plain_head=True),
    "mistral": _decoder("MistralDecoderLayer", plain_head=True),
    "mixtral": _decoder("MixtralDecoderLayer", plain_head=True),
    "qwen2": _decoder("Qwen2DecoderLayer", plain_head=True),
    "qwen3": _decoder("Qwen3DecoderLayer", plain_head=True),
    "gemma": _decoder("GemmaDecoderLayer", plain_head=True),
    "gemma2": _decoder("Gemma2DecoderLayer"),  # soft-caps its logits
    "phi3": _decoder("Phi3DecoderLayer", plain_head=True),
    "gpt_neox": _decoder("GPTNeoXLayer"),
    "gpt2": _decoder("GPT2Block"),
    "qwen2_moe": _decoder(plain_head=True),
    "qwen3_moe": _decoder(plain_head=True),
    "starcoder2": _decoder(plain_head=True),
    "olmo2": _decoder(plain_head=True),
    "olmo": Family(plain_head=True),
    **{name: _decoder() for name in (
        "ministral", "phi", "gpt_bigcode", "gptj", "codegen", "olmo3", "granite", "granitemoe",
        "cohere", "cohere2", "stablelm", "smollm3", "glm4", "exaone4", "llama4_text",
        "falcon")},  # falcon: its mask takes position_ids since transformers 5.24 (rotary and ALiBi alike)
    # Gemma-3 1B, and 4B+ with its vision tower trained on text (gemma3_text's decoder and masks); plain heads where
    # final_logit_softcapping is unset, as in every Gemma-3 release (has_plain_head reads it)
    "gemma3_text": _decoder(plain_head=True),
    "gemma3": _decoder(plain_head=True),
    **{name: Family(packing=False) for name in ("opt", "bloom", "mpt", "gpt_oss")},
    "t5": Family(wrap=("T5Block",)),
    "bart": Family(wrap=("BartEncoderLayer", "BartDecoderLayer")),
}
MASK_ATTENTION = ("eager", "sdpa", "flex_attention")  # block-diagonal mask from position_ids, any batch size
VARLEN = "varlen"  # sft's own: torch's varlen flash kernel (sft.models.attention)
# Architectures guessed from a Hub id when its config cannot be fetched (offline check before renting a GPU); the
# first hint found in the name wins, so longer names come before their prefixes.
NAME_HINTS = (("mixtral", "mixtral"), ("mistral", "mistral"), ("zephyr", "mistral"), ("qwen3", "qwen3"),
              ("qwen", "qwen2"), ("gemma-2", "gemma2"), ("gemma", "gemma"), ("phi-3", "phi3"), ("t5", "t5"),
              ("bart", "bart"), ("gpt-neox", "gpt_neox"), ("pythia", "gpt_neox"), ("gpt2", "gpt2"), ("llama", "llama"))


def family(model_type: str | None) -> Family:
    """The table's row for `model_type`; an unknown type gets the cautious defaults."""
    return FAMILIES.get(model_type, Family())


def packing_families(verified: bool) -> list[str]:
    """The model types whose packed examples are verified to stay apart (True), or known to mix (False)."""
    return sorted(name for name, row in FAMILIES.items() if row.packing is verified)


def wrap_classes(model_config: PretrainedConfig) -> list[str] | None:
    """The layer classes FSDP wraps for this model: the table's, else its class's _no_split_modules."""
    return list(family(model_config.model_type).wrap) or no_split_modules(model_config)


def no_split_modules(config: PretrainedConfig) -> list[str] | None:
    """`_no_split_modules` of the transformers class for this config (None for remote-code or unknown models)."""
    mapping = MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING if config.is_encoder_decoder else MODEL_FOR_CAUSAL_LM_MAPPING
    try:
        model_class = mapping[type(config)]
    except KeyError:
        return None
    return list(model_class._no_split_modules or []) or None


def has_plain_head(model_config: PretrainedConfig) -> bool:
    """Whether the config describes a causal LM whose logits are a plain linear head over its decoder's output (the
    chunked loss applies when the loaded head is also a bias-free nn.Linear)."""
    router_loss = getattr(model_config, "output_router_logits", False)  # MoE aux loss is added after the head
    softcapped = getattr(model_config.get_text_config(), "final_logit_softcapping", None) is not None  # Gemma-2
    return (not model_config.is_encoder_decoder and family(model_config.model_type).plain_head
            and not router_loss and not softcapped)


# Sub-configs of a model with inputs besides text (Gemma-3 4B+, Qwen-VL, LLaVA, Mistral-Small-3.1, Llama-4, Gemma-3n).
NON_TEXT_CONFIGS = ("vision_config", "audio_config")


def non_text_towers(model: nn.Module) -> list[str]:
    """Module names of a multimodal causal LM that text never runs through: its vision/audio encoders and their
    projectors, the topmost modules none of whose parameters belong to the decoder, the input embeddings or the
    head. sft trains on text: these get no gradient, which DDP without find_unused_parameters (the Trainer's default
    under gradient checkpointing) fails on at step 2, and a LoRA on every linear layer would adapt them uselessly."""
    config = model.config
    if config.is_encoder_decoder or not any(getattr(config, key, None) for key in NON_TEXT_CONFIGS):
        return []
    text = (model.get_decoder(), model.get_input_embeddings(), model.get_output_embeddings())
    reached = {id(p) for module in text if module is not None for p in module.parameters()}
    return unreached_modules(model, reached)


def unreached_modules(module: nn.Module, reached: set[int], prefix: str = "") -> list[str]:
    """The topmost submodules of `module` holding parameters, none of them in `reached`."""
    names = []
    for name, child in module.named_children():
        params = [id(p) for p in child.parameters()]
        if params and not reached.intersection(params):
            names.append(prefix + name)
        elif params:
            names += unreached_modules(child, reached, f"{prefix}{name}.")
    return names


def check_packing_supported(model_config: PretrainedConfig, attn_implementation: str | None = None,
                            flattened: bool = False) -> None:
    """Raise ValueError unless the model family and attention implementation keep packed examples apart.

    flattened: the batch is one row (PaddingFreeCollator), which flash attention needs to see the boundaries.
    Either way the model must run with use_cache=False and without an attention_mask.
    """
    model_type = getattr(model_config, "model_type", None)
    if getattr(model_config, "is_encoder_decoder", False):
        raise ValueError(f"packing and padding_free need a decoder-only model; {model_type} is an "
                         "encoder-decoder. Set packing: false and padding_free: false.")
    packing = family(model_type).packing
    if packing is False:
        raise ValueError(f"Packing is not supported for {model_type} models: they build the attention mask without "
                         "position_ids, so packed examples would attend to each other. Set packing: false.")
    if packing is None:
        raise ValueError(f"Packing / padding-free training is not verified for model_type {model_type!r}: its "
                         "attention might let packed examples see each other. Verified families: "
                         f"{', '.join(packing_families(True))}. Set packing: false and padding_free: false.")
    check_packing_attention(attn_implementation or getattr(model_config, "_attn_implementation", None) or "sdpa",
                            flattened)


def flattened_attention(attn: str | None) -> bool:
    """Whether attention `attn` keeps packed examples apart only in one flattened row with cu_seq_lens
    (PaddingFreeCollator): flash attention and sft's varlen. The MASK_ATTENTION ones read [B, L] position_ids."""
    attn = attn or ""
    return attn == VARLEN or ("flash" in attn and "paged" not in attn)  # paged attention serves generation only


def flattened_batches(attn: str | None, padding_free: bool, packing: bool) -> bool:
    """Whether batches are one flattened row: padding_free, or packed rows for an attention that needs that.
    The one decision default_collator makes and the packing check assumes."""
    return bool(padding_free or (packing and flattened_attention(attn)))


def check_packing_attention(attn: str, flattened: bool) -> None:
    """Raise ValueError unless attention implementation `attn` separates packed examples."""
    if attn in MASK_ATTENTION:
        return
    if flattened_attention(attn):
        if not flattened:
            raise ValueError(f"{attn} separates packed examples only in a single flattened row: use padding_free "
                             "(PaddingFreeCollator, which passes cu_seq_lens) or attn_implementation sdpa.")
        return
    raise ValueError(f"attn_implementation {attn!r} cannot isolate packed examples; use one of "
                     f"{', '.join(MASK_ATTENTION)} (or {VARLEN} / flash attention with flattened rows).")


def guess_model_type(name: str) -> str:
    """The model_type of `name`: from its config (local, cached or built in before the Hub), else from its name."""
    try:
        return model_architecture(name).model_type
    except SFTError:
        pass
    lowered = name.lower()
    for hint, model_type in NAME_HINTS:
        if hint in lowered:
            return model_type
    raise SFTError(f"sft check cannot tell the architecture of {name} offline; run it where the Hub is reachable.")
