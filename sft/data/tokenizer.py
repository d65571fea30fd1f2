"""Loading the tokenizer a recipe names: a fast tokenizer with the recipe's chat template and a pad token."""

import logging

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from sft.config.arguments import SFTConfig
from sft.data.chat_templates import (
    PRESETS,
    prepare_tokenizer_for_template,
    resolve_chat_template,
)
from sft.errors import SFTError
from sft.models.hub import local_files_only
from sft.models.loading import check_model_reference
from sft.models.saved import keep_legacy_on_save

log = logging.getLogger(__name__)


def load_tokenizer(config: SFTConfig) -> PreTrainedTokenizerBase:
    """The recipe's fast tokenizer, with a pad token arranged."""
    name = check_model_reference(config.tokenizer_name_or_path or config.model_name_or_path,
                                 "tokenizer_name_or_path" if config.tokenizer_name_or_path else "model_name_or_path")
    warn_remote_code(config, name)
    try:
        tokenizer = AutoTokenizer.from_pretrained(name, revision=config.revision, cache_dir=config.cache_dir,
                                                  trust_remote_code=config.trust_remote_code,
                                                  local_files_only=local_files_only(name))
    except (OSError, ValueError) as err:
        raise SFTError(f"Could not load the tokenizer of {name}: {str(err).splitlines()[0]}") from None
    if not tokenizer.is_fast:
        raise SFTError(f"The tokenizer of {name} is not a fast tokenizer; sft needs character offsets to build "
                       "loss masks. Convert it with `tokenizers` or pick a model that ships tokenizer.json.")
    keep_legacy_on_save(tokenizer)
    if config.chat_template:
        apply_chat_template(tokenizer, config.chat_template)
    if tokenizer.pad_token is None and config.pad_token:
        tokenizer.add_special_tokens({"pad_token": config.pad_token})  # embeddings grow when the model loads
    if tokenizer.pad_token is None:
        # Labels are padded with -100 by the collator, never by matching pad ids, so reusing EOS for padding
        # cannot hide the trained EOS token.
        tokenizer.pad_token = tokenizer.eos_token
        log.info("The tokenizer has no pad token; padding with %s (labels are padded with -100).", tokenizer.eos_token)
    return tokenizer


def apply_chat_template(tokenizer: PreTrainedTokenizerBase, chat_template: str) -> None:
    """Set the recipe's chat template on the tokenizer (saved with it); presets add their special tokens."""
    own = tokenizer.chat_template  # the model's own format, which a preset of another family replaces
    tokenizer.chat_template = resolve_chat_template(chat_template, tokenizer)
    if chat_template in PRESETS:
        new_tokens = prepare_tokenizer_for_template(tokenizer, chat_template)
        if new_tokens and own:
            # llama3 on a Qwen tokenizer, chatml on Llama-3's: every answer ends on a token the model has never seen
            log.warning("chat_template %s replaces the tokenizer's own chat template, and its %s are not in the "
                        "tokenizer's vocabulary: they are added with untrained embeddings, and the run teaches the "
                        "model a format it has never seen instead of its own. Leave chat_template unset to train in "
                        "the model's own format.", chat_template, ", ".join(new_tokens))
        elif new_tokens:
            log.info("Added %s for the %s chat template; embeddings grow to fit.", ", ".join(new_tokens), chat_template)


def warn_remote_code(config: SFTConfig, name: str) -> None:
    """Say loudly which repository's code will run when trust_remote_code is on."""
    if config.trust_remote_code:
        log.warning("trust_remote_code is on: Python code from %s will run on this machine.", name)
