"""A detector of device->host synchronisations for CPU tests (tests/test_host_syncs.py).

On a GPU some ops make the host wait until the device has finished all queued work: reading a value
(item/bool/int/float, tolist, .cpu(), .numpy(), a blocking .to("cpu")) and ops whose output size depends on the data
(nonzero, masked_select, boolean-mask indexing, unique, repeat_interleave without output_size, bincount, equal). One
such op per micro-step stalls the pipeline: the CPU cannot queue the next kernels while it waits.

On CPU every tensor is a host tensor, so the probe tracks which tensors would live on the device in a real job:
the model's parameters and every batch the Trainer hands to a training step are marked, and every tensor an op
computes from a marked tensor is marked too (taint tracking in a TorchDispatchMode). A sync op is recorded only
when one of its inputs is marked, with the Python frames that called it. Tensors the step builds from nothing
(torch.zeros(..., device=x.device)) are not marked until they meet a marked one; `torch.tensor(data, device=...)`
from host data (a blocking host-to-device copy, which also waits for the device) is recorded wherever it is
called during training.
"""

import traceback
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

from sft import SFTTrainer

REPO = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve()
TORCH_DIR = Path(torch.__file__).resolve().parent

aten = torch.ops.aten
# Ops that wait for the device whenever their (marked) input lives there.
ALWAYS_SYNC = {
    aten._local_scalar_dense.default: "item",  # .item(), bool(), int(), float(), is_nonzero
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.bincount.default: "bincount",
    aten.equal.default: "equal",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
}
HOST_READS = {"cpu": "cpu", "numpy": "numpy", "tolist": "tolist"}  # Tensor methods that copy to the host


@dataclass
class Sync:
    """One recorded synchronisation: the op and the Python frames (file, line, function; innermost last) that led
    to it, torch's own frames left out."""

    op: str
    frames: list[tuple[str, int, str]]

    @property
    def site(self) -> str:
        """file:line of the innermost frame: where the sync is written."""
        return "{}:{}".format(*self.frames[-1][:2]) if self.frames else "?"

    @property
    def source(self) -> tuple[str, str, str]:
        """(op, file, function) of the innermost frame: where the sync is written, without its line number."""
        return (self.op, *self.frames[-1][::2]) if self.frames else (self.op, "?", "?")

    @property
    def sft_site(self) -> str | None:
        """file:line of the innermost frame inside sft/, if any."""
        inside = [f for f in self.frames if f[0].startswith("sft/")]
        return "{}:{}".format(*inside[-1][:2]) if inside else None

    def __str__(self) -> str:
        return f"{self.op} at " + " <- ".join("{}:{} ({})".format(*f) for f in reversed(self.frames[-4:]))


def _frames() -> list[tuple[str, int, str]]:
    """The caller's frames, repo-relative inside the repo, torch internals and this file dropped."""
    out = []
    for frame in traceback.extract_stack()[:-3]:
        path = Path(frame.filename).resolve()
        if path == HERE or TORCH_DIR in path.parents:
            continue
        # installed packages by their last two parts, also from a virtual environment inside the checkout (CI's .venv)
        ours = REPO in path.parents and "site-packages" not in path.parts
        name = str(path.relative_to(REPO)) if ours else "/".join(path.parts[-2:])
        out.append((name, frame.lineno, frame.name))
    return out


def _sync_name(func, args: tuple, kwargs: dict) -> str | None:
    """The sync `func` forces on a GPU with these arguments, or None."""
    if func in ALWAYS_SYNC:
        return ALWAYS_SYNC[func]
    indexing = (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default)
    if func in indexing and any(i is not None and i.dtype == torch.bool for i in args[1]):
        return "boolean index"
    if func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None:
        return "repeat_interleave without output_size"
    return None


@dataclass
class SyncDetector:
    """Marks device tensors and records the syncs ops on them would force; use as a context manager."""

    syncs: list[Sync] = field(default_factory=list)
    marked: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary)

    def mark(self, *trees: object) -> None:
        """Mark every tensor in `trees` (mappings such as BatchEncoding, lists, tensors) as living on the device."""
        for leaf in _tensors(trees):
            self.marked[leaf] = True

    def is_marked(self, tree: object) -> bool:
        """Whether any tensor in `tree` is marked."""
        return any(t in self.marked for t in _tensors(tree))

    def record(self, op: str) -> None:
        """Record one sync at the current Python stack."""
        self.syncs.append(Sync(op, _frames()))

    def __enter__(self) -> "SyncDetector":  # noqa: PYI034
        self._modes = [_Dispatch(self), _Functions(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)

    def counts(self, sft_only: bool = False) -> Counter:
        """Syncs per (op, site); with sft_only, per (op, innermost sft frame) for those that pass through sft."""
        if sft_only:
            return Counter((s.op, s.sft_site) for s in self.syncs if s.sft_site)
        return Counter((s.op, s.site) for s in self.syncs)

    def sources(self) -> Counter:
        """Syncs per (op, file, function) where they are written."""
        return Counter(s.source for s in self.syncs)


def _tensors(tree: object) -> list[torch.Tensor]:
    """The tensors in a tree of mappings (BatchEncoding is one, but no pytree node), lists and tuples."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        tree = list(tree.values())
    if isinstance(tree, (list, tuple)):
        return [t for item in tree for t in _tensors(item)]
    return []


class _Dispatch(TorchDispatchMode):
    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.detector.is_marked((args, kwargs)):
            name = _sync_name(func, args, kwargs)
            if name is not None:
                self.detector.record(name)
            self.detector.mark(out, *_written(func, args, kwargs))
        return out


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensors an op writes into, and the tensors they are views of (x.view(-1).index_copy_(...) fills x)."""
    out = []
    for i, arg in enumerate(func._schema.arguments):
        if arg.alias_info is None or not arg.alias_info.is_write:
            continue
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        if isinstance(value, torch.Tensor):
            out += [value] + ([value._base] if value._base is not None else [])
    return out


class _Functions(TorchFunctionMode):
    """Host reads that never reach the dispatcher on CPU (.cpu() of a CPU tensor returns it) and host-to-device
    copies of Python data."""

    def __init__(self, detector: SyncDetector) -> None:
        super().__init__()
        self.detector = detector

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in HOST_READS and args and self.detector.is_marked(args[0]):
            self.detector.record(HOST_READS[name])
        elif name == "to" and args and self.detector.is_marked(args[0]) and _to_host(args[1:], kwargs):
            if kwargs.get("non_blocking"):
                # queued on the device's stream, the host not waiting; the copy is host memory (read once an event
                # says it landed: sft.training.divergence.StepValues, checked on a GPU in tests/test_gpu.py)
                out = func(*args, **kwargs)
                self.detector.marked.pop(out, None)
                return out
            self.detector.record("copy to host")
        elif (func in (torch.tensor, torch.as_tensor) and kwargs.get("device") is not None
              and not isinstance(args[0], torch.Tensor)):
            self.detector.record("host-to-device copy")
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    """`.to("cpu")`: a literal host device. `.to(device)` with the job's device is a host copy only on CPU runs, so a
    torch.device (as args.device is here) is not taken for one."""
    device = kwargs.get("device", args[0] if args else None)
    return isinstance(device, str) and torch.device(device).type == "cpu"


class ProbedTrainer(SFTTrainer):
    """SFTTrainer whose parameters and training batches are marked as device tensors for `detector`."""

    detector: SyncDetector

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        batches, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        self.detector.mark(batches, num_items)  # in a real job accelerate moved them to the GPU
        self.micro_steps = getattr(self, "micro_steps", 0) + len(batches)
        return batches, num_items

    def get_eval_dataloader(self, eval_dataset=None):
        loader = super().get_eval_dataloader(eval_dataset)
        return _Marking(loader, self.detector)


class _Marking:
    """An eval dataloader whose batches are marked as they are drawn (accelerate moves them to the GPU there)."""

    def __init__(self, loader, detector: SyncDetector) -> None:
        self.loader, self.detector = loader, detector

    def __iter__(self):
        for batch in self.loader:
            self.detector.mark(batch)
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str):
        return getattr(self.loader, name)
