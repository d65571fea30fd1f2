"""Two processes under torchrun: ZeRO-3 on CPU (gloo) really partitions, matches one process and saves reloadable
weights; the fsdp preset really wraps each decoder layer in FSDP2 (on CUDA, and on CPU through
tests/fsdp_cpu_probe.py, which keeps accelerate from turning FSDP into DDP there).

Each run goes through `python -m sft train` (tests/sharding_probe.py adds only a callback recording the sharding).
The first ZeRO-3 run on a machine JIT-compiles DeepSpeed's CPU shared-memory comm op (a few minutes, cached in
~/.cache/torch_extensions); later runs take about 30 s each.
"""

import json
import math
import os
import re
import shlex
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, GenerationConfig

from sft.cli.main import main
from sft.training.flows import train
from sft.training.recipe import load_recipe

from conftest import REPO, write_json

pytestmark = pytest.mark.multiprocess
PROBE = REPO / "tests" / "sharding_probe.py"
EXIT_PROBE = REPO / "tests" / "exit_probe.py"
# Four rows = one global batch of 2 processes x 2 rows: step 1 sees exactly these rows in any order.
ROWS = [{"instruction": "Add the two numbers.", "input": "2 and 3", "output": "5"},
        {"instruction": "What is the capital of France?", "input": "", "output": "The capital of France is Paris."},
        {"instruction": "Say hello.", "input": "", "output": "Hello, how are you today?"},
        {"instruction": "Write a function that adds two numbers.", "input": "",
         "output": "def add(a, b):\n    return a + b"}]


@pytest.fixture(scope="module")
def recipe(tmp_path_factory, tiny_model_dir) -> Path:
    """A 3-step ZeRO-3 CPU recipe on the tiny Llama, checkpointing at step 3."""
    folder = tmp_path_factory.mktemp("multiprocess")
    values = {"model_name_or_path": str(tiny_model_dir), "dataset": str(write_json(folder / "data.json", ROWS)),
              "dataset_format": "alpaca", "dtype": "float32", "distributed": "zero3", "use_cpu": True,
              "per_device_train_batch_size": 2, "max_steps": 3, "learning_rate": 1e-2, "lr_scheduler_type": "constant",
              "logging_steps": 1, "save_strategy": "steps", "save_steps": 3, "report_to": "none", "seed": 0}
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


@pytest.fixture(scope="module")
def single_process_loss(recipe, tmp_path_factory) -> float:
    """Loss of step 1 in one process over the same global batch (4 rows)."""
    out = tmp_path_factory.mktemp("single") / "run"
    train(load_recipe(recipe, distributed=None, per_device_train_batch_size=4, max_steps=1, save_strategy="no",
                      output_dir=str(out)))
    return step_losses(out)[0]


def launch(args: list, nproc: int = 2) -> subprocess.CompletedProcess:
    """Run `torchrun --standalone --nproc_per_node N args...`."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               *map(str, args)]
    path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))  # this checkout's sft first
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": path}  # processes share cores
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    result.command = shlex.join(command)
    return result


def torchrun(args: list, nproc: int = 2) -> None:
    """`launch`, failing with its output if it fails."""
    result = launch(args, nproc)
    assert result.returncode == 0, f"{result.command}\n{result.stdout[-3000:]}\n{result.stderr[-6000:]}"


def step_losses(run: Path) -> list[float]:
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


def assert_partitioned(run: Path) -> dict:
    """Every parameter is a ZeRO-3 parameter, released (empty) on both ranks, each holding half of it."""
    reports = [json.loads((run / f"sharding-rank{rank}.json").read_text()) for rank in (0, 1)]
    for report in reports:
        assert report["world_size"] == 2 and report["params"]
        for name, param in report["params"].items():
            assert param["zero_param"], name
            assert param["numel"] == 0 and param["status"] == "NOT_AVAILABLE", (name, param)
            assert param["shard_numel"] == math.ceil(param["ds_numel"] / 2), (name, param)
    return reports[0]["params"]


def assert_zero3_checkpoint(run: Path) -> Path:
    """checkpoint-3 holds both ranks' shards, promoted from its staging folder."""
    checkpoint = run / "checkpoint-3"
    # bf16 runs prefix the optimizer shards with bf16_
    shards = sorted(p.name.removeprefix("bf16_") for p in (checkpoint / "global_step3").glob("*_optim_states.pt"))
    assert shards == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    assert (checkpoint / "latest").read_text().strip() == "global_step3"
    assert not list(run.glob(".staging-*"))
    return checkpoint


def consolidated(checkpoint: Path, trainable_only: bool = False) -> dict[str, torch.Tensor]:
    """The fp32 weights DeepSpeed rebuilds from the per-rank shards of a checkpoint."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), exclude_frozen_parameters=trainable_only)


def test_zero3_full_finetune_on_two_processes(recipe, tmp_path, tiny_model_dir, single_process_loss):
    """bf16 as users train: DeepSpeed trains bf16 copies of the float32-loaded weights beside float32 masters. The
    saved models (final and checkpoint) must hold the masters, as one process saves the float32 weights it trained;
    they held the masters' bf16 rounding (config.json: bfloat16), which at lr 2e-5 was an error half the size of the
    training's whole change, and left every norm weight as it started."""
    run = tmp_path / "full"
    # 1 row x 2 accumulated micro-batches per process: step 1 still sees the 4 rows of single_process_loss
    torchrun([PROBE, "train", recipe, "--output_dir", run, "--bf16", "true", "--per_device_train_batch_size", "1",
              "--gradient_accumulation_steps", "2"])
    params = assert_partitioned(run)
    assert all(p["trainable"] for p in params.values())
    losses = step_losses(run)
    # bf16 weights against one fp32 process: 1e-2 is 100x the rounding seen, and 1000x below a mis-scaled loss
    assert len(losses) == 3 and abs(losses[0] - single_process_loss) < 1e-2
    checkpoint = assert_zero3_checkpoint(run)
    weights = consolidated(checkpoint)
    for folder in (run, checkpoint):
        assert json.loads((folder / "config.json").read_text())["dtype"] == "float32"
        saved = AutoModelForCausalLM.from_pretrained(folder).state_dict()  # a normal model, gathered at the save
        assert set(saved) == set(weights)
        for name, tensor in saved.items():
            assert tensor.dtype == torch.float32 and torch.equal(tensor, weights[name]), name
    initial = load_file(tiny_model_dir / "model.safetensors")
    for name in ("model.embed_tokens.weight", "lm_head.weight"):  # no resize: partitioned weights have shape (0,)
        assert saved[name].shape == initial[name].shape
    assert not torch.equal(saved["model.layers.0.mlp.down_proj.weight"], initial["model.layers.0.mlp.down_proj.weight"])


def test_zero3_lora_saves_a_non_empty_reloadable_adapter(recipe, tmp_path, tiny_model_dir, single_process_loss):
    from peft import PeftModel

    run = tmp_path / "lora"
    # activation checkpointing too: PEFT on ZeRO-3 must recompute with reentrant checkpointing
    torchrun([PROBE, "train", recipe, "--output_dir", run, "--use_peft", "true", "--lora_dropout", "0.0",
              "--activation_checkpointing", "true"])
    params = assert_partitioned(run)
    assert {("lora_" in name) for name, p in params.items() if p["trainable"]} == {True}
    assert abs(step_losses(run)[0] - single_process_loss) < 1e-4  # lora_B starts at zero: the base model's loss
    adapter = load_file(run / "adapter_model.safetensors")
    lora_b = [name for name in adapter if "lora_B" in name]
    assert adapter and len(lora_b) == 2 * 7 and all(adapter[name].abs().sum() > 0 for name in lora_b)  # trained
    checkpoint = assert_zero3_checkpoint(run)
    weights = consolidated(checkpoint, trainable_only=True)
    # the run's stop tokens with the adapter, in the checkpoint too (sft merge RUN/checkpoint-3 takes them)
    assert GenerationConfig.from_pretrained(checkpoint).eos_token_id == GenerationConfig.from_pretrained(run).eos_token_id
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), run)
    reloaded = {name: p for name, p in model.named_parameters() if "lora_" in name}
    assert set(reloaded) == set(weights)
    for name, tensor in reloaded.items():
        assert torch.equal(tensor, weights[name]), name


def test_zero3_lora_trains_and_saves_the_rows_of_tokens_a_chat_template_adds(recipe, tmp_path):
    """The llama3 template adds 4 tokens, whose rows the adapter trains (peft trainable tokens). Under ZeRO-3 peft
    reads their starting rows into a buffer it builds on CUDA, so on CPU the run died building the adapter ("Torch
    not compiled with CUDA enabled"); it must train as one process does and save the trained rows."""
    chat = [{"messages": [{"role": "user", "content": row["instruction"]},
                          {"role": "assistant", "content": row["output"]}]} for row in ROWS]
    flags = ["--dataset", str(write_json(tmp_path / "chat.jsonl", chat, jsonl=True)), "--dataset_format", "messages",
             "--chat_template", "llama3", "--use_peft", "true", "--lora_dropout", "0.0", "--max_steps", "1",
             "--save_strategy", "no"]
    run = tmp_path / "zero3"
    torchrun([PROBE, "train", recipe, "--output_dir", run, *flags])
    single = tmp_path / "single"
    train(load_recipe(recipe, flags + ["--distributed", "null"], per_device_train_batch_size=4, output_dir=str(single)))
    assert abs(step_losses(run)[0] - step_losses(single)[0]) < 1e-4
    adapter, expected = load_file(run / "adapter_model.safetensors"), load_file(single / "adapter_model.safetensors")
    rows = {name: tensor for name, tensor in adapter.items() if "trainable_tokens_delta" in name}
    assert {name.split(".token_adapter")[0].rsplit(".", 1)[-1] for name in rows} == {"embed_tokens", "lm_head"}
    assert set(adapter) == set(expected)
    for name, tensor in rows.items():
        assert tensor.shape == (4, 32) and torch.allclose(tensor, expected[name], atol=1e-4), name


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_fsdp_preset_wraps_each_decoder_layer_on_gpu(recipe, tmp_path):
    run = tmp_path / "fsdp"
    torchrun([PROBE, "train", recipe, "--output_dir", run, "--distributed", "fsdp", "--use_cpu", "false"],
             nproc=min(2, torch.cuda.device_count()))
    report = json.loads((run / "sharding-rank0.json").read_text())
    types = report["module_types"]
    layers = [name for name in types if re.fullmatch(r"model\.layers\.\d+", name)]
    assert layers and set(layers) <= set(report["fsdp_modules"]) and "" in report["fsdp_modules"]
    assert all(types[name] == "FSDPLlamaDecoderLayer" for name in layers)  # fully_shard, not a DDP fallback
    assert not any("DistributedDataParallel" in kind for kind in types.values())
    checkpoint = run / "checkpoint-3"
    assert any(p.name.startswith("pytorch_model_fsdp") for p in checkpoint.iterdir())  # sharded checkpoint
    model = AutoModelForCausalLM.from_pretrained(run)  # the final save is whole
    assert model.model.layers[0].mlp.down_proj.weight.shape == (32, 64)


def run_ranks(args: list, nproc: int) -> list[int]:
    """Start `nproc` processes of `args` with the environment torchrun gives its ranks and return each one's exit
    code (under torchrun, the agent ends the other ranks once one exits non-zero, hiding theirs)."""
    from test_signals_multiprocess import free_port

    port, procs = free_port(), []
    for rank in range(nproc):
        env = {**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
               "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, *map(str, args)], env=env, stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL))
    return [proc.wait(timeout=300) for proc in procs]


def test_ranks_that_exit_right_after_their_last_collective_finish_cleanly(tmp_path):
    """ZeRO-3's fast ranks go from the final save's all-gathers straight to interpreter exit while rank 0 still
    writes; a gloo thread finishing a work then can abort the rank (SIGABRT) and the launcher fails the whole job.
    sft's commands end with every rank waiting for the last one (a barrier), after success and after a stop all ranks
    agreed on (a signal's: CI saw rank 1 of the 2-process SIGTERM test abort so): no rank leaves before all are
    done, which fails without the barrier. The negative control shows the replay reproduces the abort without sft's
    ending (about half the launches abort, on an idle machine too; up to 20 are tried)."""
    aborted = 0
    for _ in range(20):
        result = launch([EXIT_PROBE, "skip", tmp_path], nproc=3)
        aborted += "SIGABRT" in result.stderr + result.stdout
        if aborted:
            break
    assert aborted, "the replay no longer reproduces the abort: it cannot show the fix works"
    for mode in ["sft", "sft", "stopped", "stopped"]:  # success, or a stop every rank agreed on (exit 143)
        for stamp in tmp_path.glob("rank*.json"):
            stamp.unlink()
        if mode == "sft":
            result = launch([EXIT_PROBE, mode, tmp_path], nproc=3)
            assert result.returncode == 0, f"{result.command}\n{result.stderr[-6000:]}"
        else:  # each rank's own exit code: torchrun's agent would end the others once one exits non-zero
            assert run_ranks([EXIT_PROBE, mode, tmp_path], nproc=3) == [128 + signal.SIGTERM] * 3
        stamps = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(3)]
        assert min(s["left"] for s in stamps) >= max(s["done"] for s in stamps)  # no rank left before all were done


@pytest.mark.slow
def test_fsdp2_on_two_cpu_processes_matches_one_process_and_saves_a_whole_model(recipe, tmp_path, tiny_model_dir,
                                                                                  single_process_loss):
    """The fsdp preset as accelerate runs it on GPUs (fsdp2_prepare_model with sft's wrap classes), on gloo: the
    divergence guard read the DTensor gradient norm FSDP2 returns, which crashed every FSDP run after step 1."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    run = tmp_path / "fsdp"
    torchrun([REPO / "tests" / "fsdp_cpu_probe.py", "train", recipe, "--output_dir", run, "--distributed", "fsdp"])
    units = json.loads((run / "fsdp-rank0.json").read_text())["units"]
    assert units["model.layers.0"] == units["model.layers.1"] == "FSDPLlamaDecoderLayer" and "" in units
    losses = step_losses(run)
    assert len(losses) == 3 and abs(losses[0] - single_process_loss) < 1e-5
    shards = run / "checkpoint-3" / "pytorch_model_fsdp_0"
    assert sorted(p.name for p in shards.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]  # each rank's shard
    dcp_to_torch_save(shards, tmp_path / "consolidated.pt")
    trained = torch.load(tmp_path / "consolidated.pt")["model"]
    saved = load_file(run / "model.safetensors")  # one whole file, not per-rank pieces
    assert set(saved) == set(trained) == set(load_file(tiny_model_dir / "model.safetensors"))
    for name, tensor in saved.items():
        assert torch.equal(tensor, trained[name]), name


@pytest.mark.slow
def test_fsdp2_lora_on_two_cpu_processes_trains_the_adapter_of_one_process(recipe, tmp_path, capsys):
    """LoRA under the fsdp preset: accelerate shards the head as a unit of its own, which the chunked loss gathers;
    the 3 step losses and the saved adapter equal a one-process run over the same global batches."""
    lora = ["--use_peft", "true", "--lora_dropout", "0.0"]
    single = tmp_path / "single"
    train(load_recipe(recipe, flags=lora, distributed=None, per_device_train_batch_size=4, save_strategy="no",
                      output_dir=str(single)))
    run = tmp_path / "fsdp-lora"
    torchrun([REPO / "tests" / "fsdp_cpu_probe.py", "train", recipe, "--output_dir", run, "--distributed", "fsdp",
              *lora])
    units = json.loads((run / "fsdp-rank0.json").read_text())["units"]
    assert units["base_model.model.lm_head"] == "FSDPLinear" and "base_model.model.model.norm" not in units
    assert step_losses(run) == pytest.approx(step_losses(single), abs=1e-5)
    adapter, expected = load_file(run / "adapter_model.safetensors"), load_file(single / "adapter_model.safetensors")
    assert len(adapter) == 28 and set(adapter) == set(expected)  # A and B of the 7 linear layers of 2 blocks
    for name, tensor in adapter.items():
        assert torch.allclose(tensor, expected[name], atol=1e-5), name
    assert any(tensor.abs().max() > 0 for name, tensor in adapter.items() if "lora_B" in name)  # it trained
    # the run's stop tokens beside the adapter, for sft merge (its sharded checkpoints hold no adapter to merge)
    assert GenerationConfig.from_pretrained(run).eos_token_id == GenerationConfig.from_pretrained(single).eos_token_id
    # its checkpoints are FSDP shards: sft merge said "Full fine-tunes need no merge" (it found no adapter_config.json)
    for verb in (["merge", str(run / "checkpoint-3"), str(tmp_path / "merged")],
                 ["generate", str(run / "checkpoint-3"), "--prompt", "hi"]):
        assert main(verb) == 2
        assert f"{run / 'checkpoint-3'} is an FSDP checkpoint: its weights are shards" in capsys.readouterr().err
