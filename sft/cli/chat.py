"""`sft chat`: an interactive conversation with a model, replies streamed as they are generated."""

import sys
from typing import Iterator, TextIO

from peft import PeftModel
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sft.evaluation.generation import (
    GenerationOptions,
    ReplyStreamer,
    dropped_ids,
    generate,
    reasoning_form,
    reply_message,
)


def chat(model: PreTrainedModel | PeftModel, tokenizer: PreTrainedTokenizerBase, options: GenerationOptions,
         system: str | None = None, stdin: TextIO = sys.stdin) -> None:
    """Read user turns from `stdin` and stream replies to stdout; /reset clears the conversation, /exit quits."""
    interactive = stdin.isatty()
    if interactive:
        print("Chat with the model. /reset starts a new conversation, /exit (or Ctrl-D) quits.")
        if model.config.is_encoder_decoder:  # generation.encoder_source: it was trained on single source/target pairs
            print("This encoder-decoder model answers each message on its own, without the earlier turns.")
    history = start_conversation(system)
    kwargs = options.chat_template_kwargs  # a reply's reasoning markup is kept and read back into its fields
    form, dropped = reasoning_form(tokenizer, kwargs), dropped_ids(tokenizer, kwargs)
    for line in user_turns(stdin, interactive):
        if line == "/exit":
            break
        if line == "/reset":
            history = start_conversation(system)
            print("(conversation reset)", flush=True)
            continue
        history.append({"role": "user", "content": line})
        print("assistant> ", end="", flush=True)
        reply = generate(model, tokenizer, history, options, ReplyStreamer(tokenizer, dropped))
        history.append(reply_message(reply, form))


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
