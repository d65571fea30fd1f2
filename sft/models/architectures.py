"""A model's architecture (its transformers config) for planning, offline: local folder or cache, a built-in table
of common families, else the Hub.

The table holds the published config.json sizes of the families the shipped recipes use; instruct and base
variants share one shape, so a name is matched without its -Instruct / -hf / -v0.x suffixes.
"""

import re

from transformers import AutoConfig, PretrainedConfig

from sft.errors import SFTError
from sft.models.hub import hub_reachable

_LLAMA3 = dict(model_type="llama", vocab_size=128256, rope_theta=500000.0, max_position_embeddings=131072)
_QWEN25 = dict(model_type="qwen2", vocab_size=151936, rope_theta=1000000.0, max_position_embeddings=32768)
_MISTRAL = dict(model_type="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=32768,
                tie_word_embeddings=False)
KNOWN_CONFIGS = {
    "meta-llama/llama-3.2-1b": dict(_LLAMA3, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                    num_attention_heads=32, num_key_value_heads=8, head_dim=64,
                                    tie_word_embeddings=True),
    "meta-llama/llama-3.2-3b": dict(_LLAMA3, hidden_size=3072, intermediate_size=8192, num_hidden_layers=28,
                                    num_attention_heads=24, num_key_value_heads=8, head_dim=128,
                                    tie_word_embeddings=True),
    "meta-llama/llama-3.1-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                    num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False),
    "meta-llama/meta-llama-3-8b": dict(_LLAMA3, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                       num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=False,
                                       max_position_embeddings=8192),
    "meta-llama/llama-3.1-70b": dict(_LLAMA3, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
                                     num_attention_heads=64, num_key_value_heads=8, tie_word_embeddings=False),
    "meta-llama/llama-2-7b": dict(model_type="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008,
                                  num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=32,
                                  max_position_embeddings=4096, tie_word_embeddings=False),
    "qwen/qwen2.5-0.5b": dict(_QWEN25, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen/qwen2.5-1.5b": dict(_QWEN25, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen/qwen2.5-7b": dict(_QWEN25, vocab_size=152064, hidden_size=3584, intermediate_size=18944,
                            num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
                            tie_word_embeddings=False),
    "mistralai/mistral-7b-v0.1": dict(_MISTRAL, vocab_size=32000),
    "mistralai/mistral-7b-v0.3": dict(_MISTRAL, vocab_size=32768),
}
# Suffixes that name a variant with the base model's shape.
_VARIANT = re.compile(r"(-instruct|-chat|-hf)(?=$|-)", re.IGNORECASE)


def known_config(name: str) -> PretrainedConfig | None:
    """The built-in config for `name` (a Hub id; instruct/chat/-hf variants map to their base), else None."""
    key = _VARIANT.sub("", name.lower())
    sizes = KNOWN_CONFIGS.get(key)
    if sizes is None:
        return None
    sizes = dict(sizes)
    return AutoConfig.for_model(sizes.pop("model_type"), **sizes)


def model_architecture(name: str, revision: str | None = None, cache_dir: str | None = None,
                       trust_remote_code: bool = False) -> PretrainedConfig:
    """The config of model `name`: a local folder or the HF cache, then the built-in table, then the Hub.

    The one place sft decides where a model's config comes from without loading it (`sft plan`, FSDP wrap classes):
    offline sources first, so a known model never waits on the Hub's retries.
    """
    options = dict(revision=revision, cache_dir=cache_dir, trust_remote_code=trust_remote_code)
    try:
        return AutoConfig.from_pretrained(name, local_files_only=True, **options)
    except (OSError, ValueError):
        pass
    config = known_config(name)
    if config is not None:
        return config
    try:
        if not hub_reachable():
            raise OSError("the Hub cannot be reached")
        return AutoConfig.from_pretrained(name, **options)
    except (OSError, ValueError):
        known = ", ".join(sorted(KNOWN_CONFIGS))
        raise SFTError(f"model_name_or_path: cannot find the config of {name!r} offline (not a local folder, not in "
                       f"the HF cache, not built in: {known}). Give a local folder with its config.json, or run "
                       "where the Hub is reachable.") from None
