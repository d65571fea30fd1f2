"""SFTConfig: transformers (Seq2Seq)TrainingArguments plus the model, data and SFT fields a recipe can set."""

import importlib.util
import os
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import Seq2SeqTrainingArguments
from transformers.utils import (
    is_torch_bf16_gpu_available,
    is_torch_tf32_available,
    is_torch_xla_available,
)

from sft.config.names import DISTRIBUTED_PRESETS, DTYPE_NAMES, HISTORY, LOSS_KERNELS, NO_ASSISTANT_TURN

# Flags a machine may be unable to honour. A recipe that sets them must still load (and pass `sft check`) on a
# laptop: where the hardware lacks them they are held back from TrainingArguments' validation and reported when
# training starts (hardware_problems); everywhere else they go through TrainingArguments.__post_init__, which sets
# mixed_precision, fills DeepSpeed's "auto" bf16/fp16 entries and the FSDP mixed-precision policy, and enables TF32.
GPU_ONLY_FLAGS = ("bf16", "bf16_full_eval", "tf32")


def _help(text: str, default: Any = None, **kwargs: Any) -> Any:
    """A dataclass field whose help text shows in `sft train --help`."""
    return field(default=default, metadata={"help": text, **kwargs})


@dataclass
class SFTConfig(Seq2SeqTrainingArguments):
    """Everything one fine-tuning run needs; a recipe is a flat YAML of these field names."""

    # Model
    model_name_or_path: str | None = _help("Hub id or local folder of the model to fine-tune.")
    tokenizer_name_or_path: str | None = _help("Tokenizer to use; defaults to the model's.")
    dtype: str = _help("Weights dtype: auto, bfloat16, float16 or float32.", "auto",
                       choices=DTYPE_NAMES)
    attn_implementation: str | None = _help(
        "Attention backend: eager, sdpa, flash_attention_2, flex_attention, or varlen (sft's: torch's variable-length "
        "flash kernel, CUDA and bf16/fp16 only, no flash-attn package; packed and padding_free batches become one "
        "flattened row with cu_seq_lens, and no [L, L] mask is built). Unset: varlen for packed or padding-free "
        "16-bit batches on a CUDA GPU where it computes the model's attention exactly, else transformers' default.")
    trust_remote_code: bool = _help("Run Python code shipped with a Hub model. Off unless you trust the repo.", False)
    revision: str | None = _help("Hub revision (branch, tag or commit) of the model and tokenizer.")
    cache_dir: str | None = _help("Where downloaded models and tokenizers are cached (default: the HF cache).")
    pad_token: str | None = _help("Pad token to add when the tokenizer has none (new mean-initialised embedding row); "
                                  "by default EOS is reused for padding, which is safe because labels are padded "
                                  "with -100.")
    allow_pickle: bool = _help("Allow loading .bin/.pt (pickle) weights; safetensors only otherwise.", False)
    chat_template: str | None = _help("Chat template: a preset name, a .jinja path or an inline Jinja string.")
    chat_template_kwargs: dict | None = _help(
        "Variables every rendering of the chat template gets (training and eval masks, eval prompts, `sft data`, "
        "`sft check`; `sft chat`/`generate` on the trained folder), e.g. {enable_thinking: false} (Qwen3, SmolLM3), "
        "{thinking: true} (Granite 3.3). A row's own `chat_template_kwargs` column (TRL's) goes over them.")

    # Data
    dataset: Any = _help(
        "Training data: a local json/jsonl/csv/parquet file or folder, a Hub id, or a list of sources "
        "{path, split, columns, weight}."
    )
    dataset_format: str = _help(
        "auto, text, alpaca, prompt_completion, messages, sharegpt or seq2seq (source/target).", "auto",
        choices=("auto", "text", "alpaca", "prompt_completion", "messages", "sharegpt", "seq2seq"),
    )
    eval_dataset: Any = _help("Evaluation data, same forms as `dataset`.")
    eval_split_size: float = _help("Hold out this fraction (<1) or number (>=1) of training rows for eval.", 0.0)
    max_length: int = _help("Longest tokenized example; longer ones are truncated and counted.", 1024)
    truncation_side: str = _help("Which end to cut over-long examples from: right or left.", "right",
                                 choices=("right", "left"))
    completion_only_loss: bool | None = _help(
        "Train only on completions (default: true for alpaca and prompt_completion data)."
    )
    assistant_only_loss: bool = _help("Chat data: train only the assistant turns (and their end-of-turn tokens).", True)
    train_on_last_turn_only: bool = _help("Chat data: train only the last assistant turn; earlier ones are context.",
                                          False)
    no_assistant_turn: str = _help("Chat rows without an assistant message: error (stop, naming the row) or drop "
                                   "(skip and count them).", "error", choices=NO_ASSISTANT_TURN)
    history: str = _help("Chat templates that render earlier turns differently from the last one (Qwen3 drops "
                         "their reasoning, GPT-OSS ends them with <|end|>): split (one example per trained turn, in "
                         "the context the template gives it at inference), last (train only the final turn) or "
                         "error.", "split", choices=HISTORY)
    dataset_num_proc: int | None = _help("Processes for tokenization (datasets.map num_proc).")
    dataloader_pin_memory: bool = _help(
        "Pin dataloader memory (only useful with a GPU); pinned batches are copied to the GPU without waiting for it "
        "(accelerator_config.non_blocking, unless the recipe sets it).", torch.cuda.is_available())
    dataloader_num_workers: int = _help(
        "Processes that fetch and collate batches beside training (0: between steps, in the training process). sft's "
        "collators take ~1.3 ms for 8 packed rows of 2048 tokens and fetching them ~0.9 ms (scripts/bench_collate.py),"
        " under 1 percent of a GPU step; a worker saves only ~1 ms of that, as receiving its batch costs ~2 ms. "
        "Worth it for slow custom collators.", 0)
    logging_nan_inf_filter: bool = _help("Replace NaN/inf losses in the logs by the running mean. Off: it reads every "
                                         "micro-step's loss on the host (a GPU sync per micro-step), and training "
                                         "stops at the first non-finite loss anyway (a diverged step is an error).",
                                         False)
    overwrite_output_dir: bool = _help("Replace an earlier sft run in output_dir (only the files sft wrote) "
                                       "instead of refusing.", False)

    # Packing
    packing: bool = _help("Pack examples into rows of max_length (best-fit-decreasing over the whole dataset).", False)
    packing_strategy: str = _help("bfd: truncate over-long examples; bfd_split: split them into max_length chunks.",
                                  "bfd", choices=("bfd", "bfd_split"))
    padding_free: bool = _help("Flatten each batch into one row with per-example position ids (no padding).", False)
    eval_packing: bool | None = _help("Pack eval data too (default: same as packing).")

    chunked_loss: bool = _help("Compute the LM head and loss only at trained positions, in chunks (exact; less "
                               "memory and compute), in training and eval. Used for plain-head causal LMs, also "
                               "under DDP, FSDP, DeepSpeed and torch_compile.", True)
    loss_kernel: str = _help("What computes the chunked training loss at the trained positions: chunked (sft's own "
                             "linear-cross-entropy), fused (the same with each chunk's softmax and gradient compiled "
                             "by inductor into fused kernels: fewer passes over the logits, a compile of a few "
                             "seconds at the first step), liger (Liger's fused linear cross-entropy: needs "
                             "liger-kernel and a CUDA GPU; same loss, normalisation and label smoothing) or auto: "
                             "fused on a CUDA GPU with Triton (measured faster there: 25 vs 45 ms for a Qwen2.5-0.5B "
                             "head on an H100, Liger's 106), chunked elsewhere. Eval always uses sft's own.", "auto",
                             choices=LOSS_KERNELS)
    activation_memory_budget: float | None = _help(
        "torch_compile only: the share of activation memory the compiler keeps for the backward (torch's "
        "activation_memory_budget; unset: 1, torch's default). Below 1 it recomputes the cheapest ops in the backward "
        "instead of keeping their outputs: 0.8 recomputes only elementwise ops (the norms' outputs, SwiGLU's "
        "product; the same matmuls and attention), keeping per layer 0.47x of eager's activations and 0.67x of "
        "Liger's (scripts/bench_activations.py); lower values also recompute matmuls and attention.")

    # PEFT (LoRA / DoRA / rsLoRA)
    use_peft: bool = _help("Train a LoRA adapter instead of all weights.", False)
    lora_r: int = _help("LoRA rank.", 16)
    lora_alpha: int = _help("LoRA scaling numerator (scale = alpha / r, or alpha / sqrt(r) with rsLoRA).", 32)
    lora_dropout: float = _help("Dropout on the LoRA input.", 0.05)
    lora_target_modules: list[str] | None = _help("Module names to adapt (default: every linear layer but the output head).")
    use_dora: bool = _help("Weight-decomposed LoRA (DoRA).", False)
    use_rslora: bool = _help("Rank-stabilised LoRA scaling alpha / sqrt(r).", False)
    lora_modules_to_save: list[str] | None = _help("Modules trained fully and saved with the adapter (e.g. embed_tokens).")

    # Quantized loading (bitsandbytes)
    load_in_4bit: bool = _help("Load the base model in 4 bit (QLoRA).", False)
    load_in_8bit: bool = _help("Load the base model in 8 bit.", False)
    bnb_4bit_quant_type: str = _help("4-bit data type: nf4 or fp4.", "nf4", choices=("nf4", "fp4"))
    bnb_4bit_use_double_quant: bool = _help("Quantize the quantization constants too (saves ~0.4 bit/param).", True)
    bnb_4bit_compute_dtype: str = _help("dtype of 4-bit matmuls: auto (the model dtype), bfloat16, float16, float32.",
                                        "auto", choices=DTYPE_NAMES)
    bnb_4bit_quant_storage: str | None = _help("Storage dtype of packed 4-bit weights (FSDP-QLoRA needs the compute dtype).")

    # Distributed
    distributed: str | None = _help("Preset: ddp, fsdp, fsdp_offload, zero2, zero3 or zero3_offload (fills fsdp/"
                                    "fsdp_config or deepspeed; see docs/distributed.md).",
                                    choices=DISTRIBUTED_PRESETS)
    # TrainingArguments types this `str`; a YAML `fsdp: true` (what transformers 5 asks for) must load too.
    fsdp: Any = _help('FSDP: true (tuned in fsdp_config, or use `distributed: fsdp`), or Alpaca-style options '
                      'such as "full_shard auto_wrap".')

    # Generation-based evaluation (predict_with_generate, generation_max_length, generation_num_beams and
    # generation_config come from Seq2SeqTrainingArguments)
    max_new_tokens: int | None = _help("Tokens to generate per eval prompt (default: generation_max_length, read as "
                                       "new tokens, or 128).")
    metrics: list[str] | None = _help("Generation metrics: exact_match, rouge, bleu, or module.path:function "
                                      "(default: all three built-ins).")

    # Early stopping
    early_stopping_patience: int | None = _help(
        "Stop training once metric_for_best_model (default: the eval loss) has not improved for this many "
        "evaluations in a row; needs evaluations during training (eval_strategy steps or epoch). Unset: never.")
    early_stopping_threshold: float = _help("How much the metric must improve on the best so far to count as an "
                                            "improvement (with early_stopping_patience).", 0.0)

    recipe_keys: list[str] = field(default_factory=list, init=False, repr=False)  # the keys the user set
    # use_cpu was turned on here because no accelerator is visible (not asked for by the recipe)
    cpu_by_default: bool = field(default=False, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.hub_token:
            # The Trainer pickles its arguments into every checkpoint (training_args.bin); a token kept here would
            # land on disk. huggingface_hub reads HF_TOKEN, so hand it over through the environment instead.
            os.environ["HF_TOKEN"] = self.hub_token
            self.hub_token = None
        if self.fp16 and self.bf16:
            raise ValueError("fp16 and bf16 are both true; pick one (bf16 on Ampere or newer GPUs, else fp16)")
        if not self.use_cpu and not (torch.accelerator.is_available() or is_torch_xla_available()):
            # transformers trains on CPU here anyway, but only use_cpu tells accelerate so: with it a torchrun /
            # `sft launch` of N processes is gloo data-parallel (not N independent runs) and bf16 is CPU autocast.
            self.use_cpu = self.cpu_by_default = True
        if self.dataloader_pin_memory and isinstance(self.accelerator_config, dict | None):
            # accelerate moves each batch to the GPU as the loop takes it, then collates the next one before handing
            # it over. A blocking copy first waits for the GPU to finish the previous step, so the GPU idled through
            # that collation and the Trainer's bookkeeping at every step (7.7 ms on 8 x 2048 tokens, BENCHMARKS.md).
            # From pinned memory the copy is queued instead (the pinned buffer is kept until it is done).
            self.accelerator_config = {"non_blocking": True, **(self.accelerator_config or {})}
        deferred = {name: getattr(self, name) for name in GPU_ONLY_FLAGS if getattr(self, name) and not
                    _supported(name, self.use_cpu)}
        for name in deferred:  # let TrainingArguments validate (and resolve) the rest on any machine
            setattr(self, name, False if name != "tf32" else None)
        super().__post_init__()
        for name, value in deferred.items():
            setattr(self, name, value)
        self._unsupported_flags = sorted(deferred)

    def hardware_problems(self) -> list[str]:
        """GPU-only flags (and loss_kernel: liger) this machine cannot honour, each as a message saying how to fix it.

        bf16 without any GPU is refused unless use_cpu was asked for: a GPU recipe that silently trains on CPU
        (a broken CUDA install, the wrong machine) would look like a hang. With use_cpu it is CPU bf16 autocast.
        fp16 without any GPU is refused too: accelerate has no CPU fp16 autocast, so it would silently train in fp32
        (with use_cpu asked for, check_values refuses it when the recipe is built, on any machine).
        """
        cpu_bf16 = [name for name in ("bf16", "bf16_full_eval") if getattr(self, name) and self.cpu_by_default]
        problems = [
            f"{name}: true needs a CUDA GPU with {'TF32' if name == 'tf32' else 'bfloat16'} support, and this "
            f"machine has none. Set {name}: false (or pass --{name} false) to run here"
            + (", or pass --use_cpu true to train under CPU bf16 autocast." if name != "tf32" else ".")
            for name in sorted({*self._unsupported_flags, *cpu_bf16})
        ]
        if self.fp16 and self.cpu_by_default:
            problems.append("fp16: true needs a GPU, and this machine has none: on CPU the Trainer has no fp16 "
                            "autocast and would silently train in fp32. Set fp16: false (or pass --fp16 false) to "
                            "train in fp32 here, or pass --fp16 false --bf16 true --use_cpu true to train under CPU "
                            "bf16 autocast.")
        liger = liger_unavailable(self.use_cpu) if self.loss_kernel == "liger" else None
        return problems + ([liger] if liger else [])

    @property
    def on_cuda(self) -> bool:
        """Whether this run's model runs on a CUDA GPU (not use_cpu, and one is visible): CUDA-only kernels ask."""
        return not self.use_cpu and torch.cuda.is_available()

    @property
    def packs_eval(self) -> bool:
        """Whether eval data is packed: eval_packing, or when unset as the training data is (packing)."""
        return self.packing if self.eval_packing is None else self.eval_packing


def liger_unavailable(use_cpu: bool) -> str | None:
    """Why `loss_kernel: liger` cannot run here, or None: Liger's kernels are Triton, so they need liger-kernel
    installed and a CUDA GPU (found without importing it: importing Triton is slow)."""
    if importlib.util.find_spec("liger_kernel") is None:
        reason = "the liger-kernel package is not installed (pip install liger-kernel; it needs triton)"
    elif use_cpu or not torch.cuda.is_available():
        reason = "Liger's Triton kernels need a CUDA GPU, and this run has none"
    else:
        return None
    return (f"loss_kernel: liger cannot run here: {reason}. Set loss_kernel: auto (or pass --loss_kernel auto) to "
            "train with sft's own chunked loss, which computes the same loss.")


def _supported(flag: str, use_cpu: bool) -> bool:
    """Whether TrainingArguments accepts `flag` here: bf16 on a bf16 GPU or on CPU (autocast), TF32 on Ampere+."""
    if flag == "tf32":
        return is_torch_tf32_available()
    return use_cpu or is_torch_bf16_gpu_available()
