"""`python -m sft ...` that also counts the rows each process tokenizes, for tests that run several processes.

Every call of sft.data.build.encode_batch (the datasets.map body that tokenizes) appends its row count to
$SFT_COUNT_DIR/tokenized-rank{RANK}.txt; a rank that loads the tokenized cache instead writes nothing.
"""

import os
import runpy
import sys
from pathlib import Path

import sft.data.build

tokenize = sft.data.build.encode_batch


def counting_encode_batch(batch: dict, indices: list[int], **kwargs) -> dict:
    path = Path(os.environ["SFT_COUNT_DIR"]) / f"tokenized-rank{os.environ.get('RANK', '0')}.txt"
    with path.open("a") as counts:
        counts.write(f"{len(indices)}\n")
    return tokenize(batch, indices, **kwargs)


sft.data.build.encode_batch = counting_encode_batch
sys.argv = ["sft", *sys.argv[1:]]
runpy.run_module("sft", run_name="__main__")
