"""`python -m sft ...` plus a callback that records how the model was sharded, for tests run under torchrun.

tests/test_multiprocess.py runs `torchrun --nproc_per_node 2 tests/sharding_probe.py train RECIPE [--key value]`.
When training begins (after DeepSpeed/FSDP set the model up, before the first forward) each rank writes
sharding-rank{R}.json into output_dir: per parameter its ZeRO-3 bookkeeping (full size ds_numel, this rank's shard
ds_tensor, the tensor the module holds, ZeroParamStatus), and the modules that are FSDP2 units.
"""

import json
import runpy
import sys
from pathlib import Path

from torch import nn
from torch.distributed.fsdp import FSDPModule
from transformers import TrainerCallback

from sft.training.trainer import SFTMixin


class RecordSharding(TrainerCallback):
    """Write this rank's view of the model's sharding."""

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        report = {"world_size": args.world_size,
                  "params": {name: describe(param) for name, param in model.named_parameters()},
                  "fsdp_modules": [name for name, module in model.named_modules() if isinstance(module, FSDPModule)],
                  "module_types": {name: type(module).__name__ for name, module in model.named_modules()}}
        out = Path(args.output_dir) / f"sharding-rank{args.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report))


def describe(param: nn.Parameter) -> dict:
    """ZeRO-3 bookkeeping of one parameter (zero_param False when DeepSpeed does not manage it)."""
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    if not is_zero_param(param):
        return {"zero_param": False, "numel": param.numel(), "trainable": param.requires_grad}
    return {"zero_param": True, "ds_numel": param.ds_numel, "shard_numel": param.ds_tensor.numel(),
            "numel": param.numel(), "status": param.ds_status.name, "trainable": param.requires_grad}


def train_with_probe(self, *args, **kwargs):
    self.add_callback(RecordSharding())
    return sft_train(self, *args, **kwargs)


sft_train = SFTMixin.train
SFTMixin.train = train_with_probe
sys.argv = ["sft", *sys.argv[1:]]
runpy.run_module("sft", run_name="__main__")
