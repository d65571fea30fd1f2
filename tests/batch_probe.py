"""`python -m sft ...` that also records, per rank, what data-parallel training did, for tests run under torchrun
or `sft launch` (tests/test_ddp.py).

Each rank writes batches-rank{R}.json into output_dir: the world size and parallel mode the Trainer saw, the class
of the module training called (DistributedDataParallel, DeepSpeedEngine, ...), the input_ids of every training
micro-batch, how many training forwards computed the chunked trained-positions loss, the dtypes of the
trainable parameters after training (the optimizer's master weights) and how many of the model's modules were
compiled in place (torch_compile).
"""

import json
import runpy
import sys
from pathlib import Path

import torch

import sft.training.loss
from sft.training.trainer import SFTMixin

RECORD: dict = {"batches": [], "chunked_train_forwards": 0, "called": []}


def counting_chunked_forward(self, *args, **kwargs):
    if torch.is_grad_enabled() and kwargs.get("labels") is not None:
        RECORD["chunked_train_forwards"] += 1
    return chunked_forward(self, *args, **kwargs)


def recording_training_step(self, model, inputs, num_items_in_batch=None):
    RECORD["batches"].append(inputs["input_ids"].tolist())
    RECORD["called"].append(type(model).__name__)
    return training_step(self, model, inputs, num_items_in_batch)


def recording_train(self, *args, **kwargs):
    try:
        return train(self, *args, **kwargs)
    finally:
        RECORD.update(world_size=self.args.world_size, parallel_mode=str(self.args.parallel_mode),
                      trainable_dtypes=sorted({str(p.dtype) for p in self.model.parameters() if p.requires_grad}),
                      compiled_modules=sum(getattr(m, "_compiled_call_impl", None) is not None
                                           for m in self.model.modules()))
        out = Path(self.args.output_dir) / f"batches-rank{self.args.process_index}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(RECORD))


chunked_forward, sft.training.loss.chunked_forward = sft.training.loss.chunked_forward, counting_chunked_forward
training_step, SFTMixin.training_step = SFTMixin.training_step, recording_training_step
train, SFTMixin.train = SFTMixin.train, recording_train
sys.argv = ["sft", *sys.argv[1:]]
runpy.run_module("sft", run_name="__main__")
