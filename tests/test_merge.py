"""sft merge: merged logits equal adapter logits, the merged folder is plain transformers, errors are clear."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
)

from sft import SFTError, load_recipe, rundir, train
from sft.cli.main import main
from sft.data.tokenizer import load_tokenizer
from sft.models.loading import load_model
from sft.models.quantization import run_quantization
from sft.models.saved import load_for_inference

from conftest import locked_by_another_process, make_llama, snapshot, write_json

ROWS = [{"prompt": "Add 2 and 3 <|calc|>", "completion": " 5"},
        {"prompt": "The capital of France is", "completion": " Paris."}]
IDS = torch.tensor([[1, 40, 41, 42, 400, 43, 401, 7]])  # 400 and 401 are the tokens the run added
TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}<|end|>{% endfor %}"
NO_PEFT = """
import sys
sys.modules["peft"] = None  # as if peft were not installed: find_spec finds nothing, import fails
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1])
print(type(model).__name__)
"""


def make_llama64(vocab_size: int) -> LlamaForCausalLM:
    """conftest's tiny Llama at hidden size 64: bitsandbytes' 4-bit inference kernels work in blocks of 64."""
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=False, use_cache=False))


def run_adapter(base_dir, out, **overrides):
    """A 3-step LoRA run through sft.training.flows.train (fp32, CPU); returns its output folder."""
    data = write_json(base_dir.parent / "merge-data.json", ROWS * 4)
    values = dict(model_name_or_path=str(base_dir), dataset=str(data), output_dir=str(out), use_peft=True, lora_r=4,
                  lora_alpha=16, lora_dropout=0.0, dtype="float32", max_steps=3, learning_rate=2e-2,
                  per_device_train_batch_size=4, save_strategy="no", report_to="none", disable_tqdm=True)
    return train(load_recipe({**values, **overrides}))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory, tokenizer):
    """A LoRA adapter trained on the conftest tiny Llama whose tokenizer gained two tokens (rows trained too)."""
    base = tmp_path_factory.mktemp("merge-base") / "base"
    make_llama(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    grown = AutoTokenizer.from_pretrained(base)  # a copy: the session tokenizer stays as it is
    grown.add_special_tokens({"additional_special_tokens": ["<|calc|>", "<|end|>"]})
    grown.chat_template = TEMPLATE
    grown.save_pretrained(base)
    return run_adapter(base, tmp_path_factory.mktemp("merge-run") / "out")


def logits(model) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_merged_logits_equal_adapter_logits(lora_run, tmp_path):
    assert main(["merge", str(lora_run), str(tmp_path / "merged")]) == 0
    adapter, _ = load_for_inference(lora_run, device="cpu")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert type(merged).__name__ == "LlamaForCausalLM" and merged.config.use_cache
    assert (logits(adapter) - logits(merged)).abs().max() < 1e-4
    with adapter.disable_adapter():
        assert (logits(adapter) - logits(merged)).abs().max() > 1e-3  # and training did change the model


def test_an_adapter_with_new_tokens_loads_with_peft_alone(lora_run):
    """Without sft: peft's AutoPeftModelForCausalLM grows the base to len(tokenizer) rows (no padding), so the run
    must train on exactly that many; padded to 448 rows, the new-token indices 402-447 were out of range there."""
    from peft import AutoPeftModelForCausalLM

    model = AutoPeftModelForCausalLM.from_pretrained(str(lora_run)).eval()
    adapter, tokenizer = load_for_inference(lora_run, device="cpu")
    assert logits(model).shape[-1] == len(tokenizer) == 402
    assert torch.equal(logits(model), logits(adapter))


def test_an_adapter_saved_with_padded_embeddings_still_loads(tmp_path, tokenizer, monkeypatch):
    """Runs before sft trained adapters on exactly len(tokenizer) rows padded them to a multiple of 64 (448 here)
    and saved both whole embeddings: sft reloads them on the rows their saved embeddings have."""
    base = tmp_path / "base"
    make_llama(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    grown = AutoTokenizer.from_pretrained(base)
    grown.add_special_tokens({"additional_special_tokens": ["<|calc|>", "<|end|>"]})
    grown.save_pretrained(base)
    # the old layout: rows padded to a multiple of 64, both whole embeddings saved (peft's "auto")
    monkeypatch.setattr("sft.models.loading.adapter_embedding_rows", lambda *args: 448)
    monkeypatch.setattr("sft.models.adapters.save_new_rows_only", lambda model: None)
    run = run_adapter(base, tmp_path / "out", max_steps=1)
    monkeypatch.undo()
    adapter, _ = load_for_inference(run, device="cpu")
    assert logits(adapter).shape[-1] == 448
    assert main(["merge", str(run), str(tmp_path / "merged")]) == 0
    assert (logits(AutoModelForCausalLM.from_pretrained(tmp_path / "merged")) - logits(adapter)).abs().max() < 1e-4


def test_merged_folder_is_plain_transformers(lora_run, tmp_path):
    merged = tmp_path / "merged"
    assert main(["merge", str(lora_run), str(merged), "--dtype", "bfloat16"]) == 0
    names = {p.name for p in merged.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names and not any("adapter" in n for n in names)
    result = subprocess.run([sys.executable, "-c", NO_PEFT, str(merged)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.split() == ["LlamaForCausalLM"]
    assert AutoModelForCausalLM.from_pretrained(merged).dtype == torch.bfloat16
    tokenizer = AutoTokenizer.from_pretrained(merged)
    assert len(tokenizer) == 402 and tokenizer.chat_template == TEMPLATE


def test_trained_and_merged_models_stop_at_the_templates_end_of_turn(lora_run, tmp_path):
    """generation_config.json lists the run's end of turn: transformers' generate and vLLM read it there, and the
    base's config (which never heard of <|end|>) let them write past the end of each turn."""
    end = AutoTokenizer.from_pretrained(lora_run).convert_tokens_to_ids("<|end|>")
    base = json.loads((lora_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert end not in listed(GenerationConfig.from_pretrained(base).eos_token_id)  # the control
    assert end in listed(GenerationConfig.from_pretrained(lora_run).eos_token_id)
    assert main(["merge", str(lora_run), str(tmp_path / "merged")]) == 0
    assert end in listed(GenerationConfig.from_pretrained(tmp_path / "merged").eos_token_id)
    full = train(load_recipe(dict(model_name_or_path=base, dataset=str(write_json(tmp_path / "d.json", ROWS)),
                                  output_dir=str(tmp_path / "full"), max_steps=1, report_to="none")))
    assert end in listed(GenerationConfig.from_pretrained(full).eos_token_id)


def test_a_merged_checkpoint_stops_at_the_templates_end_of_turn(lora_run, tmp_path):
    """A peft save writes no generation_config.json, and checkpoints got none: `sft merge RUN/checkpoint-N` took the
    base's, whose eos_token_id [2] lacks <|end|>, so the merged model wrote past every turn outside sft. Checkpoints
    now carry the run's; one saved before takes its run's."""
    base = json.loads((lora_run / "adapter_config.json").read_text())["base_model_name_or_path"]
    run = run_adapter(Path(base), tmp_path / "run", max_steps=2, save_strategy="steps", save_steps=1)
    ids = listed(GenerationConfig.from_pretrained(run).eos_token_id)
    end = AutoTokenizer.from_pretrained(run).convert_tokens_to_ids("<|end|>")
    assert end in ids and listed(GenerationConfig.from_pretrained(base).eos_token_id) == [2]  # the control
    assert listed(GenerationConfig.from_pretrained(run / "checkpoint-1").eos_token_id) == ids
    (run / "checkpoint-2" / "generation_config.json").unlink()  # as saved before checkpoints carried it
    for checkpoint in ("checkpoint-1", "checkpoint-2"):
        assert main(["merge", str(run / checkpoint), str(tmp_path / f"merged-{checkpoint}")]) == 0
        assert listed(GenerationConfig.from_pretrained(tmp_path / f"merged-{checkpoint}").eos_token_id) == ids


def listed(ids: int | list[int] | None) -> list[int]:
    return ids if isinstance(ids, list) else [ids]


def test_merge_never_replaces_a_users_files_and_replaces_its_own_only_with_overwrite(lora_run, tmp_path, capsys):
    out = tmp_path / "merged"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    for extra in ([], ["--overwrite"]):
        assert main(["merge", str(lora_run), str(out), *extra]) == 2
        assert "holds files sft did not write" in capsys.readouterr().err
        assert (out / "notes.txt").read_text() == "keep me"
    (out / "notes.txt").unlink()
    assert main(["merge", str(lora_run), str(out)]) == 0
    assert main(["merge", str(lora_run), str(out)]) == 2  # an earlier merge stays unless asked
    assert "already holds a model sft wrote" in capsys.readouterr().err
    assert main(["merge", str(lora_run), str(out), "--overwrite"]) == 0
    assert (out / "model.safetensors").is_file()


def test_merge_refuses_an_output_inside_a_run_and_never_replaces_a_run(lora_run, tmp_path, capsys):
    """`sft merge RUN RUN/merged` wrote a folder the run's manifest does not list: a later --overwrite_output_dir of
    the run refused it as foreign (and as RUN/checkpoint-9 it would pass for the run's own checkpoint). `--overwrite`
    onto a training run deleted its adapter, checkpoints and recipe: it replaces an earlier merge only."""
    run = tmp_path / "run"
    shutil.copytree(lora_run, run)
    (run / "checkpoint-2").mkdir()
    rundir.claim(run, [], folders=("checkpoint-2",))  # as a training run records each checkpoint it saves
    before = snapshot(run)
    for inside in (run / "merged", run / "checkpoint-9", run / "checkpoint-2" / "merged"):
        assert main(["merge", str(run), str(inside)]) == 2
        err = capsys.readouterr().err
        assert f"OUTPUT_DIR {inside} is inside the sft run {run.resolve()}" in err and "Traceback" not in err
        assert f"e.g. {tmp_path.resolve() / 'run-merged'}" in err
    other = tmp_path / "other"
    shutil.copytree(lora_run, other)
    for extra in ([], ["--overwrite"]):
        assert main(["merge", str(other), str(run), *extra]) == 2
        assert (f"OUTPUT_DIR {run} holds an sft training run (adapter_config.json, checkpoint-2, recipe.yaml, "
                "trainer_state.json, training_args.bin), not an earlier merge") in capsys.readouterr().err
    assert snapshot(run) == before
    assert rundir.foreign_entries(run) == []  # a later --overwrite_output_dir of the run is not refused
    assert main(["merge", str(run), str(tmp_path / "run-merged")]) == 0  # beside the run, as the message says


def test_merge_holds_its_output_folder_until_the_model_is_saved(lora_run, tmp_path, monkeypatch):
    """sft merge looked for a live run in its output folder only at its start: a training run started there during
    the (slow) load and merge was let in, and both wrote the folder. The merge now holds the lock to its end."""
    out = tmp_path / "merged"
    seen = []
    claim = rundir.claim

    def probed(folder, *args, **kwargs):  # the last thing a merge does: record the files it saved
        seen.append(locked_by_another_process(out))
        return claim(folder, *args, **kwargs)

    monkeypatch.setattr(rundir, "claim", probed)
    assert main(["merge", str(lora_run), str(out)]) == 0
    assert seen == [True] and not locked_by_another_process(out) and not (out / rundir.LOCK).exists()
    assert main(["merge", str(lora_run), str(tmp_path / "refused"), "--base_model", str(tmp_path / "no-base")]) == 2
    assert not (tmp_path / "refused").exists()  # a refused merge leaves no folder behind


@pytest.fixture(scope="module")
def qlora_run(tmp_path_factory, tokenizer):
    """2 QLoRA steps (bitsandbytes NF4 on CPU) on a tiny Llama whose sizes are multiples of 64."""
    base = tmp_path_factory.mktemp("qlora-base") / "base"
    make_llama64(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    return run_adapter(base, tmp_path_factory.mktemp("qlora-run") / "qlora", load_in_4bit=True, max_steps=2)


def test_qlora_merge_dequantizes_the_base_it_trained_on(qlora_run, tmp_path):
    run = qlora_run
    assert main(["merge", str(run), str(tmp_path / "merged")]) == 0
    adapter, _ = load_for_inference(run, device="cpu")  # 4-bit, as trained (recipe.yaml)
    adapter.train()  # the training kernels (exact float32 dequantization), not bitsandbytes' bf16 CPU inference ones
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert "quantization_config" not in merged.config.to_dict() and merged.dtype == torch.float32
    ids = IDS.clamp(max=399)
    with torch.no_grad():
        assert (adapter(input_ids=ids).logits - merged(input_ids=ids).logits).abs().max() < 1e-4


def test_qlora_adapter_loads_on_the_base_quantized_from_the_runs_dtype(tmp_path, tokenizer):
    """bitsandbytes quantizes weights in the dtype they load in: a float32 checkpoint trained with dtype bfloat16 was
    merged (and generated) on a base quantized from float32 (the default dtype, auto), whose 4-bit codes differ for
    ~0.5% of the weights (3512 of 786432 in the quickstart tiny Llama, up to 22% of a layer's largest weight)."""
    import bitsandbytes as bnb

    base = tmp_path / "base"
    make_llama64(len(tokenizer)).save_pretrained(base)  # float32 on disk
    tokenizer.save_pretrained(base)
    run = run_adapter(base, tmp_path / "run", load_in_4bit=True, max_steps=1, dtype="bfloat16")
    trained = AutoModelForCausalLM.from_pretrained(  # the base as sft train loaded it: dtype bfloat16, then quantized
        base, dtype=torch.bfloat16, device_map={"": "cpu"}, quantization_config=run_quantization(run)["quantization_config"])
    codes = {n: m.weight.data for n, m in trained.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    adapter, _ = load_for_inference(run, device="cpu")  # sft generate / chat
    layers = {n: m for n, m in adapter.base_model.model.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert [n.removesuffix(".base_layer") for n in layers] == list(codes)
    assert all(torch.equal(m.weight.data, codes[n.removesuffix(".base_layer")]) for n, m in layers.items())
    assert main(["merge", str(run), str(tmp_path / "merged")]) == 0
    merged = dict(AutoModelForCausalLM.from_pretrained(tmp_path / "merged").named_parameters())
    assert merged["model.embed_tokens.weight"].dtype == torch.float32  # auto: the dtype the base is saved in
    far = 0
    for name, module in adapter.base_model.model.named_modules():
        if isinstance(getattr(module, "base_layer", None), bnb.nn.Linear4bit):
            state = module.base_layer.weight
            expected = bnb.functional.dequantize_4bit(state.data, state.quant_state).float() + module.get_delta_weight(
                "default").float()
            far += ((merged[f"{name}.weight"] - expected).abs() > 0.02 * expected.abs().max()).sum().item()
    assert far == 0  # bfloat16 dequantization rounds by 0.4% at most; another 4-bit code is a step of 2% or more


def test_qdora_adapter_generates_what_its_merge_does(tmp_path, tokenizer):
    """On CPUs with AVX512-BF16 bitsandbytes repacks 4-bit weights at the first eval-mode forward, and peft's DoRA
    read the repacked bytes as NF4 for its weight norms: `sft generate` of a QDoRA run computed logits off by up to
    7.9 (the adapter moves them by 12). Elsewhere nothing is repacked and this passes either way."""
    base = tmp_path / "base"
    make_llama64(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)
    run = run_adapter(base, tmp_path / "run", load_in_4bit=True, use_dora=True, max_steps=2)
    assert main(["merge", str(run), str(tmp_path / "merged")]) == 0
    adapter, _ = load_for_inference(run, device="cpu")  # eval mode, as sft generate / chat run it
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    ids = IDS.clamp(max=399)
    with torch.no_grad():
        first, again = adapter(input_ids=ids).logits, adapter(input_ids=ids).logits
        assert (first - merged(input_ids=ids).logits).abs().max() < 1e-4
        assert torch.equal(first, again)


def test_a_killed_qlora_runs_checkpoint_loads_on_the_4bit_base(tmp_path, tokenizer, monkeypatch):
    """recipe.yaml and data_stats.json were written at the end of a run only: a checkpoint of a QLoRA run killed
    before it was merged (and generated) on the full-precision base, not the 4-bit one its adapter trained on."""
    base = tmp_path / "base"
    make_llama64(len(tokenizer)).save_pretrained(base)
    tokenizer.save_pretrained(base)

    def killed(*args, **kwargs):
        raise SFTError("killed before the final save")

    monkeypatch.setattr("sft.training.flows.save_run", killed)
    with pytest.raises(SFTError, match="killed"):
        run_adapter(base, tmp_path / "run", load_in_4bit=True, max_steps=1, save_strategy="steps", save_steps=1)
    run = tmp_path / "run"
    assert (run / "checkpoint-1").is_dir() and not (run / "adapter_model.safetensors").exists()
    assert run_quantization(run / "checkpoint-1")["quantization_config"].load_in_4bit
    assert json.loads((run / "data_stats.json").read_text())["formats"] == "prompt_completion"
    assert rundir.foreign_entries(run) == []  # both are sft's: a later --overwrite_output_dir is not refused


def test_a_recipe_loading_a_qlora_adapter_on_an_unquantized_base_is_warned(qlora_run, caplog):
    """sft eval / further training of a QLoRA run from a recipe without load_in_4bit evaluates other weights."""
    values = dict(model_name_or_path=str(qlora_run), dataset="unused.json", dtype="float32")
    tokenizer = load_tokenizer(load_recipe(values))
    with caplog.at_level("WARNING", logger="sft"):
        load_model(load_recipe(values), tokenizer)
    assert "trained on a 4-bit base" in caplog.text and "Set load_in_4bit: true" in caplog.text
    caplog.clear()  # Negative control: the recipe quantizing as the run did is not warned
    with caplog.at_level("WARNING", logger="sft"):
        model = load_model(load_recipe({**values, "load_in_4bit": True, "use_peft": True}), tokenizer)
    assert "4-bit base" not in caplog.text and "quantization_config" in model.base_model.model.config.to_dict()


def test_merge_errors_exit_2_with_a_message(lora_run, tiny_model_dir, tmp_path, capsys):
    assert main(["merge", str(tmp_path / "missing"), str(tmp_path / "o1")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["merge", str(tiny_model_dir), str(tmp_path / "o2")]) == 2
    assert "has no adapter_config.json" in capsys.readouterr().err
    moved = tmp_path / "adapter"
    shutil.copytree(lora_run, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    (moved / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": "/nowhere/base"}))
    assert main(["merge", str(moved), str(tmp_path / "o3")]) == 2
    err = capsys.readouterr().err
    assert (f"`base_model_name_or_path in {moved / 'adapter_config.json'} (or pass --base_model)`: /nowhere/base "
            "does not exist") in err
    # --base_model of another size: one line naming a mismatched tensor, exit 2, no traceback
    other = tmp_path / "other-base"
    make_llama(402, hidden_size=64).save_pretrained(other)
    for verb in (["merge", str(lora_run), str(tmp_path / "o4")], ["generate", str(lora_run), "--prompt", "hi"]):
        assert main([*verb, "--base_model", str(other)]) == 2
        err = capsys.readouterr().err
        assert f"The adapter in {lora_run} does not fit the base model {other} (--base_model): size mismatch for" in err
        assert "Traceback" not in err and len(err.split("sft: error:")[1].strip().splitlines()) == 1
    assert main(["merge", str(lora_run), str(tmp_path / "o5"), "--base_model", str(tmp_path / "missing")]) == 2
    err = capsys.readouterr().err  # a missing folder is named as such (it read "Repo id must use alphanumeric")
    assert f"`--base_model`: {tmp_path / 'missing'} does not exist. Give an existing folder" in err


def test_an_adapter_without_its_tokenizer_is_named_as_such(lora_run, tmp_path, capsys):
    """An adapter copied without its tokenizer files got transformers' "Couldn't instantiate the backend tokenizer
    from one of:" (its first line, naming nothing)."""
    bare = tmp_path / "adapter"
    bare.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        shutil.copy(lora_run / name, bare / name)
    for verb in (["merge", str(bare), str(tmp_path / "out")], ["generate", str(bare), "--prompt", "hi"]):
        assert main(verb) == 2
        err = capsys.readouterr().err
        assert (f"sft: error: {bare} holds no tokenizer files (tokenizer_config.json, tokenizer.json, ...): every sft "
                f"run and checkpoint saves its tokenizer beside the model. Copy the run's tokenizer files into {bare}"
                in err) and "Traceback" not in err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("use_peft", [False, True])
def test_a_run_folder_as_the_model_loads_its_base_and_adapter(lora_run, tmp_path, use_peft):
    # `sft eval RECIPE --model_name_or_path RUN` evaluates the adapter; use_peft trains it further.
    config = load_recipe(dict(model_name_or_path=str(lora_run), output_dir=str(tmp_path), dtype="float32",
                              use_peft=use_peft))
    model = load_model(config, load_tokenizer(config)).eval()
    adapter, _ = load_for_inference(lora_run, device="cpu")
    assert torch.equal(logits(model), logits(adapter))
    assert any(p.requires_grad for p in model.parameters()) == use_peft
