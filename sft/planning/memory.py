"""Per-GPU memory of one training setup: the byte formulas `sft plan` adds up.

Activations follow per-token formulas: bytes each token keeps per decoder layer (counted from the tensors autograd
saves, confirmed by MemTracker under FakeTensorMode; see docs/design.md), plus the LM head and loss. Sharding
divides what the `distributed` preset shards. Parameter bytes come in as a `Model` (sft.planning.plan.model_facts
counts them on the meta device). tests/test_plan.py checks every term against one simulated step
(sft.planning.memtrace).
"""

from dataclasses import dataclass

from transformers import PretrainedConfig

from sft.config.arguments import SFTConfig
from sft.errors import SFTError
from sft.models.precision import upcasts_quantized_base
from sft.training.linear_cross_entropy import chunk_rows, head_rows
from sft.training.loss import chunked_loss_applies

GIB = 2 ** 30
# Bytes a token keeps per decoder layer without checkpointing, as multiples of (hidden, attention width
# heads*head_dim, MLP width), for bf16 compute. Full: two RMSNorms keep their fp32 input, normalised and output
# copies (16h); attention keeps q, repeated k/v, output and o_proj's input (8q); the gated MLP keeps gate, silu,
# up and their product (8i). LoRA adds per adapted linear its dropout mask (bool, as CUDA's fused dropout keeps it:
# 5h + q + i less than CPU's bf16 noise, measured on an H100) and input copy (bf16: under autocast sft skips peft's
# float32 cast, sft.models.precision, which kept 10h + 2q + 2i more); QLoRA's float32 residual stream (k-bit
# preparation) changes the mix. Measured with MemTracker, see tests/test_plan.py.
LAYER_BYTES = {"full": (16.0, 8.0, 8.0), "lora": (25.4, 11.2, 10.0), "qlora": (38.4, 14.2, 12.2)}
# What torch_compile takes off LAYER_BYTES, in the same units, where sft compiles each block in place (one GPU, DDP)
# by (method, partitioner budget): inductor's partitioner recomputes fused elementwise ops (norms, SwiGLU's product,
# LoRA's dropout and casts) instead of keeping their outputs; at budget 0.8 it recomputes all elementwise ops, no
# matmul or attention (sft.models.compilation). Differences of the bytes autograd saves per token and layer,
# compiled minus eager, fitted on five widths with bf16 autocast and exact on a Llama-3.2-1B layer (LoRA at 0.8:
# within 0.2%; an H100's inductor within 1.2%, scripts/layer_memory.py); tests/test_plan.py measures them on another
# width. QLoRA and sharded runs (accelerate compiles the whole model there) are planned as eager: not measured, an
# upper bound.
COMPILED_SAVINGS = {("full", 1.0): (8.0, 0.0, 2.0), ("full", 0.8): (12.0, 0.0, 4.0),
                    ("lora", 1.0): (4.0, 0.0, 2.0), ("lora", 0.8): (14.875, 0.25, 4.375)}
# Gradient temporaries of the MLP (bytes per token per MLP width) while a recomputed LoRA layer runs backward
# (11 while peft's float32 input copies ran; MemTracker, tests/test_plan.py).
BACKWARD_I_BYTES = 4
# Per normalized element, bytes a norm beyond LAYER_BYTES' two keeps for backward (Model.extra_norm_width): full
# keeps its float32 input and normalized copy as those two do (8, 16h for two); under LoRA the adapted layers' input
# copies (counted in LAYER_BYTES) share part of it. Fitted to MemTracker on 16-layer Qwen3-0.6B, OLMo-2-1B and
# Gemma-3-1B (2 x 4096: full within -2..-7%, LoRA within -2..+3%, QLoRA on Qwen3 -4.6% of the trace;
# tests/test_plan.py).
NORM_BYTES = {"full": 8, "lora": 4, "qlora": 4}
EAGER_SCORE_BYTES = 6  # per attention score per head, eager attention only (sdpa/flash keep no T x T tensor)
FULL_LOGIT_BYTES = 14  # per logit where training runs no chunked loss: bf16, float32 copy, log-softmax, gradient
# per logit where eval runs no chunked loss: bf16, float32 copy, log-softmax (the model's loss frees its own before
# SFTMixin's token-loss pass makes the same again); MemTracker of memtrace.eval_step, tests/test_plan.py
EVAL_LOGIT_BYTES = 10
# Eval (no grad) keeps no activations, only one layer's transient: bytes per token as multiples of (hidden, MLP
# width). Full: the MLP's activation, up projection and product (6i), residual, normed input and the norm's float32
# temporaries (8h); LoRA adds float32 copies of adapted inputs, QLoRA a float32 residual stream. Fitted to
# MemTracker's peak of the eval step (memtrace.eval_step) across widths; tests/test_plan.py checks it.
EVAL_LAYER_BYTES = {"full": (8.0, 6.0), "lora": (12.0, 8.0), "qlora": (18.0, 8.0)}
# DoRA (use_dora) keeps per adapted linear, beside what LoRA keeps, its base output and scaled adapter output for the
# magnitude's gradient: bytes a token and layer as multiples of (hidden, attention width, key/value width, MLP width)
# over all-linear targets, bf16 compute (sft.planning.memtrace.saved_per_layer, DoRA minus LoRA on a layer whose
# widths all differ); the 16-bit copy of each base weight its F.linear multiplies is Model.layer_dora_bytes.
DORA_BYTES = (8.0, 4.0, 12.0, 8.0)
# A non-gated MLP (GPT-NeoX/Pythia, Phi-2, StarCoder2: fc1, activation, fc2) keeps its first projection's output and
# the activation's (4i), not a gated one's gate, activation, up and product (8i): bytes a token per MLP width taken
# off LAYER_BYTES (MemTracker, a 2-layer Pythia shape: 4i kept, full and LoRA; tests/test_plan.py). An activation
# written as several ops keeps more than its input (Model.activation_saved).
NON_GATED_I_SAVING = 4.0
NATIVE_ACTIVATION_BYTES = 2.0  # what a one-op activation (SwiGLU's SiLU, GELU) keeps an element: its bf16 input
# A full fine-tune of float32 weights under 16-bit autocast (the shipped full recipes: float32 masters, bf16 compute),
# one GPU or DDP: the embedding hands every layer a float32 residual stream (bytes a token and hidden element beyond
# LAYER_BYTES' bf16 one), and autocast's matmuls keep each weight's 16-bit copy (its cast cache holds every layer's
# until the forward ends, checkpointed or not); the loss casts the head once. MemTracker, tests/test_plan.py.
FLOAT32_RESIDUAL_BYTES = 10
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
    half_bytes: int = 0
    """weight_bytes with floating-point parameters in 16 bits: DeepSpeed under bf16/fp16 casts the parameters it is
    given (float32 ones included) to 16 bits and keeps the float32 copy as its master (engine
    _configure_distributed_model); buffers and 4-bit storage keep their dtype."""
    layer_half_bytes: int = 0
    """layer_bytes with floating-point parameters in 16 bits: what ZeRO-3 (its 16-bit copy) and FSDP2 under mixed
    precision (param_dtype bf16/fp16) gather, whatever dtype the weights were loaded in."""
    layer_merged_bytes: int = 0
    """Bytes of the largest decoder layer's parameters that LoRA adapts whole (peft's ParamWrapper: the 3D expert
    stacks of a mixture of experts under all-linear): each forward materializes weight + delta at the weight's size,
    and autograd keeps it for backward, per layer."""
    layer_dora_bytes: int = 0
    """Bytes of the 16-bit copies of its base weights that a DoRA layer keeps for backward: peft's DoraLinearLayer
    casts each adapted base weight to its float32 input's dtype, and the F.linear it multiplies (under autocast, in
    bf16) saves that copy. In training only: no-grad eval keeps none."""
    extra_norm_width: int = 0
    """Widths a decoder layer normalizes per token beyond the two hidden-size norms LAYER_BYTES counts (each norm
    keeps 8 bytes a normalized element, as those two do): Gemma-2/3's post-attention/post-MLP norms, the q/k norms of
    Qwen3, Gemma-3 and OLMo-2 (over every query / key head)."""
    fused_qkv_width: int = 0
    """The output width of a fused query/key/value projection (Phi-3, GPT-NeoX), else 0. Attention keeps v as a view
    of it, so all of it stays: 2 bytes a token and element in a full fine-tune (Phi-3 was planned 10.8% low). Not
    under LoRA, whose LAYER_BYTES row over-counts such a layer more (q, k, v adapted apart: Phi-3 LoRA +9.1%)."""
    gated_mlp: bool = True
    """Whether the MLP is gated (SwiGLU's gate and up, apart or fused); a non-gated one keeps less."""
    activation_saved: float = NATIVE_ACTIVATION_BYTES
    """Bytes an element the MLP's activation keeps for backward (sft.planning.layers.activation_saved_bytes)."""
    attention: str = "sdpa"
    """The attention implementation the model runs with (the recipe's, else transformers' default for the family:
    eager for Gemma-2, which keeps T x T scores)."""


def text_config(arch: PretrainedConfig) -> PretrainedConfig:
    """The decoder config the formulas read. A multimodal causal LM (Gemma-3 4B+) trains on text: its whole model is
    loaded, vision tower included, but the tower is frozen (sft.models.loading.freeze_non_text_towers) and text never
    runs through it, so activations, FLOPs and the head are its text model's. Refuses what the formulas do not
    describe: encoder-decoders, decoders without one MLP width (Gemma-3n's per-layer widths)."""
    text = arch.get_text_config()
    if arch.is_encoder_decoder or not isinstance(getattr(text, "intermediate_size", None), int):
        raise SFTError(f"sft plan models decoder-only transformers (Llama, Mistral, Qwen, Gemma-3, ...); "
                       f"{arch.model_type} is not modelled yet. Use `sft check` to validate the recipe.")
    return text


def head_dim(arch: PretrainedConfig) -> int:
    return getattr(arch, "head_dim", None) or arch.hidden_size // arch.num_attention_heads


def kv_width(arch: PretrainedConfig) -> int:
    """Key (or value) width per token: configs without grouped-query attention (GPT-NeoX / Pythia) have no
    num_key_value_heads, one key/value head per query head."""
    return (getattr(arch, "num_key_value_heads", None) or arch.num_attention_heads) * head_dim(arch)


def mlp_width(arch: PretrainedConfig) -> int:
    """The MLP width each token runs through: a dense model's intermediate_size; a mixture of experts routes each
    token through num_experts_per_tok experts (each of moe_intermediate_size, else intermediate_size: Mixtral,
    OLMoE) plus any shared expert (Qwen2-MoE), and keeps every routed copy's activations for backward."""
    experts = getattr(arch, "num_experts_per_tok", None)
    if not experts:
        return arch.intermediate_size
    width = getattr(arch, "moe_intermediate_size", None) or arch.intermediate_size
    return experts * width + (getattr(arch, "shared_expert_intermediate_size", None) or 0)


def matmul_params(arch: PretrainedConfig, gated: bool = True) -> int:
    """Weights every token multiplies through: decoder layers and the LM head (not the embedding lookup); a
    multimodal model's text model only (text never runs through its vision tower). A gated MLP (gate, up, down) has
    three matrices of the MLP width, a plain one (fc1, fc2: GPT-NeoX, Phi-2, StarCoder2) two."""
    arch = text_config(arch)
    h, layers = arch.hidden_size, arch.num_hidden_layers
    q = arch.num_attention_heads * head_dim(arch)
    kv = kv_width(arch)
    router = h * (getattr(arch, "num_local_experts", None) or getattr(arch, "num_experts", None) or 0)
    mlp = (3 if gated else 2) * h * mlp_width(arch)  # MoE: the experts a token runs through
    per_layer = h * q * 2 + h * kv * 2 + mlp + router
    return layers * per_layer + arch.vocab_size * h


def activation_scale(config: SFTConfig) -> int:
    """The activation coefficients are for 16-bit compute: fp32 training holds twice the bytes."""
    return 1 if (config.bf16 or config.fp16) else 2


def activation_mix(config: SFTConfig, setup: Setup) -> str:
    """The LAYER_BYTES row a method's activations follow: QLoRA's own (a float32 residual stream and head) where k-bit
    preparation upcasts the base (sft.models.precision.upcasts_quantized_base), else a bf16 QLoRA keeps what LoRA does
    (its 4-bit layers save their bf16 input as a linear layer does; MemTracker, tests/test_plan.py)."""
    return "lora" if setup.method == "qlora" and not upcasts_quantized_base(config) else setup.method


def planned_budget(config: SFTConfig) -> float:
    """The measured partitioner budget (COMPILED_SAVINGS) the recipe's activation_memory_budget is planned as: one
    between 0.8 and 1 as 1, one at or below 0.8 as 0.8 (a lower budget never keeps more): an upper bound."""
    budget = config.activation_memory_budget
    return 0.8 if budget is not None and budget <= 0.8 else 1.0


def compiled_savings(config: SFTConfig, setup: Setup) -> tuple[float, float, float] | None:
    """COMPILED_SAVINGS of the recipe's torch_compile, or None where activations are planned as eager."""
    if not config.torch_compile or setup.preset not in ("single", "ddp"):
        return None
    return COMPILED_SAVINGS.get((setup.method, planned_budget(config)))


def activation_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, head_trainable: bool,
                     model: Model | None = None) -> dict[str, int]:
    """Activations of one micro-batch at their peak: saved per layer, the layer being recomputed, LM head / loss.
    `model` gives the attention implementation the model runs (default the recipe's) and LoRA's merged weights."""
    tokens = setup.micro_batch * setup.max_length
    scale = activation_scale(config)
    text = text_config(arch)
    h, q, i = text.hidden_size, text.num_attention_heads * head_dim(text), mlp_width(text)
    mix = activation_mix(config, setup)
    ch, cq, ci = LAYER_BYTES[mix]
    saved_h, saved_q, saved_i = compiled_savings(config, setup) or (0.0, 0.0, 0.0)
    ch, cq, ci = ch - saved_h, cq - saved_q, ci - saved_i
    layer = int(tokens * (ch * h + cq * q + ci * i) * scale)
    if config.use_dora and setup.method != "full":
        dh, dq, dkv, di = DORA_BYTES
        layer += int(tokens * (dh * h + dq * q + dkv * kv_width(text) + di * i) * scale)
    if model:
        mlp = (model.activation_saved - NATIVE_ACTIVATION_BYTES  # beyond a SwiGLU's
               - (0 if model.gated_mlp else NON_GATED_I_SAVING))
        layer += (model.layer_merged_bytes + model.layer_dora_bytes
                  + tokens * NORM_BYTES[mix] * model.extra_norm_width * scale
                  + (tokens * 2 * model.fused_qkv_width * scale if mix == "full" else 0)
                  + int(tokens * mlp * i * scale))
    # eager keeps each head's T x T probabilities: float32 and bf16 copy
    if (model.attention if model else config.attn_implementation) == "eager":
        layer += tokens * setup.max_length * text.num_attention_heads * EAGER_SCORE_BYTES * scale
    upcast = float32_under_autocast(config, setup, model)
    layer += tokens * FLOAT32_RESIDUAL_BYTES * h if upcast else 0
    residual = 4 if mix == "qlora" or upcast else 2 * scale  # k-bit preparation keeps the residual in float32
    saved = text.num_hidden_layers * (tokens * residual * h if setup.checkpointing else layer)
    saved += autocast_weight_copies(config, setup, model, text)
    head = head_bytes(config, arch, setup, tokens, head_trainable)
    head += text.vocab_size * h * 2 if upcast and head_rows(text.vocab_size) == text.vocab_size else 0
    backward = layer + tokens * BACKWARD_I_BYTES * i * scale if setup.checkpointing and setup.method != "full" else 0
    if config.use_dora and setup.method != "full":  # each layer's forward, the recomputed one's too
        backward += dora_norm_bytes(h, i, grad=True)
    # the last layer's backward (recomputed under checkpointing) runs after the loss's buffers are freed
    return {"activations": saved + tokens * residual * h * 3, "lm head / loss": max(head, backward)}


def float32_under_autocast(config: SFTConfig, setup: Setup, model: Model | None) -> bool:
    """Whether a full fine-tune trains float32 weights under bf16/fp16 autocast on one GPU or DDP (FSDP and DeepSpeed
    compute with 16-bit weights of their own)."""
    return bool(model and setup.method == "full" and setup.preset in ("single", "ddp") and (config.bf16 or config.fp16)
                and model.trainable_bytes == 4 * model.trainable)


def autocast_weight_copies(config: SFTConfig, setup: Setup, model: Model | None, text: PretrainedConfig) -> int:
    """The 16-bit copies of every decoder layer's float32 weights autocast's cast cache holds until a forward ends."""
    return text.num_hidden_layers * model.layer_bytes // 2 if float32_under_autocast(config, setup, model) else 0


def dora_norm_bytes(h: int, i: int, grad: bool) -> int:
    """The transient of a DoRA layer's weight norms in each forward: peft builds down_proj's float32 identity [i, i]
    to make the adapter delta, then float32 [h, i] copies of the delta, the base weight and their sum; with grad,
    part of autocast's bf16 cast of the identity and of one more [h, i] live meanwhile (fitted to MemTracker on
    Llama-3.2-1B and Qwen2.5-0.5B shapes, 1-4 x 1024 and 2 x 2048 tokens: within -9%..+7%, tests/test_plan.py)."""
    return 5 * i * i + 14 * h * i if grad else 4 * i * i + 12 * h * i


def head_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, tokens: int, trainable: bool) -> int:
    """The LM head and loss at their peak: chunked (one chunk of logits) or full logits."""
    text = text_config(arch)
    vocab, h = text.vocab_size, text.hidden_size
    if not chunked_loss_applies(config, arch):
        return tokens * vocab * FULL_LOGIT_BYTES
    # one chunk: float32 logits (probabilities in place) beside the bf16 product they are cast from, then beside
    # their bf16 gradient (6 bytes a logit, traced; the previous chunk's are freed first)
    logits = min(chunk_rows(vocab), tokens) * vocab * 6
    padded = head_rows(vocab)
    copy = padded * h * 2 if padded != vocab else 0  # an unaligned head's padded 16-bit copy, while the forward runs
    # the head's gradient is accumulated in float32 and scaled once more in backward (2 x 4 bytes) then cast
    weight_grad = max(vocab * h * 10, copy + padded * h * 4) if trainable else copy
    if activation_mix(config, setup) == "qlora" and not copy:  # k-bit preparation made the head float32: autocast
        weight_grad += vocab * h * 2  # casts it (the padded copy is made in autocast's dtype instead)
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
        loaded = model.half_bytes if mixed and preset.startswith("zero") else model.weight_bytes
        weights = loaded / (n if preset.startswith("zero3") else 1)
        master = 4 * model.trainable / n if mixed else 0
        grads = model.trainable_bytes / (n if sharded else 1)
    layer = model.layer_half_bytes if mixed else model.layer_bytes
    gathered = 2 * layer if preset.startswith(("fsdp", "zero3")) else 0  # current + prefetched layer
    if preset.endswith("offload"):  # sharded parameters (and FSDP's gradients) live in CPU memory between uses
        weights, master = 0, 0
        grads = grads if preset.startswith("zero") else 0
    optimizer = 0 if preset.endswith("offload") else state_bytes * model.trainable / (n if sharded else 1)
    head_trainable = setup.method == "full" or "lm_head" in (config.lora_modules_to_save or [])
    parts = {"weights": weights, "gathered layers": gathered, "master weights (fp32)": master,
             "gradients": grads + (DDP_BUCKETS if preset == "ddp" else 0), "optimizer states": optimizer,
             **activation_bytes(config, arch, setup, head_trainable, model)}
    return {k: int(v) for k, v in parts.items()}


STATIC_PARTS = ("weights", "gathered layers", "master weights (fp32)", "optimizer states")  # held all the run


def train_peak(parts: dict[str, int], setup: Setup) -> int:
    """The peak of a step: activations peak before the gradients are complete unless accumulation keeps them."""
    static = sum(parts[k] for k in STATIC_PARTS)
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
    text = text_config(arch)
    if chunked_loss_applies(config, arch):
        memory = chunked_eval_bytes(config, text, setup, tokens, model)
    else:
        memory = tokens * text.vocab_size * EVAL_LOGIT_BYTES
    if not config.predict_with_generate:
        return memory
    new = config.max_new_tokens or config.generation_max_length or 128
    return memory + 2 * text.num_hidden_layers * kv_width(text) * (setup.max_length + new) * batch * 2


def chunked_eval_bytes(config: SFTConfig, arch: PretrainedConfig, setup: Setup, tokens: int, model: Model) -> int:
    """sft.training.loss.chunked_forward without grad: a decoder layer's transient, or later the head's, whichever
    is larger (`arch`: the text model's config)."""
    vocab, h = arch.vocab_size, arch.hidden_size
    scale = activation_scale(config)
    mix = activation_mix(config, setup)
    ch, ci = EVAL_LAYER_BYTES[mix]
    dora = dora_norm_bytes(h, mlp_width(arch), grad=False) if config.use_dora and setup.method != "full" else 0
    decoder = (tokens * (ch * h + ci * mlp_width(arch)) * scale + tokens * setup.max_length  # + bool mask
               + model.layer_merged_bytes + dora)
    # the last hidden state and its trained rows, the float32 token losses (chunked_token_losses' output and
    # chunked_forward's per-position tensor), and one chunk at its peak: float32 logits and their log-softmax, or the
    # bf16 product beside the head's bf16 cast (k-bit preparation made a QLoRA head float32; autocast casts it per
    # chunk), whichever is larger (traced: the previous chunk's are freed first); an unaligned head is read through
    # its padded 16-bit copy instead, made once (sft.training.linear_cross_entropy.aligned_head)
    rows, padded = min(chunk_rows(vocab), tokens), head_rows(vocab)
    copy = padded * h * 2 if padded != vocab else 0
    cast = vocab * h * 2 if mix == "qlora" and not copy else 0
    head = tokens * 2 * h * 2 * scale + tokens * 8 + copy + max(rows * vocab * 8, rows * padded * 2 + cast)
    # autocast keeps its bf16 copy of every float32 adapter weight until the forward ends, and of every layer's
    # weights where a full fine-tune's are float32 (FLOAT32_RESIDUAL_BYTES), whose last hidden state is float32 too
    adapters = 2 * model.trainable if setup.method != "full" and scale == 1 else 0
    copies = autocast_weight_copies(config, setup, model, arch)
    head += tokens * 2 * h * 2 if copies else 0
    return int(max(decoder, head) + adapters + copies)
