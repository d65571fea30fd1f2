"""Stop tokens: what ends an assistant turn (and so a trained example) and stops generation, and the tokens a
template writes between messages. The one place these are decided; chat masks, `sft generate`/`chat`,
generation-based eval and `sft check --prove` all ask here."""

from transformers import PreTrainedTokenizerBase

from sft.data.chat_templates import REASONING_TAGS, REPLY_MARK, TEMPLATE_ERRORS
from sft.errors import SFTError

# End-of-turn tokens of common templates, recognised even where a tokenizer does not register them as special.
KNOWN_END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "</s>",
                     "<|endoftext|>", "<|end_of_text|>", "<|END_OF_TURN_TOKEN|>")


def stop_tokens(tokenizer: PreTrainedTokenizerBase, template: str | None = None,
                generation_eos: int | list[int] | None = None, masks: bool = True) -> list[str]:
    """The tokens generation stops on, which are also the tokens that end a trained assistant turn.

    The one place this is decided (chat masks call it; `sft generate`/`chat`, generation-based eval and `sft check
    --prove` take its ids from stop_token_ids): the tokenizer's EOS and the generation config's `eos_token_id` list
    (GPT-OSS <|return|>/<|call|>, GLM <|user|>/<|observation|>, Llama-3.1 <|eom_id|>). When neither follows a final
    reply in the template's rendering (no generation config, or one that does not cover this template), the special
    token the template writes right after an earlier reply is added, unless a known stop already follows it there:
    a base tokenizer's <|endoftext|> under ChatML gains <|im_end|>, Phi-3 (whose template writes EOS after the last
    turn only) gains <|end|>, and Cohere2 keeps stopping at <|END_OF_TURN_TOKEN|>, not <|END_RESPONSE|>.
    """
    configured = generation_eos if isinstance(generation_eos, list) else [generation_eos]
    own = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token]
    tokens = list(dict.fromkeys([*own, *(_configured_stop(tokenizer, i, masks) for i in configured if i is not None)]))
    template = template or tokenizer.chat_template
    final = _text_after_reply(tokenizer, template, False)
    if generation_eos is not None and final is not None and any(t in final for t in tokens):
        return tokens
    after = _text_after_reply(tokenizer, template, True)
    if after is None or any(t in after for t in tokens):
        return tokens
    specials = [*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values()),
                *KNOWN_END_OF_TURN]
    ending = sorted((t for t in specials if after.lstrip().startswith(t)), key=len, reverse=True)
    return tokens + ending[:1]


def _configured_stop(tokenizer: PreTrainedTokenizerBase, token_id: int, masks: bool) -> str:
    """The token a generation config stops on, as this tokenizer writes it. An id the tokenizer lacks means it is
    another model's tokenizer (its vocabulary numbers tokens differently). For `masks` (the model's own generation
    config, ending trained turns) so does an id it reads as an ordinary piece of text: stop tokens are special
    tokens, and turns would end at that text. A decoding config may stop at ordinary text on purpose (a newline)."""
    token = tokenizer.convert_ids_to_tokens(token_id) if 0 <= token_id < len(tokenizer) else None
    specials = {*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values())}
    if token in specials or (token is not None and not masks):
        return token
    read = f"reads as the ordinary token {token!r}" if token is not None else f"lacks (it has {len(tokenizer)} tokens)"
    where = "the model's generation_config.json" if masks else "the generation config"
    raise SFTError(f"{where} stops generation at token id {token_id}, which the tokenizer {tokenizer.name_or_path} "
                   f"{read}: the tokenizer is not this model's, so its ids name other tokens. Use the model's own "
                   "tokenizer (leave tokenizer_name_or_path unset); if it is the model's own, fix eos_token_id in "
                   f"{where}.")


def message_delimiters(tokenizer: PreTrainedTokenizerBase, template: str | None) -> list[str]:
    """The tokenizer's tokens the template writes to open a conversation and to separate its messages: BOS, role
    markers and turn ends (<|im_start|> <|im_end|>, <|start_header_id|> <|eot_id|>, <s> [INST] [/INST] </s>).
    Found in what it writes around the contents of user, assistant, user; tokens it writes only for reasoning or
    tool calls (<think>, <tool_call>, <|python_tag|>) are not among them: data writes those inside messages."""
    if not template:
        return []
    conversation = [{"role": role, "content": REPLY_MARK} for role in ("user", "assistant", "user")]
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False)
    except TEMPLATE_ERRORS:
        return []
    pieces = text.split(REPLY_MARK)
    if len(pieces) != 4:  # content as typed parts only, or not written once each: nothing to learn here
        return []
    tokens = {*tokenizer.all_special_tokens, *(t.content for t in tokenizer.added_tokens_decoder.values())}
    # BOS is the tokenizer's to add where the template does not write it (Phi-3); GLM and Nemotron write an empty
    # <think></think> in each earlier assistant turn
    markup = "".join(pieces[:3]) + (tokenizer.bos_token or "")
    return sorted(token for token in tokens - set(REASONING_TAGS) if token and token in markup)


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, generation_eos: int | list[int] | None = None,
                   template: str | None = None) -> set[int]:
    """Ids of the stop tokens (stop_tokens) for generate(): `sft generate`/`chat`, generation-based eval, --prove."""
    vocab = tokenizer.get_vocab()  # a template's end marker that this vocabulary splits into pieces has no id
    return {vocab[token] for token in stop_tokens(tokenizer, template, generation_eos, masks=False) if token in vocab}


def _text_after_reply(tokenizer: PreTrainedTokenizerBase, template: str | None, followed: bool) -> str | None:
    """What the template writes after an assistant reply (up to the next user message when `followed`); None
    when it cannot say (no template, or one that refuses the probe)."""
    if not template:
        return None
    conversation = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": REPLY_MARK}]
    if followed:
        conversation.append({"role": "user", "content": REPLY_MARK})
    try:
        text = tokenizer.apply_chat_template(conversation, chat_template=template, tokenize=False)
    except TEMPLATE_ERRORS:
        return None  # a template refusing the probe: the EOS ids alone stop replies
    pieces = text.split(REPLY_MARK)
    return pieces[1] if len(pieces) > 1 else None
