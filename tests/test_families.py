"""Model families: sft.models.families' table is the one place a model_type's FSDP wrap classes, plain head (chunked
loss) and packing isolation are decided; every caller reads it."""

import pytest
import torch
from transformers import AutoConfig

from sft.errors import SFTError
from sft.models import families
from sft.models.families import FAMILIES, Family
from sft.models.loading import load_model
from sft.planning.memory import chunked_loss_applies
from sft.training.flows import check_packing_model
from sft.training.loss import supports_chunked_loss
from sft.training.recipe import load_recipe

from conftest import EMBEDDED_MODEL, make_gemma3, make_llama


@pytest.fixture
def llama_dir(tmp_path):
    """A folder holding a tiny llama config.json (all the callers read)."""
    make_llama(64).config.save_pretrained(tmp_path)
    return str(tmp_path)


def callers(folder: str) -> dict:
    """What each caller decides for the model in `folder`: FSDP wrap, chunked loss in training and in the plan,
    and whether packing is accepted."""
    fsdp = load_recipe({"model_name_or_path": folder, "distributed": "fsdp"})
    config = load_recipe({"model_name_or_path": folder, "packing": True})
    try:
        check_packing_model(config)
        packing = "accepted"
    except SFTError as err:
        packing = str(err)
    return {"wrap": fsdp.fsdp_config.get("transformer_layer_cls_to_wrap"),
            "chunked": supports_chunked_loss(make_llama(64)),
            "planned chunked": chunked_loss_applies(config, AutoConfig.from_pretrained(folder)),
            "packing": packing}


def test_every_caller_reads_the_one_table(llama_dir, monkeypatch):
    assert callers(llama_dir) == {"wrap": ["LlamaDecoderLayer"], "chunked": True, "planned chunked": True,
                                  "packing": "accepted"}
    monkeypatch.setitem(FAMILIES, "llama", Family(wrap=("LlamaMLP",), plain_head=False, packing=False))
    changed = callers(llama_dir)
    assert changed["wrap"] == ["LlamaMLP"] and not changed["chunked"] and not changed["planned chunked"]
    assert changed["packing"].startswith("Packing is not supported for llama models")
    monkeypatch.setitem(FAMILIES, "llama", Family())  # unknown to the table: the cautious answer everywhere
    unknown = callers(llama_dir)
    assert unknown["wrap"] == ["LlamaDecoderLayer"]  # the class's _no_split_modules
    assert not unknown["chunked"] and not unknown["planned chunked"]
    assert "not verified for model_type 'llama'" in unknown["packing"]


def test_packing_lists_come_from_the_table():
    verified, refused = families.packing_families(True), families.packing_families(False)
    assert refused == ["bloom", "gpt_oss", "mpt", "opt"]
    assert len(verified) == 32 and not set(verified) & set(refused)
    assert {"t5", "bart", "olmo"}.isdisjoint(verified + refused)  # in the table, packing not verified


def test_a_multimodal_model_s_towers_are_what_text_never_reaches(tmp_path):
    """Gemma-3 4B+ loads with its SigLIP tower and projector: they get no gradient from text (34 of the tiny
    model's parameters, every one without .grad after a text forward and backward); a text model has none."""
    from transformers import AutoTokenizer

    model = make_gemma3(64)
    towers = families.non_text_towers(model)
    assert towers == ["model.vision_tower", "model.multi_modal_projector"]
    ids = torch.randint(0, 64, (1, 12))
    model(input_ids=ids, labels=ids).loss.backward()
    unused = {name for name, param in model.named_parameters() if param.grad is None}
    in_towers = {name for name, _ in model.named_parameters() if name.startswith(tuple(towers))}
    assert unused == in_towers and len(unused) == 34
    assert families.non_text_towers(make_llama(64)) == []  # control: a text model's every module is reached
    tokenizer = AutoTokenizer.from_pretrained(EMBEDDED_MODEL)
    make_gemma3(len(tokenizer)).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    full = load_model(load_recipe({"model_name_or_path": str(tmp_path)}), tokenizer)
    frozen = {name for name, param in full.named_parameters() if not param.requires_grad}
    assert frozen == in_towers  # the whole text model trains
    lora = load_model(load_recipe({"model_name_or_path": str(tmp_path), "use_peft": True,
                                   "lora_target_modules": ["q_proj", "v_proj"]}), tokenizer)
    adapted = {name.split(".lora_A")[0] for name, _ in lora.named_parameters() if ".lora_A." in name}
    assert len(adapted) == 4 and all(".language_model.layers." in name for name in adapted)  # 2 layers x q, v


def test_a_model_no_causal_lm_class_loads_is_refused_before_the_data_is_read(tmp_path, capsys):
    """transformers has no AutoModelForCausalLM class for image-text models such as Qwen2.5-VL: `sft train` read and
    tokenized the data, then failed at model loading. Refused first now (the data file's own error comes after)."""
    from transformers import Qwen2_5_VLConfig

    from sft.cli.main import main

    model = tmp_path / "qwen2.5-vl"
    Qwen2_5_VLConfig(text_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=100),
                     vision_config=dict(depth=1, hidden_size=32, out_hidden_size=32)).save_pretrained(model)
    data = tmp_path / "data.jsonl"
    data.write_text('{"prompt": "a", "completion": "b"}\nnot json\n')
    for name, expected in ((model, "AutoModelForCausalLM"), (EMBEDDED_MODEL, "line 2")):  # control: data error
        recipe = tmp_path / "recipe.yaml"
        recipe.write_text(f"model_name_or_path: {name}\ndataset: {data}\noutput_dir: {tmp_path / 'out'}\n")
        assert main(["train", str(recipe)]) == 2
        err = capsys.readouterr().err
        assert expected in err and "Traceback" not in err, err
