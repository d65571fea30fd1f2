"""sft generate, sft chat and sft merge on encoder-decoder runs: the embedded tiny T5 trained in full and with LoRA."""

import io
import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForSeq2SeqLM, AutoTokenizer

from sft import load_recipe, train
from sft.cli import chat
from sft.cli.main import main
from sft.data.formats import ALPACA_PROMPT_NO_INPUT
from sft.evaluation.generation import GenerationOptions, render_prompt
from sft.models.saved import load_for_inference

from conftest import REPO

EMBEDDED_T5 = REPO / "data" / "models" / "tiny-t5"
PROMPT = "translate to pig latin: the gentle lion chases a stone"
IDS = torch.tensor([[5, 40, 41, 42, 43, 2]])
DECODER_IDS = torch.tensor([[3, 50, 51, 52]])  # the decoder start id (pad), then any tokens


@pytest.fixture(scope="module")
def t5_runs(tmp_path_factory) -> dict:
    """recipes/quickstart-seq2seq.yaml for a few steps on the embedded tiny T5: full and LoRA output folders."""
    work = tmp_path_factory.mktemp("quickstart-seq2seq")
    runs = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(REPO)  # the recipe names the model and data relative to the repository
        for name, extra in (("full", {}), ("lora", {"use_peft": True})):
            runs[name] = train(load_recipe("recipes/quickstart-seq2seq.yaml", max_steps=4, output_dir=str(work / name),
                                           eval_split_size=0.0, eval_strategy="no", predict_with_generate=False,
                                           disable_tqdm=True, **extra))
    return runs


def reference_model(run):
    """The run loaded with transformers and peft alone, independently of sft's loading."""
    config_path = run / "adapter_config.json"
    if not config_path.exists():
        return AutoModelForSeq2SeqLM.from_pretrained(run)
    base = AutoModelForSeq2SeqLM.from_pretrained(json.loads(config_path.read_text())["base_model_name_or_path"])
    return PeftModel.from_pretrained(base, str(run))


def reference_reply(run, source: str) -> str:
    """What the decoder writes, greedily, for `source` as the encoder's input with the tokenizer's special tokens (as
    training encoded sources)."""
    tokenizer = AutoTokenizer.from_pretrained(run)
    with torch.no_grad():
        output = reference_model(run).eval().generate(**tokenizer(source, return_tensors="pt"), max_new_tokens=8,
                                                      do_sample=False)
    return tokenizer.decode(output[0], skip_special_tokens=True)


@pytest.mark.parametrize("kind", ["full", "lora"])
def test_generate_on_a_t5_run_prints_the_decoders_reply(t5_runs, kind, capsys):
    assert main(["generate", str(t5_runs[kind]), "--prompt", PROMPT, "--max_new_tokens", "8"]) == 0
    expected = reference_reply(t5_runs[kind], PROMPT)  # the decoder's tokens, not the prompt and a continuation
    assert capsys.readouterr().out == expected + "\n" and expected.strip()


def test_generate_feeds_an_encoder_decoder_the_prompt_as_is_or_in_the_template_asked_for(capsys):
    # The untrained embedded T5 answers the two sources differently (the few-step runs above answer all alike).
    replies = {}
    for template in ("auto", "alpaca"):
        args = ["generate", str(EMBEDDED_T5), "--prompt", PROMPT, "--max_new_tokens", "8", "--template", template]
        assert main(args) == 0
        replies[template] = capsys.readouterr().out
    assert replies["auto"] == reference_reply(EMBEDDED_T5, PROMPT) + "\n"
    assert replies["alpaca"] == reference_reply(EMBEDDED_T5, ALPACA_PROMPT_NO_INPUT.format(instruction=PROMPT)) + "\n"
    assert replies["auto"] != replies["alpaca"]


def test_chat_answers_each_message_of_an_encoder_decoder_on_its_own(capsys):
    # seq2seq rows train one source to one target: the second reply is to the second message alone.
    model, tokenizer = load_for_inference(EMBEDDED_T5, device="cpu")
    messages = ["summarize: Olga: I cannot find my bag.", PROMPT]
    chat.chat(model, tokenizer, GenerationOptions(max_new_tokens=8), stdin=io.StringIO("\n".join(messages) + "\n"))
    assert capsys.readouterr().out == "".join(f"assistant> {reference_reply(EMBEDDED_T5, m)}\n" for m in messages)


def test_an_encoder_decoders_source_is_the_last_user_message(t5_runs):
    tokenizer = AutoTokenizer.from_pretrained(t5_runs["full"])
    turns = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "a"},
             {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}]
    assert render_prompt(tokenizer, turns, encoder_decoder=True) == ("c", True)
    alpaca = render_prompt(tokenizer, turns, template="alpaca", encoder_decoder=True)
    assert alpaca == (ALPACA_PROMPT_NO_INPUT.format(instruction="c"), True)


def test_merged_t5_adapter_computes_what_the_adapter_does(t5_runs, tmp_path):
    merged_dir = tmp_path / "merged"
    assert main(["merge", str(t5_runs["lora"]), str(merged_dir)]) == 0
    adapter, _ = load_for_inference(t5_runs["lora"], device="cpu")
    merged = AutoModelForSeq2SeqLM.from_pretrained(merged_dir)
    assert type(merged).__name__ == "T5ForConditionalGeneration" and merged.config.use_cache

    def logits(model):
        with torch.no_grad():
            return model(input_ids=IDS, decoder_input_ids=DECODER_IDS).logits

    assert (logits(adapter) - logits(merged)).abs().max() < 1e-4
    with adapter.disable_adapter():
        assert (logits(adapter) - logits(merged)).abs().max() > 1e-3  # and training did change the model
