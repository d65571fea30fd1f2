"""scripts/layer_memory.py: the per-layer table sft plan's activation rows are fitted to, on CPU."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import layer_memory


def test_widths_are_named_by_what_they_are():
    assert [layer_memory.name_width(w) for w in (512, 1024, 384, 192, 1408, 16)] == ["h", "2h", "q", "kv", "i", "16"]


@pytest.mark.slow
def test_layer_memory_tables_on_cpu(tmp_path, capsys):
    """Every configuration measured and written; compiling keeps less than eager and budget 0.8 less than 1, LoRA
    keeps more than full fine-tuning, and LoRA's dropout masks are bool (as CUDA keeps them)."""
    out = tmp_path / "layers.json"
    layer_memory.main(["--tokens", "64", "--json", str(out)])
    kept = json.loads(out.read_text())["kept"]
    total = {label: sum(by_kind.values()) for label, by_kind in kept.items()}
    for method in ("full", "lora"):
        assert total[f"{method} eager"] > total[f"{method} compiled 1.0"] > total[f"{method} compiled 0.8"]
    assert total["lora eager"] > total["full eager"]
    assert kept["lora eager"]["bool h"] == 5 * layer_memory.WIDTHS["h"]
    assert "bytes per token and layer" in capsys.readouterr().out
