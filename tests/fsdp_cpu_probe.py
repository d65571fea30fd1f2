"""`python -m sft ...` with accelerate's FSDP2 kept on CPU (sft.check.prove.fsdp_on_cpu, which `sft check --prove`
uses too), for tests run under torchrun on gloo. Each rank also writes fsdp-rank{R}.json into output_dir: the
modules that are FSDP2 units and their types.
"""

import json
import sys
from pathlib import Path

from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from sft.check.prove.fsdp_on_cpu import main
from sft.training.trainer import SFTMixin

sft_train = SFTMixin.train


class RecordUnits(TrainerCallback):
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        units = {name: type(module).__name__ for name, module in model.named_modules() if isinstance(module, FSDPModule)}
        out = Path(args.output_dir) / f"fsdp-rank{args.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"world_size": args.world_size, "units": units}))


def train_recording_units(self, *args, **kwargs):
    self.add_callback(RecordUnits())
    return sft_train(self, *args, **kwargs)


SFTMixin.train = train_recording_units
main(sys.argv[1:])
