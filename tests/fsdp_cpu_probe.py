"""`python -m sft ...` with accelerate's FSDP2 kept on CPU, for tests run under torchrun on gloo.

accelerate turns FSDP into plain data parallelism when it runs on CPU (its FSDP branch covers accelerator devices
only), so a CPU run of `distributed: fsdp` proves nothing by itself. FSDP2's fully_shard works on CPU with gloo, so
this probe puts the FSDP plugin the Trainer built from sft's preset (TrainingArguments.fsdp_plugin_args) back into
accelerate's state: the model is then prepared by accelerate's fsdp2_prepare_model with sft's wrap classes, trained,
checkpointed (sharded) and saved (whole) as on GPUs. Each rank writes fsdp-rank{R}.json into output_dir: the modules
that are FSDP2 units and their types.
"""

import json
import runpy
import sys
from pathlib import Path

import transformers
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from sft.training.trainer import SFTMixin

build_accelerator = transformers.Trainer.create_accelerator_and_postprocess
save_model = transformers.Trainer.save_model
sft_train = SFTMixin.train


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


class RecordUnits(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        units = {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, FSDPModule)}
        out = Path(args.output_dir) / f"fsdp-rank{args.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"world_size": args.world_size, "units": units}))


def with_fsdp(self) -> None:
    build_accelerator(self)
    keep_fsdp(self)


def train_recording_units(self, *args, **kwargs):
    self.add_callback(RecordUnits())
    return sft_train(self, *args, **kwargs)


def save_with_fsdp(self, *args, **kwargs):
    keep_fsdp(self)
    return save_model(self, *args, **kwargs)


transformers.Trainer.create_accelerator_and_postprocess = with_fsdp
transformers.Trainer.save_model = save_with_fsdp
SFTMixin.train = train_recording_units
sys.argv = ["sft", *sys.argv[1:]]
runpy.run_module("sft", run_name="__main__")
