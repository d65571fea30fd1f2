"""Two CPU processes with no extra flags (`torchrun`, `sft launch --num_processes 2`, and ZeRO-3): real data
parallelism over gloo, trained with the chunked loss inside the wrapped model, equal to one process with the same
global batch; and a multi-process eval loss equal to the one-process one on an eval set that does not divide the
batch.

Runs go through `sft train` on the embedded tiny Llama and its tokenizer (tests/batch_probe.py only records what
each rank did).
"""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sft.cli.launch import launch_command
from sft.training.flows import train
from sft.training.presets import DEEPSPEED_CONFIGS
from sft.training.recipe import load_recipe

from conftest import EMBEDDED_MODEL, REPO

pytestmark = pytest.mark.multiprocess
PROBE = REPO / "tests" / "batch_probe.py"
ROWS = json.loads((REPO / "data" / "alpaca_sample.json").read_text())
STEPS = 2


def write_recipe(folder: Path, **overrides) -> Path:
    """2 SGD steps of 2 rows per process on 8 Alpaca rows; 5 eval rows (a multiple of neither 2 nor 4)."""
    if not (EMBEDDED_MODEL / "model.safetensors").exists():
        pytest.skip(f"the embedded model {EMBEDDED_MODEL} is missing (scripts/make_tiny_model.py builds it)")
    (folder / "train.json").write_text(json.dumps(ROWS[:8]))
    (folder / "eval.json").write_text(json.dumps(ROWS[8:13]))
    values = {"model_name_or_path": str(EMBEDDED_MODEL), "dataset": str(folder / "train.json"),
              "eval_dataset": str(folder / "eval.json"), "dtype": "float32", "max_length": 128,
              "per_device_train_batch_size": 2, "per_device_eval_batch_size": 2, "max_steps": STEPS,
              # SGD without clipping: the weights move by exactly lr x gradient, so they compare gradients
              # (Adam's first steps are nearly sign(gradient) and would hide a wrong scale)
              "optim": "sgd", "max_grad_norm": 0.0, "learning_rate": 0.05, "lr_scheduler_type": "constant",
              "logging_steps": 1, "save_strategy": "no", "report_to": "none", "seed": 0, **overrides}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture(scope="module")
def recipe(tmp_path_factory) -> Path:
    return write_recipe(tmp_path_factory.mktemp("ddp"))


def one_process(recipe: Path, out: Path, accumulation: int) -> Path:
    train(load_recipe(recipe, gradient_accumulation_steps=accumulation, output_dir=str(out)))
    return out


@pytest.fixture(scope="module")
def single(recipe, tmp_path_factory) -> Path:
    """One process, the same global batch of 4: 2 rows x gradient accumulation 2."""
    return one_process(recipe, tmp_path_factory.mktemp("single") / "run", accumulation=2)


def run(command: list) -> str:
    """Runs the command; returns its stdout and stderr together."""
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this checkout's sft first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}
    result = subprocess.run(list(map(str, command)), env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{shlex.join(map(str, command))}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"
    return result.stdout + result.stderr


def torchrun(*args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", PROBE, *args]


def assert_data_parallel(out: Path, wrapper: str) -> None:
    """Both ranks in one distributed run, each step on different rows, every training forward chunked."""
    ranks = [json.loads((out / f"batches-rank{r}.json").read_text()) for r in (0, 1)]
    for report in ranks:
        assert report["world_size"] == 2 and report["parallel_mode"] == "ParallelMode.DISTRIBUTED"
        assert set(report["called"]) == {wrapper}
        assert len(report["batches"]) == STEPS and report["chunked_train_forwards"] == STEPS
    for step in range(STEPS):
        rows = [{tuple(row) for row in report["batches"][step]} for report in ranks]
        assert rows[0].isdisjoint(rows[1]), step


def max_weight_difference(a: Path, b: Path) -> float:
    first, second = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert set(first) == set(second)
    return max(float((first[k] - second[k]).abs().max()) for k in first)


def trained_tokens(out: Path) -> list[int]:
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return [entry["trained_tokens"] for entry in history if "trained_tokens" in entry]


def total_flos(out: Path) -> float:
    return json.loads((out / "train_results.json").read_text())["total_flos"]


def eval_loss(out: Path) -> float:
    return json.loads((out / "eval_results.json").read_text())["eval_loss"]


@pytest.fixture(scope="module")
def ddp_run(recipe, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("torchrun") / "run"
    console = run(torchrun("train", recipe, "--output_dir", out))  # no --use_cpu: resolved because no GPU is visible
    (out.parent / "console.txt").write_text(console)
    return out


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_torchrun_prints_sft_tables_notes_and_loading_bars_once(ddp_run):
    """Both ranks prepare the data and load the model; only rank 0 says so."""
    console = (ddp_run.parent / "console.txt").read_text()
    assert console.count("Training data") == 1 and console.count("Data formats:") == 1
    assert console.count("Done. Model, tokenizer") == 1
    assert console.count("Loading weights: 100%") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_torchrun_is_data_parallel_and_equals_one_process(ddp_run, single, recipe, tmp_path):
    assert_data_parallel(ddp_run, "DistributedDataParallel")
    assert max_weight_difference(ddp_run, single) < 1e-5
    assert trained_tokens(ddp_run) == trained_tokens(single)  # the logs count both ranks' tokens, not rank 0's
    # Negative control: half the global batch (what each rank alone would train on) lands measurably elsewhere.
    half = one_process(recipe, tmp_path / "half", accumulation=1)
    assert max_weight_difference(half, single) > 1e-4
    initial = load_file(EMBEDDED_MODEL / "model.safetensors")
    trained = load_file(single / "model.safetensors")
    assert max(float((trained[k] - initial[k]).abs().max()) for k in initial) > 1e-4


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_torchrun_with_torch_compile_compiles_each_block_and_equals_one_process(single, recipe, tmp_path):
    out = tmp_path / "compiled"
    # dynamo's eager backend: the graphs are captured and run as traced (inductor's codegen is the slow tier's)
    run(torchrun("train", recipe, "--output_dir", out, "--torch_compile", "true", "--torch_compile_backend", "eager"))
    assert_data_parallel(out, "DistributedDataParallel")  # DDP around the model, not around a compiled wrapper
    layers = json.loads((EMBEDDED_MODEL / "config.json").read_text())["num_hidden_layers"]
    assert all(json.loads((out / f"batches-rank{r}.json").read_text())["compiled_modules"] == layers for r in (0, 1))
    assert max_weight_difference(out, single) < 1e-5


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_torchrun_bf16_lora_equals_one_process(recipe, tmp_path):
    """LoRA as users train it: bf16 weights under bf16 autocast, float32 adapters fed their bf16 inputs
    (sft.models.precision); two processes train the adapter one process trains on the same global batch."""
    flags = ["--use_peft", "true", "--lora_dropout", "0.0", "--dtype", "bfloat16", "--bf16", "true", "--use_cpu",
             "true"]
    out = tmp_path / "ddp"
    run(torchrun("train", recipe, "--output_dir", out, *flags))
    assert_data_parallel(out, "DistributedDataParallel")
    single = tmp_path / "single"
    train(load_recipe(recipe, flags=flags, gradient_accumulation_steps=2, output_dir=str(single)))
    adapter, expected = load_file(out / "adapter_model.safetensors"), load_file(single / "adapter_model.safetensors")
    assert set(adapter) == set(expected) and all(tensor.dtype == torch.float32 for tensor in adapter.values())
    assert max(float((adapter[k] - expected[k]).abs().max()) for k in adapter) < 1e-5
    assert max(float(tensor.abs().max()) for k, tensor in adapter.items() if "lora_B" in k) > 1e-4  # it trained


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_two_process_eval_loss_drops_the_rows_repeated_to_even_out_batches(ddp_run, single):
    # 5 eval rows over 2 processes x 2 rows: accelerate repeats 3 rows in the last batch
    assert eval_loss(ddp_run) == pytest.approx(eval_loss(single), abs=1e-5)
    assert eval_loss(ddp_run) != pytest.approx(repeated_rows_loss(single), abs=1e-4)  # what counting them gives


def repeated_rows_loss(out: Path) -> float:
    """The eval loss of `out`'s model if the 3 rows accelerate repeats (the first ones) were counted too."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sft.data.build import prepare_splits

    config = load_recipe(out / "recipe.yaml", output_dir=str(out / "probe"))
    _, eval_data = prepare_splits(config, AutoTokenizer.from_pretrained(out))
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    rows = [*eval_data.dataset, *list(eval_data.dataset)[:3]]
    total = count = 0.0
    for row in rows:
        labels = torch.tensor(row["labels"][1:])
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([row["input_ids"]])).logits[0, :-1]
        total += float(torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="sum"))
        count += int((labels != -100).sum())
    return total / count


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_sft_launch_is_data_parallel_and_equals_one_process(recipe, single, tmp_path):
    out = tmp_path / "launch"
    command = launch_command(str(recipe), ["--output_dir", str(out)], num_processes=2)
    module = command.index("-m")
    run([*command[:module], PROBE, *command[module + 2:]])  # the probe in place of `-m sft`
    assert_data_parallel(out, "DistributedDataParallel")
    assert max_weight_difference(out, single) < 1e-5
    assert eval_loss(out) == pytest.approx(eval_loss(single), abs=1e-5)


def test_zero3_with_the_chunked_loss_equals_one_process(recipe, single, ddp_run, tmp_path):
    # A user's own ZeRO-3 JSON without stage3_gather_16bit_weights_on_model_save (DeepSpeed's default: false): the
    # final save must still be a whole model (it was DeepSpeed's shards only, no model.safetensors).
    settings = json.loads(DEEPSPEED_CONFIGS["zero3"].read_text())
    del settings["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"]
    (tmp_path / "ds.json").write_text(json.dumps(settings))
    out = tmp_path / "zero3"
    run(torchrun("train", recipe, "--output_dir", out, "--distributed", "zero3", "--deepspeed", tmp_path / "ds.json"))
    assert_data_parallel(out, "DeepSpeedEngine")
    assert max_weight_difference(out, single) < 1e-5
    assert eval_loss(out) == pytest.approx(eval_loss(single), abs=1e-5)
    # the same batches on each rank as DDP: the same FLOPs, with partitioned parameters counted at their full size
    # (the Trainer counted only the norms ZeRO-3 keeps whole, about 1/1000 of it)
    assert total_flos(out) == total_flos(ddp_run)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_early_stopping_stops_both_ranks_after_the_same_evaluation(recipe, tmp_path):
    """bf16 autocast as users train; learning rate 0, so no evaluation improves on the first: patience 2 stops
    both ranks after the third step (a rank stopping alone would leave the other waiting in its next collective)."""
    out = tmp_path / "early"
    run(torchrun("train", recipe, "--output_dir", out, "--max_steps", "6", "--learning_rate", "0",
                 "--eval_strategy", "steps", "--eval_steps", "1", "--early_stopping_patience", "2",
                 "--bf16", "true", "--use_cpu", "true"))
    assert json.loads((out / "trainer_state.json").read_text())["global_step"] == 3
    for report in (json.loads((out / f"batches-rank{r}.json").read_text()) for r in (0, 1)):
        assert len(report["batches"]) == 3


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_two_process_padding_free_eval_loss_equals_one_process(recipe, single, tmp_path):
    # flattened batches are split back into their examples before the repeated ones are dropped
    out = tmp_path / "eval"
    console = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "sft",
                   "eval", recipe, "--model_name_or_path", single, "--padding_free", "true", "--output_dir", out])
    assert eval_loss(out) == pytest.approx(eval_loss(single), abs=1e-5)
    assert console.count("eval_perplexity") == 1  # the results, printed by rank 0 alone


@pytest.mark.parametrize("preset", ["zero3", "zero2"])
def test_deepspeed_eval_of_a_trained_model_equals_one_process(recipe, single, tmp_path, preset):
    # zero3: `sft eval` evaluates through a DeepSpeedEngine built for inference, whose own `training` flag eval()
    # leaves True: the exact eval loss (over trained tokens, repeated rows dropped) must still be the one used, not the
    # Trainer's mean of batch losses (2.43 against 2.22 on a 12-row eval set before the fix).
    # zero2: transformers has no ZeRO-2 inference (it stopped with a traceback); the eval runs data parallel.
    out = tmp_path / "eval"
    run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "sft", "eval",
         recipe, "--model_name_or_path", single, "--distributed", preset, "--output_dir", out])
    assert eval_loss(out) == pytest.approx(eval_loss(single), abs=1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks CPU data parallelism")
def test_torchrun_trains_a_multimodal_model_on_text_with_gradient_checkpointing(tmp_path):
    """Gemma-3 4B+ (Gemma3ForConditionalGeneration) under torchrun with gradient checkpointing, where the Trainer's
    DDP does not look for unused parameters: its vision tower got no gradient from text and step 2 failed ("Expected
    to have finished reduction in the prior iteration"). The towers are frozen: both steps run, the text model
    trains and the tower is saved as loaded."""
    from transformers import AutoTokenizer

    from conftest import make_gemma3

    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    model = tmp_path / "gemma3"
    make_gemma3(len(tokenizer)).save_pretrained(model)
    tokenizer.save_pretrained(model)
    recipe = write_recipe(tmp_path, model_name_or_path=str(model), gradient_checkpointing=True, eval_dataset=None)
    out = tmp_path / "run"
    run(torchrun("train", recipe, "--output_dir", out))
    for rank in (0, 1):
        report = json.loads((out / f"batches-rank{rank}.json").read_text())
        assert report["world_size"] == 2 and set(report["called"]) == {"DistributedDataParallel"}
        assert len(report["batches"]) == STEPS
    initial, trained = load_file(model / "model.safetensors"), load_file(out / "model.safetensors")
    tower = [k for k in initial if k.startswith(("vision_tower.", "multi_modal_projector."))]  # as checkpoints name them
    assert len(tower) == 34 and all(torch.equal(initial[k], trained[k]) for k in tower)
    assert max(float((trained[k] - initial[k]).abs().max()) for k in initial if k not in tower) > 1e-4
