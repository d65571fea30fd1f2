"""`sft plan RECIPE`: per-GPU peak memory broken down, time, a verdict, and the cheapest overrides that make it fit.

Parameters, their dtypes and which are trainable come from the recipe's model built on the meta device exactly as
`sft train` prepares it (sft.planning.memtrace.build_model: k-bit preparation, peft adapters), so they are counted, not
estimated. Activations, the LM head and sharding follow the formulas of sft.planning.memory. Everything is checked
against one simulated step (`sft plan --trace`, tests/test_plan.py).
"""

import copy
import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field

import torch
from transformers import PretrainedConfig

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.adapters import unwrapped
from sft.planning.hardware import GPU
from sft.planning.layers import activation_saved_bytes, hidden_act, layer_projections, norm_width
from sft.planning.memory import (
    GIB,
    STATIC_PARTS,
    Model,
    Setup,
    compiled_savings,
    eval_bytes,
    head_dim,
    matmul_params,
    memory_breakdown,
    planned_budget,
    text_config,
    train_peak,
)
from sft.training.presets import fsdp_config_dict, zero_stage

METHODS = ("full", "lora", "qlora")
CUDA_CONTEXT_GIB = 0.6  # CUDA context + cuBLAS/cuDNN workspaces, outside torch's allocator
FRAGMENTATION = 0.08  # caching-allocator slack over the allocated peak (typical reserved/allocated on LLM training)


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
    unsupported: str | None = None
    """A recipe setting this GPU cannot run (sft train refuses it there), with the flags to use instead."""

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
                "overrides": self.overrides, "notes": self.notes, "unsupported": self.unsupported}

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
        also = f"; and {self.unsupported}" if self.unsupported else ""
        if self.fits:
            return f"verdict: FITS ({room})" + (f", but {self.unsupported}" if self.unsupported else "")
        if not self.overrides:
            return (f"verdict: DOES NOT FIT ({room}); no micro-batch, checkpointing, preset, offload or LoRA/QLoRA "
                    f"setting fits: use more GPUs (--num_gpus) or a shorter max_length{also}")
        return f"verdict: DOES NOT FIT ({room}); add: {' '.join(self.overrides)}{also}"


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
    layers = getattr(unwrapped(model).get_decoder(), "layers", None)
    if layers is None:  # Llama-4's causal LM is its own get_decoder() (transformers 5.24): an AttributeError traceback
        raise SFTError(f"sft plan cannot find the decoder layers of {arch.model_type}: it is not modelled yet. Use "
                       "`sft check` to validate the recipe.")
    half_bytes = weight_bytes - _bytes(model) + _bytes(model, half=True)
    text = text_config(arch)
    widths, gates = zip(*(layer_projections(layer, text) for layer in layers))
    return Model(weight_bytes=weight_bytes, half_bytes=half_bytes, trainable=sum(p.numel() for p in trainable),
                 trainable_bytes=sum(p.numel() * p.element_size() for p in trainable),
                 matmul_params=matmul_params(text, any(gates)), layer_bytes=max(_bytes(layer) for layer in layers),
                 layer_half_bytes=max(_bytes(layer, half=True) for layer in layers),
                 layer_merged_bytes=max(_merged_bytes(layer) for layer in layers),
                 layer_dora_bytes=max(_merged_bytes(layer, dora=True) for layer in layers),
                 # fewer norms than Llama's two (Phi-2's one) are planned as two: an upper bound
                 extra_norm_width=max(0, max(norm_width(layer, text) for layer in layers) - 2 * text.hidden_size),
                 fused_qkv_width=max(widths), gated_mlp=any(gates),
                 activation_saved=activation_saved_bytes(hidden_act(text)),
                 attention=unwrapped(model).config._attn_implementation)


def _bytes(module: torch.nn.Module, half: bool = False) -> int:
    """Bytes of the module's parameters (each shared one once); half: floating-point ones at 16 bits at most."""
    params = {id(p): p for p in module.parameters()}.values()
    return sum(p.numel() * (min(p.element_size(), 2) if half and p.is_floating_point() else p.element_size())
               for p in params)


def _merged_bytes(layer: torch.nn.Module, dora: bool = False) -> int:
    """Bytes of the parameters LoRA adapts whole in `layer` (peft ParamWrapper, Model.layer_merged_bytes), or with
    `dora` of the 16-bit base-weight copies its DoRA layers keep for backward (Model.layer_dora_bytes)."""
    from peft.tuners.lora.layer import LoraLayer, ParamWrapper

    if dora:  # in_features * out_features: a 4-bit weight's numel counts packed bytes
        return 2 * sum(m.in_features * m.out_features for m in layer.modules()
                       if isinstance(m, LoraLayer) and not isinstance(m, ParamWrapper) and any(m.use_dora.values()))
    wrapped = [getattr(m.get_base_layer(), m.parameter_name) for m in layer.modules() if isinstance(m, ParamWrapper)]
    return sum(p.numel() * p.element_size() for p in wrapped)


def flops_per_token(arch: PretrainedConfig, model: Model, setup: Setup) -> tuple[float, float]:
    """(model FLOPs per token: 6N + causal attention, FLOPs the GPU actually runs: no frozen-weight gradients,
    plus the forward again under checkpointing). Text only: a multimodal model's vision tower never runs."""
    text = text_config(arch)
    attention = 6 * text.num_hidden_layers * setup.max_length * text.num_attention_heads * head_dim(text)
    n = model.matmul_params
    passes = (6 if setup.method == "full" else 4) + (2 if setup.checkpointing else 0)
    return 6 * n + attention, passes * n + attention * (1 + (2 / 6 if setup.checkpointing else 0))


def make_plan(config: SFTConfig, arch: PretrainedConfig, gpu: GPU, setup: Setup, model: Model) -> Plan:
    """Memory, speed and verdict of one setup (the override search runs this for each candidate)."""
    parts = memory_breakdown(config, arch, setup, model)
    static = sum(parts[k] for k in STATIC_PARTS)
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
    from sft.errors import SFTError
    from sft.models.architectures import model_architecture

    if num_gpus < 1 or num_nodes < 1:
        raise SFTError("--num_gpus and --num_nodes must be at least 1.")
    arch = arch or model_architecture(config.model_name_or_path, config.revision)
    text = text_config(arch)  # refuses what the formulas do not describe
    # planned as it must run there: fp16 keeps a QLoRA base's float32 upcast, which bf16 skips
    fp16 = {} if gpu.bf16 else fp16_settings(config)
    if fp16:
        config = copy.copy(config)
        config.__dict__.update(fp16)
    setup = setup_of(config, num_gpus, num_nodes)
    models = {setup.method: model_facts(config, arch, setup.method)}
    plan = make_plan(config, arch, gpu, setup, models[setup.method])
    plan.steps, plan.hours = run_length(config, setup, plan.tokens_per_second)
    plan.notes = [f"model {config.model_name_or_path}: {arch.model_type}, {text.num_hidden_layers} layers, "
                  f"hidden {text.hidden_size}, vocabulary {text.vocab_size}",
                  f"{gpu.name}: {gpu.bf16_tflops:g} dense {'bf16' if gpu.bf16 else 'fp16'} TFLOP/s at an assumed "
                  f"{gpu.mfu:.0%} utilisation"]
    if fp16:
        plan.unsupported = fp16_advice(fp16, gpu)
    if config.torch_compile:
        plan.notes.append(compile_note(config, setup))
    if not plan.fits:
        plan.overrides = search(config, arch, gpu, setup, models)
    return plan


def fp16_settings(config: SFTConfig) -> dict[str, object]:
    """The settings that move a recipe's bfloat16 ones to a card without bf16 (a T4, a V100); empty when it has
    none. Weights loaded in bfloat16 and 4-bit compute in bfloat16 would run there too, as slow emulation."""
    settings: dict[str, object] = {"bf16": False, "fp16": True} if config.bf16 else {}
    if config.dtype == "bfloat16":  # fp16 mixed precision needs float32 weights to train them (GradScaler)
        settings["dtype"] = "float16" if config.use_peft else "float32"
    settings.update({key: "float16" for key in ("bnb_4bit_compute_dtype", "bnb_4bit_quant_storage")
                     if getattr(config, key) == "bfloat16"})
    return settings


def fp16_advice(settings: dict[str, object], gpu: GPU) -> str:
    """What to add to run on `gpu` (no bf16) the recipe planned with fp16_settings."""
    flags = " ".join(f"--{key} {str(value).lower()}" for key, value in settings.items())
    return f"{gpu.name} has no bf16 (sft train refuses bf16: true there): add {flags}"


def compile_note(config: SFTConfig, setup: Setup) -> str:
    """How the activations of a torch_compile recipe were planned."""
    budget, planned = config.activation_memory_budget or 1.0, planned_budget(config)
    if compiled_savings(config, setup):
        return (f"torch_compile: activations as inductor keeps them in compiled blocks (activation_memory_budget "
                f"{budget:g}{f', planned as {planned:g}' if planned != budget else ''})")
    return (f"torch_compile: activations planned as eager for {setup.method} on {setup.preset} (what compiling keeps "
            "there is not measured): an upper bound")


def search(config: SFTConfig, arch: PretrainedConfig, gpu: GPU, setup: Setup,
           models: dict[str, Model | None]) -> list[str]:
    """The overrides of the cheapest candidate setup that fits; empty when none does."""
    fitting = []
    for candidate in candidates(config, setup):
        if candidate.method not in models:
            # only the recipe's own model is described in the log ("Trainable parameters: ..."), not each candidate
            adapters_log = logging.getLogger("sft.models.adapters")
            level = adapters_log.level
            adapters_log.setLevel(logging.WARNING)
            try:
                models[candidate.method] = model_facts(config, arch, candidate.method)
            except SFTError:  # the recipe's LoRA settings cannot adapt this model (peft refuses): not a candidate
                models[candidate.method] = None
            finally:
                adapters_log.setLevel(level)
        if models[candidate.method] is None:
            continue
        plan = make_plan(config, arch, gpu, candidate, models[candidate.method])
        if plan.fits:
            fitting.append(plan)
    if not fitting:
        return []
    return override_flags(setup, min(fitting, key=lambda p: cost(p, setup)).setup)


def run_length(config: SFTConfig, setup: Setup, tokens_per_second: float) -> tuple[int | None, float | None]:
    """(optimizer steps, hours): from max_steps, else from the data's own statistics when it is local."""
    from sft.data.sources import all_local, parse_sources

    rows_per_step = setup.global_batch
    if config.max_steps and config.max_steps > 0:
        steps = config.max_steps
        return steps, steps * rows_per_step * setup.max_length / tokens_per_second / 3600
    if not all_local(parse_sources(config.dataset)):
        return None, None
    from sft.data.describe import describe_data

    stats, _ = describe_data(config)
    rows = stats.packed_rows or stats.rows
    tokens = rows * setup.max_length if stats.packed_rows else stats.tokens
    steps = math.ceil(rows / rows_per_step) * math.ceil(config.num_train_epochs)
    return steps, tokens * config.num_train_epochs / tokens_per_second / 3600


def trace_note(config: SFTConfig, plan: Plan) -> str:
    """One line comparing the planned training peak with the simulated step's (one GPU, nothing sharded)."""
    from sft.models.architectures import model_architecture
    from sft.planning.memtrace import trace_step

    if plan.setup.preset not in ("single", "ddp"):
        return "trace: skipped (the simulated step runs on one unsharded GPU; this recipe shards)"
    if config.load_in_8bit:
        return "trace: skipped (8-bit LLM.int8 layers cannot be simulated)"
    traced = trace_step(config, model_architecture(config.model_name_or_path, config.revision)).peak / GIB
    planned = plan.breakdown["training peak"] - (plan.breakdown["gradients"] if plan.setup.preset == "ddp" else 0)
    eager = " (eager: the simulated step does not compile)" if config.torch_compile else ""
    return (f"trace: simulated step peak {traced:.2f} GiB (MemTracker, fake tensors{eager}) vs planned {planned:.2f} "
            f"GiB ({100 * (planned / traced - 1):+.1f}%)")
