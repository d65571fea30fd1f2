"""Inference on a trained run: load a model or adapter folder, generate a reply, chat interactively."""

import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, TextIO

import jinja2
import torch
import transformers
import yaml
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedModel, \
    PreTrainedTokenizerBase, TextStreamer

from sft.models.adapters import ADAPTER_CONFIG, base_model_name, is_adapter_folder
from sft.data.chat_templates import stop_tokens
from sft.errors import SFTError
from sft.data.formats import ALPACA_PROMPT_NO_INPUT
from sft.models.loading import DTYPES, fit_embeddings
from sft.models.quantization import is_quantized, quantization_config
from sft.training.recipe import load_recipe

log = logging.getLogger(__name__)
# Recipe keys that decide how a run quantized its base (bf16/fp16/dtype pick bnb_4bit_compute_dtype: auto).
QUANTIZATION_KEYS = ("load_in_4bit", "load_in_8bit", "bnb_4bit_quant_type", "bnb_4bit_use_double_quant",
                     "bnb_4bit_compute_dtype", "bnb_4bit_quant_storage", "dtype", "bf16", "fp16")


@dataclass
class GenerationOptions:
    """Decoding settings of `sft generate` and `sft chat`; greedy unless do_sample."""

    max_new_tokens: int = 256
    do_sample: bool = False
    temperature: float = 0.7
    top_p: float = 0.9
    seed: int | None = None
    template: str = "auto"  # auto: the chat template if the tokenizer has one, else alpaca; or chat / alpaca

    def check(self) -> None:
        """Values generate() would reject with a traceback, as one-line errors."""
        if self.max_new_tokens < 1:
            raise SFTError(f"--max_new_tokens must be at least 1, got {self.max_new_tokens}.")
        if self.do_sample and not self.temperature > 0:
            raise SFTError(f"--temperature must be above 0 with --do_sample, got {self.temperature} (for greedy "
                           "decoding leave out --do_sample).")
        if self.do_sample and not 0 < self.top_p <= 1:
            raise SFTError(f"--top_p must be in (0, 1], got {self.top_p}.")


def load_for_inference(path: str | Path, dtype: str = "auto", base_model: str | None = None,
                       device: str | None = None) -> tuple[PreTrainedModel | PeftModel, PreTrainedTokenizerBase]:
    """A model folder, or an adapter folder on its base model, with the tokenizer saved beside it, in eval mode.

    Args:
        path: a `save_pretrained` model folder or a LoRA adapter folder (a use_peft run or one of its checkpoints).
        dtype: auto (as saved), bfloat16, float16 or float32.
        base_model: for adapters, load this base instead of the one named in adapter_config.json.
        device: where to run; default cuda when available, else cpu.
    """
    folder = check_folder(path)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_saved_tokenizer(folder)
    if is_adapter_folder(folder):
        model = load_adapter(folder, tokenizer, dtype, base_model, device)
    else:
        model = load_pretrained(str(folder), dtype, device)
    model.eval()
    return model, tokenizer


def check_folder(path: str | Path) -> Path:
    """`path` as a folder holding a model (config.json) or an adapter (adapter_config.json), or an error."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise SFTError(f"{path} does not exist or is not a folder. Give the output_dir of a run, one of its "
                       "checkpoint-N folders, or a saved model folder.")
    if not is_adapter_folder(folder) and not (folder / "config.json").is_file():
        raise SFTError(f"{path} holds neither a model (config.json) nor a LoRA adapter ({ADAPTER_CONFIG}).")
    return folder


def load_saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """The tokenizer saved with the run (it carries added tokens and the chat template)."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(folder))
    except (OSError, ValueError) as err:
        raise SFTError(f"No usable tokenizer in {folder}: {str(err).splitlines()[0]}") from None
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_adapter(folder: Path, tokenizer: PreTrainedTokenizerBase, dtype: str, base_model: str | None,
                 device: str, dequantize: bool = False) -> PeftModel:
    """The adapter in `folder` on its base model, quantized as in training unless `dequantize`."""
    name = base_model or base_model_name(folder)
    log.info("Loading the base model %s for the adapter in %s", name, folder)
    hint = (f" (the base model named in {folder / ADAPTER_CONFIG}). Check the path or Hub id and network access, "
            "or pass --base_model with a local copy")
    base = load_pretrained(name, dtype, device, run_quantization(folder), hint)
    if dequantize and is_quantized(base):
        base = base.dequantize(dtype=DTYPES.get(dtype))
    fit_embeddings(base, tokenizer)  # the run grew the vocabulary the same way before training
    return PeftModel.from_pretrained(base, str(folder))


def run_quantization(folder: Path) -> dict:
    """from_pretrained quantization arguments of the run that trained the adapter (from its recipe.yaml)."""
    recipe = next((p / "recipe.yaml" for p in (folder, folder.parent) if (p / "recipe.yaml").is_file()), None)
    if recipe is None:
        return {}
    values = yaml.safe_load(recipe.read_text(encoding="utf-8")) or {}
    if not (values.get("load_in_4bit") or values.get("load_in_8bit")):
        return {}
    keys = {key: values[key] for key in QUANTIZATION_KEYS if values.get(key) is not None}
    # through load_recipe: the same validation and defaults the training run had
    return {"quantization_config": quantization_config(load_recipe({**keys, "use_peft": True}))}


def load_pretrained(name: str, dtype: str, device: str, quantization: dict | None = None,
                    hint: str = "") -> PreTrainedModel:
    """A causal LM for inference, or an SFTError naming what could not be loaded (plus `hint`)."""
    try:
        return AutoModelForCausalLM.from_pretrained(name, dtype=DTYPES.get(dtype, "auto"), device_map={"": device},
                                                    **(quantization or {}))
    except (OSError, ValueError) as err:
        raise SFTError(f"Could not load the model {name}{hint}: {str(err).splitlines()[0]}") from None


def render_prompt(tokenizer: PreTrainedTokenizerBase, messages: list[dict[str, str]],
                  template: str = "auto") -> tuple[str, bool]:
    """The text the model continues, and whether tokenizing it should add special tokens (BOS).

    The tokenizer's chat template (template auto or chat), else the Stanford Alpaca no-input prompt that the
    alpaca format trains on (it has no system prompt, so system messages are dropped).
    """
    if template == "chat" and not tokenizer.chat_template:
        raise SFTError("The tokenizer has no chat template; use the alpaca template or a model saved with one.")
    if template == "chat" or (template == "auto" and tokenizer.chat_template):
        try:
            return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True), False
        except (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError) as err:
            raise SFTError(f"The model's chat template failed on this conversation ({type(err).__name__}: "
                           f"{str(err).splitlines()[0] if str(err) else ''}). Fix chat_template.jinja in the model "
                           "folder, or pass --template alpaca for a model trained on alpaca data.") from None
    return alpaca_prompt(messages), True


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
    """The model's reply to a conversation (or to one user prompt), without the prompt or special tokens."""
    if isinstance(messages, str):
        messages = [{"role": "user", "content": messages}]
    text, add_special_tokens = render_prompt(tokenizer, messages, options.template)
    encoded = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
    inputs = {key: encoded[key].to(model.device) for key in ("input_ids", "attention_mask")}
    if options.seed is not None:
        transformers.set_seed(options.seed)
    with torch.inference_mode():
        output = model.generate(**inputs, generation_config=generation_config(model, tokenizer, options),
                                streamer=streamer)
    return tokenizer.decode(output[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)


def generation_config(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase,
                      options: GenerationOptions) -> GenerationConfig:
    """The model's generation config with the requested decoding; stops at EOS or the template's end of turn."""
    config = GenerationConfig.from_dict(model.generation_config.to_dict())
    # Greedy decoding ignores sampling knobs; clearing the model's own (e.g. temperature 0.6) avoids warnings.
    sampling = (dict(temperature=options.temperature, top_p=options.top_p) if options.do_sample
                else dict(temperature=None, top_p=None, top_k=None))
    config.update(max_new_tokens=options.max_new_tokens, do_sample=options.do_sample, use_cache=True,
                  eos_token_id=sorted(stop_token_ids(tokenizer, config)), pad_token_id=tokenizer.pad_token_id,
                  **sampling)
    return config


def stop_token_ids(tokenizer: PreTrainedTokenizerBase, config: GenerationConfig) -> set[int]:
    """Ids of the tokens generation stops on (sft.data.chat_templates.stop_tokens: the same that end trained turns)."""
    vocab = tokenizer.get_vocab()  # a template's end marker that this vocabulary splits into pieces has no id
    return {vocab[token] for token in stop_tokens(tokenizer, None, config.eos_token_id) if token in vocab}


def chat(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase, options: GenerationOptions,
         system: str | None = None, stdin: TextIO = sys.stdin) -> None:
    """Read user turns from `stdin` and stream replies to stdout; /reset clears the conversation, /exit quits."""
    interactive = stdin.isatty()
    if interactive:
        print("Chat with the model. /reset starts a new conversation, /exit (or Ctrl-D) quits.")
    history = start_conversation(system)
    for line in user_turns(stdin, interactive):
        if line == "/exit":
            break
        if line == "/reset":
            history = start_conversation(system)
            print("(conversation reset)", flush=True)
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
        history.append({"role": "assistant", "content": generate(model, tokenizer, history, options, streamer)})


def start_conversation(system: str | None) -> list[dict[str, str]]:
    """A fresh message list, holding the system prompt if one was given."""
    return [{"role": "system", "content": system}] if system else []


def user_turns(stdin: TextIO, interactive: bool) -> Iterator[str]:
    """Non-empty input lines, stripped, until end of input; a terminal gets a `you> ` prompt with line editing."""
    while True:
        try:
            line = input("you> ") if interactive else stdin.readline()
        except EOFError:
            return
        if not interactive and not line:
            return
        if line.strip():
            yield line.strip()
