"""LoRA / QLoRA through the real pipeline: only adapters train, quantized bases stay bit-identical, resume is exact."""

import json
import logging
import math
import shutil

import bitsandbytes as bnb
import pytest
import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer
from safetensors.torch import load_file
from transformers import AutoTokenizer

from sft import SFTError, build_datasets, load_recipe, rundir, train
from sft.cli.main import main
from sft.data.tokenizer import load_tokenizer
from sft.models.loading import load_model
from sft.models.saved import load_for_inference
from sft.training.flows import evaluate
from sft.training.loss import attach_chunked_loss
from sft.training.trainer import SFTTrainer

from conftest import make_llama, reference_causal_loss, write_json

ROWS = [{"prompt": "Add 2 and 3:", "completion": " 5"}, {"prompt": "The capital of France is", "completion": " Paris."}]


@pytest.fixture
def data_file(tmp_path):
    return write_json(tmp_path / "data.json", ROWS * 4)


def recipe(model_dir, data, out, **overrides):
    """A small LoRA recipe (fp32, CPU, no saving unless asked) as a dict through load_recipe."""
    values = dict(model_name_or_path=str(model_dir), dataset=str(data), output_dir=str(out), use_peft=True,
                  lora_r=4, lora_alpha=8, lora_dropout=0.0, dtype="float32", max_steps=2, learning_rate=1e-2,
                  per_device_train_batch_size=4, logging_steps=1, save_strategy="no", report_to="none",
                  disable_tqdm=True, seed=0)
    return load_recipe({**values, **overrides})


def fit(config):
    """load_model + SFTTrainer as train() does, keeping the model to inspect; returns (model, trainer)."""
    tokenizer = load_tokenizer(config)
    train_data, _ = build_datasets(config)
    model = load_model(config, tokenizer)
    trainer = SFTTrainer(model=model, args=config, processing_class=tokenizer, train_dataset=train_data)
    return model, trainer


def losses(trainer):
    return [e["loss"] for e in trainer.state.log_history if "loss" in e]


def test_qlora_4bit_trains_only_the_adapter(tmp_path, tiny_model_dir, data_file, caplog):
    # The same 4 rows every step (batch = dataset / 2, both halves identical): the loss must fall.
    config = recipe(tiny_model_dir, write_json(tmp_path / "same.json", [ROWS[0]] * 8), tmp_path / "out",
                    load_in_4bit=True, bnb_4bit_quant_type="nf4", max_steps=5)
    with caplog.at_level(logging.INFO, logger="sft.models.adapters"):
        model, trainer = fit(config)
    assert isinstance(model, PeftModel)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj.base_layer, bnb.nn.Linear4bit) and q_proj.base_layer.weight.quant_type == "nf4"
    assert "Trainable parameters: " in caplog.text
    base_before = {k: v.clone() for k, v in model.state_dict().items() if "lora_" not in k}
    adapter_before = {k: p.detach().clone() for k, p in model.named_parameters() if p.requires_grad}
    trainer.train()
    logged = losses(trainer)
    assert len(logged) == 5 and all(math.isfinite(x) for x in logged) and logged[-1] < logged[0]
    for key, value in model.state_dict().items():  # packed 4-bit weights and quantization states included
        if key in base_before:
            assert torch.equal(value, base_before[key]), key
    assert all("lora_" in k for k in adapter_before)
    changed = [k for k, p in model.named_parameters() if p.requires_grad and not torch.equal(p, adapter_before[k])]
    assert sorted(changed) == sorted(adapter_before)


def test_default_targets_are_all_linear_layers_but_the_head(tiny_model_dir, data_file, tmp_path):
    config = recipe(tiny_model_dir, data_file, tmp_path)
    model = load_model(config, load_tokenizer(config))
    adapted = {name.rsplit(".", 1)[-1] for name, module in model.named_modules() if isinstance(module, LoraLayer)}
    assert adapted == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert not [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]


def test_qdora_magnitudes_stay_float32_and_train(tmp_path, tiny_model_dir, data_file):
    # A bf16 base: downcasting adapters to bf16 would round DoRA's small magnitude updates to zero.
    config = recipe(tiny_model_dir, data_file, tmp_path, load_in_4bit=True, use_dora=True, dtype="bfloat16")
    model, trainer = fit(config)
    magnitudes = {n: p for n, p in model.named_parameters() if "lora_magnitude_vector" in n}
    assert magnitudes and all(p.dtype == torch.float32 and p.requires_grad for p in magnitudes.values())
    before = {n: p.detach().clone() for n, p in magnitudes.items()}
    trainer.train()
    assert all(math.isfinite(x) for x in losses(trainer))
    assert all(not torch.equal(p, before[n]) for n, p in magnitudes.items())


@pytest.mark.parametrize("bf16,dora", [(True, False), (False, False), (True, True)])
def test_qlora_base_stays_as_loaded_under_bf16_and_what_trains_is_float32(tmp_path, tiny_model_dir, data_file, bf16,
                                                                            dora):
    """Under bf16 autocast the base's norms, embeddings and head stay bf16 (peft's float32 upcast cost an 8B model
    4.3 GB on an H100); without it, or under DoRA (whose weight norm takes the residual stream's dtype), they train
    in float32 as before. The adapters and a lora_modules_to_save copy are float32 either way (AdamW steps below
    bf16's precision would round away), and the run trains."""
    config = recipe(tiny_model_dir, data_file, tmp_path, load_in_4bit=True, dtype="bfloat16", bf16=bf16,
                    use_cpu=True, lora_modules_to_save=["lm_head"], use_dora=dora)
    model, trainer = fit(config)
    frozen = {n: p.dtype for n, p in model.named_parameters() if not p.requires_grad and p.is_floating_point()}
    assert frozen and set(frozen.values()) == {torch.bfloat16 if bf16 and not dora else torch.float32}, frozen
    trained = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert any("modules_to_save" in n for n in trained) and {p.dtype for p in trained.values()} == {torch.float32}
    before = {n: p.detach().clone() for n, p in trained.items() if "modules_to_save" in n}
    trainer.train()
    assert all(math.isfinite(x) for x in losses(trainer))
    assert all(not torch.equal(trained[n], value) for n, value in before.items())


def test_lora_under_autocast_keeps_adapter_inputs_bf16_and_computes_the_same(tmp_path, tiny_model_dir, data_file):
    """peft casts each adapted layer's input to its float32 adapter before dropout; under autocast the adapter's
    matmul runs in bf16 either way, so sft skips the cast (137 of 610 ms of kernels a step on an 8B model): the
    dropout sees bf16 inputs, and loss and gradients are bitwise peft's. Control: peft's own cast, restored."""
    config = recipe(tiny_model_dir, data_file, tmp_path, dtype="bfloat16", bf16=True, use_cpu=True)
    model, _ = fit(config)
    layers = [m for m in model.modules() if isinstance(m, LoraLayer)]
    batch = torch.randint(0, 100, (2, 16))

    def step():
        seen = set()
        hooks = [m.lora_dropout["default"].register_forward_pre_hook(lambda _, a: seen.add(a[0].dtype)) for m in layers]
        model.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        for hook in hooks:
            hook.remove()
        return seen, loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    seen, loss, grads = step()
    for layer in layers:  # peft's cast, as it is without sft
        layer.__dict__.pop("_cast_input_dtype", None)
    peft_seen, peft_loss, peft_grads = step()
    assert seen == {torch.bfloat16} and peft_seen == {torch.float32}
    assert torch.equal(loss, peft_loss) and all(torch.equal(grads[n], peft_grads[n]) for n in grads)


def test_dora_under_autocast_keeps_peft_s_float32_input(tmp_path, tiny_model_dir, data_file):
    """DoRA computes its weight norm in the input's dtype: its layers keep peft's float32 cast (a bf16 norm moved
    the loss by 8e-6 on a 2-layer model)."""
    config = recipe(tiny_model_dir, data_file, tmp_path, dtype="bfloat16", bf16=True, use_cpu=True, use_dora=True)
    model, _ = fit(config)
    seen = set()
    for layer in (m for m in model.modules() if isinstance(m, LoraLayer)):
        layer.lora_A["default"].register_forward_pre_hook(lambda _, a: seen.add(a[0].dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=torch.randint(0, 100, (2, 16)))
    assert seen == {torch.float32}


def test_8bit_rslora_run_saves_only_the_adapter(tmp_path, tiny_model_dir, data_file):
    config = recipe(tiny_model_dir, data_file, tmp_path / "out", load_in_8bit=True, use_rslora=True,
                    save_strategy="steps", save_steps=2)
    out = train(config)
    for folder in (out, out / "checkpoint-2"):
        assert (folder / "adapter_model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
        assert not list(folder.glob("model*.safetensors")), folder
    assert '"use_rslora": true' in (out / "adapter_config.json").read_text()
    weights = load_file(out / "adapter_model.safetensors")
    assert weights and all("lora_" in k for k in weights)
    assert any(v.abs().max() > 0 for k, v in weights.items() if "lora_B" in k)  # B starts at zero: it trained


def test_rslora_scales_by_alpha_over_sqrt_r(tiny_model_dir, data_file, tmp_path):
    config = recipe(tiny_model_dir, data_file, tmp_path, use_rslora=True, lora_r=16, lora_alpha=8)
    model = load_model(config, load_tokenizer(config))
    assert model.base_model.model.model.layers[0].mlp.up_proj.scaling["default"] == pytest.approx(8 / 4)


def test_resume_restores_adapter_optimizer_scheduler_and_rng(tmp_path, tiny_model_dir, data_file):
    # Dropout on, so the restored RNG state matters as well as the adapter, optimizer and scheduler.
    settings = dict(max_steps=6, per_device_train_batch_size=2, lora_dropout=0.1, save_strategy="steps",
                    save_steps=3, learning_rate=5e-3)
    straight = train(recipe(tiny_model_dir, data_file, tmp_path / "straight", **settings))
    resumed_dir = tmp_path / "resumed"
    resumed_dir.mkdir()
    shutil.copytree(straight / "checkpoint-3", resumed_dir / "checkpoint-3")  # as if killed after step 3
    rundir.claim(resumed_dir)  # a killed run's folder carries the manifest sft wrote when the run started
    resumed = train(recipe(tiny_model_dir, data_file, resumed_dir, resume_from_checkpoint="true", **settings))
    a, b = load_file(straight / "adapter_model.safetensors"), load_file(resumed / "adapter_model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.fixture
def grown_model_dir(tiny_model_dir):
    """The tiny model folder whose saved tokenizer has two tokens the model has no embedding rows for."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|tool|>", "<|end_tool|>"]})
    tokenizer.save_pretrained(tiny_model_dir)
    return tiny_model_dir


def test_new_token_rows_train_with_the_adapter(tmp_path, grown_model_dir, data_file):
    config = recipe(grown_model_dir, data_file, tmp_path)
    model = load_model(config, load_tokenizer(config))
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    # Input embedding and (untied) output head each train the 2 rows past the old 400, and the tables have exactly
    # 402 rows (not padded to 448): the rows peft's own loaders give the base.
    assert sorted(n.split(".token_adapter")[0].rsplit(".", 1)[-1] for n in trainable) == ["embed_tokens", "lm_head"]
    assert all("trainable_tokens_delta" in n and p.shape[0] == 2 for n, p in trainable.items())
    assert model.get_input_embeddings().weight.shape[0] == model.get_output_embeddings().weight.shape[0] == 402


def test_new_token_rows_are_saved_alone_and_reload_exactly(tmp_path, grown_model_dir, data_file):
    """peft's save_embedding_layers="auto" saved both whole 402-row embedding matrices beside the 2 trained rows
    (4.2 GB a checkpoint on Llama-3-8B); the trained rows alone reload the trained model exactly."""
    model, trainer = fit(recipe(grown_model_dir, data_file, tmp_path / "out", save_strategy="steps", save_steps=2))
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    for folder in (tmp_path / "out", tmp_path / "out" / "checkpoint-2"):
        weights = load_file(folder / "adapter_model.safetensors")
        assert {k: tuple(v.shape) for k, v in weights.items() if "lora_" not in k} == {
            "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta": (2, 32),
            "base_model.model.lm_head.token_adapter.trainable_tokens_delta": (2, 32)}
    ids = torch.tensor([[1, 40, 400, 41, 401, 7]])  # 400 and 401 are the new tokens
    reloaded, _ = load_for_inference(tmp_path / "out", device="cpu")
    with torch.no_grad():
        assert torch.equal(model.eval()(input_ids=ids).logits, reloaded(input_ids=ids).logits)


def test_modules_to_save_and_new_tokens_do_not_clash(tmp_path, grown_model_dir, data_file):
    config = recipe(grown_model_dir, data_file, tmp_path, lora_modules_to_save=["embed_tokens"])
    model = load_model(config, load_tokenizer(config))
    trainable = [n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n]
    assert any("embed_tokens.modules_to_save" in n for n in trainable)  # trained whole
    assert any("lm_head.token_adapter" in n for n in trainable)


@pytest.mark.parametrize("fully_trained", [None, ["lm_head"]])
def test_chunked_loss_runs_on_peft_wrapped_heads(tmp_path, grown_model_dir, data_file, fully_trained):
    """LoRA with tokens a chat template adds wraps lm_head in peft's TrainableTokensWrapper (lora_modules_to_save:
    [lm_head] in a ModulesToSaveWrapper): the chunked loss took it for no plain head and every such run silently
    computed full-vocabulary logits. Chunked, loss and every trainable gradient equal the model's own forward."""
    config = recipe(grown_model_dir, data_file, tmp_path, lora_modules_to_save=fully_trained)
    model = load_model(config, load_tokenizer(config))
    ids = torch.tensor([[1, 40, 400, 41, 401, 7, 401, 9], [1, 400, 52, 401, 3, 401, 11, 401]])
    labels = torch.where(ids == 40, -100, ids)
    reference = reference_causal_loss(model(input_ids=ids).logits, labels, int((labels[:, 1:] != -100).sum()))
    reference.backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad()
    assert attach_chunked_loss(model)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    assert torch.allclose(loss, reference, atol=1e-6, rtol=0)
    assert any("lm_head" in name for name in expected)  # the head's trained rows (or copy) get gradients too
    for name, parameter in model.named_parameters():
        if parameter.requires_grad:
            assert torch.allclose(parameter.grad, expected[name], atol=1e-6, rtol=1e-5), name


@pytest.mark.parametrize("keys, message", [
    (dict(load_in_4bit=True, load_in_8bit=True), "choose one"),
    (dict(load_in_4bit=True, use_peft=False), "use_peft: true"),
    (dict(lora_target_modules=["qkv_proj"]), "lora_target_modules: qkv_proj matches no module of the model"),
    (dict(lora_target_modules=["mlp"]), "Check lora_target_modules"),  # a module peft cannot adapt
    # a typo beside a valid name, or in modules_to_save: peft alone would silently train less than asked
    (dict(lora_target_modules=["q_proj", "v_prj"]),
     r"lora_target_modules: v_prj matches no module of the model\. Did you mean v_proj\?"),
    (dict(lora_modules_to_save=["lm_heads"]),
     r"lora_modules_to_save: lm_heads matches no module of the model\. Did you mean lm_head\?"),
])
def test_invalid_quantization_or_targets_are_refused(tmp_path, tiny_model_dir, data_file, keys, message):
    with pytest.raises(SFTError, match=message):
        train(recipe(tiny_model_dir, data_file, tmp_path / "out", **keys))


def test_sft_eval_of_an_adapter_run_loads_its_base(tmp_path, tiny_model_dir, data_file):
    """`sft eval RECIPE --model_name_or_path RUN` on a use_peft run: the folder holds only the adapter, so every
    config read (max_length fit, packing check, encoder-decoder check, loading) goes through its base model."""
    run = train(recipe(tiny_model_dir, data_file, tmp_path / "run"))
    assert not (run / "config.json").exists() and (run / "adapter_config.json").is_file()
    metrics = evaluate(recipe(run, data_file, tmp_path / "eval", eval_dataset=str(data_file), packing=True))
    assert math.isfinite(metrics["eval_loss"]) and (tmp_path / "eval" / "eval_results.json").is_file()


@pytest.mark.parametrize("bits", ["load_in_4bit", "load_in_8bit"])
def test_sft_eval_of_a_quantized_base_without_an_adapter_measures_it(tmp_path, tokenizer, data_file, bits):
    """Evaluating a 4/8-bit base (a QLoRA run's baseline) trains nothing: it was refused with "quantized weights cannot
    be trained directly", then by the Trainer's own training check. Its loss is the unquantized loss give or take
    the rounding of the weights. Hidden size 64: bitsandbytes' CPU 4-bit inference needs rows of a whole block."""
    model_dir = tmp_path / "model"
    make_llama(len(tokenizer), hidden_size=64, intermediate_size=128).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    keys = {"use_peft": False, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05, "eval_dataset": str(data_file)}
    plain = evaluate(recipe(model_dir, data_file, tmp_path / "plain", **keys))
    quantized = evaluate(recipe(model_dir, data_file, tmp_path / "quantized", **keys, **{bits: True}))
    assert quantized["eval_loss"] != plain["eval_loss"]  # the quantized weights were evaluated
    assert quantized["eval_loss"] == pytest.approx(plain["eval_loss"], abs=0.02)
    with pytest.raises(SFTError, match=f"{bits}: quantized weights cannot be trained directly"):
        train(recipe(model_dir, data_file, tmp_path / "train", **keys, **{bits: True}))


def test_training_on_an_adapter_folder_needs_use_peft_and_trains_that_adapter(tmp_path, tiny_model_dir, data_file,
                                                                               capsys):
    first = train(recipe(tiny_model_dir, data_file, tmp_path / "first"))
    again = tmp_path / "again"
    recipe_file = tmp_path / "again.yaml"
    recipe_file.write_text(f"model_name_or_path: {first}\ndataset: {data_file}\noutput_dir: {again}\nmax_steps: 2\n"
                           "dtype: float32\nreport_to: none\nsave_strategy: 'no'\n")
    # Without use_peft the adapter would load frozen on a frozen base: refused before any data or model loads.
    assert main(["train", str(recipe_file)]) == 2
    err = capsys.readouterr().err
    assert "is a LoRA adapter" in err and "--use_peft true" in err and f"sft merge {first}" in err
    assert "Traceback" not in err and len(err.split("sft: error:")[1].strip().splitlines()) == 1
    assert not again.exists()
    # peft rebuilds the adapter from its adapter_config.json: a recipe value it contradicts could not apply.
    assert main(["train", str(recipe_file), "--use_peft", "true", "--lora_r", "8"]) == 2
    assert "`lora_r: 8` differs from the adapter" in capsys.readouterr().err
    # Control: with use_peft (and the lora_* values it was trained with) the saved adapter trains on.
    out = train(recipe(first, data_file, again))
    before, after = load_file(first / "adapter_model.safetensors"), load_file(out / "adapter_model.safetensors")
    assert before.keys() == after.keys()
    lora = [key for key in before if "lora_" in key]  # (new-token rows the data never uses keep their values)
    assert lora and all(not torch.equal(before[key], after[key]) for key in lora)
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)


# A tool-call turn ends <|call|> (generation stops there: generation_config.json lists it), a plain turn <|end|>.
CALL_TEMPLATE = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if m.content.startswith('CALL') %}<|call|>"
                 "{% endif %}<|end|>{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")


def test_an_adapter_folder_as_the_model_masks_with_its_bases_stop_tokens(tmp_path, tiny_model_dir):
    """`sft eval`/`sft train` with model_name_or_path an adapter run: the chat masks stop where the base's
    generation_config.json says, as when the run trained. The adapter folder has no generation config of its own:
    read from it, <|call|> was no stop token and the tool-call answer trained through the <|end|> after it."""
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|call|>", "<|end|>"]})
    tokenizer.save_pretrained(base)
    generation = json.loads((base / "generation_config.json").read_text())
    call = tokenizer.convert_tokens_to_ids("<|call|>")
    (base / "generation_config.json").write_text(json.dumps({**generation, "eos_token_id": [2, call]}))
    rows = [{"messages": [{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": "CALL weather"},
                          {"role": "tool", "content": "Sunny"}, {"role": "assistant", "content": "Sunny."}]}] * 4
    data = write_json(tmp_path / "chat.jsonl", rows, jsonl=True)
    chat = {"dataset_format": "messages", "chat_template": CALL_TEMPLATE, "assistant_only_loss": True}
    run = train(recipe(base, data, tmp_path / "run", max_steps=1, **chat))
    trained = {}
    for model in (base, run):
        dataset, _ = build_datasets(recipe(model, data, tmp_path / "data", **chat))
        ids, labels = dataset[0]["input_ids"], dataset[0]["labels"]
        trained[model] = tokenizer.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained[base] == "CALL weather<|call|>Sunny.<|end|>"  # the two answers, each through its stop token
    assert trained[run] == trained[base]


def test_lora_dropout_on_expert_stacks_is_refused_with_the_settings_that_work():
    """peft adapts a mixture of experts' 3D expert stacks (all-linear) as bare parameters and refuses dropout there;
    sft's refusal told the user to check module names, which are right. It now names lora_dropout: 0 or attention
    targets, and each of those builds."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from sft.models.adapters import add_adapter

    shape = AutoConfig.for_model("mixtral", vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    values = dict(model_name_or_path="x", dataset="unused.json", output_dir="unused", use_peft=True)

    def adapt(**lora):
        with torch.device("meta"):
            return add_adapter(AutoModelForCausalLM.from_config(shape), load_recipe({**values, **lora}))

    with pytest.raises(SFTError, match=r"Set lora_dropout: 0, or name lora_target_modules without the experts"):
        adapt(lora_dropout=0.05)
    adapt(lora_dropout=0.0)
    adapt(lora_dropout=0.05, lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
