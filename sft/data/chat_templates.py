"""Built-in chat template presets (Jinja, Hugging Face chat-template style) and `chat_template` resolution.

Every preset renders earlier messages the same way whatever follows them (system prompts and tool lists go at the
start, never "before the last user message"), so a conversation's prefix renders to a prefix of its text. That is
what lets sft.data.chat locate each assistant turn without {% generation %} markers. Presets receive the usual
apply_chat_template variables: messages, tools, add_generation_prompt, bos_token, eos_token, raise_exception.
"""

import difflib
from dataclasses import dataclass
from pathlib import Path

import jinja2
from transformers import PreTrainedTokenizerBase

from sft.errors import SFTError

EOS = "eos_token"  # a preset whose turns end with the tokenizer's own EOS (</s> on Llama-2 / Mistral vocabularies)
# What rendering odd data can raise: raise_exception / undefined names (jinja2), str + None, a missing index, ...
TEMPLATE_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError)


@dataclass(frozen=True)
class ChatPreset:
    """A chat format: its Jinja template, the special tokens it writes, and the token that ends a turn."""

    template: str
    special_tokens: tuple[str, ...]  # literal tokens a base tokenizer may lack (see prepare_tokenizer_for_template)
    end_of_turn: str  # a literal token, or EOS for the tokenizer's eos_token
    description: str


# Pieces shared by the templates below (Jinja whitespace control: every tag strips the whitespace before it).
_BOS = r"{%- if bos_token %}{{- bos_token }}{%- endif %}"
_SPLIT_SYSTEM = r"""
{%- if messages and messages[0].role == 'system' %}
    {%- set system_message = messages[0].content %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set system_message = '' %}
    {%- set loop_messages = messages %}
{%- endif %}"""
_ARGS = r"(fn.arguments if fn.arguments is string else fn.arguments | tojson)"
_FN = r"{%- set fn = call.function if call.function is defined else call %}"


def _no_tools(name: str) -> str:
    """Template guard for presets whose format has no tool messages or tool list."""
    return (r"{%- if tools %}{{- raise_exception('chat_template " + name + r" has no tool format; "
            r"use chatml, llama3 or mistral_v3 for tool data') }}{%- endif %}")

def _role_tags(name: str, end: str) -> str:
    """`<|role|>` header, content, `end` (a Jinja expression) and a newline per message; system, user and assistant
    messages only (Zephyr and Phi-3, which differ only in how a turn ends)."""
    return _no_tools(name) + r"""
{%- for message in messages %}
    {%- if message.role not in ('system', 'user', 'assistant') %}
        {{- raise_exception('chat_template """ + name + r""" supports system, user and assistant messages only, got '
            + message.role) }}
    {%- endif %}
    {{- '<|' + message.role + '|>\n' + message.content + """ + end + r""" + '\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|assistant|>\n' }}{%- endif %}"""


def _alternating(name: str, roles: str = "user/assistant") -> str:
    """Template guard: after an optional system message, roles alternate user/assistant, starting with user."""
    return (r"""
    {%- if message.role not in ('user', 'assistant') %}
        {{- raise_exception('chat_template """ + name + r""" supports system, user and assistant messages only, got '
            + message.role) }}
    {%- endif %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('chat_template """ + name + r""": after an optional system message, roles must alternate """
            + roles + r"""/... (found two ' + message.role + ' messages in a row)') }}
    {%- endif %}""")


CHATML = r"""
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- '# Tools\n\nYou may call one or more functions to assist with the user query.\n\n' }}
    {{- 'You are provided with function signatures within <tools></tools> XML tags:\n<tools>' }}
    {%- for tool in tools %}{{- '\n' + (tool | tojson) }}{%- endfor %}
    {{- '\n</tools>\n\nFor each function call, return a json object with function name and arguments within '
        '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
        '\n</tool_call><|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (tools and loop.first and message.role == 'system') %}
        {{- '<|im_start|>' + message.role + '\n' }}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            """ + _FN + r"""
            {{- ('\n' if message.content or not loop.first else '') + '<tool_call>\n{"name": "' + fn.name
                + '", "arguments": ' + """ + _ARGS + r""" + '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\n' }}{%- endif %}"""

LLAMA3 = r"""
{{- '<|begin_of_text|>' }}
{%- if tools %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n' }}
    {%- if messages and messages[0].role == 'system' %}{{- messages[0].content + '\n\n' }}{%- endif %}
    {{- 'You have access to the following functions. To call a function, respond with JSON in the format '
        '{"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {%- for tool in tools %}{{- '\n\n' + (tool | tojson(indent=4)) }}{%- endfor %}
    {{- '<|eot_id|>' }}
{%- endif %}
{%- for message in messages %}
    {%- if not (tools and loop.first and message.role == 'system') %}
        {{- '<|start_header_id|>' + ('ipython' if message.role == 'tool' else message.role) + '<|end_header_id|>\n\n' }}
        {%- if message.content %}{{- message.content }}{%- endif %}
        {%- for call in message.tool_calls or [] %}
            """ + _FN + r"""
            {{- ('\n' if message.content or not loop.first else '') + '{"name": "' + fn.name + '", "parameters": '
                + """ + _ARGS + r""" + '}' }}
        {%- endfor %}
        {{- '<|eot_id|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{%- endif %}"""

# Meta's Llama-2-chat format as in its reference code and the Hub template (space before </s> included).
LLAMA2 = _no_tools("llama2") + _SPLIT_SYSTEM + r"""
{%- for message in loop_messages %}""" + _alternating("llama2") + r"""
    {%- if message.role == 'user' %}
        """ + _BOS + r"""
        {{- '[INST] ' }}
        {%- if loop.first and system_message %}{{- '<<SYS>>\n' + system_message + '\n<</SYS>>\n\n' }}{%- endif %}
        {{- message.content + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message.content + ' ' + eos_token }}
    {%- endif %}
{%- endfor %}"""

# Mistral-7B-Instruct v0.1 spacing: "<s> [INST] hi [/INST] yo</s>"; the system prompt opens the first user turn.
MISTRAL = _no_tools("mistral") + _SPLIT_SYSTEM + _BOS + r"""
{%- for message in loop_messages %}""" + _alternating("mistral") + r"""
    {%- if message.role == 'user' %}
        {{- ' [INST] ' + (system_message + '\n\n' if loop.first and system_message else '') + message.content
            + ' [/INST]' }}
    {%- else %}
        {{- ' ' + message.content + eos_token }}
    {%- endif %}
{%- endfor %}"""

# Mistral-7B-Instruct v0.3: "<s>[INST] hi[/INST] yo</s>" with control tokens for tools. Unlike the Hub template
# (system prompt and tool list before the LAST user message) both go before the first one, so a prefix of a
# conversation renders to a prefix of its text.
MISTRAL_V3 = _SPLIT_SYSTEM + r"""
{%- set ns = namespace(turn=0) %}
{%- for message in loop_messages %}
    {%- if message.role not in ('user', 'assistant', 'tool') %}
        {{- raise_exception('chat_template mistral_v3 supports system, user, assistant and tool messages only, got '
            + message.role) }}
    {%- endif %}
    {%- if message.role != 'tool' and not message.tool_calls %}
        {%- if (message.role == 'user') != (ns.turn % 2 == 0) %}
            {{- raise_exception('chat_template mistral_v3: after an optional system message, roles must alternate '
                'user/assistant/... (tool calls and tool results aside; found two ' + message.role
                + ' messages in a row)') }}
        {%- endif %}
        {%- set ns.turn = ns.turn + 1 %}
    {%- endif %}
{%- endfor %}
""" + _BOS + r"""
{%- for message in loop_messages %}
    {%- if message.role == 'user' %}
        {%- if tools and loop.first %}{{- '[AVAILABLE_TOOLS] ' + (tools | tojson) + '[/AVAILABLE_TOOLS]' }}{%- endif %}
        {{- '[INST] ' + (system_message + '\n\n' if loop.first and system_message else '') + message.content
            + '[/INST]' }}
    {%- elif message.role == 'assistant' %}
        {%- if message.content %}{{- ' ' + message.content }}{%- endif %}
        {%- if message.tool_calls %}
            {{- '[TOOL_CALLS] [' }}
            {%- for call in message.tool_calls %}
                """ + _FN + r"""
                {{- '{"name": "' + fn.name + '", "arguments": ' + """ + _ARGS + r"""
                    + (', "id": "' + call.id + '"' if call.id else '') + '}' + ('' if loop.last else ', ') }}
            {%- endfor %}
            {{- ']' }}
        {%- endif %}
        {{- eos_token }}
    {%- else %}
        {{- '[TOOL_RESULTS] {"content": ' + (message.content | tojson)
            + (', "call_id": "' + message.tool_call_id + '"' if message.tool_call_id else '') + '}[/TOOL_RESULTS]' }}
    {%- endif %}
{%- endfor %}"""

# HuggingFaceH4/zephyr-7b-beta (also TinyLlama-1.1B-Chat): <|role|> headers are plain text, turns end with </s>.
ZEPHYR = _role_tags("zephyr", "eos_token")

# Stanford Alpaca's prompt, verbatim for one turn (same text as the `alpaca` dataset format); a system message
# replaces the preamble, and each further turn adds an Instruction/Response pair.
ALPACA = _no_tools("alpaca") + _SPLIT_SYSTEM + _BOS + r"""
{{- system_message or 'Below is an instruction that describes a task. Write a response that appropriately '
    'completes the request.' }}
{%- for message in loop_messages %}""" + _alternating("alpaca") + r"""
    {%- if message.role == 'user' %}
        {{- '\n\n### Instruction:\n' + message.content + '\n\n### Response:' }}
    {%- else %}
        {{- message.content + eos_token }}
    {%- endif %}
{%- endfor %}"""

# FastChat vicuna_v1.1: "SYSTEM USER: hi ASSISTANT: yo</s>USER: ...".
VICUNA = _no_tools("vicuna") + _SPLIT_SYSTEM + _BOS + r"""
{{- (system_message or 'A chat between a curious user and an artificial intelligence assistant. The assistant '
    'gives helpful, detailed, and polite answers to the user\'s questions.') + ' ' }}
{%- for message in loop_messages %}""" + _alternating("vicuna") + r"""
    {%- if message.role == 'user' %}
        {{- 'USER: ' + message.content + ' ' }}
    {%- else %}
        {{- 'ASSISTANT: ' + message.content + eos_token }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- 'ASSISTANT:' }}{%- endif %}"""

# microsoft/Phi-3-mini-*-instruct, without the Hub template's trailing <|endoftext|> (turns end with <|end|>).
PHI3 = _role_tags("phi3", "'<|end|>'")

# Gemma (1/2) instruct: the assistant is "model"; a system message opens the first user turn.
GEMMA = _no_tools("gemma") + _SPLIT_SYSTEM + _BOS + r"""
{%- for message in loop_messages %}""" + _alternating("gemma") + r"""
    {{- '<start_of_turn>' + ('model' if message.role == 'assistant' else 'user') + '\n' }}
    {%- if loop.first and system_message %}{{- system_message + '\n\n' }}{%- endif %}
    {{- message.content + '<end_of_turn>\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<start_of_turn>model\n' }}{%- endif %}"""

PRESETS: dict[str, ChatPreset] = {
    "chatml": ChatPreset(CHATML, ("<|im_start|>", "<|im_end|>"), "<|im_end|>",
                         "ChatML (Qwen, Hermes, SmolLM, Phi-4); tools in the system turn, <tool_call> blocks"),
    "llama3": ChatPreset(LLAMA3, ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"),
                         "<|eot_id|>", "Llama 3 / 3.1 / 3.2 headers; tools as JSON, tool results as ipython"),
    "llama2": ChatPreset(LLAMA2, (), EOS, "Llama-2-chat [INST] with <<SYS>>"),
    "mistral": ChatPreset(MISTRAL, (), EOS, "Mistral-7B-Instruct v0.1: <s> [INST] hi [/INST] yo</s>"),
    "mistral_v3": ChatPreset(MISTRAL_V3, ("[INST]", "[/INST]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                                          "[TOOL_CALLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), EOS,
                             "Mistral-7B-Instruct v0.3: <s>[INST] hi[/INST] yo</s>, with tool control tokens"),
    "zephyr": ChatPreset(ZEPHYR, (), EOS, "Zephyr / TinyLlama-Chat: <|user|>\\nhi</s>\\n<|assistant|>\\nyo</s>"),
    "alpaca": ChatPreset(ALPACA, (), EOS, "Stanford Alpaca ### Instruction / ### Response, multi-turn"),
    "vicuna": ChatPreset(VICUNA, (), EOS, "Vicuna v1.1: USER: hi ASSISTANT: yo</s>"),
    "phi3": ChatPreset(PHI3, ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>"), "<|end|>",
                       "Phi-3 instruct: <|user|>\\nhi<|end|>\\n<|assistant|>\\nyo<|end|>"),
    "gemma": ChatPreset(GEMMA, ("<start_of_turn>", "<end_of_turn>"), "<end_of_turn>",
                        "Gemma instruct: <start_of_turn>user / model ... <end_of_turn>"),
}


def resolve_chat_template(value: str | None, tokenizer: PreTrainedTokenizerBase) -> str:
    """The Jinja source for a recipe's `chat_template`: None (the tokenizer's), a preset, a .jinja path or inline."""
    if value is None:
        return _tokenizer_template(tokenizer)
    if value in PRESETS:
        return PRESETS[value].template
    if "{%" in value or "{{" in value:
        return value
    if value.endswith(".jinja") or Path(value).is_file():
        path = Path(value).expanduser()
        if not path.is_file():
            raise SFTError(f"chat_template: file {value} does not exist. Give an existing .jinja file, "
                           f"a preset ({', '.join(PRESETS)}) or an inline Jinja string.")
        return path.read_text(encoding="utf-8")
    close = difflib.get_close_matches(value, PRESETS, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    raise SFTError(f"chat_template: `{value}` is not a preset, a .jinja file or a Jinja string.{hint} "
                   f"Presets: {', '.join(PRESETS)}.")


def _tokenizer_template(tokenizer: PreTrainedTokenizerBase) -> str:
    """The tokenizer's own (default) chat template, or an error saying how to pick one."""
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # transformers raises ValueError when the tokenizer has no template
        template = None
    if not template:
        raise SFTError("the tokenizer has no chat template; set chat_template: chatml "
                       "(or another preset / a .jinja path / an inline string)")
    return template


def prepare_tokenizer_for_template(tokenizer: PreTrainedTokenizerBase, preset: str) -> list[str]:
    """Add the preset's special tokens the tokenizer lacks (as extra special tokens); returns the new ones.

    The caller resizes the model's embeddings to len(tokenizer) when the list is non-empty. Tokens already in the
    vocabulary are still registered as special so they are never split, but are not returned.
    """
    if preset not in PRESETS:
        raise SFTError(f"chat_template {preset} is not a preset; presets: {', '.join(PRESETS)}.")
    absent = tokens_not_in_vocab(tokenizer, preset)
    added: list[str] = []
    if PRESETS[preset].end_of_turn == EOS and not tokenizer.eos_token:
        added += [] if "</s>" in tokenizer.get_vocab() else ["</s>"]
        tokenizer.add_special_tokens({"eos_token": "</s>"})  # EOS-terminated formats need one
    registered = set(tokenizer.all_special_tokens)
    missing = [t for t in PRESETS[preset].special_tokens if t not in registered]
    if missing:
        tokenizer.add_special_tokens({"extra_special_tokens": missing}, replace_extra_special_tokens=False)
    return added + absent


def tokens_not_in_vocab(tokenizer: PreTrainedTokenizerBase, preset: str) -> list[str]:
    """The preset's special tokens this tokenizer's vocabulary lacks (it would split them into pieces)."""
    vocab = tokenizer.get_vocab()
    return [t for t in PRESETS[preset].special_tokens if t not in vocab]


REASONING_TAGS = ("<think>", "</think>")  # around a reasoning block; data writes them inside assistant content
REPLY_MARK = "\x00reply\x00"  # stands in for an assistant reply when looking for what the template writes after it
