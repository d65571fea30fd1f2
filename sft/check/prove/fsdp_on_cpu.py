"""`python -m sft.check.prove.fsdp_on_cpu train RECIPE ...`: `sft` with FSDP kept on CPU, for the save/load proof of
a recipe's FSDP preset (2 processes under torchrun, gloo).

accelerate turns FSDP into plain data parallelism when it runs on CPU (its FSDP branch covers accelerator devices
only), so a CPU run of `distributed: fsdp` would prove DDP. FSDP2's fully_shard works on CPU with gloo: this entry
point puts the FSDP plugin the Trainer built from the recipe's preset (TrainingArguments.fsdp_plugin_args) back into
accelerate's state, so the model is prepared by accelerate's fsdp2_prepare_model with the recipe's wrap classes,
trained, checkpointed (sharded) and saved (whole) as on GPUs. The patches live in this process only: `sft train`
itself never imports this module.
"""

import runpy
import sys

import transformers
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

build_accelerator = transformers.Trainer.create_accelerator_and_postprocess
save_model = transformers.Trainer.save_model


def keep_fsdp(trainer: transformers.Trainer) -> None:
    """FSDP in accelerate's shared state (which is rebuilt for CPU during a run) with the preset's plugin."""
    if not trainer.args.fsdp_plugin_args:
        return
    state = trainer.accelerator.state
    if getattr(trainer, "cpu_fsdp_plugin", None) is None:
        trainer.cpu_fsdp_plugin = FullyShardedDataParallelPlugin(**trainer.args.fsdp_plugin_args)
        if state.mixed_precision != "no":
            trainer.cpu_fsdp_plugin.set_mixed_precision(state.mixed_precision)
    state.distributed_type, state.fsdp_plugin = DistributedType.FSDP, trainer.cpu_fsdp_plugin
    trainer.is_fsdp_enabled = True


def build_accelerator_with_fsdp(self: transformers.Trainer) -> None:
    build_accelerator(self)
    keep_fsdp(self)


def save_model_with_fsdp(self: transformers.Trainer, *args, **kwargs) -> None:
    keep_fsdp(self)
    return save_model(self, *args, **kwargs)


def keep_fsdp_on_cpu() -> None:
    """Patch this process's Trainer so FSDP stays FSDP on CPU."""
    transformers.Trainer.create_accelerator_and_postprocess = build_accelerator_with_fsdp
    transformers.Trainer.save_model = save_model_with_fsdp


def main(argv: list[str]) -> None:
    """Run the sft command line (argv without the program name) with FSDP kept on CPU."""
    keep_fsdp_on_cpu()
    sys.argv = ["sft", *argv]
    runpy.run_module("sft", run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
