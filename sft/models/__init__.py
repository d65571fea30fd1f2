"""Layer 2 — models: what a model is and how it is loaded, before any data exists.

Owns: whether the Hub can be reached, decided once per process (`hub`); a model's architecture read offline
(`architectures`); the model-family capability table (`families`: FSDP wrap classes, plain LM heads for the chunked
loss, packing isolation); loading a recipe's model with its dtype, attention backend and safe defaults (`loading`);
LoRA/DoRA adapters (`adapters`); bitsandbytes quantization (`quantization`); `torch_compile` of each repeated block
in place (`compilation`); saved run folders for inference (`saved`) and `sft merge` (`export`).
Must not import: sft.data, sft.evaluation, sft.training, sft.planning, sft.check, sft.cli.
"""
