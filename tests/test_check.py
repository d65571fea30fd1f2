"""`sft check`: every shipped recipe dry-runs on a tiny model of its architecture; broken recipes fail fast."""

import pytest

from sft.cli.main import main
from sft.models.families import guess_model_type
from sft.training.catalog import list_recipes

from conftest import FIXTURES, REPO

RECIPES = list_recipes(REPO / "recipes")


@pytest.fixture(autouse=True)
def from_repo_root(monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name data/ paths relative to the repository


def test_quickstart_passes_check(capsys):
    assert main(["check", "recipes/quickstart.yaml"]) == 0
    out = capsys.readouterr().out
    assert "tiny llama" in out and "OK: the recipe is sound." in out


@pytest.mark.parametrize("typo, hint", [("learnig_rate: 1.0e-4", "learning_rate"),
                                        ("max_seq_length: 512", "renamed: use `max_length`")])
def test_a_misspelled_or_renamed_key_fails_check_naming_it(tmp_path, capsys, typo, hint):
    broken = tmp_path / "broken.yaml"
    broken.write_text((REPO / "recipes" / "quickstart.yaml").read_text() + typo + "\n")
    assert main(["check", str(broken)]) == 2
    assert hint in capsys.readouterr().err


@pytest.mark.parametrize("name, model_type", [("meta-llama/Llama-3.1-8B-Instruct", "llama"),
                                              ("mistralai/Mistral-7B-Instruct-v0.3", "mistral"),
                                              ("Qwen/Qwen2.5-7B-Instruct", "qwen2"), ("google/flan-t5-base", "t5")])
def test_architecture_is_guessed_offline_from_the_hub_id(name, model_type):
    assert guess_model_type(name) == model_type


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: r.name)
def test_every_shipped_recipe_passes_check(recipe, capsys):
    assert main(["check", str(recipe.path)]) == 0, capsys.readouterr().err[-3000:]
    assert "OK: the recipe is sound." in capsys.readouterr().out


def test_a_misspelt_metric_for_best_model_fails_check_before_the_smoke_run(capsys):
    flags = ["--predict_with_generate", "true", "--metrics", "exact_match,rouge", "--load_best_model_at_end", "true",
             "--eval_strategy", "steps", "--save_strategy", "steps", "--metric_for_best_model", "rouge"]
    assert main(["check", "recipes/quickstart.yaml", *flags]) == 2
    assert "Did you mean `rougeL`?" in capsys.readouterr().err


@pytest.mark.parametrize("name, code", [("score", 0), ("scores", 2)])
def test_check_runs_a_user_metric_to_check_metric_for_best_model(tmp_path, monkeypatch, capsys, name, code):
    # sft check refuses a key the user function does not report (its trial call, then its smoke evaluation)
    (tmp_path / "usermetrics_best.py").write_text("def score(predictions, references):\n    return {'score': 1.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["--predict_with_generate", "true", "--max_new_tokens", "2", "--metrics", "usermetrics_best:score",
             "--metric_for_best_model", name]
    assert main(["check", "recipes/quickstart.yaml", *flags]) == code
    if code:
        assert "'scores' is not a metric evaluation reports" in (err := capsys.readouterr().err)
        assert "Did you mean `score`?" in err


def test_check_samples_a_local_eval_dataset(tmp_path, capsys):
    """A local eval_dataset is checked on its own rows: `sft check` replaced it with held-out training rows, so an eval
    file that `sft train` refuses (here question/answer columns without a `columns` mapping) passed as sound, and
    one in another format than the training data was never rendered."""
    from sft.check.smoke import tiny_recipe

    rows = "".join(f'{{"question": "What is {n} + {n}?", "answer": "{2 * n}"}}\n' for n in range(80))
    (tmp_path / "qa.jsonl").write_text(rows)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text((REPO / "recipes" / "quickstart.yaml").read_text().replace("eval_split_size: 0.1", "")
                      + f"eval_dataset: {tmp_path / 'qa.jsonl'}\n")
    assert main(["check", str(recipe)]) == 2
    err = capsys.readouterr().err
    assert f"Dataset {tmp_path / 'qa.jsonl'} [train[:64]]: cannot tell its format from columns ['question', " \
           "'answer']" in err

    mapped = f"[{{path: {tmp_path / 'qa.jsonl'}, columns: {{question: prompt, answer: completion}}}}]"
    _, values, report = tiny_recipe(str(recipe), ["--eval_dataset", mapped], tmp_path / "tiny")
    assert values["eval_dataset"] == [{"path": str(tmp_path / "qa.jsonl"), "split": "train[:64]",
                                       "columns": {"question": "prompt", "answer": "completion"}}]
    assert not values.get("eval_split_size") and report.data.endswith(", eval_dataset too")


@pytest.mark.parametrize("key", ["dataset", "eval_dataset"])
def test_a_misspelt_local_data_path_fails_check(tmp_path, capsys, key):
    """A missing file beside its near namesake is a typo `sft train` refuses: `sft check` took it for data out of
    reach (a Hub dataset offline, a file still to download), ran the smoke on the project's sample data and printed
    OK."""
    import shutil

    recipe = tmp_path / "recipe.yaml"
    text = (REPO / "recipes" / "quickstart.yaml").read_text()
    shutil.copy(REPO / "data" / "alpaca_sample.json", tmp_path)
    typo = tmp_path / "alpaca_smaple.json"
    if key == "dataset":
        text = text.replace("dataset: data/alpaca_sample.json", f"dataset: {typo}")
    else:
        text = text.replace("eval_split_size: 0.1", f"eval_dataset: {typo}")
    recipe.write_text(text)
    assert main(["check", str(recipe)]) == 2
    captured = capsys.readouterr()
    assert f"Dataset file {typo} does not exist. Did you mean {tmp_path / 'alpaca_sample.json'}?" in captured.err
    assert "OK" not in captured.out


def test_max_length_beyond_the_models_positions_fails_check(capsys):
    """`sft train` refuses a max_length beyond the model's positions; `sft check` ran its tiny stand-in (1024
    positions, max_length capped at 256) and printed OK for Mistral-7B-Instruct-v0.3 at max_length 65536."""
    flags = ["--model_name_or_path", "mistralai/Mistral-7B-Instruct-v0.3", "--max_length", "65536"]
    assert main(["check", "recipes/quickstart.yaml", *flags]) == 2
    captured = capsys.readouterr()
    assert "max_length=65536 is beyond the 32768 positions the model mistralai/Mistral-7B-Instruct-v0.3 has" in (
        captured.err) and "OK" not in captured.out


TOKENIZERS = FIXTURES / "tokenizers"


@pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizers not found at {TOKENIZERS} (set SFT_FIXTURES)")
@pytest.mark.parametrize("tokenizer, model, problem", [
    ("meta-llama-3-8b-instruct", "mistralai/Mistral-7B-Instruct-v0.3",
     "it has 128256 tokens, the model's embeddings 32768 rows, so 95488 new untrained rows are added"),
    ("tinyllama-1.1b-chat-v1.0", "meta-llama/Llama-3.2-1B",
     "it has 32000 tokens, the model's embeddings 128256 rows, so its ids name other tokens' embeddings"),
    ("mistral-7b-instruct-v0.3", "mistralai/Mistral-7B-Instruct-v0.3", None),
    ("qwen2.5-coder-3b-instruct", "Qwen/Qwen2.5-7B", None),  # 151665 tokens on 152064 padded rows: its own
])
def test_another_familys_tokenizer_fails_check(tmp_path, tokenizer, model, problem):
    """sft check sized its stand-in model to the tokenizer, so a Llama-3 tokenizer on Mistral (95488 rows of noise)
    or TinyLlama's on Llama-3.2 (ids pointing at other tokens' rows) printed OK; sft train only warns (the second
    not at all)."""
    from sft.check.smoke import tiny_recipe
    from sft.errors import SFTError

    recipe = {"model_name_or_path": model, "tokenizer_name_or_path": str(TOKENIZERS / tokenizer),
              "dataset": "data/chat_sample.jsonl", "output_dir": str(tmp_path / "run")}
    if problem is None:
        tiny_recipe(recipe, None, tmp_path)
        return
    with pytest.raises(SFTError, match="does not fit the model") as err:
        tiny_recipe(recipe, None, tmp_path)
    assert problem in str(err.value)


@pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizers not found at {TOKENIZERS} (set SFT_FIXTURES)")
def test_check_runs_rows_longer_than_its_old_cap(tmp_path, caplog):
    """sft check capped max_length at 256: every glaive tool row under Hermes-3's tool_use template (283 to 748
    tokens before the first answer) was dropped, and the check told the user to raise the max_length of 2048 they had
    set. The cap is now the tiny stand-in's 1024 positions, logged when it applies."""
    import json
    import logging

    from sft.check.smoke import tiny_recipe
    from sft.data.build import prepare_splits
    from sft.training.recipe import load_recipe

    rows = json.loads((FIXTURES / "datasets" / "chat" / "llamafactory_glaive_toolcall_en_demo.json").read_text())
    data = tmp_path / "tool_rows.json"
    data.write_text(json.dumps([row for row in rows if row["tools"] not in ("", "[]")]))
    recipe = {"model_name_or_path": "Qwen/Qwen2.5-7B", "tokenizer_name_or_path": str(TOKENIZERS / "qwen2.5-coder-3b-"
              "instruct"), "chat_template": str(REPO / "tests" / "templates" / "hermes_3_tool_use.jinja"),
              "dataset": str(data), "max_length": 2048, "output_dir": str(tmp_path / "run")}
    with caplog.at_level(logging.INFO, logger="sft.check.smoke"):
        _, values, _ = tiny_recipe(recipe, None, tmp_path)
    train, evaluation = prepare_splits(load_recipe(values))
    # 64 rows, 8 held out; `history: split` makes an example of each answer
    assert (len(train.dataset), len(evaluation.dataset), train.dropped_rows, train.truncated_rows) == (125, 17, 0, 0)
    assert values["max_length"] == 2048 and "capped" not in caplog.text


@pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizers not found at {TOKENIZERS} (set SFT_FIXTURES)")
def test_check_keeps_prompts_longer_than_1024_tokens(tmp_path):
    """sft check capped max_length at its stand-in's 1024 positions: a recipe at 4096 whose rows carry a 2068-token
    system prompt (64 real Alpaca answers after it) failed with 'all 64 rows were dropped because no trained token
    fits in max_length=1024', though `sft train` runs it. The stand-in now has the recipe's positions."""
    import json

    from transformers import AutoConfig

    from sft.check.smoke import tiny_recipe
    from sft.data.build import prepare_splits
    from sft.training.recipe import load_recipe

    policy = "You are a helpful assistant. Policy: " + " ".join(
        f"Rule {i}: always answer politely and precisely about topic number {i}." for i in range(120))
    alpaca = json.loads((FIXTURES / "alpaca" / "alpaca_tiny_100.json").read_text())[:64]
    data = tmp_path / "long.jsonl"
    data.write_text("\n".join(json.dumps({"messages": [
        {"role": "system", "content": policy}, {"role": "user", "content": f"{row['instruction']} {row['input']}"},
        {"role": "assistant", "content": row["output"]}]}) for row in alpaca))
    recipe = {"model_name_or_path": "Qwen/Qwen2.5-7B", "tokenizer_name_or_path": str(TOKENIZERS / "qwen2.5-coder-3b-"
              "instruct"), "dataset": str(data), "assistant_only_loss": True, "max_length": 4096,
              "output_dir": str(tmp_path / "run")}
    _, values, _ = tiny_recipe(recipe, None, tmp_path)
    train, evaluation = prepare_splits(load_recipe(values))
    assert (len(train.dataset), len(evaluation.dataset), train.dropped_rows, train.truncated_rows) == (56, 8, 0, 0)
    assert min(train.dataset["length"]) > 2068 and values["max_length"] == 4096
    assert AutoConfig.from_pretrained(values["model_name_or_path"]).max_position_embeddings == 4096


@pytest.mark.parametrize("model_type, positions", [("llama", "max_position_embeddings"), ("gpt2", "n_positions"),
                                                   ("bart", "max_position_embeddings")])
def test_the_stand_in_has_the_recipes_positions(model_type, positions):
    """Learned position tables too (GPT-2's under another name); never fewer than the 1024 it always had."""
    from sft.check.smoke import tiny_architecture

    assert getattr(tiny_architecture(model_type, 1000, 4096), positions) == 4096
    assert getattr(tiny_architecture(model_type, 1000, 256), positions) == 1024


def test_a_tokenizer_under_half_the_models_rows_warns_in_train(caplog):
    """sft train warned only for a tokenizer larger than the model; one from a smaller vocabulary (Llama 2's on
    Llama 3) trained silently with every id naming another token's embedding."""
    import logging

    from sft.models.loading import fit_embeddings

    from conftest import make_llama, make_tokenizer

    tokenizer = make_tokenizer()
    with caplog.at_level(logging.WARNING, logger="sft.models.loading"):
        assert fit_embeddings(make_llama(vocab_size=len(tokenizer)), tokenizer) == []
        assert "DOES NOT FIT" not in caplog.text
        assert fit_embeddings(make_llama(vocab_size=2 * len(tokenizer) + 1), tokenizer) == []
    assert (f"THE TOKENIZER DOES NOT FIT THE MODEL: it has {len(tokenizer)} tokens, the model's embeddings "
            f"{2 * len(tokenizer) + 1} rows, so its ids name other tokens' embeddings") in caplog.text


def test_the_embedded_stand_in_tokenizer_is_not_a_foreign_one(tmp_path):
    """A Hub model whose tokenizer is out of reach is checked with the embedded tiny tokenizer (2048 tokens), which
    must not be taken for another family's tokenizer of Llama-3.1 (128256 rows)."""
    from sft.check.smoke import tiny_recipe

    _, values, _ = tiny_recipe(str(REPO / "recipes" / "llama-3.1-8b-instruct" / "lora.yaml"), None, tmp_path)
    assert values["model_name_or_path"] == str(tmp_path / "model")


def test_check_runs_a_recipe_that_evaluates_during_training_to_keep_the_best(capsys):
    """The smoke run turns evaluation during training off; the settings that need it were left on, so sft check
    refused every early-stopping recipe ("early_stopping_patience is 2 ... but eval_strategy is 'no'") and, once
    load_best_model_at_end was checked, every recipe keeping the best checkpoint."""
    flags = ["--eval_strategy", "steps", "--eval_steps", "5", "--save_strategy", "steps", "--save_steps", "5",
             "--eval_split_size", "0.1", "--load_best_model_at_end", "true", "--early_stopping_patience", "2"]
    assert main(["check", "recipes/quickstart.yaml", *flags]) == 0, capsys.readouterr().err


def test_check_stands_a_tiny_multimodal_model_in_for_gemma3(tmp_path, capsys):
    """Gemma-3 4B+'s config keeps its sizes in text_config and vision_config: the stand-in read its top level (no
    vocab_size: an AttributeError traceback) and would have been built at full size."""
    from transformers import AutoTokenizer, Gemma3Config

    from sft.check.smoke import tiny_architecture

    tokenizer = AutoTokenizer.from_pretrained(REPO / "data" / "models" / "tiny-llama")
    Gemma3Config(text_config={"vocab_size": len(tokenizer)}).save_pretrained(tmp_path / "gemma3")  # 4B's shape
    tokenizer.save_pretrained(tmp_path / "gemma3")
    tiny = tiny_architecture("gemma3", len(tokenizer))
    assert (tiny.text_config.hidden_size, tiny.text_config.num_hidden_layers, tiny.text_config.vocab_size) == (
        64, 2, len(tokenizer))
    assert (tiny.vision_config.hidden_size, tiny.vision_config.num_hidden_layers) == (64, 2)
    flags = ["--model_name_or_path", str(tmp_path / "gemma3"), "--output_dir", str(tmp_path / "run")]
    assert main(["check", "recipes/quickstart.yaml", *flags]) == 0, capsys.readouterr().err


@pytest.mark.skipif(not TOKENIZERS.is_dir(), reason=f"real tokenizers not found at {TOKENIZERS} (set SFT_FIXTURES)")
def test_a_llama_recipe_checks_with_its_real_tokenizer_when_the_model_is_out_of_reach(tmp_path, capsys):
    """The stand-in kept LlamaConfig's default eos id 2 in its generation config, which Llama-3's tokenizer reads as
    '#': the shipped Llama-3.1 LoRA recipe with Meta's own tokenizer failed every check as "the tokenizer is not this
    model's". The stand-in's special ids are its tokenizer's."""
    import json

    from transformers import AutoTokenizer

    from sft.check.smoke import tiny_recipe

    flags = ["--tokenizer_name_or_path", str(TOKENIZERS / "meta-llama-3-8b-instruct"), "--report_to", "none"]
    tiny_recipe("recipes/llama-3.1-8b-instruct/lora.yaml", flags, tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZERS / "meta-llama-3-8b-instruct")
    saved = json.loads((tmp_path / "model" / "generation_config.json").read_text())
    assert (saved["bos_token_id"], saved["eos_token_id"]) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert main(["check", "recipes/llama-3.1-8b-instruct/lora.yaml", *flags]) == 0


def test_the_two_step_smoke_run_does_not_warn_of_the_recipes_warmup(caplog):
    """quickstart-chat's warmup_steps 5 is for its 36-step run; the smoke run's 2 steps keep no warmup, so the check
    does not pass on sft train's warning of a warmup longer than the run as if it were the recipe's."""
    import logging

    with caplog.at_level(logging.WARNING, logger="sft"):
        assert main(["check", "recipes/quickstart-chat.yaml"]) == 0
    assert [r.getMessage() for r in caplog.records if r.name == "sft.training.schedule"] == []


def test_check_puts_sft_trains_warnings_in_its_table_instead_of_a_plain_ok(capsys):
    """quickstart at max_length 48 drops or cuts most of its sample rows before their EOS; the check printed the
    warning among its log lines and ended "OK: the recipe is sound."."""
    assert main(["check", "recipes/quickstart.yaml", "--max_length", "48"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == "OK: the recipe runs, with 2 warning(s) above."
    assert out[-3].startswith("WARNING: Training data: 44 of 56 rows (79%) do not fit max_length=48: 27 dropped")
    assert out[-2].startswith("WARNING: Eval data: 5 of 8 rows are longer than max_length=48 and truncated.")
    assert "OK: the recipe is sound." not in out


@pytest.mark.parametrize("recipe, tied", [("recipes/qwen2.5-0.5b-instruct/full.yaml", True),
                                          ("recipes/llama-3.1-8b-instruct/lora.yaml", False)])
def test_the_stand_in_ties_its_head_as_the_real_model_does(tmp_path, recipe, tied):
    """Qwen2.5-0.5B ties its LM head to its embeddings; its stand-in was built from Qwen2Config's defaults, untied,
    so the check (and --prove) ran a LoRA with lora_modules_to_save: [embed_tokens] on another layout than the run's."""
    import json

    from sft.check.smoke import tiny_recipe

    tiny_recipe(recipe, None, tmp_path)
    assert json.loads((tmp_path / "model" / "config.json").read_text())["tie_word_embeddings"] is tied
