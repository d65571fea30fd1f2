"""The GPU benchmark's tool names (scripts/bench_gpu.py): a base and '-'-joined modifiers, each one a recipe or
TrainingArguments setting; misspelt names fail before any model is built; the best sft run is compared with the best
TRL run."""

import sys

import pytest

from sft import SFTConfig

from conftest import REPO

sys.path.insert(0, str(REPO / "scripts"))
from bench_gpu import SUITES, best_against_best, job_deadline, kernel_kind, tool_settings  # noqa: E402


def test_modifiers_compose_into_the_settings_each_tool_runs_with():
    assert tool_settings("sft") == ("sft", {})
    assert tool_settings("sft-varlen-compile-liger") == (
        "sft", {"attn_implementation": "varlen", "torch_compile": True, "loss_kernel": "liger"})
    assert tool_settings("trl-flex") == ("trl", {"attn_implementation": "flex_attention"})
    assert tool_settings("sft-compile-budget") == ("sft", {"torch_compile": True, "activation_memory_budget": 0.8})
    assert tool_settings("sft-varlen-compile-autotune") == ("sft", {
        "attn_implementation": "varlen", "torch_compile": True, "torch_compile_mode": "max-autotune-no-cudagraphs"})
    assert tool_settings("plain") == ("plain", {}) and tool_settings("sft_syncs") == ("sft_syncs", {})


@pytest.mark.parametrize("tool", ["sft-varlenn", "trl-liger", "plain-flex", "tlr", "sft-varlen-flex",
                                  "sft-compile-compile", "sft-budget", "sft-autotune"])
def test_unknown_or_conflicting_tools_are_refused_with_the_choices(tool):
    with pytest.raises(SystemExit, match="unknown tool .*sft-varlen\\|flex\\|liger\\|compile\\|budget"):
        tool_settings(tool)


def test_the_fastest_sft_run_is_compared_with_the_fastest_trl_run():
    runs = {"sft": {"tokens_per_s": 100, "peak_memory_bytes": 10, "mfu": 0.3},
            "sft-varlen-compile": {"tokens_per_s": 150, "peak_memory_bytes": 8, "mfu": 0.45},
            "sft_syncs": {"tokens_per_s": 999, "peak_memory_bytes": 1, "mfu": 0.9},  # an A/B control, not sft's best
            "trl": {"tokens_per_s": 50, "peak_memory_bytes": 20, "mfu": 0.15},
            "trl-flex": {"tokens_per_s": 100, "peak_memory_bytes": 16, "mfu": 0.3},
            "trl-compile": {"error": "failed"}, "plain": {"tokens_per_s": 2000, "peak_memory_bytes": 1, "mfu": 0.9}}
    assert best_against_best(runs) == {"sft": "sft-varlen-compile", "trl": "trl-flex", "sft_mfu": 0.45,
                                       "tokens_per_s": 1.5, "peak_memory_bytes": 0.5}
    assert best_against_best({"sft": runs["sft"], "trl-compile": runs["trl-compile"]}) == {}


def test_each_job_gets_a_share_of_the_suite_time_left():
    """Four jobs in 400 s: a job that runs to its deadline cannot starve the ones after it (one deadline for the
    whole suite let the first job's runs take it all), and time a job leaves unused goes to the jobs after it."""
    now, windows = 0.0, []
    for index, needs in enumerate([1000, 10, 1000, 1000]):  # seconds each job would run if let
        deadline = job_deadline(400, now, 4 - index)
        windows.append(deadline - now)
        now = min(now + needs, deadline)
    assert windows == [100, 100, 145, 145]  # job 2's unused 90 s split between jobs 3 and 4
    assert job_deadline(400, 401, 2) == 401  # spent: the job is skipped


def test_every_suite_job_runs_known_tools_sft_and_trl_first():
    """The suites' own tool lists (run when --tools is not given) pass the same check a misspelt --tools fails, and
    put an sft run and a TRL run first: if a job's time runs out, the issue's comparison is what was measured."""
    for jobs in SUITES.values():
        for job in jobs:
            bases = [tool_settings(tool)[0] for tool in job.tools]
            assert bases[:2] == ["sft", "trl"]


def test_profiled_kernels_are_sorted_by_kind_from_their_names():
    """--profile's split of a step: names as torch's profiler reports H100 kernels. Triton kernels (compiled blocks,
    Liger) are bare identifiers; a C++ elementwise kernel is not one, though its name also ends in `kernel`."""
    kinds = {"nvjet_tst_256x128_64x4_2x1_v_bz_coopA_NNT": "matmul", "sm90_xmma_gemm_bf16bf16_bf16f32_f32": "matmul",
             "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64>>(Flash_fwd_params)": "attention",
             "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8, "
             "2, 4, 2, false, false, cutlass::bfloat16_t>>": "attention",
             "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<FusedAdamMathFunctor>": "optimizer",
             "Memcpy DtoD (Device -> Device)": "copy/cast", "triton_poi_fused_add_mul_silu_0": "triton",
             "_rms_norm_forward_kernel": "triton", "liger_cross_entropy_kernel": "triton",
             "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>": "other",
             "aten::mm": "matmul", "aten::scatter_add_": "other"}
    assert {name: kernel_kind(name) for name in kinds} == kinds


def test_fusedloss_is_the_fused_loss_kernel():
    assert tool_settings("sft-varlen-compile-fusedloss") == (
        "sft", {"attn_implementation": "varlen", "torch_compile": True, "loss_kernel": "fused"})
    assert "fused" in SFTConfig.__dataclass_fields__["loss_kernel"].metadata["choices"]
    assert tool_settings("sft-varlen-eagerloss") == ("sft", {"attn_implementation": "varlen", "loss_kernel": "chunked"})


def test_blocking_puts_back_the_blocking_batch_copies_and_the_others_get_sft_s_queued_ones():
    from bench_gpu import queued_copies

    from sft.training.recipe import load_recipe

    _, settings = tool_settings("sft-varlen-compile-blocking")
    assert settings["accelerator_config"] == {"non_blocking": False}
    recipe = {"output_dir": "/tmp/unused", "dataloader_pin_memory": True, "report_to": "none"}
    assert load_recipe(recipe | settings).accelerator_config.non_blocking is False
    assert load_recipe(recipe).accelerator_config.non_blocking is True  # sft's default, which TRL lacks:
    assert queued_copies({"device": "cuda"}) == {"accelerator_config": {"non_blocking": True}}  # given to TRL, plain
    assert queued_copies({"device": "cpu"}) == {}


def test_trace_gaps_charges_each_gpu_wait_to_the_outermost_host_work_running():
    """A GPU timeline with two waits: one while the host reads a value (aten::item, its nested op inside), one in
    the optimizer's step; a 5 µs gap is under the threshold; gaps on one stream covered by another are not gaps."""
    from trace_gaps import analyse

    def event(cat, name, ts, dur, tid=1):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": tid}

    events = [event("kernel", "gemm", 0, 10, 7), event("kernel", "add", 10, 10, 7), event("kernel", "gemm", 50, 10, 7),
              event("kernel", "exp", 65, 5, 7), event("kernel", "copy", 200, 10, 8),
              event("kernel", "adam", 205, 20, 7),
              event("cpu_op", "aten::item", 20, 29), event("cpu_op", "aten::_local_scalar_dense", 21, 27),
              event("user_annotation", "Optimizer.step#AdamW.step", 100, 90, 2),
              event("cuda_runtime", "cudaLaunchKernel", 190, 5, 2)]
    result = analyse(events, min_us=20)
    assert result["span_us"] == 225 and result["idle_us"] == 30 + 130
    assert result["by_host"] == [("Optimizer.step#AdamW.step", 130, 1), ("aten::item", 30, 1)]
    assert [(start, end) for start, end, _ in result["longest"]] == [(70, 200), (20, 50)]
    assert analyse([event("cpu_op", "aten::mm", 0, 5)], 20) == {"gpu_events": 0}


def test_the_clock_synchronises_the_gpu_only_where_it_reads_a_time(tmp_path, monkeypatch):
    """A wait at every step end idled the GPU while the host collated the next batch, in every tool's timed steps.
    The clock waits at the first step (time to first step), the warm-up's end and the timed steps' end (tokens/s),
    and the profiled steps' end; the other steps are timed on the host."""
    import torch
    from bench_gpu import PROFILED, WARMUP, clock_callback

    synchronised = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *args: synchronised.append(len(record["ends"]) + 1))
    record = {"ends": []}
    steps = 8
    spec = {"device": "cuda", "steps": steps, "progress": str(tmp_path / "progress"), "t0": 0.0}
    clock = clock_callback(spec, record)
    for _ in range(WARMUP + steps + PROFILED):
        clock.on_step_end(None, None, None)
    assert synchronised == [1, WARMUP, WARMUP + steps, WARMUP + steps + PROFILED]
    assert len(record["ends"]) == WARMUP + steps + PROFILED


def test_gpu_peak_replays_an_allocation_history_to_its_peak():
    """scripts/gpu_peak.py: the blocks live at the highest allocated total (not the last one, not all ever made),
    charged to the first frame outside torch."""
    from gpu_peak import live_at_peak, site

    def alloc(addr: int, size: int, filename: str = "/x/sft/a.py") -> dict:
        return {"action": "alloc", "addr": addr, "size": size,
                "frames": [{"filename": "/env/torch/nn/functional.py", "line": 1, "name": "linear"},
                           {"filename": filename, "line": addr, "name": "forward"}]}

    events = [alloc(1, 10), alloc(2, 5), {"action": "free_requested", "addr": 1}, alloc(3, 7),
              {"action": "free_requested", "addr": 2}, alloc(4, 9)]
    peak, live, last = live_at_peak(events)
    assert peak == 16 and sorted(live) == [3, 4] and last["addr"] == 4
    assert site(last["frames"]) == "a.py:4 forward"
