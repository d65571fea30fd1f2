"""Recipes: strict keys with nearest-key hints, typed values, flag overrides, hardware checks deferred."""

import pytest

from sft.cli.main import main
from sft.errors import SFTError
from sft.training.recipe import load_recipe, parse_flags, resolved_recipe


def test_flags_override_recipe_keys_in_both_spellings(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 2.0e-5\nmax_steps: 100\npacking: false\n")
    config = load_recipe(recipe, flags=["--learning_rate", "1e-4", "--max_steps=5", "--packing", "true"])
    assert (config.learning_rate, config.max_steps, config.packing) == (1e-4, 5, True)


def test_yaml_scientific_notation_without_dot_is_a_float(tmp_path):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\n")  # YAML 1.1 reads this as a string
    assert load_recipe(recipe).learning_rate == 1e-4


@pytest.mark.parametrize("source", ["yaml", "flag"])
def test_a_typo_names_the_nearest_valid_key(tmp_path, source):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learnig_rate: 1e-4\n" if source == "yaml" else "learning_rate: 1e-4\n")
    flags = ["--learnig_rate", "1e-4"] if source == "flag" else []
    with pytest.raises(SFTError, match="Unknown key `learnig_rate`.*Did you mean `learning_rate`"):
        load_recipe(recipe, flags=flags)


@pytest.mark.parametrize("values, message", [
    ({"max_steps": "many"}, "`max_steps`.*expected an integer, got 'many'"),
    ({"learning_rate": [1]}, "`learning_rate`.*expected a number"),
    ({"packing": "maybe"}, "`packing`.*expected true or false"),
    ({"dtype": "fp8"}, "`dtype`.*'fp8' is not one of auto, bfloat16, float16, float32"),
    ({"lora_target_modules": {"a": 1}}, "`lora_target_modules`.*expected a list"),
    ({"fp16": True, "bf16": True}, "fp16 and bf16"),
])
def test_wrong_value_types_are_reported_with_the_key(values, message):
    with pytest.raises(SFTError, match=message):
        load_recipe(values)


def test_gpu_only_flags_load_anywhere_and_fail_clearly_at_train_time(tmp_path):
    config = load_recipe({"bf16": True, "tf32": True, "output_dir": str(tmp_path / "out")})
    assert config.bf16 is True
    problems = config.hardware_problems()
    if problems:  # on a CPU-only machine
        assert "bf16: true needs a CUDA GPU" in problems[0] and "--bf16 false" in problems[0]
        from sft.training.flows import train

        with pytest.raises(SFTError, match="bf16"):
            train(config)
        assert not (tmp_path / "out").exists()


def test_bare_flag_means_true_and_lists_parse():
    assert parse_flags(["--packing", "--lora_target_modules", "q_proj,v_proj"]) == {
        "packing": "true", "lora_target_modules": "q_proj,v_proj"}
    flags = ["--use_peft", "--lora_target_modules", "q_proj,v_proj"]
    assert load_recipe({}, flags=flags).lora_target_modules == ["q_proj", "v_proj"]


def test_resolved_recipe_has_no_secrets_and_round_trips(tmp_path):
    config = load_recipe({"hub_token": "hf_secret", "learning_rate": 3e-4, "output_dir": str(tmp_path)})
    resolved = resolved_recipe(config)
    assert "hub_token" not in resolved and "hf_secret" not in str(resolved)
    assert load_recipe(resolved).learning_rate == 3e-4


def test_cli_exits_2_on_a_typo_without_traceback(tmp_path, capsys):
    recipe = tmp_path / "r.yaml"
    recipe.write_text("learning_rate: 1e-4\n")
    assert main(["train", str(recipe), "--learnig_rate", "1e-4"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate" in err and "Traceback" not in err


def test_help_lists_every_recipe_key(capsys):
    assert main(["train", "--help"]) == 0
    out = capsys.readouterr().out
    for key in ("--learning_rate", "--model_name_or_path", "--packing", "--dataset_format", "--lora_r"):
        assert key in out
    assert "Train only on completions" in out


def test_the_default_max_length_is_fitted_to_the_model_on_a_copy(tiny_model_dir, tmp_path):
    """The tiny model has 512 positions: the default max_length (1024) is lowered for the run, in the config the run
    uses; the caller's recipe is not written to."""
    from sft.training.flows import fitted_max_length
    from sft.training.recipe import with_model_limits

    config = load_recipe({"model_name_or_path": str(tiny_model_dir), "output_dir": str(tmp_path)})
    fitted = with_model_limits(config, fitted_max_length(config))
    assert (config.max_length, fitted.max_length) == (1024, 512)
    assert resolved_recipe(fitted)["max_length"] == 512
    assert with_model_limits(fitted, fitted_max_length(fitted)) is fitted


@pytest.mark.parametrize("key, value", [("lora_r", 8), ("lora_alpha", 16), ("lora_dropout", 0.1),
                                        ("lora_target_modules", ["q_proj"]), ("use_dora", True),
                                        ("use_rslora", True), ("lora_modules_to_save", ["lm_head"])])
def test_a_lora_key_without_use_peft_is_refused_not_ignored(key, value):
    with pytest.raises(SFTError, match=f"{key} is set but use_peft is false.*use_peft: true"):
        load_recipe({key: value})
    assert getattr(load_recipe({key: value, "use_peft": True}), key) == value


def test_a_full_fine_tunes_saved_recipe_with_default_lora_keys_still_loads(tmp_path):
    saved = resolved_recipe(load_recipe({"output_dir": str(tmp_path)}))
    assert saved["lora_r"] == 16 and saved["use_peft"] is False  # every SFT field is written, LoRA's included
    assert load_recipe(saved).use_peft is False


def test_other_tools_keys_name_sft_s_key_instead_of_a_spelling_guess():
    from sft.training.recipe import FIELDS, PEER_KEYS

    for key, advice in PEER_KEYS.items():
        assert key not in FIELDS, key  # a key sft knows never reaches the advice
        with pytest.raises(SFTError, match="another tool's name") as error:
            load_recipe({key: 1})
        assert advice in str(error.value)
        named = advice.split(":")[0].split(" ")[0]
        assert named == "nothing" or named in FIELDS, (key, named)
    # alpaca-lora's flags used to get guesses from their spelling alone
    with pytest.raises(SFTError, match="sft's is per_device_train_batch_size"):
        load_recipe({}, flags=["--micro_batch_size", "4"])


def test_a_comma_separated_list_reads_the_same_in_a_recipe_and_on_the_command_line(tmp_path):
    """`--metrics exact_match,rouge` is two metrics; the same text in a recipe was one unknown metric
    ("Unknown metric `exact_match,rouge`")."""
    path = tmp_path / "recipe.yaml"
    path.write_text("metrics: exact_match, rouge\nlora_target_modules: q_proj,v_proj\nuse_peft: true\n")
    from_recipe = load_recipe(path)
    from_flags = load_recipe({"use_peft": True},
                             flags=["--metrics", "exact_match,rouge", "--lora_target_modules", "q_proj,v_proj"])
    assert from_recipe.metrics == from_flags.metrics == ["exact_match", "rouge"]
    assert from_recipe.lora_target_modules == from_flags.lora_target_modules == ["q_proj", "v_proj"]
    path.write_text("metrics: rouge\n")
    assert load_recipe(path).metrics == ["rouge"]


@pytest.mark.parametrize(("source", "flags", "message"), [
    (["learning_rate", 1e-4], None, "load_recipe takes a recipe file's path, a dict of recipe keys or None, got list"),
    (5, None, "got int 5"),
    ({}, "--learning_rate 1e-4", r"flags are a list of strings, e.g. \['--learning_rate', '1e-4'\], not one string")])
def test_a_recipe_of_another_type_is_an_sft_error(source, flags, message):
    """From Python, load_recipe(5) raised TypeError ('int' object is not iterable), a list a ValueError from dict(),
    and flags given as one string "Unexpected argument '-'"."""
    with pytest.raises(SFTError, match=message):
        load_recipe(source, flags=flags)
