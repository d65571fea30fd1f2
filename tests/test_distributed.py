"""Distributed presets as configuration: wrap classes, preset files, Alpaca FSDP flags, refusals, sft launch."""

import base64
import json
import shlex

import pytest
import yaml
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSeq2SeqLM

from sft.cli.launch import launch_command, split_arguments
from sft.cli.main import main
from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.families import family
from sft.training.presets import (
    ACCELERATE_CONFIGS,
    DEEPSPEED_CONFIGS,
    LAUNCHER_ENV,
    PRESETS,
    check_launcher,
    check_slurm_tasks,
    evaluation_config,
    zero_stage,
)
from sft.training.recipe import FIELDS, load_recipe, resolved_recipe

from conftest import REPO

SMALL = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
             vocab_size=64)
ARCHITECTURES = {  # model_type: (tiny config fields, the classes FSDP must wrap)
    "llama": (SMALL, ["LlamaDecoderLayer"]),
    "mistral": (SMALL, ["MistralDecoderLayer"]),
    "qwen2": (SMALL, ["Qwen2DecoderLayer"]),
    "gpt2": (dict(n_embd=16, n_layer=1, n_head=2, n_positions=64, vocab_size=64), ["GPT2Block"]),
    "t5": (dict(d_model=16, d_ff=32, d_kv=8, num_layers=1, num_heads=2, vocab_size=64), ["T5Block"]),
    # no wrap classes in sft.models.families: resolved from the model class's _no_split_modules
    "opt": (dict(hidden_size=16, ffn_dim=32, num_hidden_layers=1, num_attention_heads=2, word_embed_proj_dim=16,
                 vocab_size=64), ["OPTDecoderLayer"]),
}


def tiny_config_dir(tmp_path, model_type: str):
    """A folder holding only the config.json of a tiny `model_type` model (all the presets read)."""
    fields, _ = ARCHITECTURES[model_type]
    folder = tmp_path / model_type
    AutoConfig.for_model(model_type, **fields).save_pretrained(folder)
    return folder


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_fsdp_preset_wraps_the_decoder_layer_class_of_each_architecture(tmp_path, model_type):
    folder = tiny_config_dir(tmp_path, model_type)
    config = load_recipe({"model_name_or_path": str(folder), "distributed": "fsdp"})
    expected = ARCHITECTURES[model_type][1]
    assert config.fsdp_config["transformer_layer_cls_to_wrap"] == expected
    assert config.fsdp_plugin_args["transformer_cls_names_to_wrap"] == ",".join(expected)
    assert bool(family(model_type).wrap) == (model_type != "opt")
    # the names are real classes of that model, so accelerate finds them when it wraps
    model_config = AutoConfig.from_pretrained(folder)
    auto = AutoModelForSeq2SeqLM if model_config.is_encoder_decoder else AutoModelForCausalLM
    module_classes = {type(m).__name__ for m in auto.from_config(model_config).modules()}
    assert set(expected) <= module_classes


def test_fsdp_wrap_class_the_model_lacks_is_refused_naming_its_blocks(tmp_path):
    """accelerate found the wrong name only once data and weights were loaded, as a traceback (on GPUs only: on CPU
    FSDP becomes DDP and the name was never read)."""
    folder = tiny_config_dir(tmp_path, "llama")
    wrong = {"model_name_or_path": str(folder), "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaBlock"]}}
    for values in ({**wrong, "distributed": "fsdp"}, {**wrong, "fsdp": "full_shard auto_wrap"}):
        with pytest.raises(SFTError, match=r"^fsdp_config.transformer_layer_cls_to_wrap: LlamaBlock is not a module "
                           r"class of the llama model \(LlamaForCausalLM\); its repeated blocks are LlamaDecoderLayer. "
                           r"Set fsdp_config: \{transformer_layer_cls_to_wrap: \[LlamaDecoderLayer\]\}.$"):
            load_recipe(values)
    other = load_recipe({**wrong, "distributed": "fsdp", "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaMLP"]}})
    assert other.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaMLP"  # a real class: the user's choice


def test_fsdp_of_a_model_without_blocks_to_split_is_refused_naming_them(tmp_path):
    """BioGPT's class has no _no_split_modules and sft no wrap class: accelerate would make the whole model one FSDP
    unit (every weight gathered at once) without a word."""
    folder = tmp_path / "biogpt"
    AutoConfig.for_model("biogpt", hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                         vocab_size=64).save_pretrained(folder)
    with pytest.raises(SFTError, match=r"FSDP cannot tell which blocks of the biogpt model \(BioGptForCausalLM\) to "
                       r"shard .* Set fsdp_config: \{transformer_layer_cls_to_wrap: \[BioGptDecoderLayer\]\}"):
        load_recipe({"model_name_or_path": str(folder), "distributed": "fsdp"})
    chosen = load_recipe({"model_name_or_path": str(folder), "distributed": "fsdp",
                          "fsdp_config": {"transformer_layer_cls_to_wrap": ["BioGptDecoderLayer"]}})
    assert chosen.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "BioGptDecoderLayer"


def test_save_only_model_with_the_fsdp_preset_saves_whole_checkpoints(tmp_path):
    """The Trainer refuses save_only_model with SHARDED_STATE_DICT (the preset's) once data and model are loaded."""
    folder = str(tiny_config_dir(tmp_path, "llama"))
    config = load_recipe({"model_name_or_path": folder, "distributed": "fsdp", "save_only_model": True})
    assert config.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    with pytest.raises(SFTError, match="save_only_model with FSDP needs whole-model checkpoints: remove "
                                       "fsdp_config.state_dict_type: SHARDED_STATE_DICT"):
        load_recipe({"model_name_or_path": folder, "distributed": "fsdp", "save_only_model": True,
                     "fsdp_config": {"state_dict_type": "SHARDED_STATE_DICT"}})
    with pytest.raises(SFTError, match="save_only_model cannot be combined with FSDP and load_best_model_at_end"):
        load_recipe({"model_name_or_path": folder, "distributed": "fsdp", "save_only_model": True,
                     "load_best_model_at_end": True, "eval_strategy": "steps", "save_strategy": "steps"})


def test_fsdp_preset_is_fsdp2_with_sharded_checkpoints(tmp_path):
    config = load_recipe({"model_name_or_path": str(tiny_config_dir(tmp_path, "llama")), "distributed": "fsdp"})
    assert config.fsdp is True
    plugin = config.fsdp_plugin_args
    assert plugin["fsdp_version"] == 2 and plugin["reshard_after_forward"] is True
    assert plugin["auto_wrap_policy"] == "TRANSFORMER_BASED_WRAP"
    assert plugin["state_dict_type"] == "SHARDED_STATE_DICT" and "cpu_offload" not in plugin
    offload = load_recipe({"model_name_or_path": str(tmp_path / "llama"), "distributed": "fsdp_offload"})
    assert offload.fsdp_plugin_args["cpu_offload"] is True


def test_unreachable_model_config_leaves_wrapping_to_no_split_modules(caplog):
    config = load_recipe({"model_name_or_path": "nobody/not-a-model", "distributed": "fsdp"})  # hub is offline
    assert config.fsdp is True and "transformer_layer_cls_to_wrap" not in config.fsdp_config
    assert "_no_split_modules" in caplog.text


def test_known_model_wraps_its_layers_without_the_hub():
    """Wrap classes come from sft.models.architectures.model_architecture: a built-in model needs neither cache nor Hub."""
    config = load_recipe({"model_name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "distributed": "fsdp"})
    assert config.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]


def test_activation_checkpointing_moves_to_fsdp_own(tmp_path):
    config = load_recipe({"model_name_or_path": str(tiny_config_dir(tmp_path, "llama")), "distributed": "fsdp",
                          "activation_checkpointing": True})
    assert config.fsdp_config["activation_checkpointing"] is True
    assert config.activation_checkpointing is False  # the Trainer refuses both at once


@pytest.mark.parametrize("preset", ["zero2", "zero3", "zero3_offload"])
def test_deepspeed_presets_point_at_their_json(preset):
    config = load_recipe({"distributed": preset, "use_cpu": True})
    assert config.deepspeed == str(DEEPSPEED_CONFIGS[preset])
    stage = config.hf_deepspeed_config.config["zero_optimization"]["stage"]
    assert stage == (2 if preset == "zero2" else 3)
    assert config.fsdp_plugin_args is None


def test_ddp_preset_changes_nothing():
    plain, ddp = load_recipe({}), load_recipe({"distributed": "ddp"})
    assert (ddp.fsdp, ddp.deepspeed, ddp.fsdp_config) == (plain.fsdp, plain.deepspeed, plain.fsdp_config)


def test_presets_match_the_recipe_key_choices():
    assert PRESETS == FIELDS["distributed"].metadata["choices"]


def test_recipe_yaml_keeps_the_preset_name_not_its_expansion():
    config = load_recipe({"distributed": "zero3", "use_cpu": True})
    saved = resolved_recipe(config)
    assert saved["distributed"] == "zero3" and "deepspeed" not in saved
    assert load_recipe(saved).deepspeed == config.deepspeed


# Preset files -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", PRESETS)
def test_accelerate_preset_loads_in_accelerate(preset):
    from accelerate.commands.config.config_args import load_config_from_file

    path = ACCELERATE_CONFIGS[preset]
    assert path.parent == REPO / "recipes" / "accelerate" and path.exists()
    cluster = load_config_from_file(str(path))
    expected = {"ddp": "MULTI_GPU", "fsdp": "FSDP", "fsdp_offload": "FSDP"}.get(preset, "DEEPSPEED")
    assert cluster.distributed_type.value == expected
    if expected == "FSDP":
        assert cluster.fsdp_config["fsdp_version"] == 2
        assert cluster.fsdp_config["fsdp_offload_params"] == (preset == "fsdp_offload")
    if expected == "DEEPSPEED":
        relative = cluster.deepspeed_config["deepspeed_config_file"]
        assert (REPO / relative) == DEEPSPEED_CONFIGS[preset]


@pytest.mark.parametrize("preset", sorted(DEEPSPEED_CONFIGS))
def test_deepspeed_preset_is_valid_for_deepspeed(preset):
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    config = json.loads(DEEPSPEED_CONFIGS[preset].read_text())
    zero = {key: 1000 if value == "auto" else value for key, value in config["zero_optimization"].items()}
    assert DeepSpeedZeroConfig(**zero).stage == (2 if preset == "zero2" else 3)  # rejects unknown keys
    if zero["stage"] == 3:
        assert zero["stage3_gather_16bit_weights_on_model_save"] is True  # the final save is a normal model
    assert "train_batch_size" not in config  # DeepSpeed derives it; "auto" breaks zero.Init on CPU (world size 1)
    offloaded = "offload_param" in zero
    assert offloaded == (preset == "zero3_offload") == ("optimizer" in config)  # CPU Adam for ZeRO-Offload


# Stanford Alpaca flags ----------------------------------------------------------------------------------------


def test_stanford_alpaca_fsdp_flags_give_fsdp2_full_shard_of_llama_layers():
    from sft.cli.alpaca import alpaca_recipe

    argv = ["--fsdp", "full_shard auto_wrap", "--fsdp_transformer_layer_cls_to_wrap", "LlamaDecoderLayer"]
    values, flags = alpaca_recipe(argv, has_gpu=True)
    config = load_recipe(values, flags=flags)
    assert config.fsdp is True
    assert config.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaDecoderLayer"]
    assert config.fsdp_config["reshard_after_forward"] is True and not config.fsdp_config.get("cpu_offload")
    assert config.fsdp_plugin_args == {
        "fsdp_version": 2, "auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "transformer_cls_names_to_wrap":
        "LlamaDecoderLayer", "cpu_ram_efficient_loading": False, "state_dict_type": "FULL_STATE_DICT",
        "reshard_after_forward": True}


def test_fsdp_config_json_flag_and_offload_option():
    config = load_recipe(flags=["--fsdp", "full_shard offload auto_wrap", "--fsdp_config",
                                '{"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}'])
    assert config.fsdp_plugin_args["transformer_cls_names_to_wrap"] == "LlamaDecoderLayer"
    assert config.fsdp_plugin_args["cpu_offload"] is True
    assert load_recipe(flags=["--fsdp", "shard_grad_op auto_wrap"]).fsdp_plugin_args["reshard_after_forward"] is False


@pytest.mark.parametrize("value", ["true", True])
def test_fsdp_true_from_the_command_line_or_yaml(value):
    config = load_recipe({"fsdp": value}) if value is True else load_recipe(flags=["--fsdp"])
    assert config.fsdp is True and config.fsdp_plugin_args["fsdp_version"] == 2


def test_unknown_fsdp_option_is_refused():
    with pytest.raises(SFTError, match="unknown option 'hybrid_shard'"):
        load_recipe(flags=["--fsdp", "hybrid_shard auto_wrap"])


def test_deepspeed_flag_takes_a_json_path(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": "auto"}))
    config = load_recipe(flags=["--deepspeed", str(path), "--use_cpu", "true"])
    assert config.deepspeed == str(path) and config.hf_deepspeed_config.config["zero_optimization"]["stage"] == 2


# User settings win, combinations ------------------------------------------------------------------------------


def test_user_fsdp_config_keys_win_over_the_preset(tmp_path):
    folder = tiny_config_dir(tmp_path, "llama")
    config = load_recipe({"model_name_or_path": str(folder), "distributed": "fsdp", "fsdp_config": {
        "transformer_layer_cls_to_wrap": ["LlamaMLP"], "fsdp_state_dict_type": "FULL_STATE_DICT",
        "activation_checkpointing": False}, "activation_checkpointing": True})
    assert config.fsdp_config["transformer_layer_cls_to_wrap"] == ["LlamaMLP"]
    assert config.fsdp_plugin_args["state_dict_type"] == "FULL_STATE_DICT"
    assert config.fsdp_plugin_args["activation_checkpointing"] is False and config.activation_checkpointing is True


def test_user_deepspeed_file_and_checkpointing_kwargs_win(tmp_path):
    path = tmp_path / "mine.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 3}, "train_micro_batch_size_per_gpu": "auto"}))
    config = load_recipe({"distributed": "zero3", "deepspeed": str(path), "use_peft": True, "use_cpu": True,
                          "activation_checkpointing_kwargs": {"use_reentrant": False, "every_n_layers": 2}})
    assert config.deepspeed == str(path)
    assert config.activation_checkpointing_kwargs == {"use_reentrant": False, "every_n_layers": 2}


def test_peft_on_zero3_uses_reentrant_checkpointing():
    peft = load_recipe({"distributed": "zero3", "use_peft": True, "activation_checkpointing": True, "use_cpu": True})
    assert peft.activation_checkpointing_kwargs == {"use_reentrant": True}
    full = load_recipe({"distributed": "zero3", "activation_checkpointing": True, "use_cpu": True})
    assert full.activation_checkpointing_kwargs is None  # transformers' non-reentrant default


def test_a_base64_deepspeed_config_is_read_like_its_file():
    """TrainingArguments also takes the DeepSpeed config base64-encoded; its stage was unread (None), so PEFT on it got
    no reentrant checkpointing, and sft eval would have evaluated a ZeRO-3 recipe unsharded."""
    text = base64.urlsafe_b64encode(DEEPSPEED_CONFIGS["zero3"].read_bytes()).decode()
    config = load_recipe({"deepspeed": text, "use_peft": True, "activation_checkpointing": True, "use_cpu": True})
    assert zero_stage(config.deepspeed) == 3
    assert config.activation_checkpointing_kwargs == {"use_reentrant": True}
    assert evaluation_config(config) is config  # sft eval keeps ZeRO-3


def test_qlora_with_zero3_is_refused_before_the_model_loads(tmp_path, capsys):
    recipe = tmp_path / "qlora-zero3.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "not-downloaded"), "use_peft": True,
                                      "load_in_4bit": True, "distributed": "zero3", "dataset": "none.json"}))
    assert main(["train", str(recipe)]) == 2  # the model path does not even exist: nothing was loaded
    err = capsys.readouterr().err
    assert "ZeRO-3" in err and "FSDP-QLoRA" in err and "distributed: fsdp" in err and "Traceback" not in err
    with pytest.raises(SFTError, match="FSDP-QLoRA"):
        load_recipe({"load_in_8bit": True, "use_peft": True, "distributed": "zero3_offload"})


def test_fsdp_qlora_stores_4bit_weights_in_the_compute_dtype(tmp_path):
    folder = str(tiny_config_dir(tmp_path, "llama"))
    base = {"model_name_or_path": folder, "distributed": "fsdp", "use_peft": True, "load_in_4bit": True}
    assert load_recipe({**base, "bnb_4bit_compute_dtype": "bfloat16"}).bnb_4bit_quant_storage == "bfloat16"
    assert load_recipe({**base, "dtype": "float16"}).bnb_4bit_quant_storage == "float16"
    assert load_recipe({**base, "bnb_4bit_quant_storage": "uint8"}).bnb_4bit_quant_storage == "uint8"  # user wins
    single_gpu = load_recipe({"model_name_or_path": folder, "use_peft": True, "load_in_4bit": True})
    assert single_gpu.bnb_4bit_quant_storage is None
    # FSDP without a preset too: with uint8 storage accelerate leaves the 4-bit base out of sharding
    for fsdp in (True, "full_shard auto_wrap"):
        qlora = {"model_name_or_path": folder, "fsdp": fsdp, "use_peft": True, "load_in_4bit": True}
        assert load_recipe({**qlora, "bnb_4bit_compute_dtype": "bfloat16"}).bnb_4bit_quant_storage == "bfloat16"


def test_fsdp_and_deepspeed_together_are_refused():
    with pytest.raises(SFTError, match="choose one"):
        load_recipe({"distributed": "zero2", "fsdp": "full_shard auto_wrap"})
    with pytest.raises(SFTError, match="load_in_8bit cannot be sharded"):
        load_recipe({"distributed": "fsdp", "load_in_8bit": True, "use_peft": True})


# sft launch ---------------------------------------------------------------------------------------------------

MULTI_NODE = ["--num_machines", "2", "--machine_rank", "1", "--main_process_ip", "10.0.0.1",
              "--main_process_port", "29500"]


def test_launch_dry_run_prints_the_accelerate_command(capsys):
    recipe = "recipes/mistral-7b/full-zero3.yaml"
    code = main(["launch", str(REPO / recipe), "--dry_run", "--num_processes", "16", *MULTI_NODE,
                 "--learning_rate", "2e-5", "--gradient_accumulation_steps", "2", "--", "--seed", "3"])
    assert code == 0
    argv = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])
    assert argv[1] == "launch" and argv[0].endswith("accelerate")
    assert argv[argv.index("--config_file") + 1] == str(ACCELERATE_CONFIGS["zero3"])  # the recipe's `distributed`
    assert argv[argv.index("--deepspeed_config_file") + 1] == str(DEEPSPEED_CONFIGS["zero3"])
    assert argv[argv.index("--num_processes") + 1] == "16"
    module = argv.index("-m")
    assert all(flag in argv[:module] for flag in MULTI_NODE)
    assert argv[module:] == ["-m", "sft", "train", str(REPO / recipe), "--learning_rate", "2e-5",
                             "--gradient_accumulation_steps", "2", "--seed", "3"]


def test_launch_preset_flag_overrides_the_recipe_and_tells_the_trainer():
    argv = launch_command(str(REPO / "recipes/quickstart.yaml"), ["--same_network", "--packing=true"], "fsdp", 2)
    assert argv[argv.index("--config_file") + 1] == str(ACCELERATE_CONFIGS["fsdp"])
    assert "--same_network" in argv[:argv.index("-m")]
    assert argv[argv.index("-m") + 4:] == ["--packing=true", "--distributed", "fsdp"]
    assert "--deepspeed_config_file" not in argv
    default = launch_command(str(REPO / "recipes/quickstart.yaml"), [], None, 1)
    assert default[default.index("--config_file") + 1] == str(ACCELERATE_CONFIGS["ddp"])


def test_launch_split_rule():
    accelerate, recipe = split_arguments(["--num_machines=2", "--cpu", "--debug", "--lr_scheduler_type", "cosine",
                                          "--main_process_port", "1234", "--", "--num_machines", "9"])
    assert accelerate == ["--num_machines=2", "--cpu", "--main_process_port", "1234"]
    assert recipe == ["--debug", "--lr_scheduler_type", "cosine", "--num_machines", "9"]


def test_launch_rejects_bad_overrides_before_starting_processes(capsys):
    assert main(["launch", str(REPO / "recipes/quickstart.yaml"), "--num_processes", "2", "--lerning_rate", "1"]) == 2
    assert "Did you mean `learning_rate`" in capsys.readouterr().err


@pytest.mark.multiprocess
def test_launch_ends_with_the_processes_own_error_and_exit_code(tmp_path):
    """A recipe error found in the processes (here a misspelt attention backend) is each process's one-line error and
    exit code 2: run as its own program, accelerate ended it with torch elastic's ChildFailedError traceback and exit
    code 1. A good run through the same in-process launcher trains on 2 processes and saves the model."""
    import subprocess
    import sys

    def launch(*flags: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "sft", "launch", "recipes/quickstart.yaml", "--num_processes", "2",
                               "--output_dir", str(tmp_path / "out"), *flags], cwd=REPO, capture_output=True, text=True,
                              timeout=600)

    bad = launch("--attn_implementation", "eagr")
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert bad.stderr.count("sft: error: attn_implementation: 'eagr' is not an attention backend") == 2
    assert "Traceback" not in bad.stderr and "ChildFailedError" not in bad.stderr
    good = launch("--max_steps", "2")
    assert good.returncode == 0, good.stderr[-2000:]
    assert (tmp_path / "out" / "model.safetensors").exists()


@pytest.mark.parametrize("preset", PRESETS)
def test_accelerate_accepts_the_launch_command(preset, monkeypatch):
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    argv = launch_command(str(REPO / "recipes/quickstart.yaml"), MULTI_NODE, preset, 4)
    args, defaults, _ = _validate_launch_command(launch_command_parser().parse_args(argv[2:]))
    assert (args.num_processes, args.num_machines, args.machine_rank) == (4, 2, 1)
    assert (args.module, args.training_script, args.training_script_args[0]) == (True, "sft", "train")
    if preset in DEEPSPEED_CONFIGS:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)  # as accelerate does
        _, env = prepare_deepspeed_cmd_env(args)
        assert env["ACCELERATE_USE_DEEPSPEED"] == "true"
        assert env["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(DEEPSPEED_CONFIGS[preset])
        for key, value in env.items():  # the Trainer's DeepSpeedPlugin accepts what the launcher set
            if key.startswith("ACCELERATE_"):
                monkeypatch.setenv(key, value)
        assert isinstance(load_recipe({"distributed": preset, "use_cpu": True}), SFTConfig)
    else:
        env = prepare_multi_gpu_env(args)
        assert (env.get("ACCELERATE_USE_FSDP") == "true") == preset.startswith("fsdp")
        assert (env.get("FSDP_OFFLOAD_PARAMS") == "true") == (preset == "fsdp_offload")


def test_a_finished_command_closes_the_process_group_a_failed_one_leaves_it(monkeypatch, tmp_path):
    """torchrun ranks must not reach interpreter exit with gloo's group open: its threads can abort a rank after a run
    that succeeded (SIGABRT, seen in the ZeRO-3 LoRA multiprocess test). After an error other ranks may still wait in
    a collective, so the group is left to the launcher."""
    import torch.distributed as dist

    from sft.cli import main as cli

    def open_group(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)

    def fail(args, rest):
        raise SFTError("bad recipe")

    open_group("first")
    try:
        monkeypatch.setattr(cli, "run_train", lambda args, rest: None)
        assert main(["train", "recipe.yaml"]) == 0
        assert not dist.is_initialized()
        open_group("second")
        monkeypatch.setattr(cli, "run_train", fail)
        assert main(["train", "recipe.yaml"]) == 2
        assert dist.is_initialized()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture
def plain_process(monkeypatch):
    """No launcher's variables, as in a shell that runs `sft train` itself."""
    for name in (*LAUNCHER_ENV, "SLURM_STEP_NUM_TASKS"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("flags, what", [(["--distributed", "fsdp"], "distributed: fsdp"),
                                         (["--distributed", "zero3_offload"], "distributed: zero3_offload"),
                                         (["--fsdp", "full_shard auto_wrap"], "fsdp"),
                                         (["--deepspeed", str(DEEPSPEED_CONFIGS["zero2"])], "deepspeed")])
def test_a_sharded_run_without_a_launcher_is_refused_before_loading(plain_process, tiny_model_dir, tmp_path,
                                                                     capsys, flags, what):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset": "no-such-data.json",
                                      "output_dir": str(tmp_path / "out")}))
    assert main(["train", str(recipe), *flags]) == 2  # the data does not even exist: nothing was tokenized
    err = capsys.readouterr().err
    assert f"sft: error: {what} shards the run over processes that a launcher starts" in err
    assert "`sft launch RECIPE --num_processes N` (N GPUs; 1 on one GPU)" in err and "torchrun" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_a_sharded_eval_without_a_launcher_is_refused_naming_torchrun(plain_process, tiny_model_dir, tmp_path,
                                                                        capsys):
    """sft eval of a ZeRO-3 recipe as one plain process died in from_pretrained (DeepSpeed looking for MPI)."""
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset": "no-such-data.json",
                                      "output_dir": str(tmp_path / "out")}))
    assert main(["eval", str(recipe), "--distributed", "zero3"]) == 2
    err = capsys.readouterr().err
    assert "Run `torchrun --nproc_per_node N -m sft eval RECIPE`." in err and "sft launch" not in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("verb", ["train", "eval"])
def test_srun_tasks_that_are_not_one_run_are_refused_before_loading(plain_process, tiny_model_dir, tmp_path,
                                                                     capsys, monkeypatch, verb):
    """`srun -n 2 sft train`: srun connects nothing, so each task trained alone into the same output_dir."""
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(tiny_model_dir), "dataset": "no-such-data.json",
                                      "output_dir": str(tmp_path / "out")}))
    assert main([verb, str(recipe)]) == 2  # before the (missing) data is read
    err = capsys.readouterr().err
    assert "srun started 2 tasks (SLURM_STEP_NUM_TASKS=2), and each is a separate 1-process run" in err
    assert f"--rdzv_endpoint HEAD_NODE:29500 -m sft {verb} RECIPE`" in err
    assert "Traceback" not in err and not (tmp_path / "out").exists()


def test_srun_tasks_that_are_the_runs_processes_go_ahead(monkeypatch):
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "2")
    check_slurm_tasks(2)  # DeepSpeed's MPI discovery: one process per task
    check_slurm_tasks(16)  # srun --ntasks-per-node 1 torchrun --nproc_per_node 8 on 2 nodes
    with pytest.raises(SFTError, match="separate 1-process run"):
        check_slurm_tasks(1)
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "1")  # srun -n 1, or the batch script itself
    check_slurm_tasks(1)


@pytest.mark.parametrize("variable", LAUNCHER_ENV)
def test_a_sharded_run_under_a_launcher_or_a_ddp_run_goes_ahead(plain_process, monkeypatch, variable):
    check_launcher(load_recipe({"distributed": "ddp"}))  # one plain process is plain training
    config = load_recipe({"distributed": "zero3", "use_cpu": True})
    with pytest.raises(SFTError, match="launcher"):
        check_launcher(config)
    monkeypatch.setenv(variable, "1")  # torchrun / accelerate / deepspeed (WORLD_SIZE, LOCAL_RANK), or mpirun
    check_launcher(config)


def test_check_passes_a_sharded_recipe_and_says_how_to_launch_it(plain_process, capsys, monkeypatch):
    monkeypatch.chdir(REPO)
    assert main(["check", "recipes/quickstart.yaml", "--distributed", "fsdp"]) == 0
    out = capsys.readouterr().out
    assert "skipped (multi-process)  distributed, fsdp, fsdp_config: train with `sft launch recipes/quickstart.yaml " \
           "--num_processes N` (N GPUs; 1 on one GPU), plain `sft train` refuses a sharded run" in out
    assert "OK: the recipe is sound." in out
