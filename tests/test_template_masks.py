"""Trained text of every fixture chat template (../shared/fixtures/templates, the publishers' originals) on four
conversations: multi-turn with a system prompt, no system prompt, reasoning_content on every answer, and a tool
call with its result.

The rule (sft/data/chat.py, docs/design.md): each trained assistant turn is what the model generates after the
generation prompt, through the token generation stops on. Expected texts are written per family from the
template's meaning; they are not produced by the code under test. Labels come from the pipeline's own
sft.data.encode.Encoding on a real byte-level BPE tokenizer (Qwen2.5's vocabulary) with each family's special tokens
added, and the stop tokens are those the publisher's generation_config.json declares.
"""

import copy
import json
import re
from functools import cache
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from sft.data.chat import ChatRenderer
from sft.data.encode import Encoding
from sft.data.stops import message_delimiters
from sft.errors import SFTError

from conftest import FIXTURES

TEMPLATES = FIXTURES / "templates"
pytestmark = pytest.mark.skipif(not TEMPLATES.is_dir(), reason=f"fixture chat templates not found at {TEMPLATES} "
                                "(the shared fixtures live in ../shared next to the repository)")

# family: (special tokens the template writes, bos, eos, stop tokens of generation_config.json's eos_token_id).
# Stop tokens are the publishers' generation configs on the Hub (not part of the fixtures), by token name:
FAMILIES = {
    # CohereForAI c4ai-command-r-v01 / c4ai-command-r7b-12-2024: eos_token_id 255001
    "cohere": (["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                "<|SYSTEM_TOKEN|>"], "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>", ["<|END_OF_TURN_TOKEN|>"]),
    "cohere2": (["<|START_OF_TURN_TOKEN|>", "<|END_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>",
                 "<|SYSTEM_TOKEN|>", "<|START_RESPONSE|>", "<|END_RESPONSE|>"], "<BOS_TOKEN>",
                "<|END_OF_TURN_TOKEN|>", ["<|END_OF_TURN_TOKEN|>"]),
    # deepseek-ai DeepSeek-V3 / R1: eos_token_id 1
    "deepseekv3": (["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>",
                    "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
                    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                    "<｜tool▁output▁end｜>"], "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>",
                   ["<｜end▁of▁sentence｜>"]),
    # Gemma 4 format: eos_token_id [1, 106, 50] = <eos>, <turn|>, <|tool_response>
    "diffusion_gemma": (["<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|tool_call>", "<tool_call|>",
                         "<|tool_response>", "<tool_response|>", "<|tool>", "<tool|>", '<|"|>', "<|think|>"],
                        "<bos>", "<eos>", ["<eos>", "<turn|>", "<|tool_response>"]),
    # google gemma-2-*-it: eos_token_id [1, 107]; gemma-3-*-it: [1, 106] (<eos>, <end_of_turn>)
    "gemma": (["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", ["<eos>", "<end_of_turn>"]),
    "gemma3": (["<start_of_turn>", "<end_of_turn>"], "<bos>", "<eos>", ["<eos>", "<end_of_turn>"]),
    # zai-org GLM-4.5 / 4.6: eos_token_id [151329, 151336, 151338]
    "glm4moe": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>", "<think>",
                 "</think>", "<tool_call>", "</tool_call>"], None, "<|endoftext|>",
                ["<|endoftext|>", "<|user|>", "<|observation|>"]),
    # openai gpt-oss-20b / 120b: eos_token_id [200002, 199999, 200012]
    "gptoss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|return|>", "<|call|>"],
               "<|startoftext|>", "<|return|>", ["<|return|>", "<|endoftext|>", "<|call|>"]),
    # HuggingFaceM4 Idefics3-8B-Llama3: eos <end_of_utterance>
    "idefics3": (["<end_of_utterance>", "<image>"], "<|begin_of_text|>", "<end_of_utterance>",
                 ["<end_of_utterance>"]),
    # LiquidAI LFM2 / LFM2.5: eos_token_id 7 (<|im_end|>)
    "lfm2": (["<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
              "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>"], "<|startoftext|>",
             "<|im_end|>", ["<|im_end|>"]),
    "lfm2_2_5": (["<|im_start|>", "<|im_end|>", "<|tool_list_start|>", "<|tool_list_end|>", "<|tool_call_start|>",
                  "<|tool_call_end|>", "<|tool_response_start|>", "<|tool_response_end|>", "<think>", "</think>"],
                 "<|startoftext|>", "<|im_end|>", ["<|im_end|>"]),
    # meta-llama Meta-Llama-3-8B-Instruct: [128001, 128009]; Llama-3.1 / 3.2 Instruct: [128001, 128008, 128009]
    "llama3": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|end_of_text|>"], "<|begin_of_text|>",
               "<|eot_id|>", ["<|end_of_text|>", "<|eot_id|>"]),
    "llama3_1": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                  "<|end_of_text|>"], "<|begin_of_text|>", "<|eot_id|>",
                 ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    "llama3_2": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>",
                  "<|end_of_text|>"], "<|begin_of_text|>", "<|eot_id|>",
                 ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    # llava-hf llava-v1.6-mistral-7b-hf: eos_token_id 2 (</s>)
    "llava_next": (["[INST]", "[/INST]", "<image>"], "<s>", "</s>", ["</s>"]),
    # nvidia Nemotron-3 Nano / Super / Ultra: eos_token_id [2, 11] = </s>, <|im_end|>
    "nemotron_3_nano": (["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
                        "<s>", "<|im_end|>", ["</s>", "<|im_end|>"]),
    "nemotron_3_super": (["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
                         "<s>", "<|im_end|>", ["</s>", "<|im_end|>"]),
    "nemotron_3_ultra": (["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"],
                         "<s>", "<|im_end|>", ["</s>", "<|im_end|>"]),
    # microsoft Phi-3-mini-4k-instruct / Phi-3.5-mini-instruct: [32000, 32001, 32007]
    "phi3": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>", "<|endoftext|>",
             ["<|endoftext|>", "<|assistant|>", "<|end|>"]),
    "phi3_5": (["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"], "<s>", "<|endoftext|>",
               ["<|endoftext|>", "<|assistant|>", "<|end|>"]),
    # Qwen2.5 / Qwen2.5-VL / Qwen3 / Qwen3.5 / Qwen3.6 / Qwen3-VL: [151645, 151643] = <|im_end|>, <|endoftext|>
    **{name: (["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"], None,
              "<|im_end|>", ["<|im_end|>", "<|endoftext|>"])
       for name in ("qwen2_5", "qwen2_5_vl", "qwen3", "qwen3_5_nothink", "qwen3_5_think", "qwen3_6",
                    "qwen3_instruct_2507", "qwen3_vl")},
}

SYSTEM = {"role": "system", "content": "Be brief."}
ASK, ASK_AGAIN = {"role": "user", "content": "What is 2+2?"}, {"role": "user", "content": "And 3+3?"}
FOUR, SIX = {"role": "assistant", "content": "It is 4."}, {"role": "assistant", "content": "It is 6."}
WEATHER = {"role": "user", "content": "Weather in Paris?"}
CALL = {"role": "assistant", "content": "", "tool_calls": [
    {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}
RESULT = {"role": "tool", "tool_call_id": "call00001", "name": "get_weather", "content": "Sunny, 20 C"}
SUNNY = {"role": "assistant", "content": "It is sunny in Paris."}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
CONVERSATIONS = {
    "multi": {"messages": [SYSTEM, ASK, FOUR, ASK_AGAIN, SIX]},
    "no_system": {"messages": [ASK, FOUR, ASK_AGAIN, SIX]},
    "reasoning": {"messages": [ASK, dict(FOUR, reasoning_content="Add two and two."), ASK_AGAIN,
                               dict(SIX, reasoning_content="Add three and three.")]},
    "tool": {"messages": [WEATHER, CALL, RESULT, SUNNY], "tools": TOOLS},
}


@cache
def base_tokenizer():
    """Qwen2.5's byte-level BPE (vocab.json + merges.txt from the fixtures)."""
    return AutoTokenizer.from_pretrained(FIXTURES / "tokenizers" / "qwen2.5-coder-3b-instruct")


@cache
def family_tokenizer(name: str):
    """The byte-level BPE with the family's template, bos/eos and special tokens; and its stop tokens' ids."""
    specials, bos, eos, stops = FAMILIES[name]
    tok = copy.deepcopy(base_tokenizer())
    tok.add_special_tokens({"extra_special_tokens": [t for t in specials + [eos] + stops + [bos] if t]},
                           replace_extra_special_tokens=True)
    tok.eos_token, tok.bos_token = eos, bos
    tok.chat_template = (TEMPLATES / f"{name}.jinja").read_text(encoding="utf-8")
    return tok, tok.convert_tokens_to_ids(stops)


def trained_texts(tok, name: str, row: dict, stops: list[int], **options) -> list[str]:
    """Decoded runs of trained tokens of every example the row renders to, in order."""
    renderer = ChatRenderer(tok, generation_eos=stops, **options)
    texts = []
    for example in renderer.render_row(row, "chat.jsonl", 3):
        out = Encoding(tok, max_length=10**6).encode([example])
        ids, labels = out["input_ids"][0], out["labels"][0]
        run: list[int] = []
        for token, label in zip(ids + [None], labels + [-100]):
            if label != -100:
                run.append(token)
            elif run:
                texts.append(tok.decode(run, skip_special_tokens=False))
                run = []
    return texts


def answers(before: str, end: str) -> list[str]:
    """Both answers of the multi-turn conversations, each after `before` (what the model writes ahead of the
    answer) and through `end` (the stop token the turn ends with)."""
    return [f"{before}It is 4.{end}", f"{before}It is 6.{end}"]


def reasoned(open_: str, between: str, end: str) -> list[str]:
    """Both answers of the reasoning conversation: reasoning after `open_`, then `between`, the answer, `end`."""
    return [f"{open_}Add two and two.{between}It is 4.{end}", f"{open_}Add three and three.{between}It is 6.{end}"]


# Why a conversation is refused: the template raises on it, or renders the turn without what the row holds.
ALTERNATE = r"chat template rejected the conversation \(TemplateError: Conversation roles must alternate"
NO_REASONING = r"messages\[1\]: the chat template does not render this assistant message's reasoning"
NO_CALLS = r"messages\[1\]: the chat template does not render this assistant message's tool_calls"
QWEN_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Paris"}}'
EMPTY_THINK = "<think>\n\n</think>\n\n"
# Qwen3.5 / 3.6 prompts end "<think>\n" and an answer without reasoning continues "\n</think>\n\n": the first
# trained token is "\n\n", which holds the prompt's last newline (a token straddling the start is trained).
OPEN_THINK = "\n\n</think>\n\n"

EXPECTED = {
    # Cohere: turns end <|END_OF_TURN_TOKEN|>; Cohere2 writes <|END_RESPONSE|> first, which the model also emits.
    "cohere": {"multi": answers("", "<|END_OF_TURN_TOKEN|>"), "no_system": answers("", "<|END_OF_TURN_TOKEN|>"),
               "reasoning": NO_REASONING, "tool": ALTERNATE},
    "cohere2": {"multi": answers("", "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"),
                "no_system": answers("", "<|END_RESPONSE|><|END_OF_TURN_TOKEN|>"),
                "reasoning": NO_REASONING, "tool": ALTERNATE},
    # DeepSeek-V3/R1: the prompt ends "<｜Assistant｜><think>\n", the rendered turn "<｜Assistant｜>answer": the turn
    # starts where they differ. Reasoning is cut from every turn; tool calls need string arguments.
    "deepseekv3": {"multi": answers("", "<｜end▁of▁sentence｜>"), "no_system": answers("", "<｜end▁of▁sentence｜>"),
                   "reasoning": NO_REASONING,
                   "tool": [("<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                             '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>'),
                            "It is sunny in Paris.<｜end▁of▁sentence｜>"]},
    # Gemma 4 format: thought channel; a call ends at <|tool_response>, which the model emits to hand over; after
    # the result the prompt opens no model turn, so the model writes "<|turn>model\n" itself.
    "diffusion_gemma": {"multi": answers("", "<turn|>"), "no_system": answers("", "<turn|>"),
                        "reasoning": reasoned("<|channel>thought\n", "\n<channel|>", "<turn|>"),
                        "tool": ['<|tool_call>call:get_weather{city:<|"|>Paris<|"|>}<tool_call|><|tool_response>',
                                 "<|turn>model\nIt is sunny in Paris.<turn|>"]},
    "gemma": {"multi": r"TemplateError: System role not supported", "no_system": answers("", "<end_of_turn>"),
              "reasoning": NO_REASONING, "tool": ALTERNATE},
    "gemma3": {"multi": answers("", "<end_of_turn>"), "no_system": answers("", "<end_of_turn>"),
               "reasoning": NO_REASONING, "tool": ALTERNATE},
    # GLM-4.5: no end-of-turn token; a turn ends with the next role tag the model writes (<|user|>,
    # <|observation|> after a call), appended to the last turn. Its think block follows the prompt's <|assistant|>.
    "glm4moe": {"multi": answers("\n<think></think>\n", "<|user|>"),
                "no_system": answers("\n<think></think>\n", "<|user|>"),
                "reasoning": reasoned("\n<think>", "</think>\n", "<|user|>"),
                "tool": [("\n<think></think>\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
                          "</arg_value>\n</tool_call><|observation|>"),
                         "\n<think></think>\nIt is sunny in Paris.<|user|>"]},
    # GPT-OSS: channels; the final answer ends <|return|> (history turns render <|end|>: each turn is split into
    # its own example); a call ends <|call|>, so the tool's result is never trained.
    "gptoss": {"multi": answers("<|channel|>final<|message|>", "<|return|>"),
               "no_system": answers("<|channel|>final<|message|>", "<|return|>"),
               "reasoning": reasoned("<|channel|>analysis<|message|>",
                                     "<|end|><|start|>assistant<|channel|>final<|message|>", "<|return|>"),
               "tool": [' to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>',
                        "<|channel|>final<|message|>It is sunny in Paris.<|return|>"]},
    # Idefics3 reads content as typed parts only; "Assistant:" is the prompt, the answer starts with its space.
    "idefics3": {"multi": answers(" ", "<end_of_utterance>"), "no_system": answers(" ", "<end_of_utterance>"),
                 "reasoning": NO_REASONING, "tool": NO_CALLS},
    "lfm2": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
             "reasoning": NO_REASONING, "tool": NO_CALLS},
    "lfm2_2_5": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                 "reasoning": reasoned("<think>", "</think>", "<|im_end|>"),
                 "tool": ["<|tool_call_start|>[get_weather(city='Paris')]<|tool_call_end|><|im_end|>",
                          "It is sunny in Paris.<|im_end|>"]},
    "llama3": {"multi": answers("", "<|eot_id|>"), "no_system": answers("", "<|eot_id|>"),
               "reasoning": NO_REASONING, "tool": NO_CALLS},
    "llama3_1": {"multi": answers("", "<|eot_id|>"), "no_system": answers("", "<|eot_id|>"),
                 "reasoning": NO_REASONING, "tool": [LLAMA_CALL + "<|eot_id|>", "It is sunny in Paris.<|eot_id|>"]},
    "llama3_2": {"multi": answers("", "<|eot_id|>"), "no_system": answers("", "<|eot_id|>"),
                 "reasoning": NO_REASONING, "tool": [LLAMA_CALL + "<|eot_id|>", "It is sunny in Paris.<|eot_id|>"]},
    # LLaVA-Next (Mistral): typed parts only; the answer follows "[/INST]" with a space.
    "llava_next": {"multi": answers(" ", "</s>"), "no_system": answers(" ", "</s>"), "reasoning": NO_REASONING,
                   "tool": r"TemplateError: Only user and assistant roles are supported"},
    # Nemotron-3: the prompt opens "<think>\n"; an answer without reasoning renders "<think></think>": the turn
    # starts where the two differ, after "<think>".
    **{name: {"multi": answers("</think>", "<|im_end|>"), "no_system": answers("</think>", "<|im_end|>"),
              "reasoning": reasoned("", "\n</think>\n", "<|im_end|>"),
              "tool": ["</think>\n" + XML_CALL + "\n<|im_end|>", "</think>It is sunny in Paris.<|im_end|>"]}
       for name in ("nemotron_3_nano", "nemotron_3_super")},
    "nemotron_3_ultra": {"multi": answers("</think>", "<|im_end|>"), "no_system": answers("</think>", "<|im_end|>"),
                         "reasoning": reasoned("", "</think>", "<|im_end|>"),
                         "tool": ["</think>\n" + XML_CALL + "\n<|im_end|>", "</think>It is sunny in Paris.<|im_end|>"]},
    # Phi-3: turns end <|end|>, a stop token of its generation config (the EOS it writes after the last is not).
    "phi3": {"multi": answers("", "<|end|>"), "no_system": answers("", "<|end|>"), "reasoning": NO_REASONING,
             "tool": NO_CALLS},
    "phi3_5": {"multi": answers("", "<|end|>"), "no_system": answers("", "<|end|>"), "reasoning": NO_REASONING,
               "tool": NO_CALLS},
    "qwen2_5": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                "reasoning": NO_REASONING, "tool": [QWEN_CALL + "<|im_end|>", "It is sunny in Paris.<|im_end|>"]},
    "qwen2_5_vl": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                   "reasoning": NO_REASONING, "tool": NO_CALLS},
    # Qwen3: the final turn always has a think block (empty without reasoning); history turns have none, so each
    # turn is its own example, trained as the final one.
    "qwen3": {"multi": answers(EMPTY_THINK, "<|im_end|>"), "no_system": answers(EMPTY_THINK, "<|im_end|>"),
              "reasoning": reasoned("<think>\n", "\n</think>\n\n", "<|im_end|>"),
              "tool": [EMPTY_THINK + QWEN_CALL + "<|im_end|>", EMPTY_THINK + "It is sunny in Paris.<|im_end|>"]},
    # Qwen3.5 without thinking: the prompt holds the empty think block; reasoning data starts after its "<think>\n".
    "qwen3_5_nothink": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                        "reasoning": reasoned("", "\n</think>\n\n", "<|im_end|>"),
                        "tool": [XML_CALL + "<|im_end|>", "It is sunny in Paris.<|im_end|>"]},
    **{name: {"multi": answers(OPEN_THINK, "<|im_end|>"), "no_system": answers(OPEN_THINK, "<|im_end|>"),
              "reasoning": reasoned("", "\n</think>\n\n", "<|im_end|>"),
              "tool": [OPEN_THINK + XML_CALL + "<|im_end|>", OPEN_THINK + "It is sunny in Paris.<|im_end|>"]}
       for name in ("qwen3_5_think", "qwen3_6")},
    "qwen3_instruct_2507": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                            "reasoning": NO_REASONING,
                            "tool": [QWEN_CALL + "<|im_end|>", "It is sunny in Paris.<|im_end|>"]},
    "qwen3_vl": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"),
                 "reasoning": NO_REASONING, "tool": [QWEN_CALL + "<|im_end|>", "It is sunny in Paris.<|im_end|>"]},
}


def test_every_fixture_template_is_covered():
    assert sorted(EXPECTED) == sorted(p.stem for p in TEMPLATES.glob("*.jinja")) == sorted(FAMILIES)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("kind", list(CONVERSATIONS))
def test_trained_text_is_what_the_model_generates(name, kind):
    tok, stops = family_tokenizer(name)
    expected = EXPECTED[name][kind]
    if isinstance(expected, str):  # refused, with one line naming the row and the reason
        with pytest.raises(SFTError, match=r"^Dataset chat\.jsonl, row 3\b.*" + expected) as error:
            trained_texts(tok, name, CONVERSATIONS[kind], stops)
        assert "\n" not in str(error.value)
    else:
        assert trained_texts(tok, name, CONVERSATIONS[kind], stops) == expected


def test_tool_results_are_never_trained():
    rendering = [name for name, kinds in EXPECTED.items() if not isinstance(kinds["tool"], str)]
    assert len(rendering) == 17
    for name in rendering:
        tok, stops = family_tokenizer(name)
        assert not any(RESULT["content"] in text for text in trained_texts(tok, name, CONVERSATIONS["tool"], stops))
    # Negative control: the check can see the result once it is trained (the whole text, assistant_only_loss off).
    tok, stops = family_tokenizer("gptoss")
    whole = trained_texts(tok, "gptoss", CONVERSATIONS["tool"], stops, assistant_only_loss=False)
    assert any(RESULT["content"] in text for text in whole)


def test_history_policies_on_a_template_that_drops_earlier_think_blocks():
    tok, stops = family_tokenizer("qwen3")
    row = CONVERSATIONS["multi"]
    examples = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)
    assert [e.split for e in examples] == [False, True]
    # the first answer in the context it has at inference: nothing after it, its think block in place
    assert examples[0].text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\nIt is 4.<|im_end|>\n")
    assert "<|im_start|>assistant\nIt is 4.<|im_end|>" in examples[1].text  # history form in the whole rendering
    assert trained_texts(tok, "qwen3", row, stops, history="last") == [EMPTY_THINK + "It is 6.<|im_end|>"]
    with pytest.raises(SFTError, match=r"row 3, messages\[2\]: .*\(history: error\)\. Set `history: split`"):
        trained_texts(tok, "qwen3", row, stops, history="error")
    # Negative control: a prefix-preserving template keeps the row one example under every policy.
    tok, stops = family_tokenizer("qwen2_5")
    assert len(ChatRenderer(tok, generation_eos=stops, history="error").render_row(row, "chat.jsonl", 3)) == 1


@pytest.mark.parametrize("answer", ["<div>Hi</div>", "<3 you", "<thinking> is a tag"])
def test_an_answer_opening_like_the_prompts_think_token_is_trained_whole(answer):
    """DeepSeek-R1's generation prompt ends "<｜Assistant｜><think>\\n", its rendered answer "<｜Assistant｜>answer":
    they first differ after the characters an answer such as "<div>" shares with <think>. Those are the answer's
    (no text holds part of an added token): the whole answer is trained. It was refused as not rendered."""
    tok, stops = family_tokenizer("deepseekv3")
    row = {"messages": [ASK, {"role": "assistant", "content": answer}]}
    assert trained_texts(tok, "deepseekv3", row, stops) == [answer + "<｜end▁of▁sentence｜>"]


def test_a_tool_result_closed_differently_once_more_follows_keeps_the_answer_after_it():
    """Hermes-3's tool_use template closes the last tool result "</tool_response><|im_end|>" and one that more
    messages follow "</tool_response>\\n<|im_end|>". The answer after the result is what the model writes after the
    prompt it gets at inference (the first form and "<|im_start|>assistant\\n"), not a lone newline: that was taken
    for the answer and the row refused as not rendering its content."""
    tok, stops = family_tokenizer("qwen2_5")
    tok = copy.deepcopy(tok)
    tok.chat_template = (Path(__file__).parent / "templates" / "hermes_3_tool_use.jinja").read_text(encoding="utf-8")
    row = CONVERSATIONS["tool"]
    assert trained_texts(tok, "hermes", row, stops) == ["It is sunny in Paris.<|im_end|>", QWEN_CALL + "<|im_end|>"]
    answer = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)[0]
    assert answer.text.endswith("Sunny, 20 C\n</tool_response><|im_end|><|im_start|>assistant\n"
                                "It is sunny in Paris.<|im_end|>\n")
    assert answer.text.startswith(tok.apply_chat_template(row["messages"][:3], tools=row["tools"], tokenize=False,
                                                          add_generation_prompt=True))


def reasoning_row(**fields) -> dict:
    """The reasoning conversation with its reasoning under other names."""
    first, second = (dict(m) for m in CONVERSATIONS["reasoning"]["messages"][1::2])
    for message in (first, second):
        reasoning = message.pop("reasoning_content")
        message.update({key: reasoning if value is None else value.format(reasoning, message["content"])
                        for key, value in fields.items()})
    return {"messages": [ASK, first, ASK_AGAIN, second]}


@pytest.mark.parametrize("name", ["qwen3", "glm4moe", "gptoss", "lfm2_2_5", "nemotron_3_nano"])
def test_reasoning_under_any_name_trains_the_same(name):
    tok, stops = family_tokenizer(name)
    expected = EXPECTED[name]["reasoning"]
    assert trained_texts(tok, name, reasoning_row(thinking=None), stops) == expected
    assert trained_texts(tok, name, reasoning_row(content="<think>\n{0}\n</think>\n\n{1}"), stops) == expected


def test_think_block_in_content_of_a_template_without_reasoning():
    tok, stops = family_tokenizer("qwen2_5")  # renders content verbatim: the block is trained as written
    row = reasoning_row(content="<think>{0}</think>{1}")
    assert trained_texts(tok, "qwen2_5", row, stops) == reasoned("<think>", "</think>", "<|im_end|>")
    tok, stops = family_tokenizer("deepseekv3")  # cuts everything before </think> from the content: refused
    with pytest.raises(SFTError, match=NO_REASONING):
        trained_texts(tok, "deepseekv3", row, stops)


def labelled(example) -> list[tuple[str, str]]:
    """(kind, text) of each labelled piece of an example's trained turns."""
    return [(kind, example.text[start:end]) for start, end, kind in example.kinds]


def test_pieces_of_a_turn_are_labelled():
    tok, stops = family_tokenizer("gptoss")
    first = ChatRenderer(tok, generation_eos=stops).render_row(CONVERSATIONS["reasoning"], "chat.jsonl", 3)[0]
    assert labelled(first) == [("channel", "<|channel|>analysis<|message|>"), ("reasoning", "Add two and two."),
                               ("channel", "<|end|><|start|>assistant<|channel|>final<|message|>"),
                               ("answer", "It is 4."), ("end", "<|return|>")]
    call = ChatRenderer(tok, generation_eos=stops).render_row(CONVERSATIONS["tool"], "chat.jsonl", 3)[0]
    assert labelled(call)[:2] == [
        ("tool_call", 'to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}'),
        ("end", "<|call|>")]
    tok, stops = family_tokenizer("qwen3")
    call = ChatRenderer(tok, generation_eos=stops).render_row(CONVERSATIONS["tool"], "chat.jsonl", 3)[0]
    assert labelled(call) == [("reasoning", "<think>\n\n</think>"), ("tool_call", QWEN_CALL), ("end", "<|im_end|>")]


def test_show_marks_reasoning_channel_and_tool_call_apart():
    from sft.data.show import show_examples

    tok, stops = family_tokenizer("gptoss")
    examples = ChatRenderer(tok, generation_eos=stops).render_row(CONVERSATIONS["reasoning"], "chat.jsonl", 3)
    encoded = Encoding(tok, max_length=10**6).encode(examples[:1])
    example = {key: encoded[key][0] for key in ("input_ids", "labels", "kinds")}
    shown = show_examples([example], tok, 1, color=False)
    assert ("[[channel: <|channel|>analysis<|message|>]][[reasoning: Add two and two.]]"
            "[[channel: <|end|><|start|>assistant<|channel|>final<|message|>]][[It is 4.<|return|>]]") in shown
    assert "(marked apart: channel, reasoning)" in shown
    plain = show_examples([{"input_ids": example["input_ids"], "labels": example["labels"]}], tok, 1, color=False)
    assert "[[<|channel|>analysis<|message|>Add two and two.<|end|>" in plain  # without kinds: one trained run
    assert encoded["reasoning"] == [len(tok("Add two and two.", add_special_tokens=False)["input_ids"])]


@pytest.mark.parametrize("kind", ["multi", "tool"])
def test_generation_block_mask_agrees_except_the_newline_after_the_stop(kind):
    """LFM2.5 marks {% generation %} through "<|im_end|>\\n"; generation stops at <|im_end|>, so sft does not
    train the newline. Everything else agrees with transformers' return_assistant_tokens_mask."""
    tok, stops = family_tokenizer("lfm2_2_5")
    row = CONVERSATIONS[kind]
    [example] = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)
    out = Encoding(tok, max_length=10**6).encode([example])
    ids, labels = out["input_ids"][0], out["labels"][0]
    theirs = tok.apply_chat_template(row["messages"], tools=row.get("tools"), tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
    assert theirs["input_ids"] == ids
    differ = [i for i, (mask, label) in enumerate(zip(theirs["assistant_masks"], labels)) if mask != (label != -100)]
    assert differ and all(theirs["assistant_masks"][i] and tok.decode(ids[i]) == "\n" and
                          tok.decode(ids[i - 1]) == "<|im_end|>" for i in differ)


def qwen3_recipe(tmp_path, rows: list[dict], **keys) -> str:
    """A recipe for `rows` on a 1-layer Llama with the Qwen3 template, its tokenizer and its stop tokens."""
    import yaml
    from transformers import GenerationConfig, LlamaConfig

    tok, stops = family_tokenizer("qwen3")
    model = tmp_path / "model"
    tok.save_pretrained(model)
    LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=4).save_pretrained(model)
    GenerationConfig(eos_token_id=stops).save_pretrained(model)  # the stop tokens come from here
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in rows), encoding="utf-8")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(model), "dataset": str(data),
                                      "output_dir": str(tmp_path / "run"), "max_length": 512, **keys}),
                      encoding="utf-8")
    return str(recipe)


def sft_data_json(recipe: str, capsys, *flags: str) -> dict:
    import json

    from sft.cli.main import main

    assert main(["data", recipe, "--json", *flags]) in (0, None)
    return json.loads(capsys.readouterr().out)


def test_sft_data_reports_reasoning_tokens_and_split_rows(tmp_path, capsys):
    from sft.cli.main import main

    tok, _ = family_tokenizer("qwen3")
    recipe = qwen3_recipe(tmp_path, [CONVERSATIONS[k] for k in ("reasoning", "multi")])
    stats = sft_data_json(recipe, capsys)
    pieces = ["<think>\nAdd two and two.\n</think>", "<think>\nAdd three and three.\n</think>",
              "<think>\n\n</think>", "<think>\n\n</think>"]
    assert stats["reasoning_tokens"] == sum(len(tok(p, add_special_tokens=False)["input_ids"]) for p in pieces)
    assert (stats["rows"], stats["history"], stats["split_rows"]) == (4, "split", 2)  # each row's first turn split
    assert main(["data", recipe, "--show", "1"]) in (0, None)
    shown = capsys.readouterr().out
    assert "[[reasoning: <think>\nAdd two and two.\n</think>]]" in shown and "history" in shown


def test_sft_data_counts_a_split_example_that_max_length_drops(tmp_path, capsys):
    """history: split makes two examples of the first row; the second, whose long question fills max_length, keeps
    no trained token and is dropped. It is counted as split and dropped: the examples in the data plus the dropped
    ones are the rows in the file plus the split ones."""
    long_question = dict(ASK_AGAIN, content="And " + "3+3 and " * 60 + "3+3?")
    recipe = qwen3_recipe(tmp_path, [{"messages": [ASK, FOUR, long_question, SIX]}, {"messages": [ASK, FOUR]}])
    stats = sft_data_json(recipe, capsys, "--max_length", "60")
    assert (stats["rows"], stats["split_rows"], stats["dropped_rows"], stats["truncated_rows"]) == (2, 1, 1, 0)
    stats = sft_data_json(recipe, capsys)  # control: at 512 tokens the split example is kept
    assert (stats["rows"], stats["split_rows"], stats["dropped_rows"], stats["truncated_rows"]) == (3, 1, 0, 0)


def test_eval_split_holds_out_every_example_of_a_split_row(tmp_path):
    """eval_split_size: 4 holds out 4 conversations; the two examples history: split makes of each stay together."""
    import re
    from collections import Counter

    from sft import build_datasets, load_recipe

    tok, _ = family_tokenizer("qwen3")
    rows = [{"messages": [dict(ASK, content=f"Row {i}: what is 2+2?"), FOUR, ASK_AGAIN, SIX]} for i in range(20)]
    train, evaluation = build_datasets(load_recipe(qwen3_recipe(tmp_path, rows, eval_split_size=4)))

    def row_numbers(dataset) -> Counter:
        return Counter(re.search(r"Row (\d+):", tok.decode(ids))[1] for ids in dataset["input_ids"])

    held, trained = row_numbers(evaluation), row_numbers(train)
    assert len(held) == 4 and set(held.values()) == {2}
    assert len(trained) == 16 and set(trained.values()) == {2} and not held.keys() & trained.keys()


@pytest.mark.parametrize("name", ["gptoss", "qwen3", "glm4moe", "llama3_1", "nemotron_3_nano"])
def test_real_tool_call_data_trains_calls_and_answers_never_results(name):
    """40 real glaive conversations (ShareGPT function_call / observation turns): every call and answer is
    trained exactly once, ends at a stop token, and no tool result is ever trained."""
    import json

    rows = json.loads((FIXTURES / "datasets/chat/llamafactory_glaive_toolcall_en_demo.json").read_text())[:40]
    tok, stops = family_tokenizer(name)
    renderer = ChatRenderer(tok, generation_eos=stops)
    stop_texts = tok.convert_ids_to_tokens(stops)
    for number, row in enumerate(rows, 1):
        turns = [t for t in row["conversations"] if t["from"] in ("gpt", "function_call")]
        results = [t["value"] for t in row["conversations"] if t["from"] == "observation"]
        examples = renderer.render_row(row, "glaive.json", number)
        pieces = [e.text[start:end] for e in examples for start, end in e.spans]
        assert len(pieces) == len(turns)
        for piece in pieces:
            assert piece.endswith(tuple(stop_texts))
            assert not any(result.strip() in piece for result in results)
        for turn in turns:
            marker = json.loads(turn["value"])["name"] if turn["from"] == "function_call" else turn["value"].strip()
            assert sum(marker in piece for piece in pieces) >= 1


def test_stop_tokens_come_from_eos_and_the_generation_config():
    from sft.data.stops import stop_tokens

    tok, stops = family_tokenizer("cohere2")
    assert stop_tokens(tok, None, stops) == stop_tokens(tok) == ["<|END_OF_TURN_TOKEN|>"]  # not <|END_RESPONSE|>
    tok, stops = family_tokenizer("gptoss")
    assert stop_tokens(tok, None, stops) == ["<|return|>", "<|endoftext|>", "<|call|>"]
    # Negative control: without the publisher's list, history turns' <|end|> would be taken for the turn end.
    assert stop_tokens(tok) == ["<|return|>", "<|end|>"]
    tok, stops = family_tokenizer("glm4moe")  # no end-of-turn token: the next role tag the template writes
    assert stop_tokens(tok) == ["<|endoftext|>", "<|user|>"]
    assert stop_tokens(tok, None, stops) == ["<|endoftext|>", "<|user|>", "<|observation|>"]


def tool_row(arguments) -> dict:
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call00001", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}]}
    return {"messages": [{"role": "user", "content": "Weather in München?"}, call, RESULT, SUNNY], "tools": TOOLS}


@pytest.mark.parametrize("name,arguments,rendered", [
    ("deepseekv3", '{"city":"München"}', '{"city":"München"}'),  # the data's own text, not re-serialised
    ("deepseekv3", {"city": "München"}, '{"city": "München"}'),  # as transformers' tojson writes it
    ("qwen2_5", '{"city":"München"}', '{"city": "München"}')])  # a tojson template gets the mapping
def test_tool_call_arguments_are_trained_as_the_template_writes_them(name, arguments, rendered):
    """DeepSeek-V3 concatenates argument strings: a string in the data is trained verbatim (it was parsed and
    re-serialised with json.dumps' ensure_ascii, training `M\\u00fcnchen` and other spacing); tojson templates
    serialise a mapping."""
    tok, stops = family_tokenizer(name)
    assert rendered in trained_texts(tok, name, tool_row(arguments), stops)[0]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_each_template_refuses_its_message_boundaries_inside_a_message(name):
    """The tokens a template writes between messages (found by rendering it), written inside one, are refused by
    name; the same conversation without them renders."""
    tok, stops = family_tokenizer(name)
    delimiters = message_delimiters(tok, tok.chat_template)
    assert delimiters or name in ("idefics3", "llava_next")  # typed content parts only: nothing to compare
    assert not set(delimiters) & {"<think>", "</think>", "<tool_call>", "<|python_tag|>"}
    renderer = ChatRenderer(tok, generation_eos=stops)
    assert renderer.render_row({"messages": [ASK, FOUR]}, "chat.jsonl", 3)
    for token in delimiters:
        row = {"messages": [{"role": "user", "content": f"What does {token} mean?"}, FOUR]}
        with pytest.raises(SFTError, match=re.escape(f"messages[0]: this user message contains {token!r}")):
            renderer.render_row(row, "chat.jsonl", 3)


@pytest.mark.parametrize("name, token", [("qwen2_5", "<tool_call>"), ("llama3_1", "<|python_tag|>")])
def test_tokens_data_writes_inside_a_message_are_kept_and_trained(name, token):
    # Hermes-style tool calls in the content, Llama 3.1 built-in tool calls: tokens, not message boundaries
    tok, stops = family_tokenizer(name)
    row = {"messages": [ASK, {"role": "assistant", "content": f"{token}It is 4."}]}
    assert trained_texts(tok, name, row, stops)[0].startswith(f"{token}It is 4.")


# ---------------------------------------------------------------------------------------------------------------
# chat_template_kwargs: the template's variables (Qwen3's enable_thinking) in every rendering
# ---------------------------------------------------------------------------------------------------------------

NO_THINK = {"enable_thinking": False}
EMPTY_THINK = "<think>\n\n</think>\n\n"


def test_enable_thinking_false_moves_the_empty_think_block_into_the_prompt():
    """Qwen3 without reasoning: by default the empty think block the template writes in the final turn is trained;
    with enable_thinking false the generation prompt holds it, and only the answer and <|im_end|> are trained."""
    tok, stops = family_tokenizer("qwen3")
    row = {"messages": [ASK, FOUR]}
    assert trained_texts(tok, "qwen3", row, stops) == [f"{EMPTY_THINK}It is 4.<|im_end|>"]
    assert trained_texts(tok, "qwen3", row, stops, template_kwargs=NO_THINK) == ["It is 4.<|im_end|>"]


def test_a_rows_chat_template_kwargs_go_over_the_recipes():
    tok, stops = family_tokenizer("qwen3")
    row = {"messages": [ASK, FOUR]}
    thinking = dict(row, chat_template_kwargs={"enable_thinking": True})
    assert trained_texts(tok, "qwen3", thinking, stops, template_kwargs=NO_THINK) == [
        f"{EMPTY_THINK}It is 4.<|im_end|>"]
    assert trained_texts(tok, "qwen3", dict(row, chat_template_kwargs=NO_THINK), stops) == ["It is 4.<|im_end|>"]
    # Arrow's null for a key other rows set leaves the recipe's value
    unset = dict(row, chat_template_kwargs={"enable_thinking": None})
    assert trained_texts(tok, "qwen3", unset, stops, template_kwargs=NO_THINK) == ["It is 4.<|im_end|>"]


@pytest.mark.parametrize("value, said", [("no", "'no' is not a mapping"), ([True], "[True] is not a mapping"),
                                         ({1: True}, "its key 1 is not a string"),
                                         ({"messages": []}, "`messages` is what sft passes the template itself")])
def test_a_bad_chat_template_kwargs_value_in_a_row_is_refused_naming_it(value, said):
    tok, stops = family_tokenizer("qwen3")
    with pytest.raises(SFTError) as err:
        trained_texts(tok, "qwen3", {"messages": [ASK, FOUR], "chat_template_kwargs": value}, stops)
    assert str(err.value).startswith("Dataset chat.jsonl, row 3, chat_template_kwargs: bad value: ")
    assert said in str(err.value)


def decoded_prompts_and_answers(dataset, tok) -> list[tuple[str, str]]:
    """What generation-based eval cuts out of each example: the prompt it generates from and the reference."""
    import torch

    from sft.evaluation.predict import causal_example

    examples = [causal_example(torch.tensor(row["input_ids"]), torch.tensor(row["labels"])) for row in dataset]
    return [(tok.decode(e.prompt), tok.decode(e.reference)) for e in examples]


def test_recipe_and_row_kwargs_reach_built_data_and_eval_prompts(tmp_path):
    """Through load_recipe and build_datasets (the path of `sft train`, `sft data` and eval): the recipe's
    enable_thinking false puts the empty think block at the end of the prompt eval predictions generate from; a
    row's column turns it back on for that row (the other row's column is Arrow's null); the tokenized-data cache
    tells the two recipes apart."""
    from sft import build_datasets, load_recipe

    tok, _ = family_tokenizer("qwen3")
    rows = [{"messages": [ASK, FOUR], "chat_template_kwargs": {"enable_thinking": True}},
            {"messages": [ASK_AGAIN, SIX]}]
    recipe = qwen3_recipe(tmp_path, rows, eval_dataset=str(tmp_path / "chat.jsonl"))
    prompt = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    default = build_datasets(load_recipe(recipe))[1]
    assert decoded_prompts_and_answers(default, tok) == [
        (prompt.format(ASK["content"]), f"{EMPTY_THINK}It is 4.<|im_end|>"),
        (prompt.format(ASK_AGAIN["content"]), f"{EMPTY_THINK}It is 6.<|im_end|>")]
    no_think = build_datasets(load_recipe(recipe, chat_template_kwargs=NO_THINK))[1]
    assert decoded_prompts_and_answers(no_think, tok) == [
        (prompt.format(ASK["content"]), f"{EMPTY_THINK}It is 4.<|im_end|>"),
        (prompt.format(ASK_AGAIN["content"]) + EMPTY_THINK, "It is 6.<|im_end|>")]


@pytest.mark.parametrize("value, said", [
    ("thinking", "Bad value for `chat_template_kwargs` in command line: expected a mapping, got 'thinking'."),
    ("{1: true}", "Bad value for `chat_template_kwargs`: its key 1 is not a string"),
    ("{tools: []}", "Bad value for `chat_template_kwargs`: `tools` is what sft passes the template itself")])
def test_a_bad_recipe_chat_template_kwargs_exits_2_with_one_line(tmp_path, capsys, value, said):
    from sft.cli.main import main

    recipe = qwen3_recipe(tmp_path, [{"messages": [ASK, FOUR]}])
    assert main(["data", recipe, "--chat_template_kwargs", value]) == 2
    err = capsys.readouterr().err
    assert said in err and "Traceback" not in err


def generate_prompts(monkeypatch, folder: Path, *extra: str) -> list[str]:
    """The prompt `sft generate FOLDER` (and `sft chat`, which shares load_for_verb and generate) builds for ASK, on
    a 1-layer model with Qwen3's tokenizer and stop tokens standing in for the folder's."""
    from transformers import LlamaConfig, LlamaForCausalLM

    import sft.models.saved
    from sft.cli.main import main
    from sft.evaluation import generation

    tok, stops = family_tokenizer("qwen3")
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=4, eos_token_id=stops))
    monkeypatch.setattr(sft.models.saved, "load_for_inference", lambda *args, **kwargs: (model, tok))
    prompts = []
    render = generation.render_prompt
    monkeypatch.setattr(generation, "render_prompt", lambda *a: prompts.append(render(*a)[0]) or render(*a))
    assert main(["generate", str(folder), "--prompt", ASK["content"], "--max_new_tokens", "1", *extra]) in (0, None)
    return prompts


ASKED = f"<|im_start|>user\n{ASK['content']}<|im_end|>\n<|im_start|>assistant\n"


def test_sft_generate_prompts_with_the_runs_kwargs_unless_told(tmp_path, monkeypatch, capsys):
    """`sft generate` on a run folder's checkpoint: the prompt ends with the empty think block as the run's
    recipe.yaml (enable_thinking false) trained it; --chat_template_kwargs overrides it, and a bad one exits 2."""
    from sft import load_recipe
    from sft.cli.main import main
    from sft.training.recipe import save_recipe

    config = load_recipe(qwen3_recipe(tmp_path, [{"messages": [ASK, FOUR]}], chat_template_kwargs=NO_THINK))
    run = Path(config.output_dir)
    (run / "checkpoint-5").mkdir(parents=True)
    save_recipe(config, run / "recipe.yaml")
    assert generate_prompts(monkeypatch, run / "checkpoint-5") == [ASKED + EMPTY_THINK]
    assert generate_prompts(monkeypatch, run, "--chat_template_kwargs", "{enable_thinking: true}") == [ASKED]
    capsys.readouterr()
    assert main(["generate", str(run), "--prompt", "2+2?", "--chat_template_kwargs", "[enable_thinking]"]) == 2
    assert "Bad value for --chat_template_kwargs: ['enable_thinking'] is not a mapping" in capsys.readouterr().err


def test_a_merged_model_prompts_with_the_kwargs_its_run_trained_with(tmp_path, monkeypatch, capsys):
    """sft merge keeps the run's data_stats.json, not its recipe.yaml (a merged folder is not a run): the kwargs were
    read from recipe.yaml alone, so `sft generate`/`chat` of a merged enable_thinking-false model prompted without
    the empty think block it trained after. The run's data statistics (`sft data --json`, data_stats.json) record
    them."""
    from sft.cli.main import main

    recipe = qwen3_recipe(tmp_path, [{"messages": [ASK, FOUR]}])
    capsys.readouterr()
    assert main(["data", recipe, "--json", "--chat_template_kwargs", "{enable_thinking: false}"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["chat_template_kwargs"] == NO_THINK and stats["formats"] == "messages"
    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "data_stats.json").write_text(json.dumps(stats))  # as sft merge copies it from the run
    assert generate_prompts(monkeypatch, merged) == [ASKED + EMPTY_THINK]
    (merged / "data_stats.json").write_text(json.dumps(dict(stats, chat_template_kwargs=None)))
    assert generate_prompts(monkeypatch, merged) == [ASKED]


def test_mask_proof_renders_with_the_recipes_kwargs(tmp_path):
    """`sft check --prove` renders its expected masks with the recipe's (and rows') kwargs: a Qwen3 recipe with
    enable_thinking false is proven, its empty think blocks untrained."""
    from sft.check.prove.bench import Bench
    from sft.check.prove.masks import prove_masks

    rows = [{"messages": [ASK, FOUR]}, {"messages": [ASK_AGAIN, SIX], "chat_template_kwargs": {"enable_thinking": True}},
            CONVERSATIONS["multi"]]
    recipe = qwen3_recipe(tmp_path, rows, chat_template_kwargs=NO_THINK)
    proof = prove_masks(Bench.build(recipe, None, tmp_path / "bench"), 8)
    assert proof.passed, proof.evidence
    assert proof.figure.startswith("3 rows, 4 trained answers")
