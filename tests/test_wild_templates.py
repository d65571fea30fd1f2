"""Trained text of publisher chat templates beyond the fixtures (tests/templates, sources in SOURCES.md): Seed-OSS,
MiniMax-M2, Kimi-K2 and Kimi-K2-Thinking, IBM Granite 3.3 and 4.0, Mistral Small 3.2, Ministral-3 Reasoning,
DeepSeek-R1-Distill-Qwen.
They guard the general rule of sft/data/chat.py (no per-template code): each trained assistant turn is what the
model generates after the generation prompt, through its stop token; prompts, system text and tool results are
never trained. Expected texts are written per family from the template's meaning, on the conversations and the
byte-level tokenizer of test_template_masks.py, with each family's special tokens and its publisher's stop tokens.
"""

import copy
from functools import cache
from pathlib import Path

import pytest
from test_template_masks import (
    CALL,
    CONVERSATIONS,
    FOUR,
    NO_CALLS,
    NO_REASONING,
    RESULT,
    SUNNY,
    TOOLS,
    WEATHER,
    answers,
    base_tokenizer,
    reasoned,
    trained_texts,
)

from sft.data.chat import ChatRenderer
from sft.data.encode import Encoding
from sft.errors import SFTError

from conftest import FIXTURES

HERE = Path(__file__).parent / "templates"
pytestmark = pytest.mark.skipif(not (FIXTURES / "tokenizers").is_dir(),
                                reason=f"fixture tokenizers not found at {FIXTURES / 'tokenizers'}")

DEEPSEEK = ["<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>",
            "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>"]
GRANITE = ["<|start_of_role|>", "<|end_of_role|>", "<|tool_call|>"]
KIMI = ["<|im_user|>", "<|im_assistant|>", "<|im_system|>", "<|im_middle|>", "<|im_end|>", "<|tool_calls_section_begin|>",
        "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
MISTRAL = ["[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
           "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[ARGS]", "[CALL_ID]"]
# family: (special tokens, bos, eos, stop tokens = the publisher's generation_config.json eos_token_id, by name)
FAMILIES = {
    # ByteDance-Seed Seed-OSS-36B-Instruct: eos_token_id 2 (<seed:eos>)
    "seed_oss": (["<seed:bos>", "<seed:eos>", "<seed:think>", "</seed:think>", "<seed:tool_call>", "</seed:tool_call>",
                  "<seed:cot_budget_reflect>", "</seed:cot_budget_reflect>"], "<seed:bos>", "<seed:eos>",
                 ["<seed:eos>"]),
    # MiniMaxAI MiniMax-M2: eos_token_id 200020 ([e~[)
    "minimax_m2": (["]~!b[", "]~b]", "<think>", "</think>", "<minimax:tool_call>", "</minimax:tool_call>"], "]~!b[",
                   "[e~[", ["[e~["]),
    # moonshotai Kimi-K2-Instruct / Kimi-K2-Thinking: eos_token_id 163586 (<|im_end|>); the tokenizer's eos is [EOS]
    "kimi_k2": (KIMI, "[BOS]", "[EOS]", ["<|im_end|>"]),
    "kimi_k2_thinking": (KIMI + ["<think>", "</think>"], "[BOS]", "[EOS]", ["<|im_end|>"]),
    # ibm-granite granite-3.3-2b-instruct / granite-4.0: eos_token_id 100257 (<|end_of_text|>), also their bos
    "granite_3_3": (GRANITE, "<|end_of_text|>", "<|end_of_text|>", ["<|end_of_text|>"]),
    "granite_4_0": (GRANITE, "<|end_of_text|>", "<|end_of_text|>", ["<|end_of_text|>"]),
    # mistralai Mistral-Small-3.2-24B-Instruct-2506: eos_token_id 2 (</s>)
    "mistral_small_3_2": (MISTRAL, "<s>", "</s>", ["</s>"]),
    # mistralai Ministral-3-14B-Reasoning-2512: eos_token_id 2 (</s>); [THINK] and [/THINK] are tokens 34 and 35
    "ministral_3_reasoning": (MISTRAL + ["[THINK]", "[/THINK]"], "<s>", "</s>", ["</s>"]),
    # deepseek-ai DeepSeek-R1-Distill-Qwen-32B: eos_token_id 151643 (<｜end▁of▁sentence｜>)
    "deepseek_r1_distill_qwen": (DEEPSEEK, "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", ["<｜end▁of▁sentence｜>"]),
}


@cache
def family_tokenizer(name: str):
    specials, bos, eos, stops = FAMILIES[name]
    tok = copy.deepcopy(base_tokenizer())
    tok.add_special_tokens({"extra_special_tokens": list(dict.fromkeys(specials + [eos, bos] + stops))},
                           replace_extra_special_tokens=True)
    tok.eos_token, tok.bos_token = eos, bos
    tok.chat_template = (HERE / f"{name}.jinja").read_text(encoding="utf-8")
    return tok, tok.convert_tokens_to_ids(stops)


def call_texts(call: str, end: str, before: str = "") -> list[str]:
    """The tool conversation's two trained turns: the call through `end`, then the answer after the result."""
    return [before + call + end, f"{before}It is sunny in Paris.{end}"]


SEED_CALL = "<seed:tool_call>\n<function=get_weather>\n<parameter=city>Paris</parameter>\n</function>\n</seed:tool_call>"
MINIMAX_CALL = ('<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
                "</minimax:tool_call>")
GRANITE_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
KIMI_CALL = ("<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
             '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>')
R1_END = "<｜end▁of▁sentence｜>"
R1_NO_STOP = r"messages\[1\]: no stop token \(<｜end▁of▁sentence｜>\) ends this assistant turn"

EXPECTED = {
    # Seed-OSS keeps every turn's reasoning (<seed:think>) in history: one example; "assistant\n" is the prompt's.
    "seed_oss": {"multi": answers("", "<seed:eos>"), "no_system": answers("", "<seed:eos>"),
                 "reasoning": reasoned("<seed:think>", "</seed:think>\n", "<seed:eos>"),
                 "tool": call_texts(SEED_CALL, "<seed:eos>")},
    # MiniMax-M2: the prompt ends "]~b]ai\n<think>\n"; an answer without reasoning renders none, so it starts where
    # the two differ; reasoning continues the prompt's "<think>\n" and is kept after the last user message only
    # (each answer its own example). The call starts "\n<minimax:tool_call>": its "\n" merges with the prompt's
    # into one token, which straddles the start and is trained.
    "minimax_m2": {"multi": answers("", "[e~["), "no_system": answers("", "[e~["),
                   "reasoning": reasoned("", "\n</think>\n\n", "[e~["), "tool": call_texts("\n\n" + MINIMAX_CALL, "[e~[")},
    # Kimi-K2 writes its own call ids (functions.NAME:INDEX).
    "kimi_k2": {"multi": answers("", "<|im_end|>"), "no_system": answers("", "<|im_end|>"), "reasoning": NO_REASONING,
                "tool": call_texts(KIMI_CALL, "<|im_end|>")},
    # Kimi-K2-Thinking: the prompt ends "<|im_middle|>"; the model writes the think block (empty for these turns).
    # A final answer always renders as history (reasoning cut), and a call renders its data id, not the function's
    # name (Kimi ids read functions.NAME:INDEX): both refused (see the tests below).
    "kimi_k2_thinking": {"multi": answers("<think></think>", "<|im_end|>"),
                         "no_system": answers("<think></think>", "<|im_end|>"), "reasoning": NO_REASONING,
                         "tool": NO_CALLS},
    "granite_3_3": {"multi": answers("", "<|end_of_text|>"), "no_system": answers("", "<|end_of_text|>"),
                    "reasoning": NO_REASONING, "tool": NO_CALLS},
    "granite_4_0": {"multi": answers("", "<|end_of_text|>"), "no_system": answers("", "<|end_of_text|>"),
                    "reasoning": NO_REASONING, "tool": call_texts(GRANITE_CALL, "<|end_of_text|>")},
    "mistral_small_3_2": {"multi": answers("", "</s>"), "no_system": answers("", "</s>"), "reasoning": NO_REASONING,
                          "tool": call_texts('[TOOL_CALLS]get_weather[CALL_ID]call00001[ARGS]{"city": "Paris"}', "</s>")},
    # Ministral-3 Reasoning reads reasoning only as a {"type": "thinking"} content part and writes it as
    # [THINK]...[/THINK] before the answer, in every turn (history as generated: one example). The prompt ends
    # "[/INST]"; the model writes the think block, the answer and </s>.
    "ministral_3_reasoning": {"multi": answers("", "</s>"), "no_system": answers("", "</s>"),
                              "reasoning": reasoned("[THINK]", "[/THINK]", "</s>"),
                              "tool": call_texts('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "</s>")},
    # R1-Distill: the prompt ends "<｜Assistant｜><think>\n", a rendered answer "<｜Assistant｜>answer" (reasoning cut
    # from every turn): the turn starts where the two differ. Its calls render only with null content and end with
    # neither <｜tool▁calls▁end｜> nor a stop token (llama.cpp calls this official template broken): refused.
    "deepseek_r1_distill_qwen": {"multi": answers("", R1_END), "no_system": answers("", R1_END),
                                 "reasoning": NO_REASONING, "tool": R1_NO_STOP},
}


def test_every_stored_template_is_covered():
    stored = {p.stem for p in HERE.glob("*.jinja")} - {"hermes_3_tool_use"}  # test_template_masks.py covers it
    assert sorted(EXPECTED) == sorted(FAMILIES) == sorted(stored)


@pytest.mark.parametrize("name", sorted(EXPECTED))
@pytest.mark.parametrize("kind", list(CONVERSATIONS))
def test_trained_text_is_what_the_model_generates(name, kind):
    tok, stops = family_tokenizer(name)
    expected = EXPECTED[name][kind]
    if isinstance(expected, str):
        with pytest.raises(SFTError, match=r"^Dataset chat\.jsonl, row 3\b.*" + expected) as error:
            trained_texts(tok, name, CONVERSATIONS[kind], stops)
        assert "\n" not in str(error.value)
    else:
        assert trained_texts(tok, name, CONVERSATIONS[kind], stops) == expected


def test_split_counts():
    """Which rows became more than one example: the templates that render history differently."""
    counts = {name: [len(ChatRenderer(family_tokenizer(name)[0], generation_eos=family_tokenizer(name)[1])
                         .render_row(CONVERSATIONS[kind], "chat.jsonl", 3))
                     for kind in CONVERSATIONS if not isinstance(EXPECTED[name][kind], str)] for name in EXPECTED}
    assert counts == {"seed_oss": [1, 1, 1, 1], "minimax_m2": [1, 1, 2, 1], "kimi_k2": [1, 1, 1],
                      "kimi_k2_thinking": [1, 1], "granite_3_3": [1, 1], "granite_4_0": [1, 1, 1],
                      "mistral_small_3_2": [1, 1, 1], "ministral_3_reasoning": [1, 1, 1, 1],
                      "deepseek_r1_distill_qwen": [1, 1]}


def kimi_call(reasoning: str = "") -> dict:
    call = copy.deepcopy(CALL)
    call["tool_calls"][0]["id"] = "functions.get_weather:0"
    return dict(call, reasoning_content=reasoning) if reasoning else call


def test_kimi_thinking_trains_a_calls_reasoning_in_the_context_it_has_at_inference():
    """After the last plain answer the template keeps a call's reasoning; once an answer follows the call, the
    whole rendering cuts it. The answer's example is the generation prompt (reasoning in place) plus the answer."""
    tok, stops = family_tokenizer("kimi_k2_thinking")
    result = dict(RESULT, tool_call_id="functions.get_weather:0")
    row = {"messages": [CONVERSATIONS["multi"]["messages"][1], {"role": "assistant", "content": "It is 4."}, WEATHER,
                        kimi_call("Need the weather."), result, SUNNY], "tools": TOOLS}
    assert trained_texts(tok, "kimi_k2_thinking", row, stops) == [
        "<think>Need the weather.</think>" + KIMI_CALL + "<|im_end|>", "<think></think>It is sunny in Paris.<|im_end|>",
        "<think></think>It is 4.<|im_end|>"]
    examples = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)
    assert "<think>Need the weather.</think>" in examples[1].text  # the answer's context keeps the call's reasoning
    assert not any(RESULT["content"] in text for text in trained_texts(tok, "kimi_k2_thinking", row, stops))


def test_minimax_keeps_reasoning_between_calls_after_the_last_user_message():
    tok, stops = family_tokenizer("minimax_m2")
    row = {"messages": [WEATHER, dict(CALL, reasoning_content="Need the weather."), RESULT,
                        dict(SUNNY, reasoning_content="It says sunny.")], "tools": TOOLS}
    assert len(ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)) == 1
    assert trained_texts(tok, "minimax_m2", row, stops) == [
        "Need the weather.\n</think>\n\n\n" + MINIMAX_CALL + "[e~[", "It says sunny.\n</think>\n\nIt is sunny in Paris.[e~["]


def test_a_think_block_in_content_becomes_seed_oss_reasoning():
    """A leading <think> block in the content is passed as reasoning_content: Seed-OSS writes its own think tokens."""
    tok, stops = family_tokenizer("seed_oss")
    row = {"messages": [WEATHER, {"role": "assistant", "content": "<think>\nLook it up.\n</think>\n\nSunny."}]}
    assert trained_texts(tok, "seed_oss", row, stops) == ["<seed:think>Look it up.</seed:think>\nSunny.<seed:eos>"]
    example = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)[0]
    assert [(kind, example.text[start:end]) for start, end, kind in example.kinds] == [
        ("reasoning", "<seed:think>Look it up.</seed:think>"), ("answer", "Sunny."), ("end", "<seed:eos>")]


@pytest.mark.parametrize("content", ["", None])
def test_a_template_that_renders_calls_only_for_null_content_gets_null_content(content):
    """DeepSeek-R1-Distill renders a call-only message's tool calls when its content is null (OpenAI's form) and
    drops them for "". Rows reached it with content "" (null normalised to text), so every call was refused as not
    rendered, though apply_chat_template renders the same data; the call now reaches the template and the refusal
    names what is really missing: the template ends the call turn with no stop token."""
    tok, stops = family_tokenizer("deepseek_r1_distill_qwen")
    renderer = ChatRenderer(tok, generation_eos=stops)
    assert renderer._inputs.null_call_content and renderer._inputs.string_arguments
    row = {"messages": [WEATHER, dict(CALL, content=content), RESULT, SUNNY], "tools": TOOLS}
    with pytest.raises(SFTError, match=R1_NO_STOP):
        renderer.render_row(row, "chat.jsonl", 3)
    # Negative control: a template that renders calls for "" keeps the usual form.
    assert not any(ChatRenderer(family_tokenizer(name)[0])._inputs.null_call_content
                   for name in FAMILIES if name != "deepseek_r1_distill_qwen")


def test_a_call_the_template_renders_without_its_name_is_refused_showing_what_it_renders():
    """Kimi-K2-Thinking writes a call's id where Kimi's ids name the function (functions.NAME:INDEX); with an OpenAI
    id the function's name is nowhere in the turn. The refusal used to say only "does not render tool_calls"; it
    now shows the turn as rendered, so the id in the name's place is visible."""
    tok, stops = family_tokenizer("kimi_k2_thinking")
    with pytest.raises(SFTError) as error:
        trained_texts(tok, "kimi_k2_thinking", CONVERSATIONS["tool"], stops)
    assert ("tool_calls in the turn the model generates (it renders '<think></think><|tool_calls_section_begin|>"
            '<|tool_call_begin|>call00001<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
            "<|tool_calls_section_end|>'), so it cannot be trained") in str(error.value)
    assert "\n" not in str(error.value)
    row = {"messages": [WEATHER, kimi_call(), dict(RESULT, tool_call_id="functions.get_weather:0"), SUNNY],
           "tools": TOOLS}
    assert trained_texts(tok, "kimi_k2_thinking", row, stops) == call_texts(KIMI_CALL, "<|im_end|>", "<think></think>")


MINISTRAL_CALL = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}'


def test_ministral_trains_reasoning_of_calls_and_think_blocks_as_thinking_parts():
    """Reasoning under any name, or a leading <think> block in the content, reaches Ministral-3 Reasoning as a
    {"type": "thinking"} part before the answer's text part (a call's reasoning alone): all were refused as "does
    not render this assistant message's reasoning", the template ignoring reasoning_content."""
    tok, stops = family_tokenizer("ministral_3_reasoning")
    row = {"messages": [WEATHER, dict(CALL, thinking="Need the weather."), RESULT,
                        dict(SUNNY, content="<think>\nIt says sunny.\n</think>\n\nIt is sunny in Paris.")],
           "tools": TOOLS}
    assert trained_texts(tok, "ministral_3_reasoning", row, stops) == [
        "[THINK]Need the weather.[/THINK]" + MINISTRAL_CALL + "</s>",
        "[THINK]It says sunny.[/THINK]It is sunny in Paris.</s>"]
    mixed = {"messages": [CONVERSATIONS["reasoning"]["messages"][0], dict(FOUR, reasoning="Add two and two."),
                          *CONVERSATIONS["no_system"]["messages"][2:]]}
    assert trained_texts(tok, "ministral_3_reasoning", mixed, stops) == [
        "[THINK]Add two and two.[/THINK]It is 4.</s>", "It is 6.</s>"]


@pytest.mark.parametrize("history", ["split", "last", "error"])
def test_ministral_keeps_earlier_reasoning_so_every_history_policy_trains_both_turns_in_one_example(history):
    tok, stops = family_tokenizer("ministral_3_reasoning")
    examples = ChatRenderer(tok, generation_eos=stops, history=history).render_row(
        CONVERSATIONS["reasoning"], "chat.jsonl", 3)
    assert len(examples) == 1
    assert examples[0].text.endswith("[INST]What is 2+2?[/INST][THINK]Add two and two.[/THINK]It is 4.</s>"
                                     "[INST]And 3+3?[/INST][THINK]Add three and three.[/THINK]It is 6.</s>")
    assert trained_texts(tok, "ministral_3_reasoning", CONVERSATIONS["reasoning"], stops, history=history) == \
        reasoned("[THINK]", "[/THINK]", "</s>")


def test_show_marks_ministral_reasoning_apart():
    from sft.data.show import show_examples

    tok, stops = family_tokenizer("ministral_3_reasoning")
    examples = ChatRenderer(tok, generation_eos=stops).render_row(CONVERSATIONS["reasoning"], "chat.jsonl", 3)
    encoded = Encoding(tok, max_length=10**6).encode(examples)
    example = {key: encoded[key][0] for key in ("input_ids", "labels", "kinds")}
    shown = show_examples([example], tok, 1, color=False)
    # its [THINK] tags count with the reasoning, as Qwen3's <think> ones do (they were shown as channel markup)
    assert "[/INST][[reasoning: [THINK]Add two and two.[/THINK]]][[It is 4.</s>]]" in shown
    assert encoded["reasoning"] == [sum(len(tok(text, add_special_tokens=False)["input_ids"])
                                        for text in ("[THINK]Add two and two.[/THINK]",
                                                     "[THINK]Add three and three.[/THINK]"))]


def test_only_a_template_reading_thinking_parts_gets_them():
    """The probe: Ministral-3 Reasoning renders a thinking part and ignores the fields; every other stored template
    either reads the fields or renders no reasoning (Mistral Small 3.2 prints typed parts' text only)."""
    probed = {name: ChatRenderer(family_tokenizer(name)[0])._inputs.thinking_parts for name in FAMILIES}
    assert probed == {name: name == "ministral_3_reasoning" for name in FAMILIES}


@pytest.mark.parametrize("printed", ["{{ m.content }}", "{{ m.content | tojson }}"])
def test_a_template_printing_the_content_list_does_not_read_thinking_parts(printed):
    """Such a template shows the part's reasoning too, key names and all (not a form a model is trained on): the
    probe's marker comes out escaped there, so the renderer keeps passing reasoning as fields."""
    tok = copy.deepcopy(family_tokenizer("mistral_small_3_2")[0])
    tok.chat_template = "{% for m in messages %}" + printed + "</s>{% endfor %}"
    assert not ChatRenderer(tok)._inputs.thinking_parts
