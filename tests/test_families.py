"""Model families: sft.models.families' table is the one place a model_type's FSDP wrap classes, plain head (chunked
loss) and packing isolation are decided; every caller reads it."""

import pytest
from transformers import AutoConfig

from sft.errors import SFTError
from sft.models import families
from sft.models.families import FAMILIES, Family
from sft.planning.memory import chunked_loss_applies
from sft.training.flows import check_packing_model
from sft.training.loss import supports_chunked_loss
from sft.training.recipe import load_recipe

from conftest import make_llama


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
    assert len(verified) == 31 and not set(verified) & set(refused)
    assert {"t5", "bart", "olmo"}.isdisjoint(verified + refused)  # in the table, packing not verified
