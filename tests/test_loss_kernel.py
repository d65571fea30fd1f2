"""`loss_kernel: liger`: Liger's fused linear cross-entropy computes the training loss at the trained positions, with
sft's normalisation and label smoothing, equal to sft's chunked loss; it is refused, saying what to do, where it
cannot run. Liger needs Triton and CUDA, so these CPU tests put a reference of the same signature in its place
(the real kernel is checked in tests/test_gpu.py).

`loss_kernel: fused`: sft's chunked loss with each chunk's softmax and gradient compiled by inductor (CPU inductor
here, Triton on a GPU), equal to the eager chunk step; `loss_kernel: auto` runs it on a CUDA GPU with Triton, the
eager step elsewhere."""

import importlib.util
import os
import sys

import pytest
import torch
import torch.nn.functional as F
from test_loss import batch
from test_trainer import toy_dataset

import sft.training.linear_cross_entropy
import sft.training.loss
from sft import SFTConfig, SFTTrainer
from sft.data.encode import IGNORE_INDEX
from sft.errors import SFTError
from sft.training.loss import TokenLoss, attach_chunked_loss, liger_linear_cross_entropy
from sft.training.recipe import load_recipe

from conftest import make_llama


class ReferenceLiger:
    """liger_kernel.transformers.functional.liger_fused_linear_cross_entropy's signature, computed with torch's
    cross entropy (whose label smoothing is an independent statement of the formula); records each call."""

    def __init__(self) -> None:
        self.calls = []

    def __call__(self, input, weight, target, bias=None, ce_weight=None, ignore_index=-100, lse_square_scale=0.0,
                 label_smoothing=0.0, reduction="mean", softcap=None, return_z_loss=False, accum_dtype=None,
                 use_token_scaling=False, return_token_accuracy=False, return_predicted_tokens=False,
                 chunk_mem_const=1):
        self.calls.append({"input": input.detach().clone(), "target": target.clone(), "bias": bias,
                           "ignore_index": ignore_index, "lse_square_scale": lse_square_scale,
                           "label_smoothing": label_smoothing, "reduction": reduction, "softcap": softcap,
                           "return_z_loss": return_z_loss, "accum_dtype": accum_dtype})
        return F.cross_entropy((input @ weight.T).float(), target, ignore_index=ignore_index,
                               label_smoothing=label_smoothing, reduction=reduction)


@pytest.fixture
def reference(monkeypatch):
    """Liger replaced by the reference wherever sft looks it up (any device accepted)."""
    liger = ReferenceLiger()
    monkeypatch.setattr(sft.training.loss, "liger_linear_cross_entropy", lambda device: liger)
    return liger


def loss_and_grads(model, inputs, normalizer):
    model.zero_grad()
    loss = model(**inputs, num_items_in_batch=normalizer).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


@pytest.mark.parametrize(("smoothing", "normalizer"), [(0.0, None), (0.1, 97)])
def test_liger_gets_the_trained_rows_only_and_equals_the_chunked_loss(smoothing, normalizer, monkeypatch):
    model = make_llama(300, initializer_range=0.3)  # peaked logits: smoothing changes the loss measurably
    inputs = batch(300)
    attach_chunked_loss(model, label_smoothing=smoothing)
    chunked, chunked_grads = loss_and_grads(model, inputs, normalizer)
    liger = ReferenceLiger()
    attach_chunked_loss(model, label_smoothing=smoothing, liger=liger)  # replaces the earlier attachment

    def fail(*args):
        raise AssertionError("LinearCrossEntropy ran although Liger was attached")

    monkeypatch.setattr(sft.training.linear_cross_entropy.LinearCrossEntropy, "apply", fail)
    fused, fused_grads = loss_and_grads(model, inputs, normalizer)
    (call,) = liger.calls
    targets = inputs["labels"][:, 1:]
    keep = targets != IGNORE_INDEX
    hidden = model.model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).last_hidden_state
    assert torch.equal(call["target"], targets[keep]) and int(keep.sum()) == 39 < targets.numel()
    assert torch.allclose(call["input"], hidden[:, :-1][keep], atol=1e-6)  # the decoder's output at those rows
    assert (call["reduction"], call["ignore_index"], call["label_smoothing"], call["accum_dtype"]) == \
        ("sum", IGNORE_INDEX, smoothing, torch.float32)
    assert (call["bias"], call["lse_square_scale"], call["softcap"], call["return_z_loss"]) == (None, 0.0, None, False)
    assert torch.allclose(fused, chunked, atol=1e-6)
    for name, grad in fused_grads.items():
        assert torch.allclose(grad, chunked_grads[name], atol=1e-6), name
    other, _ = loss_and_grads(model, inputs, 39 if normalizer else 97)  # the normaliser matters: the check can fail
    assert abs(float(other) - float(fused)) > 0.1


def test_no_trained_row_gives_sft_s_zero_loss_without_calling_liger():
    model = make_llama(300)
    inputs = batch(300)
    inputs["labels"][:] = IGNORE_INDEX
    liger = ReferenceLiger()
    attach_chunked_loss(model, liger=liger)
    loss = model(**inputs).loss
    loss.backward()
    assert float(loss.detach()) == 0.0 and liger.calls == []
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters() if p.grad is not None)


def train_losses(tmp_path, tokenizer, **flags):
    model = make_llama(len(tokenizer), seed=1)
    args = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                     max_steps=2, learning_rate=1e-3, logging_steps=1, report_to="none", save_strategy="no", seed=3,
                     **flags)
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=toy_dataset(),
                         eval_dataset=toy_dataset(1))
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, trainer


def test_trainer_with_liger_trains_as_the_chunked_loss(tmp_path, tokenizer, reference):
    chunked, chunked_trainer = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1)
    assert chunked_trainer.token_loss.kernel == "chunked" and reference.calls == []  # auto on CPU: the eager step
    fused, trainer = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, loss_kernel="liger")
    assert trainer.token_loss.kernel == "liger"
    assert len(reference.calls) == 4  # 2 steps x 2 accumulated micro-batches
    assert {c["label_smoothing"] for c in reference.calls} == {0.1}
    assert fused == pytest.approx(chunked, abs=1e-6) and fused[0] != pytest.approx(fused[1], abs=1e-3)
    evaluated = trainer.evaluate()["eval_loss"]  # eval: sft's own per-token losses, not Liger
    assert len(reference.calls) == 4
    assert evaluated == pytest.approx(chunked_trainer.evaluate()["eval_loss"], abs=1e-6)


INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1" and importlib.util.find_spec("liger_kernel") is not None


@pytest.mark.skipif(not INTERPRETED, reason="the real Liger kernel on CPU needs liger-kernel and triton installed and "
                    "TRITON_INTERPRET=1 (Triton's interpreter)")
def test_the_real_liger_kernel_interpreted_on_cpu_equals_the_chunked_loss(tmp_path, tokenizer, monkeypatch):
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    model = make_llama(300, initializer_range=0.3)
    inputs = batch(300)
    for smoothing, normalizer in ((0.0, None), (0.1, 97)):
        attach_chunked_loss(model, label_smoothing=smoothing)
        chunked, chunked_grads = loss_and_grads(model, inputs, normalizer)
        attach_chunked_loss(model, label_smoothing=smoothing, liger=liger_fused_linear_cross_entropy)
        fused, fused_grads = loss_and_grads(model, inputs, normalizer)
        assert torch.allclose(fused, chunked, atol=1e-6)
        for name, grad in fused_grads.items():
            assert torch.allclose(grad, chunked_grads[name], atol=1e-6), name
    monkeypatch.setattr(sft.training.loss, "liger_linear_cross_entropy", lambda device: liger_fused_linear_cross_entropy)
    chunked_losses, _ = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1)
    fused_losses, trainer = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, loss_kernel="liger")
    assert trainer.token_loss.kernel == "liger" and fused_losses == pytest.approx(chunked_losses, abs=1e-6)


def test_liger_refuses_a_model_without_the_chunked_loss(reference):
    with pytest.raises(SFTError, match="plain linear output head"):
        TokenLoss(torch.nn.Linear(2, 2), True, 0.0, "liger", "cuda")
    with pytest.raises(SFTError, match="chunked_loss: true"):
        TokenLoss(make_llama(64), False, 0.0, "liger", "cuda")
    assert TokenLoss(make_llama(64), True, 0.0, "liger", "cuda").kernel == "liger"  # the control


def test_liger_refuses_a_device_other_than_cuda_and_a_missing_package(monkeypatch):
    with pytest.raises(SFTError, match="needs a CUDA GPU.*loss_kernel: auto"):
        liger_linear_cross_entropy(torch.device("cpu"))
    monkeypatch.setitem(sys.modules, "liger_kernel", None)  # import liger_kernel now raises ImportError
    with pytest.raises(SFTError, match="pip install liger-kernel"):
        liger_linear_cross_entropy(torch.device("cuda"))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_trainer_and_recipe_refuse_liger_without_a_gpu(tmp_path, tokenizer, monkeypatch):
    with pytest.raises(SFTError, match="loss_kernel: liger"):
        train_losses(tmp_path, tokenizer, loss_kernel="liger")
    config = load_recipe({"loss_kernel": "liger", "output_dir": str(tmp_path / "out")})  # loads: `sft check` works
    (problem,) = config.hardware_problems()
    assert problem.startswith("loss_kernel: liger cannot run here") and "loss_kernel: auto" in problem
    assert load_recipe({"output_dir": str(tmp_path / "out")}).hardware_problems() == []
    monkeypatch.setattr("importlib.util.find_spec", lambda name, *args: object())  # as if liger-kernel were installed
    (problem,) = config.hardware_problems()
    assert "need a CUDA GPU" in problem
    from sft.training.flows import train

    with pytest.raises(SFTError, match="loss_kernel: liger cannot run here"):
        train(config)  # before any data or model is loaded


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks `sft check` on a machine without a GPU")
def test_sft_check_runs_a_liger_recipe_with_sft_s_own_loss_on_cpu(tmp_path):
    from sft.check.smoke import CheckReport, cpu_overrides

    report = CheckReport(recipe="liger.yaml")
    overrides = cpu_overrides(load_recipe({"loss_kernel": "liger"}), report, tmp_path)
    assert overrides["loss_kernel"] == "auto" and report.skipped == ["loss_kernel=liger"]
    plain = CheckReport(recipe="plain.yaml")
    assert "loss_kernel" not in cpu_overrides(load_recipe({}), plain, tmp_path) and plain.skipped == []


def test_recipe_checks_the_loss_kernel_value_and_combination():
    assert load_recipe({}).loss_kernel == "auto"
    with pytest.raises(SFTError, match="`loss_kernel`.*not one of auto, chunked, fused, liger"):
        load_recipe({"loss_kernel": "fast"})
    for kernel in ("liger", "fused"):
        with pytest.raises(SFTError, match=f"loss_kernel: {kernel} computes the chunked loss, but chunked_loss is "
                                           "false"):
            load_recipe({"loss_kernel": kernel, "chunked_loss": False})
    assert load_recipe({"loss_kernel": "fused"}).loss_kernel == "fused"


def compiled_frames() -> int:
    return torch._dynamo.utils.counters["frames"]["ok"]


@pytest.mark.parametrize("autocast", [False, True], ids=["float32", "bf16-autocast"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_the_fused_chunk_step_gives_the_eager_loss_and_gradients(autocast, smoothing):
    """The compiled chunk step against the eager one, on a head padded for alignment (1003 rows: its padded columns
    must get no probability and no gradient) with 3 chunks, the last of 1 row, in float32 and under CPU bf16
    autocast with float32 weights (the shipped full recipes' mix)."""
    lce = sft.training.linear_cross_entropy
    torch.manual_seed(0)
    hidden = torch.randn(17, 32, requires_grad=True)
    weight = (torch.randn(1003, 32) * 0.5).requires_grad_()
    targets = torch.randint(0, 1003, (17,))
    results = {}
    for fused in (False, True):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = lce.LinearCrossEntropy.apply(hidden, weight, targets, torch.tensor(11.0), 8, smoothing, fused)
        loss.backward()
        results[fused] = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
        hidden.grad = weight.grad = None
    (eager_loss, eager_hidden, eager_weight), (loss, grad_hidden, grad_weight) = results[False], results[True]
    tolerance = 1e-2 if autocast else 1e-5  # bf16: the 16-bit gradients rounded in a different order
    assert torch.allclose(loss, eager_loss, rtol=1e-6)
    assert torch.allclose(grad_hidden, eager_hidden, rtol=tolerance, atol=1e-6)
    assert torch.allclose(grad_weight, eager_weight, rtol=tolerance, atol=1e-6)
    assert grad_weight.shape == weight.shape


def test_the_fused_chunk_step_runs_compiled_and_keeps_padded_columns_out():
    """The compiled function is what runs (inductor compiled one graph for chunks of any size), and the padded
    columns neither take probability nor get gradient: a version that lets them into the softmax gives another loss
    (the control)."""
    lce = sft.training.linear_cross_entropy
    torch.manual_seed(1)
    hidden, targets = torch.randn(9, 16) * 0.1, torch.randint(0, 1003, (9,))  # small logits: padding would show
    head = lce.aligned_head(torch.randn(1003, 16))
    assert head.shape[0] == 1024
    torch._dynamo.reset()
    frames = compiled_frames()
    for rows in (5, 7, 2):  # chunks of every size share one graph
        lce.fused_logit_gradients(hidden[:rows], head, targets[:rows], 1003, 0.0)
    grad, total = lce.fused_logit_gradients(hidden, head, targets, 1003, 0.0)
    assert compiled_frames() == frames + 1
    assert float(grad[:, 1003:].abs().sum()) == 0.0
    assert torch.allclose(grad.sum(dim=-1), torch.zeros(9), atol=1e-5)  # softmax - onehot over the real columns
    reference = F.cross_entropy(hidden @ head[:1003].T, targets, reduction="sum")
    assert torch.allclose(total, reference, rtol=1e-6)
    leaky = F.cross_entropy(hidden @ head.T, targets, reduction="sum")  # zero logits at 21 padded columns
    assert not torch.allclose(leaky, reference, rtol=1e-4)


def test_trainer_with_the_fused_kernel_trains_as_the_chunked_loss(tmp_path, tokenizer):
    """Under CPU bf16 autocast, the user's mix; the compiled step runs inside the chunked forward (compiled there
    although the loss is kept out of any compiled model graph by torch.compiler.disable)."""
    chunked, _ = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, bf16=True, use_cpu=True)
    torch._dynamo.reset()
    frames = compiled_frames()
    fused, trainer = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, bf16=True, use_cpu=True,
                                  loss_kernel="fused")
    assert trainer.token_loss.kernel == "fused" and compiled_frames() > frames
    assert fused == pytest.approx(chunked, abs=1e-3) and fused[0] != pytest.approx(fused[1], abs=1e-2)


def test_fused_refuses_a_model_without_the_chunked_loss():
    with pytest.raises(SFTError, match="loss_kernel: fused computes the chunked loss.*plain linear output head"):
        TokenLoss(torch.nn.Linear(2, 2), True, 0.0, "fused")
    with pytest.raises(SFTError, match="chunked_loss: true"):
        TokenLoss(make_llama(64), False, 0.0, "fused")
    assert TokenLoss(make_llama(64), True, 0.0, "fused").kernel == "fused"  # the control


def test_a_fused_step_that_cannot_compile_says_what_to_do(monkeypatch):
    """Inductor's failure (here: no C/C++ compiler found) becomes an SFTError naming the fix, not a traceback at the
    first step."""
    from torch._inductor.exc import InductorError

    lce = sft.training.linear_cross_entropy

    def no_compiler(*args):
        raise InductorError(RuntimeError("Failed to find C compiler. Please specify via CC environment variable"),
                            None)

    monkeypatch.setattr(lce, "compiled_logit_gradients", no_compiler)
    hidden, weight = torch.randn(4, 8, requires_grad=True), torch.randn(16, 8, requires_grad=True)
    with pytest.raises(SFTError, match=r"loss_kernel: fused could not compile .*Failed to find C compiler.*Set "
                                       r"loss_kernel: chunked"):
        lce.LinearCrossEntropy.apply(hidden, weight, torch.tensor([1, 2, 3, 4]), torch.tensor(4.0), 8, 0.0, True)
    assert lce.LinearCrossEntropy.apply(hidden, weight, torch.tensor([1, 2, 3, 4]), torch.tensor(4.0), 8, 0.0,
                                        False) > 0  # the eager step, the advice, runs


@pytest.mark.parametrize("capability,triton,compiles,fused", [
    ((9, 0), True, True, True), ((7, 0), True, True, True), ((6, 1), True, True, False), ((9, 0), False, True, False),
    ((9, 0), True, False, False)])
def test_auto_runs_the_fused_step_on_a_cuda_gpu_with_triton(monkeypatch, capability, triton, compiles, fused):
    """Where inductor has Triton for the GPU (compute capability 7.0 or newer) and the step compiles there; the
    device asked is the run's own (under torchrun each rank's)."""
    import torch.utils._triton

    asked = []
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index: asked.append(index) or capability)
    monkeypatch.setattr(torch.utils._triton, "has_triton_package", lambda: triton)
    monkeypatch.setattr(sft.training.loss, "fused_step_compiles", lambda device: asked.append(device) or compiles)
    assert sft.training.loss.fused_step_runs(torch.device("cuda", 1)) is fused
    # each question only once the one before it allowed the fused step
    assert asked == ([] if not triton else [1] if capability < (7, 0) else [1, torch.device("cuda", 1)])
    assert sft.training.loss.fused_step_runs("cpu") is False


def test_auto_keeps_the_eager_step_where_the_fused_one_cannot_compile(monkeypatch, caplog):
    """Triton needs the machine's C compiler (slim images lack one): auto then trains with the eager step and says
    why, where an explicit `loss_kernel: fused` stops with the fix. The probe itself compiles where it can (CPU
    inductor here)."""
    from torch._inductor.exc import InductorError

    probe = sft.training.loss.fused_step_compiles
    probe.cache_clear()
    assert probe(torch.device("cpu"))
    probe.cache_clear()

    def no_compiler(*args):
        raise InductorError(RuntimeError("Failed to find C compiler. Please specify via CC environment variable"),
                            None)

    monkeypatch.setattr(sft.training.linear_cross_entropy, "compiled_logit_gradients", no_compiler)
    with caplog.at_level("WARNING", logger="sft.training.loss"):
        assert not probe(torch.device("cpu"))
    assert "eager chunk step runs" in caplog.text and "Failed to find C compiler" in caplog.text
    probe.cache_clear()


def test_trainer_with_auto_on_a_gpu_trains_with_the_fused_step(tmp_path, tokenizer, monkeypatch):
    """The Trainer's `loss_kernel: auto` where fused_step_runs (a GPU's answer, patched here: the step itself runs
    under CPU bf16 autocast) compiles the chunk step and trains as the eager one; where it does not (CPU), the eager
    step runs (the control); a model without the chunked loss keeps its own under auto."""
    chunked, eager = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, bf16=True, use_cpu=True)
    assert eager.token_loss.kernel == "chunked"
    monkeypatch.setattr(sft.training.loss, "fused_step_runs", lambda device: True)
    torch._dynamo.reset()
    frames = compiled_frames()
    fused, trainer = train_losses(tmp_path, tokenizer, label_smoothing_factor=0.1, bf16=True, use_cpu=True)
    assert trainer.token_loss.kernel == "fused" and compiled_frames() > frames
    assert fused == pytest.approx(chunked, abs=1e-3)
    assert TokenLoss(torch.nn.Linear(2, 2), True, 0.0, "auto", "cuda").kernel == "model"


def test_sft_check_says_what_computes_the_loss_on_a_gpu(capsys, monkeypatch):
    """Its smoke run on CPU runs the eager chunk step; the table says what a GPU run of the recipe computes: under
    auto the fused chunk step, the recipe's kernel where it names one, the model's own loss where the chunked loss
    does not apply (chunked_loss: false, a soft-capped head)."""
    from test_packing import family_config

    from sft.cli.main import main
    from sft.training.loss import loss_on_a_gpu

    from conftest import REPO

    llama = family_config("llama")
    values = dict(model_name_or_path="x", dataset="unused.json", output_dir="unused")
    assert loss_on_a_gpu(load_recipe(values), llama).startswith("the chunked loss, its chunk step fused (auto")
    assert loss_on_a_gpu(load_recipe({**values, "loss_kernel": "chunked"}), llama) == (
        "the chunked loss, its eager chunk step (the recipe's)")
    assert loss_on_a_gpu(load_recipe({**values, "loss_kernel": "liger"}), llama).startswith("Liger's")
    assert loss_on_a_gpu(load_recipe({**values, "chunked_loss": False}), llama).endswith("(chunked_loss: false)")
    assert "no plain linear head" in loss_on_a_gpu(load_recipe(values), family_config("gemma2"))
    monkeypatch.chdir(REPO)  # the quickstart names data/ paths relative to the repository
    assert main(["check", "recipes/quickstart.yaml"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("loss on a GPU"))
    assert "its chunk step fused (auto" in row
