"""One simulated training step of a recipe's architecture, measured by torch's MemTracker under FakeTensorMode.

Nothing is allocated: fake tensors carry shapes and dtypes only, so an 8B or 70B model traces on a laptop in
seconds. This is the ground truth `sft plan`'s formulas are checked against (`sft plan --trace`, tests/test_plan.py).

What the step does is what `sft train` does on one GPU: the model in the recipe's dtype, LoRA through sft's own
`add_adapter` (k-bit preparation included), activation checkpointing as the Trainer enables it, bf16 autocast,
sft's chunked loss where it applies (else the model's own full-logits loss), fused AdamW, two optimizer steps (the
second has optimizer state, as every step after the first does) of `gradient_accumulation_steps` micro-batches
(at most two: a third adds nothing new). Every position is trained (the worst case the planner also assumes).
The eval step is sft's eval forward: per-position token losses one chunk of logits at a time (sft.training.loss).

bitsandbytes 4-bit weights cannot be faked (they quantize while moving to a GPU), so under QLoRA each quantized
linear layer is a `FakeLinear4bit`: its packed storage and quantization constants have the sizes bitsandbytes
gives them (checked against real bitsandbytes layers on CPU in tests/test_plan.py), and its forward dequantizes
the weight to the compute dtype and saves nothing for backward but the packed weight, as bitsandbytes' MatMul4Bit.
"""

import contextlib
import gc
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker
from transformers import AutoModelForCausalLM, PretrainedConfig
from transformers.integrations.deepspeed import unset_hf_deepspeed_config

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.adapters import head_weight, unwrapped
from sft.models.compilation import compile_blocks
from sft.models.quantization import DTYPES, compute_dtype
from sft.planning.cuda_autocast import CudaAutocastOnCpu
from sft.training.linear_cross_entropy import LinearCrossEntropy, chunk_rows, chunked_token_losses
from sft.training.loss import supports_chunked_loss, token_cross_entropy

QUANT_BLOCK = 64  # bitsandbytes' 4-bit block size: one absmax per 64 weights
_NO_HOOK = types.SimpleNamespace(remove=lambda: None)
DOUBLE_QUANT_BLOCK = 256  # double quantization: absmax in uint8, one float32 constant per 256 of them


class PeakTracker(MemTracker):
    """torch's MemTracker keeping only each device's peak.

    MemTracker also updates the peak of every module seen so far on every operator, which makes a trace
    quadratic in depth (minutes for a 32-layer LoRA model); the device peak is all the planner is checked against.
    """

    def _update_peak_stats(self, peak_state: object) -> None:
        for device, snapshot in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snapshot["Total"]:
                self._peak_mem[device] = snapshot["Total"]
                self._peak_mem_snap[device] = dict(snapshot)


@dataclass
class Trace:
    """Peak memory of the simulated step, bytes by MemTracker's reference type."""

    peak: int
    """Total bytes live at the peak."""
    by_kind: dict[str, int]
    """Parameter, Gradient, Activation, Optstate, Temp, ... bytes at the peak."""


def quantized_bytes(numel: int, double_quant: bool) -> int:
    """Bytes bitsandbytes keeps for a 4-bit weight of `numel` elements: packed nibbles, one absmax per block (uint8
    under double quantization, with float32 constants per 256 blocks and its 256-entry code), the 16-value code."""
    blocks = -(-numel // QUANT_BLOCK)
    if not double_quant:
        return numel // 2 + 4 * blocks + 4 * 16
    return numel // 2 + blocks + 4 * 16 + 4 * -(-blocks // DOUBLE_QUANT_BLOCK) + 4 * 256


class _MatMul4bit(torch.autograd.Function):
    """x @ dequant(W).T keeping only the packed weight for backward (bitsandbytes' MatMul4Bit)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, packed: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(packed)
        ctx.shape, ctx.dtype = shape, dtype
        return x.to(dtype) @ _dequantize(packed, shape, dtype).T

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple:
        (packed,) = ctx.saved_tensors
        return grad @ _dequantize(packed, ctx.shape, ctx.dtype), None, None, None


def _dequantize(packed: torch.Tensor, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A compute-dtype weight of `shape` made from the packed storage (values do not matter under fake tensors)."""
    return packed[: shape[0] * shape[1] // 2].to(dtype).repeat(2).view(shape)


class FakeLinear4bit(nn.Linear):
    """A frozen linear layer holding bitsandbytes-sized 4-bit storage instead of its float weight."""

    def __init__(self, linear: nn.Linear, double_quant: bool, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features, self.compute_dtype = linear.in_features, linear.out_features, dtype
        size = quantized_bytes(linear.weight.numel(), double_quant)
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.uint8), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = _MatMul4bit.apply(x, self.weight, (self.out_features, self.in_features), self.compute_dtype)
        return out if self.bias is None else out + self.bias.to(out.dtype)

    # peft's DoRA reads a quantized base weight through dequantize_module_weight, which asks a module with `W_q`
    # (HQQ's attribute) to dequantize() itself; the packed storage is no weight to broadcast with (QDoRA traced and
    # planned with a traceback). So the stand-in answers as bitsandbytes' dequantization does: the compute-dtype weight.
    @property
    def W_q(self) -> torch.Tensor:  # noqa: N802 (peft's name)
        return self.weight

    def dequantize(self) -> torch.Tensor:
        return _dequantize(self.weight, (self.out_features, self.in_features), self.compute_dtype)


def quantize_layers(model: nn.Module, config: SFTConfig) -> None:
    """Replace the linear layers bitsandbytes would quantize (all but the output head) by FakeLinear4bit."""
    head = model.get_output_embeddings()
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and child is not head:
                setattr(parent, name, FakeLinear4bit(child, config.bnb_4bit_use_double_quant, compute_dtype(config)))


def build_model(config: SFTConfig, model_config: PretrainedConfig, device: str) -> nn.Module:
    """The recipe's model (random weights on `device`) prepared as `sft train` prepares it on one GPU."""
    from sft.models.adapters import add_adapter
    from sft.models.loading import freeze_non_text_towers

    model_config = model_config.__class__.from_dict({**model_config.to_dict(), "use_cache": False})
    # unset: transformers' own choice, as `sft train` loads it (sdpa where the family supports it, else eager: Gemma-2)
    model_config._attn_implementation = config.attn_implementation
    dtype = DTYPES.get(config.dtype, torch.bfloat16 if config.bf16 else torch.float32)
    if config.load_in_8bit:
        raise ValueError("memtrace cannot simulate 8-bit (LLM.int8) layers")
    unset_hf_deepspeed_config()  # loading a ZeRO-3 recipe sets a global that would partition this model
    with torch.device(device):
        try:
            model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        except ValueError as err:  # e.g. an attn_implementation the family lacks, as from_pretrained refuses it
            reason = (str(err).splitlines() or [type(err).__name__])[0]
            if reason.startswith("Unrecognized configuration class"):  # Qwen2.5-VL, LLaVA-Next, Idefics3, Qwen3-VL
                reason = ("transformers has no AutoModelForCausalLM class for it, the class `sft train` loads causal "
                          "LMs with (image-text models such as Qwen2.5-VL or LLaVA load as "
                          "AutoModelForImageTextToText, which sft does not train)")
            raise SFTError(f"Could not build {model_config.model_type}: {reason}") from None
        if config.load_in_4bit:
            quantize_layers(model, config)
        freeze_non_text_towers(model)  # a multimodal model's vision tower, as load_model freezes it
        if config.use_peft:
            model = add_adapter(model, config)
    dropout_as_on_cuda(model)
    if config.activation_checkpointing or config.gradient_checkpointing:
        model.activation_checkpointing_enable(config.activation_checkpointing_kwargs
                                              or config.gradient_checkpointing_kwargs)
        if config.use_peft:
            model.enable_input_require_grads()
    return model.train()


def dropout_as_on_cuda(model: nn.Module) -> None:
    """Dropout layers keep for backward what CUDA's fused dropout keeps: a bool mask (torch.native_dropout). On CPU
    F.dropout keeps a noise tensor in the input's dtype instead, one more byte an element under bf16: LoRA's five
    dropped layer inputs a layer, 5h + q + i bytes a token, more on CPU than on an H100 (scripts/layer_memory.py,
    BENCHMARKS.md). The step simulated is the GPU's."""
    for module in model.modules():
        if isinstance(module, nn.Dropout) and 0 < module.p < 1:
            module.forward = types.MethodType(_fused_dropout, module)


def _fused_dropout(self: nn.Dropout, x: torch.Tensor) -> torch.Tensor:
    return torch.native_dropout(x, self.p, True)[0] if self.training else x


def materialize(model: nn.Module) -> None:
    """Meta parameters and buffers replaced by fake tensors of the same shape (call inside FakeTensorMode).

    The model is built on the meta device because peft and k-bit preparation move and cast tensors with
    Module.to, which cannot swap fake parameters in place.
    """
    made: dict[int, torch.Tensor] = {}  # tied weights (embeddings = head) stay one tensor

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in made:
            new = torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu")
            made[id(tensor)] = nn.Parameter(new, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else new
        return made[id(tensor)]

    for module in model.modules():
        for store in (module._parameters, module._buffers):
            for name, tensor in store.items():
                if tensor is not None:
                    store[name] = fake(tensor)


def chunked_applies(model: nn.Module, config: SFTConfig) -> bool:
    """Whether SFTTrainer attaches the chunked loss to this model (sft.training.loss.attach_chunked_loss), under any
    preset."""
    return config.chunked_loss and supports_chunked_loss(unwrapped(model))


def trained_rows(hidden: torch.Tensor) -> torch.Tensor:
    """chunked_forward's trained rows (index_select at the trained positions) with every position trained. The
    trained positions' count is data a fake tensor does not hold; this slice is the same rows, copied as
    index_select copies them."""
    return hidden[:, :-1].clone(memory_format=torch.contiguous_format).flatten(0, 1)


def loss_of(model: nn.Module, config: SFTConfig, ids: torch.Tensor) -> torch.Tensor:
    """The training loss as SFTTrainer computes it (chunked loss where it applies), every position trained."""
    if not chunked_applies(model, config):
        return model(input_ids=ids, labels=ids, use_cache=False).loss
    base = unwrapped(model)
    hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
    weight = head_weight(base.get_output_embeddings())
    return LinearCrossEntropy.apply(trained_rows(hidden), weight, ids[:, 1:].reshape(-1),
                                    torch.tensor(float(ids.numel())), chunk_rows(weight.shape[0]))


@contextlib.contextmanager
def prompt_collection() -> Iterator[None]:
    """Python's cyclic garbage collected at once, as reference counting frees a real step's tensors. Under fake
    tensors peft's DoRA layers leave reference cycles (the real layers leave none on CPU), which held tensors until the
    collector's next run: a 4-layer DoRA step traced 3.78 GiB, 5.02 with the collector off and 3.96 with it at once,
    and the same test gave another peak after other tests ran. Only DoRA recipes' steps: it doubles a trace's time."""
    threshold, enabled = gc.get_threshold(), gc.isenabled()
    gc.collect()
    gc.set_threshold(1, 1, 1)
    gc.enable()
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if not enabled:
            gc.disable()


def trace_step(config: SFTConfig, model_config: PretrainedConfig, fake: bool = True, evaluate: bool = False) -> Trace:
    """Peak memory of two optimizer steps of the recipe's training on one device (fake tensors unless `fake`), or
    with `evaluate` of one eval batch (no optimizer)."""
    torch.manual_seed(0)
    model = build_model(config, model_config, "meta" if fake else "cpu")
    with FakeTensorMode() if fake else contextlib.nullcontext():
        if fake:
            materialize(model)
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], fused=True)
        tracker = PeakTracker()
        tracker.track_external(model, optimizer)
        for param in model.parameters():
            if not param.requires_grad:  # MemTracker hooks every parameter's gradient, which frozen ones refuse
                tracker._param_to_grad_hook_handles[param] = (_NO_HOOK, _NO_HOOK)
        with tracker, prompt_collection() if config.use_dora else contextlib.nullcontext():
            if evaluate:
                eval_step(model, config, model_config.get_text_config().vocab_size, "cpu")
            else:
                train_steps(model, optimizer, config, model_config.get_text_config().vocab_size, "cpu",
                            tracker.reset_mod_stats)
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    by_kind = {str(getattr(k, "value", k)): v for k, v in snapshot.items() if k != "Total"}
    return Trace(peak=snapshot["Total"], by_kind=by_kind)


def train_steps(model: nn.Module, optimizer: torch.optim.Optimizer, config: SFTConfig, vocab_size: int, device: str,
                before_forward: typing.Callable[[], None] = lambda: None) -> None:
    """Two optimizer steps of `gradient_accumulation_steps` (at most 2) micro-batches of random tokens."""
    shape = (config.per_device_train_batch_size, config.max_length)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=bool(config.bf16))
    for _ in range(2):
        for _ in range(min(config.gradient_accumulation_steps, 2)):
            before_forward()  # MemTracker's per-module stats allow one forward each; the peak is kept
            ids = torch.randint(0, vocab_size, shape, device=device)
            with autocast, as_on_cuda(device):
                loss = loss_of(model, config, ids)
            loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)


def eval_step(model: nn.Module, config: SFTConfig, vocab_size: int, device: str) -> None:
    """One eval batch as SFTTrainer evaluates it: chunked_forward's no-grad branch (per-position token losses from
    one chunk of logits at a time) where the chunked loss applies, else the model's own full-logits loss and
    SFTMixin's token-loss pass over those logits."""
    model.eval()
    ids = torch.randint(0, vocab_size, (config.per_device_eval_batch_size, config.max_length), device=device)
    with torch.no_grad(), torch.autocast(device, dtype=torch.bfloat16, enabled=bool(config.bf16)), as_on_cuda(device):
        if not chunked_applies(model, config):
            outputs = model(input_ids=ids, labels=ids, use_cache=False)
            token_cross_entropy(outputs.logits, ids, shifted=True)  # EvalTokenSums.add
            return
        base = unwrapped(model)
        hidden = base.get_decoder()(input_ids=ids, use_cache=False).last_hidden_state
        weight = head_weight(base.get_output_embeddings())
        targets = ids[:, 1:]
        token_losses = torch.zeros(targets.shape, dtype=torch.float32, device=device)
        token_losses.view(-1)[:] = chunked_token_losses(trained_rows(hidden), weight, targets.reshape(-1),
                                                         chunk_rows(weight.shape[0]))


def as_on_cuda(device: str) -> contextlib.AbstractContextManager:
    """On the CPU, CUDA's autocast acted out (its float32 ops: LayerNorm, pow, ...), as dropout_as_on_cuda acts out
    its dropout: the step simulated is the GPU's. On a GPU its own autocast does it."""
    return CudaAutocastOnCpu() if device == "cpu" else contextlib.nullcontext()


def with_layers(model_config: PretrainedConfig, layers: int) -> PretrainedConfig:
    """A copy of the config with its first `layers` decoder layers (and their layer types, where it lists them)."""
    values = {**model_config.to_dict(), "num_hidden_layers": layers}
    if values.get("layer_types"):
        values["layer_types"] = values["layer_types"][:layers]
    return model_config.__class__.from_dict(values)


def saved_per_layer(config: SFTConfig, model_config: PretrainedConfig, tokens: int, device: str = "cpu",
                    backend: str | None = None) -> dict[tuple[str, int], float]:
    """Bytes autograd saves per token in one decoder layer of the recipe's model, by (dtype, elements per token),
    under the recipe's bf16 autocast on `device`: a 2-layer model minus a 1-layer one (the embedding, final norm and
    head cancel), each block compiled in place with `backend` as sft's torch_compile does (None: eager). A storage
    saved twice counts once. The LAYER_BYTES and COMPILED_SAVINGS of sft.planning.memory are fitted to these."""
    saved = {}
    for layers in (1, 2):
        arch = with_layers(model_config, layers)
        torch._dynamo.reset()
        torch.manual_seed(0)
        model = build_model(config, arch, device)
        if backend:
            compile_blocks(model, backend=backend)
        ids = torch.randint(0, arch.vocab_size, (1, tokens), device=device)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        for _ in range(2):  # the first call compiles; the second is measured
            seen = {}

            def keep(tensor: torch.Tensor, seen: dict = seen) -> torch.Tensor:
                storage = tensor.untyped_storage()
                if storage.data_ptr() not in params:
                    seen[storage.data_ptr()] = (tensor.dtype, storage.nbytes())
                return tensor

            with (torch.autocast(device, dtype=torch.bfloat16, enabled=bool(config.bf16)), as_on_cuda(device),
                  torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t)):
                unwrapped(model).get_decoder()(input_ids=ids, use_cache=False)
        by_kind: dict[tuple[str, int], float] = {}
        for dtype, nbytes in seen.values():
            kind = (str(dtype).removeprefix("torch."), nbytes // (tokens * dtype.itemsize))
            by_kind[kind] = by_kind.get(kind, 0) + nbytes / tokens
        saved[layers] = by_kind
    layer = {k: saved[2].get(k, 0) - saved[1].get(k, 0) for k in sorted(set(saved[1]) | set(saved[2]))}
    return {k: v for k, v in layer.items() if v}
