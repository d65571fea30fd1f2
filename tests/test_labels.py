"""Exact labels for every plain format: trained tokens are the completion (or all text) plus EOS, nothing else."""

import pytest

from sft.data.build import build_datasets
from sft.data.encode import IGNORE_INDEX, Encoding
from sft.data.formats import (
    ALPACA_PROMPT_INPUT,
    ALPACA_PROMPT_NO_INPUT,
    Rendered,
    render_alpaca,
    render_prompt_completion,
    render_text,
)
from sft.data.tokenizer import load_tokenizer
from sft.errors import SFTError
from sft.training.recipe import load_recipe

from conftest import EMBEDDED_MODEL, FIXTURES, write_json


def encode_one(tokenizer, rendered, max_length=512, side="right"):
    out = Encoding(tokenizer, max_length, side).encode([rendered])
    return out["input_ids"][0], out["labels"][0], out["truncated"][0]


def expected(tokenizer, prompt: str, completion: str, train_prompt: bool = False):
    """Labels built by hand: BOS + prompt tokens + completion tokens + EOS, from separately known token ids."""
    ids = tokenizer(prompt + completion)["input_ids"] + [tokenizer.eos_token_id]
    n_prompt = len(tokenizer(prompt)["input_ids"])
    labels = [IGNORE_INDEX] * len(ids)
    start = 1 if train_prompt else n_prompt
    labels[start:] = ids[start:]
    return ids, labels


def test_alpaca_with_input_trains_output_and_eos(tokenizer):
    row = {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5"}
    ids, labels, cut = encode_one(tokenizer, render_alpaca(row, "x.json", 1, completion_only=True))
    prompt = ALPACA_PROMPT_INPUT.format(instruction=row["instruction"], input=row["input"])
    assert tokenizer.decode(ids) == "<s>" + prompt + "5</s>"
    trained = [t for t in labels if t != IGNORE_INDEX]
    assert tokenizer.decode(trained) == "5</s>"
    assert trained[-1] == tokenizer.eos_token_id and not cut
    assert (ids, labels) == expected(tokenizer, prompt, "5")


def test_alpaca_without_input_uses_the_no_input_template(tokenizer):
    row = {"instruction": "Say hello.", "input": "", "output": "Hello, how are you today?"}
    ids, labels, _ = encode_one(tokenizer, render_alpaca(row, "x.json", 1, completion_only=True))
    prompt = ALPACA_PROMPT_NO_INPUT.format(instruction=row["instruction"])
    assert tokenizer.decode(ids) == "<s>" + prompt + row["output"] + "</s>"
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == row["output"] + "</s>"


def test_alpaca_full_loss_trains_everything_but_the_first_token(tokenizer):
    row = {"instruction": "Say hello.", "input": "", "output": "Hello"}
    ids, labels, _ = encode_one(tokenizer, render_alpaca(row, "x.json", 1, completion_only=False))
    assert labels[0] == IGNORE_INDEX and labels[1:] == ids[1:]


def test_prompt_completion_labels_are_exact(tokenizer):
    row = {"prompt": "The capital of France is", "completion": " Paris."}
    ids, labels, _ = encode_one(tokenizer, render_prompt_completion(row, "x.jsonl", 1, completion_only=True))
    assert (ids, labels) == expected(tokenizer, row["prompt"], row["completion"])
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == " Paris.</s>"


def test_text_trains_all_tokens_after_the_first_and_eos(tokenizer):
    row = {"text": "Hello, how are you today?"}
    ids, labels, _ = encode_one(tokenizer, render_text(row, "x.jsonl", 1, completion_only=False))
    assert ids == tokenizer(row["text"])["input_ids"] + [tokenizer.eos_token_id]
    assert labels == [IGNORE_INDEX] + ids[1:]


def test_boundary_token_merging_prompt_and_answer_is_trained(tokenizer):
    # "Paris" right after "is" without a space: any token that reaches into the answer must be trained.
    text = "The capital of France isParis"
    ids, labels, _ = encode_one(tokenizer, Rendered(text, [(len("The capital of France is"), len(text))],
                                                    append_eos=False))
    covered = "".join(tokenizer.decode([t]) for t in labels if t != IGNORE_INDEX)
    assert covered.endswith("Paris") and "capital" not in covered


def test_untrained_spans_and_special_tokens_inside_spans(tokenizer):
    text = "Hello</s> world</s>"  # </s> written in the text is one special token with real offsets
    ids, labels, _ = encode_one(tokenizer, Rendered(text, [(0, len("Hello</s>"))], append_eos=False))
    assert tokenizer.decode([t for t in labels if t != IGNORE_INDEX]) == "Hello</s>"
    assert ids.count(tokenizer.eos_token_id) == 2


@pytest.mark.parametrize("side", ["right", "left"])
def test_truncation_keeps_max_length_and_untrains_the_new_first_token(tokenizer, side):
    row = {"text": "The quick brown fox jumps over the lazy dog. " * 4}
    ids, labels, cut = encode_one(tokenizer, render_text(row, "x", 1, False), max_length=8, side=side)
    full, _, _ = encode_one(tokenizer, render_text(row, "x", 1, False))
    assert cut and len(ids) == 8 and labels[0] == IGNORE_INDEX
    assert ids == (full[:8] if side == "right" else full[-8:])
    assert labels[1:] == ids[1:]



def test_padding_and_truncation_saved_in_tokenizer_json_are_ignored():
    """TinyLlama-Chat's tokenizer.json was saved after a padded call: the backend pads every row to 2048 with </s>
    and truncates at 2048. Encoding calls the backend directly, so rows came back 512 tokens of </s> padding, marked
    truncated, with the appended EOS cut off and never trained."""
    from conftest import make_tokenizer

    saved, plain = make_tokenizer(), make_tokenizer()
    eos = saved.eos_token_id
    saved.backend_tokenizer.enable_padding(length=600, pad_id=eos, pad_token=saved.eos_token)
    saved.backend_tokenizer.enable_truncation(max_length=6)
    row = {"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5"}
    ids, labels, cut = encode_one(saved, render_alpaca(row, "x.json", 1, completion_only=True))
    assert (ids, labels, cut) == encode_one(plain, render_alpaca(row, "x.json", 1, completion_only=True))
    assert not cut and ids.count(eos) == 1 and labels[-1] == eos and 6 < len(ids) < 512

MULTI_TOKEN_ENDINGS = ["I love it 🦜", "答案是龘", "so x ≤ ∮"]  # byte-fallback / byte-level BPE: one character, many tokens


@pytest.mark.parametrize("name", ["mistral-7b-instruct-v0.1", "qwen2.5-coder-3b-instruct", "meta-llama-3-8b-instruct"])
@pytest.mark.parametrize("dataset_format", ["alpaca", "prompt_completion", "text"])
def test_an_answer_ending_in_a_many_token_character_is_trained_to_its_last_byte(tmp_path, name, dataset_format):
    """Real tokenizers split an emoji or a rare CJK character into several tokens; every one of them is trained (the
    run used to stop at the first, so the model never learned to finish the character before EOS)."""
    tokenizer_dir = FIXTURES / "tokenizers" / name
    if not tokenizer_dir.is_dir():
        pytest.skip(f"real tokenizers not found at {FIXTURES / 'tokenizers'} (../shared/fixtures is beside a checkout)")
    answers = {"alpaca": lambda a: {"instruction": "Say it.", "output": a},
               "prompt_completion": lambda a: {"prompt": "Say it: ", "completion": a}, "text": lambda a: {"text": a}}
    rows = [answers[dataset_format](answer) for answer in MULTI_TOKEN_ENDINGS]
    config = load_recipe({"model_name_or_path": str(EMBEDDED_MODEL), "tokenizer_name_or_path": str(tokenizer_dir),
                          "dataset": str(write_json(tmp_path / "data.json", rows)), "max_length": 64})
    tokenizer = load_tokenizer(config)
    train, _ = build_datasets(config, tokenizer)
    for answer, labels in zip(MULTI_TOKEN_ENDINGS, train["labels"]):
        trained = [t for t in labels if t != IGNORE_INDEX]
        assert trained[-1] == tokenizer.eos_token_id
        whole = answer if dataset_format != "text" else answer[-2:]  # text never trains its first token
        assert tokenizer.decode(trained[:-1]).endswith(whole), tokenizer.convert_ids_to_tokens(trained)


CONVERSATION = [{"role": "user", "content": "What is 2+3?"}, {"role": "assistant", "content": "It is 5."}]


@pytest.mark.parametrize("name", ["mistral-7b-instruct-v0.1", "mistral-7b-instruct-v0.3"])
@pytest.mark.parametrize("add_eos_token", [False, True])
def test_text_holding_a_rendered_chat_template_gets_its_bos_and_eos_once(name, add_eos_token):
    """A text (or prompt/completion) row that already holds a chat template's rendering, `<s>[INST] ... </s>`, is
    what apply_chat_template tokenizes to: Mistral's tokenizer adds BOS (and EOS with add_eos_token), and the rows
    began with <s> <s> (and ended </s> </s>, both trained), a sequence the model never sees at inference."""
    from transformers import AutoTokenizer

    folder = FIXTURES / "tokenizers" / name
    if not folder.is_dir():
        pytest.skip(f"real tokenizers not found at {FIXTURES / 'tokenizers'} (../shared/fixtures is beside a checkout)")
    # transformers drops BOS when only add_eos_token is given; both flags are what such a tokenizer_config holds
    tokenizer = AutoTokenizer.from_pretrained(folder, **(dict(add_eos_token=True, add_bos_token=True)
                                                         if add_eos_token else {}))
    whole = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    prompt = tokenizer.apply_chat_template(CONVERSATION[:1], tokenize=False, add_generation_prompt=True)
    reference = list(tokenizer.apply_chat_template(CONVERSATION, tokenize=True)["input_ids"])
    answer = len(list(tokenizer.apply_chat_template(CONVERSATION[:1], add_generation_prompt=True)["input_ids"]))
    doubled = tokenizer(whole)["input_ids"]  # the premise: the tokenizer adds its own
    assert doubled[:2] == [tokenizer.bos_token_id] * 2
    assert (doubled[-2:] == [tokenizer.eos_token_id] * 2) is add_eos_token
    ids, labels, _ = encode_one(tokenizer, render_text({"text": whole}, "x", 1, False))
    assert ids == reference and ids.count(tokenizer.eos_token_id) == 1
    assert labels == [IGNORE_INDEX] + reference[1:]
    row = {"prompt": prompt, "completion": whole[len(prompt):]}
    ids, labels, _ = encode_one(tokenizer, render_prompt_completion(row, "x", 1, True))
    assert ids == reference and labels == [IGNORE_INDEX] * answer + reference[answer:]


@pytest.mark.parametrize("model, dataset_format", [(EMBEDDED_MODEL, "alpaca"), (EMBEDDED_MODEL, "prompt_completion"),
                                                   (EMBEDDED_MODEL.parent / "tiny-t5", "seq2seq")])
def test_an_answer_holding_a_stop_token_is_refused_unless_it_ends_there(tmp_path, model, dataset_format):
    """`</s>` (an HTML strike-through tag) inside an answer is read as EOS: the model learned to stop there and
    generation eval cut the reference there; chat messages were refused for it, plain answers were trained. An
    answer that ends with the EOS it is trained to write is kept, its EOS trained once."""
    names = {"alpaca": ("instruction", "output"), "prompt_completion": ("prompt", "completion"),
             "seq2seq": ("source", "target")}[dataset_format]
    rows = [dict(zip(names, ("Strike out old in HTML.", "Write <s>old</s> new.")))]
    config = load_recipe({"model_name_or_path": str(model), "max_length": 64,
                          "dataset": str(write_json(tmp_path / "bad.json", rows))})
    with pytest.raises(SFTError, match=f"bad.json, row 1: field `{names[1]}` contains '</s>' before its end"):
        build_datasets(config)
    rows = [dict(zip(names, ("Say hi.", "hi</s>")))]
    config = load_recipe({"model_name_or_path": str(model), "max_length": 64,
                          "dataset": str(write_json(tmp_path / "good.json", rows))})
    tokenizer = load_tokenizer(config)
    labels = build_datasets(config, tokenizer)[0]["labels"][0]
    assert [t for t in labels if t != IGNORE_INDEX][-1] == tokenizer.eos_token_id
    assert labels.count(tokenizer.eos_token_id) == 1
