"""`sft plan RECIPE`: per-GPU peak memory broken down, time, a verdict, and the cheapest overrides that make it fit.

Parameters, their dtypes and which are trainable come from the recipe's model built on the meta device exactly as
`sft train` prepares it (sft.memtrace.build_model: k-bit preparation, peft adapters), so they are counted, not
estimated. Activations follow per-token formulas: bytes each token keeps per decoder layer (counted from the
tensors autograd saves, confirmed by MemTracker under FakeTensorMode; see docs/design.md), plus the LM head and
loss. Sharding divides what the `distributed` preset shards. Everything is checked against one simulated step
(`sft plan --trace`, tests/test_plan.py).
"""

import copy
import dataclasses
import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from sft.config import SFTConfig
from sft.distributed import fsdp_config_dict, zero_stage
from sft.hardware import GPU
from sft.loss import CHUNK_ELEMENTS, MIN_CHUNK_ROWS, PLAIN_HEAD_MODELS

GIB = 2 ** 30
# Bytes a token keeps per decoder layer without checkpointing, as multiples of (hidden, attention width
# heads*head_dim, MLP width), for bf16 compute. Full: two RMSNorms keep their fp32 input, normalised and output
# copies (16h); attention keeps q, repeated k/v, output and o_proj's input (8q); the gated MLP keeps gate, silu,
# up and their product (8i). LoRA adds per adapted linear its dropout mask and fp32/bf16 input copies; QLoRA's
# float32 residual stream (k-bit preparation) changes the mix. Measured with MemTracker, see tests/test_plan.py.
LAYER_BYTES = {"full": (16.0, 8.0, 8.0), "lora": (40.4, 14.2, 13.0), "qlora": (38.4, 14.2, 12.2)}
# Gradient temporaries of the MLP (bytes per token per MLP width) while a recomputed LoRA layer runs backward.
BACKWARD_I_BYTES = 11
METHODS = ("full", "lora", "qlora")
CUDA_CONTEXT_GIB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces, outside torch's allocator
FRAGMENTATION = 0.08  # caching-allocator slack over the allocated peak (typical reserved/allocated on LLM training)
DDP_BUCKETS = 2 * 25 * 2 ** 20  # DDP's gradient buckets (25 MB, two in flight)
OPTIMIZER_STATE_BYTES = {"adamw_bnb_8bit": 2, "adamw_8bit": 2, "paged_adamw_8bit": 2, "sgd": 0, "adafactor": 0}


@dataclass
class Setup:
    """The recipe settings the plan depends on; the override search varies them."""

    micro_batch: int
    """per_device_train_batch_size."""
    grad_accum: int
    """gradient_accumulation_steps."""
    max_length: int
    """Tokens per row (packed rows are full; unpacked rows are at most this long: planned as full)."""
    checkpointing: bool
    """Activation (gradient) checkpointing."""
    method: str
    """full, lora or qlora (4-bit base + LoRA)."""
    preset: str
    """single, ddp, fsdp, fsdp_offload, zero2, zero3 or zero3_offload."""
    num_gpus: int = 1
    """GPUs per node."""
    num_nodes: int = 1
    """Nodes."""

    @property
    def world(self) -> int:
        return self.num_gpus * self.num_nodes

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.grad_accum * self.world


@dataclass
class Model:
    """What the meta-device model of one method holds."""

    weight_bytes: int
    """All parameters and buffers as loaded and prepared (4-bit packed, k-bit-prepared float32, adapters)."""
    trainable: int
    """Trainable parameters."""
    trainable_bytes: int
    """Bytes of the trainable parameters in their own dtype."""
    matmul_params: int
    """Multiply-accumulates per token of the full model (all weights but the input embedding)."""
    layer_bytes: int
    """Bytes of the largest decoder layer's weights (what FSDP / ZeRO-3 gather at once)."""


@dataclass
class Plan:
    """The answer of `sft plan`."""

    setup: Setup
    gpu: GPU
    breakdown: dict[str, float]
    """Component -> GiB per GPU."""
    peak_gib: float
    """Per-GPU peak torch allocates (what torch.cuda.max_memory_allocated reports)."""
    total_gib: float
    """peak_gib plus framework overhead: what must fit in the GPU's memory."""
    tokens_per_second: float
    """All GPUs together."""
    flops_per_token: float
    """6N + attention, model FLOPs (recomputation not counted, as MFU defines it)."""
    steps: int | None = None
    """Optimizer steps of the run, when the data is local (or max_steps is set)."""
    hours: float | None = None
    """Wall-clock hours of training."""
    overrides: list[str] = field(default_factory=list)
    """`--flag value` strings that make it fit; empty when it fits."""
    notes: list[str] = field(default_factory=list)
    """Assumptions the numbers rest on."""

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.gpu.memory_gib


def setup_of(config: SFTConfig, num_gpus: int, num_nodes: int) -> Setup:
    """The plan-relevant settings of a loaded recipe."""
    method = "qlora" if (config.load_in_4bit or config.load_in_8bit) else "lora" if config.use_peft else "full"
    return Setup(micro_batch=config.per_device_train_batch_size, grad_accum=config.gradient_accumulation_steps,
                 max_length=config.max_length, method=method, preset=preset_of(config, num_gpus * num_nodes),
                 checkpointing=bool(config.activation_checkpointing or config.gradient_checkpointing
                                    or fsdp_config_dict(config.fsdp_config).get("activation_checkpointing")),
                 num_gpus=num_gpus, num_nodes=num_nodes)


def preset_of(config: SFTConfig, world: int) -> str:
    """The sharding scheme the recipe runs with on `world` GPUs."""
    if config.fsdp:
        return "fsdp_offload" if fsdp_config_dict(config.fsdp_config).get("cpu_offload") else "fsdp"
    stage = zero_stage(config.deepspeed)
    if stage:
        offload = config.distributed == "zero3_offload" or "offload" in str(config.deepspeed)
        return f"zero{stage}" + ("_offload" if offload and stage == 3 else "")
    return "ddp" if world > 1 else "single"


def variant(config: SFTConfig, method: str) -> SFTConfig:
    """The recipe with another training method (attributes only: no validation, no global DeepSpeed state)."""
    out = copy.copy(config)
    out.use_peft = method != "full"
    out.load_in_4bit = method == "qlora" and not config.load_in_8bit
    out.load_in_8bit = method == "qlora" and config.load_in_8bit
    return out


def model_facts(config: SFTConfig, arch: PretrainedConfig, method: str) -> Model:
    """Parameter bytes of the recipe's model prepared for `method`, from a meta-device build."""
    from sft.memtrace import build_model

    cfg = variant(config, method)
    cfg.activation_checkpointing = cfg.gradient_checkpointing = False
    if cfg.load_in_8bit:  # LLM.int8 keeps 1 byte per weight; planned as 4-bit storage doubled
        cfg.load_in_8bit, cfg.load_in_4bit = False, True
    model = build_model(cfg, arch, "meta")
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    weight_bytes = sum(t.numel() * t.element_size() for t in tensors)
    if config.load_in_8bit and method == "qlora":
        weight_bytes += sum(t.numel() for t in tensors if t.dtype == torch.uint8)
    trainable = [p for p in model.parameters() if p.requires_grad]
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers = base.get_decoder().layers
    return Model(weight_bytes=weight_bytes, trainable=sum(p.numel() for p in trainable),
                 trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
                 matmul_params=matmul_params(arch), layer_bytes=max(_bytes(layer) for layer in layers))


def _bytes(module: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def matmul_params(arch: PretrainedConfig) -> int:
    """Weights every token multiplies through: decoder layers and the LM head (not the embedding lookup)."""
    h, layers = arch.hidden_size, arch.num_hidden_layers
    q = arch.num_attention_heads * head_dim(arch)
    kv = arch.num_key_value_heads * head_dim(arch)
    per_layer = h * q * 2 + h * kv * 2 + 3 * h * arch.intermediate_size
    return layers * per_layer + arch.vocab_size * h


def head_dim(arch: PretrainedConfig) -> int:
    return getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads


def activation_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, head_trainable: bool) -> dict[str, int]:
    """Activations of one micro-batch at their peak: saved per layer, the layer being recomputed, LM head / loss."""
    tokens = setup.micro_batch * setup.max_length
    scale = 1 if (config.bf16 or config.fp16) else 2  # the coefficients are for 16-bit compute
    h, q, i = arch.hidden_size, arch.num_attention_heads * head_dim(arch), arch.intermediate_size
    ch, cq, ci = LAYER_BYTES[setup.method]
    layer = int(tokens * (ch * h + cq * q + ci * i) * scale)
    residual = 4 if setup.method == "qlora" else 2 * scale  # k-bit preparation keeps the residual in float32
    saved = arch.num_hidden_layers * (tokens * residual * h if setup.checkpointing else layer)
    head = head_bytes(config, arch, setup, tokens, head_trainable)
    backward = layer + tokens * BACKWARD_I_BYTES * i * scale if setup.checkpointing and setup.method != "full" else 0
    # the last layer's backward (recomputed under checkpointing) runs after the loss's buffers are freed
    return {"activations": saved + tokens * residual * h * 3, "lm head / loss": max(head, backward)}


def chunked_loss_applies(config: SFTConfig, arch: PretrainedConfig, setup: Setup) -> bool:
    """Whether SFTTrainer uses the chunked loss (sft.loss) for this recipe: plain heads, no FSDP/DeepSpeed."""
    return (config.chunked_loss and arch.model_type in PLAIN_HEAD_MODELS and not arch.is_encoder_decoder
            and setup.preset in ("single", "ddp"))


def head_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, tokens: int, trainable: bool) -> int:
    """The LM head and loss at their peak: chunked (one chunk of logits) or full logits."""
    vocab, h = arch.vocab_size, arch.hidden_size
    if not chunked_loss_applies(config, arch, setup):
        return tokens * vocab * 14  # bf16 logits, float32 copy, log-softmax, and its gradient
    chunk = max(MIN_CHUNK_ROWS, CHUNK_ELEMENTS // vocab)
    logits = min(chunk, tokens) * vocab * 10  # float32 logits (turned into probabilities in place), bf16 grad
    # the head's gradient is accumulated in float32 and scaled once more in backward (2 x 4 bytes) then cast
    weight_grad = vocab * h * 10 if trainable else 0
    if setup.method == "qlora":  # k-bit preparation made the head float32: autocast casts it to bf16 per chunk
        weight_grad += vocab * h * 2
    return logits + weight_grad + tokens * h * 4


def shards(setup: Setup) -> int:
    """How many GPUs share one copy of what the preset shards (hybrid FSDP shards within a node)."""
    return setup.world if setup.preset != "ddp" else 1


def memory_breakdown(config: SFTConfig, arch: PretrainedConfig, setup: Setup, model: Model) -> dict[str, int]:
    """Bytes per GPU by component at the training peak (framework overhead excluded)."""
    n, preset = shards(setup), setup.preset
    sharded = preset.startswith(("fsdp", "zero"))
    mixed = sharded and (config.bf16 or config.fp16)  # fp32 master weights under FSDP2 / DeepSpeed mixed precision
    state_bytes = OPTIMIZER_STATE_BYTES.get(str(config.optim).split(".")[-1].lower(),
                                            8 if mixed else 2 * model.trainable_bytes / max(model.trainable, 1))
    frozen = model.weight_bytes - model.trainable_bytes
    if preset in ("fsdp", "fsdp_offload"):  # accelerate's FSDP2 upcasts trainable weights: they are the master
        weights = (frozen + 4 * model.trainable if mixed else model.weight_bytes) / n
        master, grads = 0, (4 if mixed else 2) * model.trainable / n
    else:
        weights = model.weight_bytes / (n if preset.startswith("zero3") else 1)
        master = 4 * model.trainable / n if mixed else 0
        grads = model.trainable_bytes / (n if sharded else 1)
    gathered = 2 * model.layer_bytes if preset.startswith(("fsdp", "zero3")) else 0  # current + prefetched layer
    if preset.endswith("offload"):
        weights, master = (0 if preset == "zero3_offload" else weights), 0
        grads = grads if preset.startswith("zero") else 0
    optimizer = 0 if preset.endswith("offload") else state_bytes * model.trainable / (n if sharded else 1)
    head_trainable = setup.method == "full" or "lm_head" in (config.lora_modules_to_save or [])
    parts = {"weights": weights, "gathered layers": gathered, "master weights (fp32)": master,
             "gradients": grads + (DDP_BUCKETS if preset == "ddp" else 0), "optimizer states": optimizer,
             **activation_bytes(config, arch, setup, head_trainable)}
    return {k: int(v) for k, v in parts.items()}


def train_peak(parts: dict[str, int], setup: Setup) -> int:
    """The peak of a step: activations peak before the gradients are complete unless accumulation keeps them."""
    static = parts["weights"] + parts["gathered layers"] + parts["master weights (fp32)"] + parts["optimizer states"]
    acts = parts["activations"] + parts["lm head / loss"]
    grads = parts["gradients"]
    return static + (acts + grads if setup.grad_accum > 1 else max(acts, grads))
