"""Generation settings: decoding options, the prompt a conversation renders to, a reply, the generation config."""

import functools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import torch
import transformers
import yaml
from peft import PeftModel
from transformers import (
    GenerationConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    TextStreamer,
)

from sft import rundir
from sft.config.validate import template_kwargs_problem
from sft.data.chat import ChatRenderer
from sft.data.chat_templates import REASONING_TAGS, REPLY_MARK, TEMPLATE_ERRORS
from sft.data.formats import ALPACA_PROMPT_NO_INPUT, CHAT_FORMATS
from sft.data.stops import stop_token_ids
from sft.data.template_inputs import REASONING_MARK
from sft.errors import SFTError

# Greedy decoding ignores sampling knobs; clearing the model's own (e.g. temperature 0.6) avoids warnings and, in
# evaluation, metrics that are noisy from run to run.
# Greedy search, whatever the model's generation config asks for (sampling, or beams as BART-CNN's does)
GREEDY = dict(do_sample=False, num_beams=1, temperature=None, top_p=None, top_k=None)


@dataclass
class GenerationOptions:
    """Decoding settings of `sft generate` and `sft chat`; greedy unless do_sample."""

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int | None = None
    template: str = "auto"  # auto: the chat template if the tokenizer has one, else alpaca; or chat / alpaca
    chat_template_kwargs: dict | None = None  # the chat template's variables (trained_template_kwargs)

    def check(self) -> None:
        """Values generate() would reject with a traceback, as one-line errors."""
        if self.max_new_tokens < 1:
            raise SFTError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.do_sample and not self.temperature > 0:
            raise SFTError(f"--temperature must be above 0 with --do_sample, got {self.temperature} (for greedy "
                           "decoding leave out --do_sample).")
        if self.do_sample and not 0 < self.top_p <= 1:
            raise SFTError(f"--top_p must be in (0, 1], got {self.top_p}.")
        if self.seed is not None and not 0 <= self.seed < 2**32:  # numpy's seeding range (transformers.set_seed)
            raise SFTError(f"--seed must be between 0 and {2**32 - 1}, got {self.seed}.")


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                  template: str = "auto", encoder_decoder: bool = False,
                  template_kwargs: dict | None = None) -> tuple[str, bool]:
    """The text the model continues (an encoder-decoder: reads), and whether tokenizing it should add special tokens.

    The tokenizer's chat template (template auto or chat) with the variables `template_kwargs`, else the Stanford
    Alpaca no-input prompt that the alpaca format trains on (it has no system prompt, so system messages are
    dropped). An encoder-decoder gets encoder_source() instead.
    """
    if encoder_decoder:
        return encoder_source(tokenizer, messages, template, template_kwargs), True
    if template == "chat" and not tokenizer.chat_template:
        raise SFTError("The tokenizer has no chat template; use the alpaca template or a model saved with one.")
    if template == "chat" or (template == "auto" and tokenizer.chat_template):
        try:
            return conversation_renderer(tokenizer, template_kwargs).render_messages(messages), False
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            raise SFTError(f"The model's chat template failed on this conversation ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}). Fix chat_template.jinja in the model "
                           "folder, or pass --template alpaca for a model trained on alpaca data.") from None
    return alpaca_prompt(messages), True


def trained_template(folder: str | Path) -> str | None:
    """The prompt format a run folder (or one of its checkpoints, or its merged model) trained on, from its
    data_stats.json: alpaca when it trained Alpaca rows only, chat when chat rows only, else None. A model whose
    tokenizer has a chat template but was trained on Alpaca prompts (the quickstart) answers the prompt it learnt."""
    stats = rundir.run_file(Path(folder), rundir.DATA_STATS)
    if stats is None:
        return None
    try:
        formats = set(json.loads(stats.read_text())["formats"].split(", "))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return "alpaca" if formats == {"alpaca"} else "chat" if formats <= set(CHAT_FORMATS) else None


def trained_template_kwargs(folder: str | Path) -> dict | None:
    """The chat_template_kwargs a run folder (or one of its checkpoints, or its merged model) trained with, from its
    data_stats.json (or the recipe.yaml of a run saved before data_stats recorded them): the prompt `sft chat`/
    `generate` build must be the one its masks trained on. None where none are recorded (a Hub model) or set."""
    folder = Path(folder)
    stats, recipe = rundir.run_file(folder, rundir.DATA_STATS), rundir.run_file(folder, rundir.RECIPE)
    try:
        recorded = json.loads(stats.read_text(encoding="utf-8")) if stats else None
        if not (isinstance(recorded, dict) and "chat_template_kwargs" in recorded):
            recorded = yaml.safe_load(recipe.read_text(encoding="utf-8")) if recipe else None
    except (OSError, ValueError, yaml.YAMLError):
        return None
    kwargs = recorded.get("chat_template_kwargs") if isinstance(recorded, dict) else None
    return kwargs if isinstance(kwargs, dict) and kwargs else None


def prompt_template_kwargs(flag: str | None, folder: str | Path) -> dict | None:
    """The chat template variables of `sft chat`/`generate`: --chat_template_kwargs (a YAML mapping) when given,
    else those the run trained with (trained_template_kwargs)."""
    if flag is None:
        return trained_template_kwargs(folder)
    try:
        value = yaml.safe_load(flag)
    except yaml.YAMLError as err:
        value = f"{flag} (not YAML: {str(err).splitlines()[0]})"
    problem = template_kwargs_problem(value if value is not None else {})
    if problem:
        raise SFTError(f"Bad value for --chat_template_kwargs: {problem}.")
    return value or None


def encoder_source(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]], template: str,
                   template_kwargs: dict | None = None) -> str:
    """An encoder-decoder's input: the last user message alone, as is (template auto: seq2seq and prompt_completion
    rows train on plain sources) or in the Alpaca prompt / chat template asked for (tokenized, like training's
    sources, with the special tokens).

    Seq2seq rows train one source to one target, so a transcript of earlier turns would be an input the model
    never saw: `sft chat` on such a model answers each message on its own.
    """
    turn = [m for m in messages if m["role"] == "system"] + [m for m in messages if m["role"] == "user"][-1:]
    return turn[-1]["content"] if template == "auto" else render_prompt(tokenizer, turn, template,
                                                                         template_kwargs=template_kwargs)[0]


def alpaca_prompt(messages: list[dict[str, str]]) -> str:
    """The Alpaca prompt for the first instruction; later turns continue with the same section headers."""
    text = ""
    for message in messages:
        if message["role"] == "assistant":
            text += message["content"]
        elif message["role"] == "user":
            text += (f"\n\n### Instruction:\n{message['content']}\n\n### Response:" if text
                     else ALPACA_PROMPT_NO_INPUT.format(instruction=message["content"]))
    return text


def generate(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase,
             messages: list[dict[str, str]] | str, options: GenerationOptions,
             streamer: TextStreamer | None = None) -> str:
    """The model's reply to a conversation (or to one user prompt), without the prompt or special tokens; an
    encoder-decoder reads the prompt in its encoder, and its reply is what the decoder wrote."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    encoder_decoder = model.config.is_encoder_decoder
    text, add_special_tokens = render_prompt(tokenizer, messages, options.template, encoder_decoder,
                                             options.chat_template_kwargs)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    inputs = {key: encoded[key].to(model.device) for key in ("input_ids", "attention_mask")}
    if options.seed is not None:
        transformers.set_seed(options.seed)
    with torch.inference_mode():
        output = model.generate(**inputs, generation_config=generation_config(model, tokenizer, options),
                                streamer=streamer)
    ids = reply_tokens(output, inputs["input_ids"], encoder_decoder)[0].tolist()
    return decode_reply(tokenizer, ids, dropped_ids(tokenizer, options.chat_template_kwargs))


def dropped_ids(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None) -> set[int]:
    """What generated text leaves out (sft chat and generate replies, eval predictions and references): what
    skip_special_tokens drops, less three kinds of text it would lose. The markup the chat template writes around a
    reply's reasoning (reasoning_form; GPT-OSS's <|channel|>analysis<|message|>... are special tokens): dropped, a
    reply read 'analysisThe user wants 2+2.assistantfinalIt is 4.'. <think> and </think>: a tokenizer that
    registers them as special (fine-tunes often do) lost them, and `sft chat` fed its history a reply with the
    reasoning as part of the answer, which reasoning templates (Qwen3, DeepSeek-R1, GLM) cut off at </think> in
    earlier turns. <unk>: a character the tokenizer cannot write (T5 has no `{`, `<`, `ł`, no Chinese); dropped, an
    eval scored a reply that left it out as one that wrote it."""
    special = {*tokenizer.all_special_ids, *(i for i, t in tokenizer.added_tokens_decoder.items() if t.special)}
    form = reasoning_form(tokenizer, template_kwargs)
    markup = set(tokenizer("".join(form), add_special_tokens=False)["input_ids"]) if form else set()
    return {i for i in special - markup - {tokenizer.unk_token_id}
            if tokenizer.convert_ids_to_tokens(i) not in REASONING_TAGS}


def conversation_renderer(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None) -> ChatRenderer:
    """The training renderer of the tokenizer's chat template with these variables, built once (its probes render
    the template several times) for every prompt of a chat session."""
    return _renderer(tokenizer, json.dumps(template_kwargs or {}, sort_keys=True))


@functools.lru_cache(maxsize=4)
def _renderer(tokenizer: PreTrainedTokenizerBase, template_kwargs: str) -> ChatRenderer:
    return ChatRenderer(tokenizer, template_kwargs=json.loads(template_kwargs))


def reasoning_form(tokenizer: PreTrainedTokenizerBase, template_kwargs: dict | None = None) -> tuple[str, str] | None:
    """What the chat template writes in a reply around its reasoning, found by rendering one after the generation
    prompt: (before the reasoning, between it and the answer). Qwen3 ('<think>\\n', '\\n</think>\\n\\n'), GPT-OSS
    ('<|channel|>analysis<|message|>', '<|end|><|start|>assistant<|channel|>final<|message|>'), Magistral ('[THINK]',
    '[/THINK]'), a prompt that opens the block itself (Qwen3.5) ('', '\\n</think>\\n\\n'). None where the template
    renders no reasoning in a reply (Kimi-K2-Thinking: only in a tool call's)."""
    if not tokenizer.chat_template:
        return None
    user = {"role": "user", "content": "hi"}
    answer = {"role": "assistant", "content": REPLY_MARK, "reasoning_content": REASONING_MARK}
    try:
        renderer = conversation_renderer(tokenizer, template_kwargs)
        prompt, full = renderer.render_messages([user]), renderer.render_messages([user, answer], False)
    except (SFTError, *TEMPLATE_ERRORS):
        return None
    reply = full[len(prompt):] if full.startswith(prompt) else ""
    at, answer_at = reply.find(REASONING_MARK), reply.find(REPLY_MARK)
    return (reply[:at], reply[at + len(REASONING_MARK):answer_at]) if 0 <= at < answer_at else None


def reply_message(text: str, form: tuple[str, str] | None) -> dict[str, str]:
    """A reply (decode_reply's text) as the assistant message the next prompt renders: where it has the template's
    reasoning form, its reasoning as reasoning_content and the answer as the content (GPT-OSS renders an earlier
    turn's content as its final channel: the whole reply there was a prompt it never saw); else the whole text as the
    content, which render_messages prepares as training does (a think block into the fields a template reads)."""
    if form and text.startswith(form[0]) and form[1] in text[len(form[0]):]:
        reasoning, answer = text[len(form[0]):].split(form[1], 1)
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    return {"role": "assistant", "content": text}


def decode_reply(tokenizer: PreTrainedTokenizerBase, ids: list[int], dropped: set[int] | None = None) -> str:
    """A reply's text without special tokens (turn ends, padding), its reasoning markup and <unk> kept; `dropped`:
    dropped_ids(tokenizer) computed once by a caller that decodes many."""
    dropped = dropped_ids(tokenizer) if dropped is None else dropped
    return tokenizer.decode([i for i in ids if i not in dropped], skip_special_tokens=False)


class ReplyStreamer(TextStreamer):
    """Prints a reply as it is generated, as decode_reply writes it (not the prompt)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, dropped: set[int] | None = None) -> None:
        super().__init__(tokenizer, skip_prompt=True)
        self.dropped = dropped  # dropped_ids; read at the first reply token where not given

    def put(self, value: torch.Tensor) -> None:
        if self.skip_prompt and self.next_tokens_are_prompt:
            super().put(value)
            return
        self.dropped = dropped_ids(self.tokenizer) if self.dropped is None else self.dropped
        ids = value[0] if value.dim() > 1 else value
        super().put(ids[[int(i) not in self.dropped for i in ids.tolist()]])


def reply_tokens(output: torch.Tensor, prompt: torch.Tensor, encoder_decoder: bool) -> torch.Tensor:
    """The generated tokens in each row of generate()'s `output` for the batch of prompts `prompt`: a decoder-only
    output repeats the (padded) prompt first, an encoder-decoder one the decoder start id."""
    return output[:, 1:] if encoder_decoder else output[:, prompt.shape[1]:]


def generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                      options: GenerationOptions) -> GenerationConfig:
    """The model's generation config with the requested decoding; stops at EOS or the template's end of turn."""
    sampling = dict(do_sample=True, num_beams=1, temperature=options.temperature, top_p=options.top_p)
    return decoding_config(model, tokenizer, max_new_tokens=options.max_new_tokens,
                           **(sampling if options.do_sample else GREEDY))


def decoding_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, config: GenerationConfig | None = None,
                    **settings: Any) -> GenerationConfig:
    """`config` (default: a copy of the model's generation config) with `settings`, the KV cache on, padding with the
    tokenizer's pad token, stopping at its EOS, the config's EOS ids and the chat template's end of turn."""
    config = GenerationConfig.from_dict(model.generation_config.to_dict()) if config is None else config
    config.update(**settings)
    config.update(use_cache=True, pad_token_id=tokenizer.pad_token_id)
    return with_stop_tokens(config, tokenizer)


def with_stop_tokens(config: GenerationConfig, tokenizer: PreTrainedTokenizerBase) -> GenerationConfig:
    """`config` stopping at the tokenizer's EOS, its own eos_token_id list and the chat template's end of turn
    (stop_token_ids). A trained or merged model saves it as generation_config.json, where transformers' generate,
    vLLM and TGI read when to stop: a base model trained on a template it did not know (llama3's <|eot_id|> on a
    base Llama, chatml on anything) would otherwise write past the end of each turn outside sft."""
    config.eos_token_id = sorted(stop_token_ids(tokenizer, config.eos_token_id))
    return config
