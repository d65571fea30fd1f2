"""sft generate / sft chat: prompts (chat template or Alpaca), a trained quickstart adapter, chat over a pipe."""

import io
import json
import os
import subprocess
import sys

import pytest
import torch
from test_template_masks import FAMILIES, family_tokenizer
from test_wild_templates import FAMILIES as WILD
from test_wild_templates import family_tokenizer as wild_tokenizer
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from sft import SFTError, load_recipe, train
from sft.cli import chat
from sft.cli.main import main
from sft.data.formats import ALPACA_PROMPT_NO_INPUT
from sft.data.stops import stop_token_ids
from sft.evaluation import generation
from sft.evaluation.generation import GenerationOptions, render_prompt
from sft.models.saved import load_for_inference

from conftest import EMBEDDED_MODEL, FIXTURES, REPO, make_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def quickstart_adapter(tmp_path_factory):
    """recipes/quickstart-qlora.yaml for 3 steps: the embedded tiny Llama, or a hidden-64 one until it is built."""
    work = tmp_path_factory.mktemp("quickstart-qlora")
    overrides = dict(max_steps=3, output_dir=str(work / "out"), eval_split_size=0.0, eval_strategy="no",
                     save_strategy="no", disable_tqdm=True)
    if not (EMBEDDED_MODEL / "config.json").exists():
        tokenizer = make_tokenizer()
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                     num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                     tie_word_embeddings=False)).save_pretrained(work / "base")
        tokenizer.save_pretrained(work / "base")
        overrides["model_name_or_path"] = str(work / "base")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)
        return train(load_recipe("recipes/quickstart-qlora.yaml", **overrides))


def test_generate_prints_a_completion_of_a_trained_adapter(quickstart_adapter, capsys):
    args = ["generate", str(quickstart_adapter), "--prompt", "What is 18 plus 7?", "--max_new_tokens", "8",
            "--template", "alpaca"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    model, tokenizer = load_for_inference(quickstart_adapter, device="cpu")
    expected = generation.generate(model, tokenizer, "What is 18 plus 7?", GenerationOptions(max_new_tokens=8,
                                                                                              template="alpaca"))
    assert printed == expected + "\n" and expected.strip()


def test_generate_prompts_a_run_as_it_was_trained(quickstart_adapter, monkeypatch):
    """The quickstart trains Alpaca rows on a tokenizer that has a chat template: `sft generate RUN` (the README's
    command) must prompt with the Alpaca prompt the run learnt, not the chat template it never saw."""
    assert json.loads((quickstart_adapter / "data_stats.json").read_text())["formats"] == "alpaca"
    assert load_for_inference(quickstart_adapter, device="cpu")[1].chat_template  # what `auto` used to pick
    templates = []
    monkeypatch.setattr(generation, "generate", lambda model, tokenizer, messages, options, *rest: (
        templates.append(options.template) or "reply"))
    assert main(["generate", str(quickstart_adapter), "--prompt", "What is 18 plus 7?"]) == 0
    assert main(["generate", str(quickstart_adapter), "--prompt", "Hi", "--template", "chat"]) == 0  # as asked
    assert templates == ["alpaca", "chat"]


def test_a_merged_run_is_prompted_as_it_was_trained(quickstart_adapter, tmp_path, monkeypatch):
    """`sft merge` left the run's data_stats.json behind: `sft generate MERGED` of the quickstart (Alpaca rows, a
    tokenizer with a chat template) prompted with the chat template, which the model never saw."""
    merged = tmp_path / "merged"
    assert main(["merge", str(quickstart_adapter), str(merged)]) == 0
    assert (merged / "data_stats.json").read_bytes() == (quickstart_adapter / "data_stats.json").read_bytes()
    templates = []
    monkeypatch.setattr(generation, "generate", lambda model, tokenizer, messages, options, *rest: (
        templates.append(options.template) or "reply"))
    assert main(["generate", str(merged), "--prompt", "What is 18 plus 7?"]) == 0
    assert templates == ["alpaca"]


@pytest.mark.parametrize("formats, template", [
    ("alpaca", "alpaca"), ("messages", "chat"), ("messages, sharegpt", "chat"),
    ("alpaca, messages", None), ("prompt_completion", None), (None, None)])
def test_the_trained_template_comes_from_the_run_s_data_stats(tmp_path, formats, template):
    (tmp_path / "checkpoint-5").mkdir()
    if formats is not None:
        (tmp_path / "data_stats.json").write_text(json.dumps({"rows": 3, "formats": formats}))
    assert generation.trained_template(tmp_path) == template
    assert generation.trained_template(tmp_path / "checkpoint-5") == template  # a checkpoint of the run


def test_chat_reads_a_pipe_streams_replies_and_handles_commands(quickstart_adapter):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, "-m", "sft", "chat", str(quickstart_adapter), "--max_new_tokens", "6"],
                            input="hello\n/reset\nhi\n/exit\nnever read\n", capture_output=True, text=True,
                            env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.count("assistant> ") == 2 and "(conversation reset)" in result.stdout
    assert "Traceback" not in result.stderr


def test_chat_reset_starts_a_new_conversation(monkeypatch, capsys):
    seen = []

    def fake_generate(model, tokenizer, messages, options, streamer=None):
        seen.append([m["content"] for m in messages])
        return f"reply {len(seen)}"

    monkeypatch.setattr(chat, "generate", fake_generate)
    stdin = io.StringIO("hello\n\nagain\n/reset\nhi\n/exit\nignored\n")
    chat.chat(None, make_tokenizer(), GenerationOptions(), system="be brief", stdin=stdin)
    assert seen == [["be brief", "hello"], ["be brief", "hello", "reply 1", "again"], ["be brief", "hi"]]


def test_prompts_use_the_chat_template_or_else_alpaca(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)  # no chat template
    text, add_special = render_prompt(tokenizer, [{"role": "user", "content": "Name a color."}])
    assert text == ALPACA_PROMPT_NO_INPUT.format(instruction="Name a color.") and add_special
    turns = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_prompt(tokenizer, turns)[0].endswith("### Response:b\n\n### Instruction:\nc\n\n### Response:")
    with pytest.raises(SFTError, match="no chat template"):
        render_prompt(tokenizer, turns, template="chat")
    tokenizer.chat_template = CHATML
    text, add_special = render_prompt(tokenizer, [{"role": "user", "content": "hi"}])
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n" and not add_special
    assert render_prompt(tokenizer, turns, template="alpaca")[0].startswith(ALPACA_PROMPT_NO_INPUT[:40])


def test_generation_stops_at_the_templates_end_of_turn(tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = CHATML
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir)
    ids = stop_token_ids(tokenizer, model.generation_config.eos_token_id)
    assert ids == {tokenizer.eos_token_id, tokenizer.convert_tokens_to_ids("<|im_end|>")}


def test_generate_on_a_model_folder_samples_reproducibly(tiny_model_dir, capsys):
    args = ["generate", str(tiny_model_dir), "--prompt", "hi", "--max_new_tokens", "6", "--do_sample", "--seed", "3",
            "--temperature", "1.5"]
    assert main(args) == 0
    first = capsys.readouterr().out
    assert main(args) == 0
    assert capsys.readouterr().out == first


def test_generate_errors_exit_2_with_a_message(tmp_path, capsys):
    assert main(["generate", str(tmp_path), "--prompt", "hi", "--seed", "-1"]) == 2  # a traceback after loading
    assert "sft: error: --seed must be between 0 and 4294967295, got -1." in capsys.readouterr().err
    assert main(["generate", str(tmp_path / "missing"), "--prompt", "hi"]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["chat", str(tmp_path)]) == 2
    assert "neither a model (config.json) nor a LoRA adapter" in capsys.readouterr().err



def test_an_interrupted_run_is_named_with_its_last_checkpoint(tmp_path, monkeypatch, capsys):
    """A run stopped before its final save holds only checkpoint-N folders: every verb that loads a model names the
    last one and how to finish the run, instead of "neither a model nor an adapter" (generate, chat, merge) or
    transformers' "Unrecognized model ... Should have a `model_type` key" (train, eval, data)."""
    monkeypatch.chdir(REPO)
    run = tmp_path / "run"
    for step in (2, 10):
        (run / f"checkpoint-{step}").mkdir(parents=True)
    expected = f"{run} holds no final model, only checkpoints: its run stopped before the end. Give its last " \
               f"checkpoint, {run / 'checkpoint-10'}, or finish the run"
    recipe = ["recipes/quickstart.yaml", "--model_name_or_path", str(run), "--output_dir", str(tmp_path / "out")]
    for argv in (["generate", str(run), "--prompt", "hi"], ["merge", str(run), str(tmp_path / "merged")],
                 ["train", *recipe], ["eval", *recipe]):
        assert main(argv) == 2, argv
        assert expected in capsys.readouterr().err, argv
    assert main(["train", *recipe[:2], str(tmp_path), "--output_dir", str(tmp_path / "out")]) == 2
    assert f"`model_name_or_path`: {tmp_path} holds neither a model (config.json) nor a LoRA adapter " \
           "(adapter_config.json); it holds run. Give a folder that save_pretrained wrote" in capsys.readouterr().err
    assert main(["data", "recipes/quickstart.yaml", "--tokenizer_name_or_path", str(run)]) == 2
    assert f"`tokenizer_name_or_path`: {run} holds no tokenizer files" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and not (tmp_path / "merged").exists()

QWEN = FIXTURES / "tokenizers" / "qwen2.5-coder-3b-instruct"
REASONING = {"qwen3": ("<think>\nThe user wants 2+2.\n</think>\n\nIt is 4.", "assistant\nIt is 4.<|im_end|>"),
             # R1's generation prompt opens the think block, so the reply starts inside it
             "deepseekv3": ("The user wants 2+2.\n</think>\n\nIt is 4.", "<｜Assistant｜>\n\nIt is 4.<｜end▁of▁sentence｜>")}


def chat_twice(tokenizer, reply: str, stop: int, monkeypatch) -> list[str]:
    """The prompts of a two-turn `sft chat` whose model "writes" `reply` and `stop` token by token each turn."""
    ids = torch.tensor([tokenizer(reply, add_special_tokens=False)["input_ids"] + [stop]])
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1))
    prompts = []

    def replay(input_ids, streamer, **_):
        prompts.append(tokenizer.decode(input_ids[0]))
        streamer.put(input_ids)
        for token in ids[0]:
            streamer.put(token[None])
        streamer.end()
        return torch.cat([input_ids, ids], dim=1)

    monkeypatch.setattr(model, "generate", replay)
    chat.chat(model, tokenizer, GenerationOptions(), stdin=io.StringIO("2+2?\nand 3+3?\n"))
    return prompts


@pytest.mark.skipif(not QWEN.is_dir(), reason=f"real tokenizers not found at {QWEN} (set SFT_FIXTURES)")
@pytest.mark.parametrize("template", REASONING)
@pytest.mark.parametrize("special", [False, True])  # Qwen3 and R1 register the tags as plain added tokens
def test_chat_keeps_the_think_tags_its_template_cuts_earlier_reasoning_at(template, special, monkeypatch, capsys):
    """A tokenizer with <think> and </think> registered as special lost them to skip_special_tokens: `sft chat`
    printed the reasoning run into the answer and kept it so in the history, and Qwen3's and DeepSeek-R1's templates
    (which cut an earlier turn's reasoning at </think>) prompted the next turn with the reasoning as the answer."""
    from tokenizers import AddedToken

    tokenizer = AutoTokenizer.from_pretrained(QWEN)
    tokenizer.add_tokens([AddedToken(tag, special=special, normalized=False) for tag in ("<think>", "</think>")],
                         special_tokens=special)
    tokenizer.chat_template = (FIXTURES / "templates" / f"{template}.jinja").read_text()
    reply, earlier_turn = REASONING[template]
    prompts = chat_twice(tokenizer, reply, tokenizer.eos_token_id, monkeypatch)
    assert earlier_turn in prompts[1] and "wants" not in prompts[1]
    assert capsys.readouterr().out == f"assistant> {reply}\n" * 2


REPLY_FAMILIES = [*((family_tokenizer, name) for name in sorted(FAMILIES)),
                  *((wild_tokenizer, name) for name in sorted(WILD))]
THINKING_PARTS = {"ministral_3_reasoning"}  # reads reasoning only as a {"type": "thinking"} content part
TEXT_PARTS = {"idefics3", "llava_next"}  # reads content only as typed parts: a string renders nothing or fails


@pytest.mark.skipif(not (FIXTURES / "templates").is_dir(), reason="fixture chat templates not found (set SFT_FIXTURES)")
@pytest.mark.parametrize("family, name", REPLY_FAMILIES, ids=[name for _, name in REPLY_FAMILIES])
def test_chat_prompts_the_next_turn_as_the_template_renders_the_reply(family, name, monkeypatch, capsys):
    """`sft chat` keeps each reply for the next turn's prompt, which must be what the model's template renders for
    that conversation: with a reasoning template, the reply's reasoning and answer in the fields (or the thinking
    part) it reads. GPT-OSS's reply lost its markup (special tokens) to decoding, printed as 'analysisThe user wants
    2+2.assistantfinalIt is 4.', and went whole into the final channel of the next prompt; Nemotron 3's kept its
    reasoning as the earlier answer, Magistral's ran it into the answer; Idefics3 was prompted with empty messages
    (it reads typed parts), LLaVA-Next failed. The messages are now prepared as training prepares a row's."""
    tokenizer, stops = family(name)
    form = generation.reasoning_form(tokenizer)
    reasoning, answer = "The user wants 2+2.", "It is 4."
    reply = f"{form[0]}{reasoning}{form[1]}{answer}" if form else answer
    prompts = chat_twice(tokenizer, reply, stops[0], monkeypatch)
    turn = {"role": "assistant", "content": answer}
    if form and name in THINKING_PARTS:
        turn["content"] = [{"type": "thinking", "thinking": reasoning}, {"type": "text", "text": answer}]
    elif form:
        turn.update(reasoning_content=reasoning, thinking=reasoning)
    conversation = [{"role": "user", "content": "2+2?"}, turn, {"role": "user", "content": "and 3+3?"}]
    if name in TEXT_PARTS:
        conversation = [{**m, "content": [{"type": "text", "text": m["content"]}]} for m in conversation]
    assert prompts[1] == tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
    assert capsys.readouterr().out == f"assistant> {reply}\n" * 2


@pytest.mark.skipif(not (FIXTURES / "tokenizers").is_dir(), reason="fixture tokenizers not found (set SFT_FIXTURES)")
def test_chat_moves_a_replys_think_block_where_the_template_reads_reasoning(monkeypatch):
    """Kimi-K2-Thinking renders reasoning only in a tool call's turn (so a reply has no reasoning form) and writes an
    earlier answer as <think></think>answer: a reply '<think>...</think>answer' kept as the content went into the
    next prompt as <think></think><think>...</think>answer. The reply's think block now moves into reasoning_content,
    as training prepares a row's."""
    tokenizer, stops = wild_tokenizer("kimi_k2_thinking")
    prompts = chat_twice(tokenizer, "<think>The user wants 2+2.</think>It is 4.", stops[0], monkeypatch)
    assert "<|im_middle|><think></think>It is 4.<|im_end|>" in prompts[1] and "wants" not in prompts[1]
