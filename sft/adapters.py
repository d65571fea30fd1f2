"""LoRA / DoRA / rsLoRA adapters from a recipe (peft), and the preparation a quantized base needs (QLoRA)."""

import logging

from peft import LoraConfig, PeftModel, get_peft_model
from transformers import PreTrainedModel

from sft.config import SFTConfig

log = logging.getLogger(__name__)
ALL_LINEAR = "all-linear"  # peft's shorthand: every linear layer except the output head


def lora_config(config: SFTConfig, model: PreTrainedModel, new_rows: range = range(0)) -> LoraConfig:
    """The peft LoraConfig for the recipe; `new_rows` are embedding rows added for new tokens, trained as well.

    Args:
        config: the recipe (lora_* keys, use_dora, use_rslora).
        model: the base model the adapter goes on.
        new_rows: embedding rows beyond the base vocabulary (added tokens and their padding).
    """
    return LoraConfig(
        task_type="CAUSAL_LM",
        r=config.lora_r,
        lora_alpha=config.lora_alpha,
        lora_dropout=config.lora_dropout,
        target_modules=config.lora_target_modules or ALL_LINEAR,
        use_dora=config.use_dora,
        use_rslora=config.use_rslora,
        modules_to_save=config.lora_modules_to_save,
        trainable_token_indices=new_token_targets(model, new_rows, config.lora_modules_to_save or []),
    )


def new_token_targets(model: PreTrainedModel, new_rows: range, fully_trained: list[str]) -> dict[str, list[int]] | None:
    """Input and output embedding layers mapped to the new rows to train, or None when no rows were added.

    A frozen base would otherwise keep the new tokens at their initial values: the model could neither read
    nor write them. Only those rows are trained and saved (peft trainable tokens), not the whole matrix.
    """
    if not new_rows:
        return None
    layers = [model.get_input_embeddings(), model.get_output_embeddings()]
    names = [name for name, module in model.named_modules() if any(module is layer for layer in layers)]
    # A layer listed in lora_modules_to_save is trained whole already; peft refuses both on one layer.
    return {name: list(new_rows) for name in names if name.rsplit(".", 1)[-1] not in fully_trained} or None


def add_adapter(model: PreTrainedModel, config: SFTConfig, new_token_ids: list[int] | None = None) -> PeftModel:
    """Freeze `model` and wrap it in the recipe's trainable LoRA adapter (after k-bit preparation if quantized).

    Args:
        model: the loaded base model, embeddings already resized for the tokenizer.
        config: the recipe.
        new_token_ids: ids of tokens added to the vocabulary (sft.model.fit_embeddings); their rows get trained.
    """
    if config.load_in_4bit or config.load_in_8bit:
        prepare_quantized_base(model)
    # Train every row past the old vocabulary, padding rows too: saved with the adapter, they reload exactly.
    rows = model.get_input_embeddings().weight.shape[0]
    new_rows = range(new_token_ids[0], rows) if new_token_ids else range(0)
    # peft keeps adapter weights (DoRA magnitudes included) in float32 even on a bf16 base; never downcast
    # them: bf16 rounds the small updates of DoRA magnitudes to zero and silently freezes them.
    peft_model = get_peft_model(model, lora_config(config, model, new_rows))
    log_trainable_parameters(peft_model)
    return peft_model


def prepare_quantized_base(model: PreTrainedModel) -> None:
    """Freeze the quantized base and keep normalisation weights in float32, as QLoRA does.

    Unlike peft.prepare_model_for_kbit_training this leaves embeddings and the output head in the model dtype
    (QLoRA's reference script casts them back too): float32 copies cost 2 GB more on a 128k-vocabulary 8B model.
    Input gradients for gradient checkpointing are enabled by transformers when the Trainer turns it on.
    """
    for param in model.parameters():
        param.requires_grad_(False)
    for module in model.modules():
        if "norm" in type(module).__name__.lower():  # LayerNorm, LlamaRMSNorm, ...: small and precision-sensitive
            module.float()


def log_trainable_parameters(model: PeftModel) -> tuple[int, int]:
    """Log and return (trainable, total) parameter counts; 4-bit weights count as unpacked parameters."""
    trainable, total = model.get_nb_trainable_parameters()
    log.info("Trainable parameters: %s of %s (%.4f%%)", f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1))
    return trainable, total

