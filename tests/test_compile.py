"""torch_compile on CPU compiles the module that computes the training loss (the chunked forward runs inside the
compiled model), with the eager loss; label smoothing goes through the same forward as transformers' smoother."""

import math

import pytest
import torch
from test_loss import batch
from test_trainer import toy_dataset
from torch import nn
from transformers.trainer_pt_utils import LabelSmoother

import sft.training.loss
from sft import SFTConfig, SFTTrainer

from conftest import make_llama


class RecordingTrainer(SFTTrainer):
    """Records, per training compute_loss, the class of the module called and the chunked-loss forwards it ran."""

    def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
        before = CALLS["chunked"]
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if model.training:
            self.calls.append((type(model).__name__, CALLS["chunked"] - before))
        return loss


CALLS = {"chunked": 0}


@pytest.fixture
def count_chunked(monkeypatch):
    original = sft.training.loss.chunked_forward

    def counting(*args, **kwargs):
        # Only forwards that compute the chunked loss: without labels (the Trainer's label smoother pops them) the
        # model's own forward runs and the loss is computed elsewhere.
        if kwargs.get("labels") is not None and not kwargs.get("full_logits"):
            CALLS["chunked"] += 1
        return original(*args, **kwargs)

    monkeypatch.setattr(sft.training.loss, "chunked_forward", counting)


def losses(tmp_path, tokenizer, **flags) -> tuple[list[float], list]:
    model = make_llama(len(tokenizer), seed=1)
    args = SFTConfig(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, max_steps=2, learning_rate=1e-3,
                     logging_steps=1, report_to="none", save_strategy="no", seed=3, **flags)
    trainer = RecordingTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=toy_dataset())
    trainer.calls = []
    trainer.train()
    return [e["loss"] for e in trainer.state.log_history if "loss" in e], trainer.calls


@pytest.mark.slow
def test_torch_compile_compiles_the_module_that_computes_the_loss(tmp_path, tokenizer, count_chunked):
    eager, eager_calls = losses(tmp_path, tokenizer)
    # aot_eager: dynamo and AOT autograd as with inductor, without minutes of C++ codegen on a CI CPU (the gpu tier
    # runs inductor)
    compiled, compiled_calls = losses(tmp_path, tokenizer, torch_compile=True, torch_compile_backend="aot_eager")
    assert eager_calls == [("LlamaForCausalLM", 1)] * 2
    assert compiled_calls == [("OptimizedModule", 1)] * 2  # the chunked loss ran inside the compiled module's call
    assert compiled == pytest.approx(eager, abs=1e-4)


def test_label_smoothing_equals_transformers_label_smoother():
    model = make_llama(300, initializer_range=0.3)  # peaked logits: smoothing changes the loss measurably
    inputs = batch(300)
    smoother = LabelSmoother(epsilon=0.1)
    logits = model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits
    expected = smoother({"logits": logits}, inputs["labels"], shift_labels=True, num_items_in_batch=50)
    expected.backward()
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    sft.training.loss.attach_chunked_loss(model, label_smoothing=0.1)
    smoothed = model(**inputs, num_items_in_batch=50).loss
    smoothed.backward()
    assert torch.allclose(smoothed, expected, atol=1e-6)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, grads[name], atol=1e-6), name
    plain = LabelSmoother(epsilon=0.0)({"logits": logits}, inputs["labels"], shift_labels=True, num_items_in_batch=50)
    assert abs(float(plain) - float(smoothed.detach())) > 1e-2  # smoothing changes the loss: the comparison can fail


def test_trainer_hands_label_smoothing_to_the_chunked_forward(tmp_path, tokenizer, count_chunked):
    plain, _ = losses(tmp_path, tokenizer)
    smoothed, smoothed_calls = losses(tmp_path, tokenizer, label_smoothing_factor=0.1)
    unchunked, unchunked_calls = losses(tmp_path, tokenizer, label_smoothing_factor=0.1, chunked_loss=False)
    assert smoothed_calls == [("LlamaForCausalLM", 1)] * 2  # the smoothed loss came from the chunked forward
    assert unchunked_calls == [("LlamaForCausalLM", 0)] * 2  # transformers' LabelSmoother, no chunked forward
    assert smoothed == pytest.approx(unchunked, abs=1e-4) and smoothed[0] != pytest.approx(plain[0], abs=1e-3)


def compiled_graph_ops(chunks: int, monkeypatch) -> tuple[int, float]:
    """Calls dynamo captured for one chunked training forward + backward of a tiny Llama whose trained rows span
    `chunks` chunks of the loss, and the loss."""
    from torch._dynamo.utils import counters
    from transformers import LlamaConfig, LlamaForCausalLM

    from sft.training import loss as loss_module

    monkeypatch.setattr(loss_module, "MIN_CHUNK_ROWS", 8)
    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 8 * 512)  # 8 rows per chunk at vocabulary 512
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, vocab_size=512))
    assert loss_module.attach_chunked_loss(model)
    torch._dynamo.reset()
    counters.clear()
    ids = torch.randint(0, 512, (1, 8 * chunks + 1))
    loss = torch.compile(model, backend="eager")(input_ids=ids, labels=ids).loss
    loss.backward()
    return counters["stats"]["calls_captured"], float(loss.detach())


def test_compiled_forward_keeps_the_chunk_loop_out_of_the_graph(monkeypatch):
    """torch_compile must not trace the loss's chunk loop: dynamo would unroll it, and compile time would grow with
    the chunk count (64-128 chunks at real shapes). The captured graph is the same for 2 and 8 chunks."""
    few, few_loss = compiled_graph_ops(2, monkeypatch)
    many, many_loss = compiled_graph_ops(8, monkeypatch)
    assert few == many and math.isfinite(few_loss) and math.isfinite(many_loss)

    # negative control: with the loss traced (as before), the graph grows with every chunk
    from sft.training import loss as loss_module

    monkeypatch.setattr(loss_module, "eager_linear_cross_entropy", loss_module.LinearCrossEntropy.apply)
    traced_few, _ = compiled_graph_ops(2, monkeypatch)
    traced_many, _ = compiled_graph_ops(8, monkeypatch)
    assert traced_many > traced_few  # the unrolled chunk loop: the traced calls grow with every chunk
    torch._dynamo.reset()
