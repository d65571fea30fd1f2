"""`sft plan RECIPE`: per-GPU peak memory broken down, time, a verdict, and the cheapest overrides that make it fit.

Parameters, their dtypes and which are trainable come from the recipe's model built on the meta device exactly as
`sft train` prepares it (sft.planning.memtrace.build_model: k-bit preparation, peft adapters), so they are counted, not
estimated. Activations follow per-token formulas: bytes each token keeps per decoder layer (counted from the
tensors autograd saves, confirmed by MemTracker under FakeTensorMode; see docs/design.md), plus the LM head and
loss. Sharding divides what the `distributed` preset shards. Everything is checked against one simulated step
(`sft plan --trace`, tests/test_plan.py).
"""

import copy
import dataclasses
import itertools
import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from sft.config.arguments import SFTConfig
from sft.training.presets import fsdp_config_dict, zero_stage
from sft.planning.hardware import GPU
from sft.training.loss import PLAIN_HEAD_MODELS, chunk_rows

GIB = 2 ** 30
# Bytes a token keeps per decoder layer without checkpointing, as multiples of (hidden, attention width
# heads*head_dim, MLP width), for bf16 compute. Full: two RMSNorms keep their fp32 input, normalised and output
# copies (16h); attention keeps q, repeated k/v, output and o_proj's input (8q); the gated MLP keeps gate, silu,
# up and their product (8i). LoRA adds per adapted linear its dropout mask and fp32/bf16 input copies; QLoRA's
# float32 residual stream (k-bit preparation) changes the mix. Measured with MemTracker, see tests/test_plan.py.
LAYER_BYTES = {"full": (16.0, 8.0, 8.0), "lora": (40.4, 14.2, 13.0), "qlora": (38.4, 14.2, 12.2)}
# Gradient temporaries of the MLP (bytes per token per MLP width) while a recomputed LoRA layer runs backward.
BACKWARD_I_BYTES = 11
EAGER_SCORE_BYTES = 6  # per attention score per head, eager attention only (sdpa/flash keep no T x T tensor)
METHODS = ("full", "lora", "qlora")
FULL_LOGIT_BYTES = 14  # per logit where training runs no chunked loss: bf16, float32 copy, log-softmax, gradient
# per logit where eval runs no chunked loss: bf16, float32 copy, log-softmax (the model's loss frees its own before
# SFTMixin's token-loss pass makes the same again); MemTracker of memtrace.eval_step, tests/test_plan.py
EVAL_LOGIT_BYTES = 10
# Eval (no grad) keeps no activations, only one layer's transient: bytes per token as multiples of (hidden, MLP
# width). Full: the MLP's activation, up projection and product (6i), residual, normed input and the norm's float32
# temporaries (8h); LoRA adds float32 copies of adapted inputs, QLoRA a float32 residual stream. Fitted to
# MemTracker's peak of the eval step (memtrace.eval_step) across widths; tests/test_plan.py checks it.
EVAL_LAYER_BYTES = {"full": (8.0, 6.0), "lora": (12.0, 8.0), "qlora": (18.0, 8.0)}
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
    """single, ddp, fsdp, fsdp_hybrid (sharded within a node), fsdp_offload, zero2, zero3 or zero3_offload."""
    eval_batch: int = 1
    """per_device_eval_batch_size."""
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

    def as_dict(self) -> dict:
        """The `sft plan --json` object."""
        return {"fits": self.fits, "peak_gib": round(self.peak_gib, 3), "total_gib": round(self.total_gib, 3),
                "gpu": self.gpu.name, "gpu_memory_gib": self.gpu.memory_gib, "num_gpus": self.setup.num_gpus,
                "num_nodes": self.setup.num_nodes, "setup": dataclasses.asdict(self.setup),
                "breakdown": {k: round(v, 3) for k, v in self.breakdown.items()},
                "tokens_per_second": round(self.tokens_per_second, 1), "flops_per_token": self.flops_per_token,
                "mfu": self.gpu.mfu, "steps": self.steps, "hours": self.hours,
                "gpu_hours": self.hours * self.setup.world if self.hours is not None else None,
                "overrides": self.overrides, "notes": self.notes}

    def table(self, recipe: str) -> str:
        """The readable report: setup, memory table, time, verdict."""
        s = self.setup
        where = f"{s.num_nodes} x {s.num_gpus}" if s.num_nodes > 1 else f"{s.num_gpus}"
        lines = [f"sft plan: {recipe} on {where} x {self.gpu.name} ({self.gpu.memory_gib:g} GiB each)",
                 f"setup: {s.method}, micro-batch {s.micro_batch} x {s.max_length} tokens, gradient accumulation "
                 f"{s.grad_accum}, checkpointing {'on' if s.checkpointing else 'off'}, {s.preset}", "",
                 f"{'per GPU':<28}{'GiB':>8}", "-" * 36]
        lines += [f"{k:<28}{v:>8.2f}" for k, v in self.breakdown.items() if v or k == "activations"]
        lines += ["-" * 36, f"{'peak allocated':<28}{self.peak_gib:>8.2f}",
                  f"{'total with overhead':<28}{self.total_gib:>8.2f}", ""]
        run = (f"{self.steps:,} steps, {self.hours:.1f} h, {self.hours * s.world:.1f} GPU-hours" if self.hours
               else "steps unknown: the data is not local (set max_steps, or run where it is)")
        lines += [f"time: {self.flops_per_token / 1e9:.1f} GFLOPs/token (6N + attention), "
                  f"{self.tokens_per_second:,.0f} tokens/s, {run}"]
        lines += [f"      {note}" for note in self.notes]
        lines.append(self.verdict())
        return "\n".join(lines)

    def verdict(self) -> str:
        """FITS / DOES NOT FIT, with the overrides that make it fit."""
        room = f"{self.total_gib:.1f} of {self.gpu.memory_gib:g} GiB"
        if self.fits:
            return f"verdict: FITS ({room})"
        if not self.overrides:
            return (f"verdict: DOES NOT FIT ({room}); no micro-batch, checkpointing, preset, offload or LoRA/QLoRA "
                    "setting fits: use more GPUs (--num_gpus) or a shorter max_length")
        return f"verdict: DOES NOT FIT ({room}); add: {' '.join(self.overrides)}"


def setup_of(config: SFTConfig, num_gpus: int, num_nodes: int) -> Setup:
    """The plan-relevant settings of a loaded recipe."""
    method = "qlora" if (config.load_in_4bit or config.load_in_8bit) else "lora" if config.use_peft else "full"
    return Setup(micro_batch=config.per_device_train_batch_size, grad_accum=config.gradient_accumulation_steps,
                 max_length=config.max_length, method=method, preset=preset_of(config, num_gpus * num_nodes),
                 checkpointing=bool(config.activation_checkpointing or config.gradient_checkpointing
                                    or fsdp_config_dict(config.fsdp_config).get("activation_checkpointing")),
                 eval_batch=config.per_device_eval_batch_size, num_gpus=num_gpus, num_nodes=num_nodes)


def preset_of(config: SFTConfig, world: int) -> str:
    """The sharding scheme the recipe runs with on `world` GPUs."""
    if config.fsdp:
        fsdp = fsdp_config_dict(config.fsdp_config)
        hybrid = "hybrid" in f"{config.fsdp} {fsdp.get('sharding_strategy', '')}".lower()
        return "fsdp_offload" if fsdp.get("cpu_offload") else "fsdp_hybrid" if hybrid else "fsdp"
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
    from sft.planning.memtrace import build_model

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
    if config.attn_implementation == "eager":  # eager keeps each head's T x T probabilities: float32 and bf16 copy
        layer += tokens * setup.max_length * arch.num_attention_heads * EAGER_SCORE_BYTES * scale
    residual = 4 if setup.method == "qlora" else 2 * scale  # k-bit preparation keeps the residual in float32
    saved = arch.num_hidden_layers * (tokens * residual * h if setup.checkpointing else layer)
    head = head_bytes(config, arch, setup, tokens, head_trainable)
    backward = layer + tokens * BACKWARD_I_BYTES * i * scale if setup.checkpointing and setup.method != "full" else 0
    # the last layer's backward (recomputed under checkpointing) runs after the loss's buffers are freed
    return {"activations": saved + tokens * residual * h * 3, "lm head / loss": max(head, backward)}


def chunked_loss_applies(config: SFTConfig, arch: PretrainedConfig) -> bool:
    """Whether SFTTrainer attaches the chunked loss (sft.training.loss.supports_chunked_loss, from the config alone): plain
    heads, under every preset, in training and eval."""
    return (config.chunked_loss and arch.model_type in PLAIN_HEAD_MODELS and not arch.is_encoder_decoder
            and not getattr(arch, "output_router_logits", False))


def head_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, tokens: int, trainable: bool) -> int:
    """The LM head and loss at their peak: chunked (one chunk of logits) or full logits."""
    vocab, h = arch.vocab_size, arch.hidden_size
    if not chunked_loss_applies(config, arch):
        return tokens * vocab * FULL_LOGIT_BYTES
    logits = min(chunk_rows(vocab), tokens) * vocab * 10  # float32 logits (probabilities in place), bf16 gradient
    # the head's gradient is accumulated in float32 and scaled once more in backward (2 x 4 bytes) then cast
    weight_grad = vocab * h * 10 if trainable else 0
    if setup.method == "qlora":  # k-bit preparation made the head float32: autocast casts it to bf16 per chunk
        weight_grad += vocab * h * 2
    return logits + weight_grad + tokens * h * 4


def shards(setup: Setup) -> int:
    """How many GPUs share one copy of what the preset shards (hybrid FSDP shards within a node)."""
    return 1 if setup.preset == "ddp" else setup.num_gpus if setup.preset == "fsdp_hybrid" else setup.world


def memory_breakdown(config: SFTConfig, arch: PretrainedConfig, setup: Setup, model: Model) -> dict[str, int]:
    """Bytes per GPU by component at the training peak (framework overhead excluded)."""
    n, preset = shards(setup), setup.preset
    sharded = preset.startswith(("fsdp", "zero"))
    mixed = sharded and (config.bf16 or config.fp16)  # fp32 master weights under FSDP2 / DeepSpeed mixed precision
    state_bytes = OPTIMIZER_STATE_BYTES.get(str(getattr(config.optim, "value", config.optim)),
                                            8 if mixed else 2 * model.trainable_bytes / max(model.trainable, 1))
    frozen = model.weight_bytes - model.trainable_bytes
    if preset.startswith("fsdp"):  # accelerate's FSDP2 upcasts trainable weights: they are the master
        weights = (frozen + 4 * model.trainable if mixed else model.weight_bytes) / n
        master, grads = 0, (4 * model.trainable if mixed else model.trainable_bytes) / n
    else:
        weights = model.weight_bytes / (n if preset.startswith("zero3") else 1)
        master = 4 * model.trainable / n if mixed else 0
        grads = model.trainable_bytes / (n if sharded else 1)
    gathered = 2 * model.layer_bytes if preset.startswith(("fsdp", "zero3")) else 0  # current + prefetched layer
    if preset.endswith("offload"):  # sharded parameters (and FSDP's gradients) live in CPU memory between uses
        weights, master = 0, 0
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


def eval_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, model: Model) -> int:
    """Evaluation's transient (no gradients kept): sft's chunked eval forward, or full logits where the chunked loss
    does not apply, plus the KV cache of generation."""
    if config.eval_strategy == "no" and not config.do_eval:
        return 0
    batch = setup.eval_batch
    tokens = batch * setup.max_length
    if chunked_loss_applies(config, arch):
        memory = chunked_eval_bytes(config, arch, setup, tokens, model)
    else:
        memory = tokens * arch.vocab_size * EVAL_LOGIT_BYTES
    if not config.predict_with_generate:
        return memory
    new = config.max_new_tokens or config.generation_max_length or 128
    kv_width = arch.num_key_value_heads * head_dim(arch)
    return memory + 2 * arch.num_hidden_layers * kv_width * (setup.max_length + new) * batch * 2


def chunked_eval_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, tokens: int, model: Model) -> int:
    """sft.training.loss.chunked_forward without grad: a decoder layer's transient, or later the head's, whichever is larger."""
    vocab, h = arch.vocab_size, arch.hidden_size
    scale = 1 if (config.bf16 or config.fp16) else 2  # the coefficients are for 16-bit compute
    ch, ci = EVAL_LAYER_BYTES[setup.method]
    decoder = tokens * (ch * h + ci * arch.intermediate_size) * scale + tokens * setup.max_length  # + bool mask
    # the last hidden state and its trained rows, one chunk of bf16 logits + float32 copy + log-softmax, and the
    # float32 token losses (chunked_token_losses' output and chunked_forward's per-position tensor)
    head = tokens * 2 * h * 2 * scale + min(chunk_rows(vocab), tokens) * vocab * 10 + tokens * 8
    if setup.method == "qlora":  # k-bit preparation made the head float32: autocast casts it to bf16 per chunk
        head += vocab * h * 2
    # autocast keeps its bf16 copy of every float32 adapter weight until the forward ends
    adapters = 2 * model.trainable if setup.method != "full" and scale == 1 else 0
    return int(max(decoder, head) + adapters)


def flops_per_token(arch: PretrainedConfig, model: Model, setup: Setup) -> tuple[float, float]:
    """(model FLOPs per token: 6N + causal attention, FLOPs the GPU actually runs: no frozen-weight gradients,
    plus the forward again under checkpointing)."""
    attention = 6 * arch.num_hidden_layers * setup.max_length * arch.num_attention_heads * head_dim(arch)
    n = model.matmul_params
    passes = (6 if setup.method == "full" else 4) + (2 if setup.checkpointing else 0)
    return 6 * n + attention, passes * n + attention * (1 + (2 / 6 if setup.checkpointing else 0))


def make_plan(config: SFTConfig, arch: PretrainedConfig, gpu: GPU, setup: Setup, model: Model) -> Plan:
    """Memory, speed and verdict of one setup (the override search runs this for each candidate)."""
    parts = memory_breakdown(config, arch, setup, model)
    static = sum(parts[k] for k in ("weights", "gathered layers", "master weights (fp32)", "optimizer states"))
    train = train_peak(parts, setup)
    evaluation = eval_bytes(config, arch, setup, model)
    peak = max(train, static + evaluation)
    overhead = CUDA_CONTEXT_GIB * GIB + FRAGMENTATION * peak
    breakdown = {k: v / GIB for k, v in parts.items()}
    breakdown.update({"training peak": train / GIB, "eval / generation": evaluation / GIB,
                      "framework overhead": overhead / GIB})
    model_flops, run_flops = flops_per_token(arch, model, setup)
    slowdown = 0.5 if setup.preset.endswith("offload") else 1.0  # optimizer steps on the CPU, over PCIe
    speed = setup.world * gpu.bf16_tflops * 1e12 * gpu.mfu * slowdown / run_flops
    return Plan(setup=setup, gpu=gpu, breakdown=breakdown, peak_gib=peak / GIB, total_gib=(peak + overhead) / GIB,
                tokens_per_second=speed, flops_per_token=model_flops)


def candidates(config: SFTConfig, setup: Setup) -> list[Setup]:
    """Settings to try, each keeping the global batch: smaller micro-batches, checkpointing, presets, LoRA/QLoRA."""
    micro, out = setup.micro_batch, []
    micros = halvings(micro)
    methods = METHODS[METHODS.index(setup.method):] if not config.load_in_8bit else ("qlora",)
    presets = [setup.preset] + [p for p in ("zero2", "fsdp", "zero3", "fsdp_offload", "zero3_offload")
                                if p != setup.preset and (setup.world > 1 or p.endswith("offload"))]
    for method in methods:
        for preset in presets:
            if method == "qlora" and preset.startswith("zero3"):
                continue  # refused by sft (ZeRO-3 cannot partition packed 4-bit weights)
            for checkpointing in sorted({setup.checkpointing, True}):
                for m, eval_batch in itertools.product(micros, halvings(setup.eval_batch)):
                    out.append(dataclasses.replace(setup, micro_batch=m, grad_accum=setup.grad_accum * micro // m,
                                                   checkpointing=checkpointing, method=method, preset=preset,
                                                   eval_batch=eval_batch))
    return out


def halvings(batch: int) -> list[int]:
    """batch, batch/2, ... down to 1 or an odd size (a smaller micro-batch must divide the old one)."""
    out = [batch]
    while out[-1] % 2 == 0:
        out.append(out[-1] // 2)
    return out


def cost(plan: Plan, original: Setup) -> tuple:
    """Cheapest first: keep the training method, avoid CPU offload, then the fastest, then bigger micro-batches."""
    s = plan.setup
    return (METHODS.index(s.method) - METHODS.index(original.method), s.preset.endswith("offload"),
            round(1 / plan.tokens_per_second, 9), -s.micro_batch, -s.eval_batch)


def override_flags(original: Setup, new: Setup) -> list[str]:
    """The `--flag value` overrides that turn `original` into `new`."""
    flags = []
    if new.micro_batch != original.micro_batch:
        flags += [f"--per_device_train_batch_size {new.micro_batch}", f"--gradient_accumulation_steps {new.grad_accum}"]
    if new.eval_batch != original.eval_batch:
        flags.append(f"--per_device_eval_batch_size {new.eval_batch}")
    if new.checkpointing and not original.checkpointing:
        flags.append("--activation_checkpointing true")
    if new.preset != original.preset:
        flags.append(f"--distributed {new.preset}")
    if new.method != original.method:
        flags.append("--use_peft true")
    if new.method == "qlora" and original.method != "qlora":
        flags.append("--load_in_4bit true")
    return flags


def plan_recipe(config: SFTConfig, gpu: GPU, num_gpus: int = 1, num_nodes: int = 1,
                arch: PretrainedConfig | None = None) -> Plan:
    """The plan of a loaded recipe on `num_nodes` x `num_gpus` GPUs of kind `gpu`, with overrides if it does not fit."""
    from sft.models.architectures import model_architecture
    from sft.errors import SFTError

    if num_gpus < 1 or num_nodes < 1:
        raise SFTError("--num_gpus and --num_nodes must be at least 1.")
    arch = arch or model_architecture(config.model_name_or_path, config.revision)
    if arch.is_encoder_decoder or not hasattr(arch, "intermediate_size"):
        raise SFTError(f"sft plan models decoder-only transformers (Llama, Mistral, Qwen, ...); {arch.model_type} "
                       "is not modelled yet. Use `sft check` to validate the recipe.")
    setup = setup_of(config, num_gpus, num_nodes)
    models = {setup.method: model_facts(config, arch, setup.method)}
    plan = make_plan(config, arch, gpu, setup, models[setup.method])
    plan.steps, plan.hours = run_length(config, setup, plan.tokens_per_second)
    plan.notes = [f"model {config.model_name_or_path}: {arch.model_type}, {arch.num_hidden_layers} layers, "
                  f"hidden {arch.hidden_size}, vocabulary {arch.vocab_size}",
                  f"{gpu.name}: {gpu.bf16_tflops:g} dense bf16 TFLOP/s at an assumed {gpu.mfu:.0%} utilisation"]
    if not plan.fits:
        plan.overrides = search(config, arch, gpu, setup, models)
    return plan


def search(config: SFTConfig, arch: PretrainedConfig, gpu: GPU, setup: Setup, models: dict[str, Model]) -> list[str]:
    """The overrides of the cheapest candidate setup that fits; empty when none does."""
    fitting = []
    for candidate in candidates(config, setup):
        if candidate.method not in models:
            models[candidate.method] = model_facts(config, arch, candidate.method)
        plan = make_plan(config, arch, gpu, candidate, models[candidate.method])
        if plan.fits:
            fitting.append(plan)
    if not fitting:
        return []
    return override_flags(setup, min(fitting, key=lambda p: cost(p, setup)).setup)


def run_length(config: SFTConfig, setup: Setup, tokens_per_second: float) -> tuple[int | None, float | None]:
    """(optimizer steps, hours): from max_steps, else from the data's own statistics when it is local."""
    from pathlib import Path

    from sft.data.sources import parse_sources

    rows_per_step = setup.global_batch
    if config.max_steps and config.max_steps > 0:
        steps = config.max_steps
        return steps, steps * rows_per_step * setup.max_length / tokens_per_second / 3600
    if not all(Path(s.path).exists() for s in parse_sources(config.dataset)):
        return None, None
    from sft.data.describe import describe_data

    stats, _ = describe_data(config)
    rows = stats.packed_rows or stats.rows
    tokens = rows * setup.max_length if stats.packed_rows else stats.tokens
    steps = math.ceil(rows / rows_per_step) * math.ceil(config.num_train_epochs)
    return steps, tokens * config.num_train_epochs / tokens_per_second / 3600
