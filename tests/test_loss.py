"""The chunked trained-positions loss equals the plain full-logits loss, in value and in gradients."""

import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from sft.data.encode import IGNORE_INDEX
from sft.training import linear_cross_entropy
from sft.training.linear_cross_entropy import LinearCrossEntropy
from sft.training.loss import attach_chunked_loss

from conftest import make_llama, reference_causal_loss


def batch(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (3, 20), generator=g)
    labels = ids.clone()
    labels[0, :12] = IGNORE_INDEX
    labels[1, :3] = IGNORE_INDEX
    labels[2, 15:] = IGNORE_INDEX
    labels[:, 0] = IGNORE_INDEX
    mask = torch.ones_like(ids)
    mask[2, 15:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


@pytest.mark.parametrize("normalizer", [None, 97])
def test_chunked_loss_and_gradients_equal_the_plain_ones(normalizer, monkeypatch):
    monkeypatch.setattr("sft.training.linear_cross_entropy.MIN_CHUNK_ROWS", 1)
    # 7-row chunks over a 300-token vocabulary: a ragged split
    monkeypatch.setattr("sft.training.linear_cross_entropy.CHUNK_ELEMENTS", 7 * 300)
    model = make_llama(300)
    inputs = batch(300)
    trained = int((inputs["labels"][:, 1:] != IGNORE_INDEX).sum())
    plain = reference_causal_loss(model(input_ids=inputs["input_ids"], attention_mask=inputs["attention_mask"]).logits,
                                  inputs["labels"], normalizer or trained)
    plain.backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters()}
    model.zero_grad()
    assert attach_chunked_loss(model)
    chunked = model(**inputs, num_items_in_batch=normalizer).loss  # the model's own forward computes it
    assert model(input_ids=inputs["input_ids"]).logits.shape == (3, 20, 300)  # without labels: unchanged
    chunked.backward()
    assert torch.allclose(chunked, plain, atol=1e-6)
    for name, param in model.named_parameters():
        assert torch.allclose(param.grad, expected[name], atol=1e-6), name


def test_frozen_head_gets_no_gradient_but_hidden_does():
    hidden = torch.randn(10, 8, requires_grad=True)
    weight = torch.randn(50, 8)
    targets = torch.randint(0, 50, (10,))
    loss = LinearCrossEntropy.apply(hidden, weight, targets, torch.tensor(10.0), 3)
    loss.backward()
    reference = torch.nn.functional.cross_entropy(hidden.detach().requires_grad_() @ weight.T, targets)
    assert torch.allclose(loss, reference, atol=1e-6) and hidden.grad is not None and weight.grad is None


def test_chunked_loss_gathers_a_head_that_fsdp2_shards_as_its_own_unit(tmp_path):
    """accelerate makes the LM head an FSDP2 unit of its own where it finds no final norm beside it (PEFT models):
    its weight is gathered only by its forward, which the chunked loss does not call, so a LoRA + FSDP run failed
    its first step with "aten.mm.default got mixed torch.Tensor and DTensor". Loss and every gradient (the head's,
    reduced by FSDP2's end-of-backward callback, included) must equal the unsharded model's."""
    import copy

    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    model = make_llama(300)
    inputs = batch(300)
    reference = copy.deepcopy(model)
    attach_chunked_loss(reference)
    expected_loss = reference(**inputs).loss
    expected_loss.backward()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'group'}", rank=0, world_size=1)
    try:
        assert attach_chunked_loss(model)  # at load, before the Trainer shards the model
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model.lm_head)  # its own unit, as accelerate's fsdp2_prepare_model makes it for a PEFT model
        fully_shard(model)
        loss = model(**inputs).loss
        loss.backward()
        assert torch.allclose(loss, expected_loss, atol=1e-6)
        for (name, param), ref in zip(model.named_parameters(), reference.parameters()):
            assert torch.allclose(param.grad.full_tensor(), ref.grad, atol=1e-6), name
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("multimodal", [False, True], ids=["gemma3_text", "gemma3"])
def test_gemma3_chunked_loss_equals_its_own_and_a_soft_capped_head_keeps_its_own(multimodal):
    """Gemma-3 (1B as Gemma3ForCausalLM, 4B+ as Gemma3ForConditionalGeneration) has a plain head: its 262k-token
    logits were computed whole. The chunked loss and gradients equal the model's own; with
    final_logit_softcapping set (Gemma-2 style) the head is not plain and the model keeps its own loss."""
    from transformers import Gemma3ForCausalLM

    from conftest import make_gemma3

    model = make_gemma3(292) if multimodal else Gemma3ForCausalLM(make_gemma3(292).config.text_config).float()
    model.train()
    inputs = batch(300)
    plain = model(**inputs).loss
    plain.backward()
    expected = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    assert attach_chunked_loss(model)
    chunked = model(**inputs).loss
    chunked.backward()
    assert torch.allclose(chunked, plain, atol=1e-6)
    assert {k for k, p in model.named_parameters() if p.grad is not None} == set(expected)
    for name, grad in expected.items():
        assert torch.allclose(dict(model.named_parameters())[name].grad, grad, atol=1e-6), name
    capped = copy.deepcopy(model.config)
    capped.get_text_config().final_logit_softcapping = 30.0
    assert not attach_chunked_loss(type(model)(capped))


def head_case(vocab: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(37, 16, generator=g).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, 16, generator=g) * 0.25).to(dtype).requires_grad_()
    return hidden, weight, torch.randint(0, vocab, (37,), generator=g)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_an_unaligned_head_gives_the_loss_and_gradients_of_its_own_rows_only(smoothing, monkeypatch):
    """A head whose bf16 rows are not 16-byte aligned (301 rows; float32 weights under bf16 autocast, as the shipped
    full fine-tune recipes run) is read through a copy padded with zero rows: the padding's logits must stay out of
    the softmax, the smoothing mean and both gradients. Against the same loss without the padding: loss and the
    float32-accumulated weight gradient to 1e-6, the input gradient within its bf16 rounding."""
    hidden, weight, targets = head_case(301, torch.float32)
    assert linear_cross_entropy.aligned_head(weight[:300]).shape == (300, 16)  # 300 float32 rows are aligned
    with torch.autocast("cpu", dtype=torch.bfloat16):  # in bf16 they are not: a bf16 copy of 320 rows
        padded = linear_cross_entropy.aligned_head(weight[:300])
        assert padded.shape == (320, 16) and padded.dtype == torch.bfloat16 and not padded[300:].any()

    def run() -> tuple:
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = LinearCrossEntropy.apply(h, w, targets, torch.tensor(37.0), 8, smoothing)
            token_losses = linear_cross_entropy.chunked_token_losses(h.detach(), w.detach(), targets, 8)
        loss.backward()
        return loss.detach(), h.grad, w.grad, token_losses

    loss, grad_hidden, grad_weight, token_losses = run()
    monkeypatch.setattr(linear_cross_entropy, "aligned_head", lambda w: w)
    expected = run()
    assert grad_weight.shape == (301, 16)
    assert torch.allclose(loss, expected[0], rtol=1e-6)
    assert torch.allclose(grad_weight, expected[2], rtol=1e-6, atol=1e-9)
    assert torch.allclose(grad_hidden, expected[1], rtol=1e-2, atol=1e-5)
    assert torch.allclose(token_losses, expected[3], rtol=1e-6)


class GemmOperands(TorchDispatchMode):
    """Records every matmul's 2-D inputs and output: (leading dimension in elements, byte offset) of each."""

    def __init__(self) -> None:
        super().__init__()
        self.operands = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            matrices = [a for a in (*args, out) if isinstance(a, torch.Tensor) and a.dim() == 2]
            self.operands += [(max(m.stride()), m.storage_offset() * m.element_size()) for m in matrices]
        return out

    def misaligned(self) -> list:
        return [(ld, offset) for ld, offset in self.operands if ld * 2 % 16 or offset % 16]


@pytest.mark.parametrize("autocast", [False, True], ids=["bf16", "float32_under_bf16_autocast"])
def test_the_heads_matmuls_read_16_byte_aligned_rows_whatever_the_vocabulary(autocast, monkeypatch):
    """cuBLAS takes sm75 align1 kernels for a half-precision matrix whose rows are not 16-byte aligned (a Qwen2.5-0.5B
    head cut to 151,665 rows spent half its H100 step's matmul time there). Every matmul of the chunked loss, forward,
    backward and eval, must read aligned rows for a 1,001-row head; without the padding (the negative control) they
    do not; and the padded loss equals the unpadded one."""
    hidden, weight, targets = head_case(1001, torch.float32 if autocast else torch.bfloat16)

    def run() -> tuple:
        h, w = hidden.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), GemmOperands() as gemms:
            loss = LinearCrossEntropy.apply(h, w, targets, torch.tensor(37.0), 8)
            loss.backward()
            linear_cross_entropy.chunked_token_losses(h.detach(), w.detach(), targets, 8)
        return gemms, loss.detach(), h.grad, w.grad

    gemms, loss, grad_hidden, grad_weight = run()
    assert len(gemms.operands) >= 3 * 3 * 5 and not gemms.misaligned()
    monkeypatch.setattr(linear_cross_entropy, "aligned_head", lambda w: w)
    unpadded, unpadded_loss, unpadded_hidden, unpadded_weight = run()
    assert unpadded.misaligned()
    assert torch.allclose(loss, unpadded_loss, rtol=1e-3)
    assert torch.allclose(grad_hidden.float(), unpadded_hidden.float(), rtol=1e-2, atol=1e-4)
    assert torch.allclose(grad_weight.float(), unpadded_weight.float(), rtol=1e-2, atol=1e-4)
