"""scripts/bench_loss.py on CPU: every variant is measured or recorded as failed (Liger off CUDA), the table and JSON
come out, and its exactness columns catch a loss that is off by 1%."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import bench_loss

ARGS = ["--small", "--shapes", "qwen2.5-0.5b", "--fractions", "0.5", "--batch", "2", "--length", "32", "--repeats",
        "1"]


def run(tmp_path, variants: str) -> dict:
    out = tmp_path / "loss.json"
    bench_loss.main([*ARGS, "--variants", variants, "--json", str(out)])
    (case,) = json.loads(out.read_text())["cases"]
    return case


def test_bench_loss_measures_the_variants_and_records_failures(tmp_path, capsys):
    case = run(tmp_path, "chunked,chunked-4x,liger,full-logits")
    assert (case["hidden_size"], case["vocab_size"], case["tokens"], case["trained"]) == (112, 9496, 64, 32)
    runs = {r["variant"]: r for r in case["variants"]}
    assert list(runs) == ["chunked", "chunked-4x", "liger", "full-logits"]
    assert "needs a CUDA GPU" in runs["liger"]["error"]  # recorded; the run went on
    for name in ("chunked", "chunked-4x", "full-logits"):
        assert runs[name]["loss_abs_diff"] < 1e-5 and runs[name]["ms"] > 0 and runs[name]["peak_bytes"] is None
        assert runs[name]["grad_hidden_rel_diff"] < 1e-5 and runs[name]["grad_weight_rel_diff"] < 1e-5
    assert runs["chunked"]["loss"] == pytest.approx(case["reference_loss"], abs=1e-5)
    table = capsys.readouterr().out
    assert "chunked-4x" in table and "failed: SFTError: loss_kernel: liger needs a CUDA GPU" in table


def test_exactness_columns_catch_a_loss_off_by_one_percent(tmp_path, monkeypatch):
    build = bench_loss.build

    def off(name, case):
        function = build(name, case)
        return lambda hidden, weight: function(hidden, weight) * 1.01

    monkeypatch.setattr(bench_loss, "build", off)
    (wrong,) = run(tmp_path, "chunked")["variants"]
    assert wrong["loss_abs_diff"] > 0.05  # 1% of a loss of about ln(9496) = 9.2
    assert wrong["grad_hidden_rel_diff"] > 5e-3 and wrong["grad_weight_rel_diff"] > 5e-3


def test_compiled_variant_is_opt_in():
    assert "chunked-compiled" not in bench_loss.parse_args(["--small"]).variants.split(",")
    assert bench_loss.parse_args(["--variants", "chunked-compiled"]).variants == "chunked-compiled"


@pytest.mark.slow
def test_compiled_variant_builds_one_graph_and_is_exact(tmp_path):
    (compiled,) = run(tmp_path, "chunked-compiled")["variants"]
    assert (compiled["graphs"], compiled["graph_breaks"]) == (1, 0)  # the kernel compiled whole; rows chosen eagerly
    assert compiled["loss_abs_diff"] < 1e-5 and compiled["grad_weight_rel_diff"] < 1e-5
