"""The training step never makes the host wait for the GPU: no device-to-host sync per micro-step from sft (issue 19).

tests/sync_probe.py marks the parameters and batches as device tensors and records every op on them that would
sync on a GPU. A run of 2 optimizer steps x 4 accumulated micro-steps, logging_steps beyond the run, may sync:
- once per optimizer step, in sft, where the run is not on a CUDA GPU: DivergenceGuard reads the step's loss and
  gradient norm (StepValues.read_now). On a GPU it reads them a step later from a copy made without waiting, and at
  once only at a step that saves, evaluates or ends training (test_the_guard_on_a_gpu_waits_only_at_the_last_step);
- once per run, in the Trainer: its loss accumulator is created from a Python number and read at the end;
- in transformers' mask code (masking_utils, create_causal_mask), once or twice per forward: for a packed /
  padding-free batch it checks whether the position_ids hold more than one sequence
  (find_packed_sequence_indices); for a padded batch under sdpa whether the attention mask pads anything, to use
  sdpa's is_causal instead of a mask (_ignore_causal_mask_sdpa). Both are skipped under torch.compile; sft cannot
  remove them without replacing transformers' mask code.
Nothing else: the chunked loss selects trained positions at a size the collator counted on the host.
"""

import collections
import traceback
import warnings

import datasets
import pytest
import torch
from sync_probe import ProbedTrainer, SyncDetector

from sft import SFTConfig, SFTTrainer
from sft.data.boundaries import token_lengths
from sft.data.collators import TRAINED_TARGETS, HostCount, PackedCollator, PaddingFreeCollator
from sft.data.packing import pack_dataset
from sft.training import loss as loss_module
from sft.training.linear_cross_entropy import LinearCrossEntropy, chunk_rows
from sft.training.loss import attach_chunked_loss

from conftest import make_llama

OPTIMIZER_STEPS, ACCUMULATION = 2, 4
PER_RUN = {("host-to-device copy", "transformers/trainer.py", "_inner_training_loop"): 1,  # _tr_loss = tensor(0.)
           ("item", "transformers/trainer.py", "_finalize_training"): 1}  # the train loss, once
PER_OPTIMIZER_STEP = ("tolist", "sft/training/divergence.py", "read_now")
MASKS = "transformers/masking_utils.py"
PACKED_MASK = ("item", MASKS, "find_packed_sequence_indices")
PADDED_MASK = ("item", MASKS, "_ignore_causal_mask_sdpa")


def sft_data(n: int = 32, seed: int = 0) -> datasets.Dataset:
    """Examples of 6-29 tokens with 1..L-1 trained (prompt masked)."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(n):
        length = int(torch.randint(6, 30, (1,), generator=g))
        trained = int(torch.randint(1, length, (1,), generator=g))
        ids = torch.randint(5, 300, (length,), generator=g).tolist()
        rows.append({"input_ids": ids, "labels": [-100] * (length - trained) + ids[length - trained:]})
    return datasets.Dataset.from_list(rows)


def probed_run(tmp_path, tokenizer, evaluate: bool = False, deferred: bool = False,
               **config) -> tuple[SyncDetector, ProbedTrainer]:
    """Train OPTIMIZER_STEPS steps of ACCUMULATION micro-batches (and evaluate) under the sync detector."""
    data = sft_data()
    if config.get("packing"):
        data = pack_dataset(sft_data(96), 64)  # 26 rows: 13 micro-batches
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, per_device_eval_batch_size=4,
                     gradient_accumulation_steps=ACCUMULATION, max_steps=OPTIMIZER_STEPS, logging_steps=100,
                     report_to="none", save_strategy="no", dataloader_drop_last=True, **config)
    model = make_llama(len(tokenizer), seed=1)
    trainer = ProbedTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=data,
                            eval_dataset=data.select(range(8)) if evaluate else None)
    trainer.divergence.deferred = deferred  # as on a CUDA GPU: the guard reads each step a step later
    trainer.detector = detector = SyncDetector()
    detector.mark(list(model.parameters()))
    with detector:
        trainer.train()
        if evaluate:
            trainer.evaluate()
    return detector, trainer


CONFIGS = {
    "padded": {},
    "padded, no chunked loss": {"chunked_loss": False},
    "packed": {"packing": True},
    "padding-free": {"padding_free": True},
    "packed + padding-free": {"packing": True, "padding_free": True},
    "packed, no chunked loss": {"packing": True, "chunked_loss": False},
    "packed + NEFTune": {"packing": True, "neftune_noise_alpha": 5.0},
    "padded + NEFTune": {"neftune_noise_alpha": 5.0},
    "label smoothing": {"label_smoothing_factor": 0.1},
    "label smoothing, no chunked loss": {"label_smoothing_factor": 0.1, "chunked_loss": False},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_no_sync_per_micro_step(tmp_path, tokenizer, name):
    config = CONFIGS[name]
    detector, trainer = probed_run(tmp_path, tokenizer, **config)
    assert trainer.micro_steps == OPTIMIZER_STEPS * ACCUMULATION
    sources = detector.sources()
    masks = {source: sources.pop(source) for source in list(sources) if source[1] == MASKS}
    assert dict(sources) == {**PER_RUN, PER_OPTIMIZER_STEP: OPTIMIZER_STEPS}, "\n".join(map(str, detector.syncs))
    # transformers' mask checks (module doc): one per packed forward, one or two per padded one
    if config.get("packing") or config.get("padding_free"):
        assert masks == {PACKED_MASK: trainer.micro_steps}
    else:
        assert set(masks) == {PADDED_MASK}
        assert trainer.micro_steps <= masks[PADDED_MASK] <= 2 * trainer.micro_steps


def test_the_guard_on_a_gpu_waits_only_at_the_last_step(tmp_path, tokenizer):
    """Deferred as on a CUDA GPU, the divergence guard's reads of steps 1..N-1 wait for nothing (a copy queued
    without waiting, read a step later); the last step, which ends training, is read at once. Without deferral
    (the control, as on CPU) it waits at every step."""
    detector, trainer = probed_run(tmp_path, tokenizer, deferred=True, packing=True)
    assert trainer.state.global_step == OPTIMIZER_STEPS > 1
    sources = detector.sources()
    guard = {source: count for source, count in sources.items() if source[1] == "sft/training/divergence.py"}
    assert guard == {PER_OPTIMIZER_STEP: 1}, "\n".join(map(str, detector.syncs))
    assert trainer.divergence.last_finite[0] == OPTIMIZER_STEPS and trainer.divergence.bad is None
    detector, _ = probed_run(tmp_path, tokenizer, deferred=False, packing=True)
    assert detector.sources()[PER_OPTIMIZER_STEP] == OPTIMIZER_STEPS


@pytest.mark.parametrize("config", [{}, {"packing": True}, {"padding_free": True}], ids=["padded", "packed",
                                                                                          "padding-free"])
def test_eval_loss_adds_no_sync_per_batch(tmp_path, tokenizer, config):
    """Evaluation reads the exact eval loss once (EvalTokenSums.mean) and the Trainer its losses once."""
    detector, _ = probed_run(tmp_path, tokenizer, evaluate=True, **config)
    train_syncs = sum(1 for s in detector.syncs if s.source[1] != MASKS)
    evaluation = [s for s in detector.syncs if any(f[2] == "evaluate" for f in s.frames)]
    sources = {s.source for s in evaluation if s.source[1] != MASKS}
    assert sources == {("item", "sft/training/loss.py", "mean"),  # one read of the two sums, twice
                       ("cpu", "transformers/trainer_pt_utils.py", "nested_numpify"),
                       ("numpy", "transformers/trainer_pt_utils.py", "nested_numpify")}, sources
    assert sum(1 for s in evaluation if s.source in sources) == 4
    assert train_syncs - 4 == sum(PER_RUN.values()) + OPTIMIZER_STEPS


def test_negative_control_an_item_in_the_loss_path_is_caught(tmp_path, tokenizer, monkeypatch):
    original = loss_module.chunked_forward

    def forward_that_reads(*args, **kwargs):
        out = original(*args, **kwargs)
        out.loss.item()
        return out

    monkeypatch.setattr(loss_module, "chunked_forward", forward_that_reads)
    detector, trainer = probed_run(tmp_path, tokenizer, packing=True)
    injected = [s for s in detector.syncs if s.source == ("item", "tests/test_host_syncs.py", "forward_that_reads")]
    assert len(injected) == trainer.micro_steps
    assert all(s.sft_site.startswith("sft/training/loss.py:") for s in injected)  # reached through sft's forward


def test_negative_control_without_host_counts_the_chunked_loss_syncs(tmp_path, tokenizer, monkeypatch):
    """The count HostCount adds is what keeps the trained-position selection off the host."""
    monkeypatch.setattr(HostCount, "__call__", lambda self, features: self.collator(features))
    detector, trainer = probed_run(tmp_path, tokenizer, packing=True)
    selections = [s for s in detector.syncs if s.source == ("nonzero", "sft/training/loss.py", "trained_index")]
    assert len(selections) == trainer.micro_steps


def chunked_loss_and_grads(tokenizer, batch: dict, host_count: bool, reference: bool = False):
    model = make_llama(len(tokenizer), seed=2)
    assert attach_chunked_loss(model, 0.1)
    inputs = {k: v for k, v in batch.items() if k != TRAINED_TARGETS or host_count}
    if reference:  # the boolean-index selection this replaced, over the same decoder output
        hidden = model.get_decoder()(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                     use_cache=False).last_hidden_state
        targets = batch["labels"][:, 1:]
        keep = targets != -100
        chunk = chunk_rows(model.lm_head.weight.shape[0])
        loss = LinearCrossEntropy.apply(hidden[:, :-1][keep], model.lm_head.weight, targets[keep],
                                        keep.sum().float().clamp(min=1), chunk, 0.1)
    else:
        loss = model(**inputs).loss
    loss.backward()
    return loss.detach(), {k: p.grad.clone() for k, p in model.named_parameters()}


def test_selection_by_host_count_gives_bit_identical_loss_and_gradients(tokenizer):
    rows = pack_dataset(sft_data(12), 64)
    batch = HostCount(PackedCollator(tokenizer.pad_token_id))(list(rows))
    assert batch[TRAINED_TARGETS] == (int((batch["labels"][:, 1:] != -100).sum()), *batch["labels"][:, 1:].shape)
    loss, grads = chunked_loss_and_grads(tokenizer, batch, host_count=True)
    for other in (chunked_loss_and_grads(tokenizer, batch, host_count=False),
                  chunked_loss_and_grads(tokenizer, batch, host_count=False, reference=True)):
        assert torch.equal(loss, other[0])
        assert all(torch.equal(grads[k], other[1][k]) for k in grads)
    assert loss > 0 and grads["lm_head.weight"].abs().sum() > 0


def test_a_count_for_another_shape_is_not_used(tokenizer):
    """Context parallelism shards sequences after collation: the count no longer describes them."""
    rows = pack_dataset(sft_data(12), 64)
    batch = HostCount(PackedCollator(tokenizer.pad_token_id))(list(rows))
    keep = batch["labels"][:, 1:] != -100
    wrong = (int(keep.sum()) - 1, *keep.shape)
    assert loss_module.trained_index(keep, wrong).numel() == int(keep.sum()) - 1  # a wrong count would be used
    sharded = keep[:, : keep.shape[1] // 2]
    assert torch.equal(loss_module.trained_index(sharded, (int(keep.sum()), *keep.shape)),
                       sharded.flatten().nonzero().squeeze(1))


def test_host_count_leaves_the_collators_batch_unchanged(tokenizer):
    rows = list(pack_dataset(sft_data(12), 64))
    for collator in (PackedCollator(tokenizer.pad_token_id), PaddingFreeCollator()):
        plain, counted = collator(rows), HostCount(collator)(rows)
        assert counted.pop(TRAINED_TARGETS)[0] == int((plain["labels"][:, 1:] != -100).sum())
        assert plain.keys() == counted.keys()
        assert all(torch.equal(plain[k], counted[k]) if isinstance(plain[k], torch.Tensor) else plain[k] == counted[k]
                   for k in plain)


def test_token_lengths_match_bincount():
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1, 2, 3], [0, 1, 0, 1, 2, 3, 4, 0, 1, 2]])
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    ids = torch.cumsum(starts.flatten(), 0) - 1
    assert torch.equal(token_lengths(position_ids), torch.bincount(ids)[ids].view_as(position_ids))
    assert token_lengths(position_ids)[0].tolist() == [3, 3, 3, 2, 2, 1, 4, 4, 4, 4]


def test_config_defaults_that_keep_the_host_off_the_gpu(tmp_path):
    args = SFTConfig(output_dir=str(tmp_path), report_to="none")
    assert args.logging_nan_inf_filter is False  # the Trainer's filter reads every micro-step's loss
    assert args.dataloader_num_workers == 0  # scripts/bench_collate.py: workers save ~1 ms per 8x2048 batch


def device_moves(tmp_path, tokenizer, monkeypatch, **config) -> list[bool]:
    """The non_blocking flag of every batch move accelerate's dataloader makes in 2 training steps."""
    import accelerate.data_loader

    flags, move = [], accelerate.data_loader.send_to_device

    def recorded(batch, device, non_blocking=False, **kwargs):
        flags.append(non_blocking)
        return move(batch, device, non_blocking=non_blocking, **kwargs)

    monkeypatch.setattr(accelerate.data_loader, "send_to_device", recorded)
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=2, report_to="none",
                     save_strategy="no", **config)
    SFTTrainer(model=make_llama(len(tokenizer)), args=args, processing_class=tokenizer, train_dataset=sft_data()).train()
    return flags


@pytest.mark.filterwarnings("ignore:.*pin_memory.*:UserWarning")  # a CPU-only torch has no memory to pin
def test_batches_go_to_the_gpu_without_waiting_for_it(tmp_path, tokenizer, monkeypatch):
    """With pinned batches (the default where a GPU is) accelerate queues each batch's copy: a blocking one waits for
    the previous step to finish, and the GPU then idles while the next batch is collated. The recipe's own
    accelerator_config.non_blocking wins; unpinned batches keep blocking copies (non_blocking needs pinned memory)."""
    assert set(device_moves(tmp_path / "a", tokenizer, monkeypatch, dataloader_pin_memory=True)) == {True}
    assert set(device_moves(tmp_path / "b", tokenizer, monkeypatch, dataloader_pin_memory=True,
                            accelerator_config={"non_blocking": False})) == {False}
    assert set(device_moves(tmp_path / "c", tokenizer, monkeypatch, dataloader_pin_memory=False)) == {False}


def sync_site(filename: str, lineno: int) -> str:
    """Where a synchronising call came from: the warning's frame, and where that is inside torch (a torch.cuda
    helper), the first caller outside torch too."""
    site = f"{filename}:{lineno}"
    if "/torch/" in filename:
        callers = [f for f in traceback.extract_stack()[:-3]
                   if "/torch/" not in f.filename and "warnings" not in f.filename]
        if callers:
            site += f" <- {callers[-1].filename}:{callers[-1].lineno} ({callers[-1].name})"
    return site


class SyncCountingTrainer(SFTTrainer):
    """Counts the synchronising CUDA calls inside each training step with torch.cuda's sync debug mode."""

    def training_step(self, *args, **kwargs):
        sites = []

        def record(message, category, filename, lineno, file=None, line=None):
            # torch's own once-per-process note on entering the mode ("Synchronization debug mode is a prototype
            # feature ... synchronizing operations") is not a sync: only the per-call warning counts
            if "called a synchronizing CUDA operation" in str(message):
                sites.append(sync_site(filename, lineno))

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            torch.cuda.set_sync_debug_mode("warn")
            try:
                return super().training_step(*args, **kwargs)
            finally:
                torch.cuda.set_sync_debug_mode(0)
                self.step_syncs.append(sites)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("non_blocking", [True, False])
def test_the_dataloader_moves_batches_without_synchronising_on_gpu(tmp_path, tokenizer, non_blocking):
    """The whole loop, not one training step: accelerate's batch moves make no synchronising CUDA call with sft's
    default (non_blocking from pinned memory); with blocking copies (the control) each move is one."""
    import accelerate.utils.operations
    from transformers import tokenization_utils_base

    sites = []

    def record(message, category, filename, lineno, file=None, line=None):
        if "called a synchronizing CUDA operation" in str(message):
            sites.append(sync_site(filename, lineno))

    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=OPTIMIZER_STEPS,
                     logging_steps=100, report_to="none", save_strategy="no",
                     accelerator_config={"non_blocking": non_blocking})
    trainer = SFTTrainer(model=make_llama(len(tokenizer), seed=1), args=args, processing_class=tokenizer,
                         train_dataset=sft_data())
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train()
        finally:
            torch.cuda.set_sync_debug_mode(0)
    # a batch is a BatchEncoding (its own .to copies each tensor) or a dict (accelerate's send_to_device copies them)
    movers = [module.__file__.removesuffix("c") for module in (accelerate.utils.operations, tokenization_utils_base)]
    moves = [site for site in sites if any(mover in site for mover in movers)]
    print(f"non_blocking={non_blocking}: {len(moves)} synchronising batch moves of {len(sites)} syncs in the loop:",
          collections.Counter(sites).most_common(8))
    assert bool(moves) is not non_blocking, sites


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("config", [{}, {"packing": True, "neftune_noise_alpha": 5.0}, {"padding_free": True}],
                         ids=["padded", "packed+neftune", "padding-free"])
def test_training_steps_do_not_synchronise_on_gpu(tmp_path, tokenizer, config):
    """The CPU probe's claim on a real GPU: a training step (forward, chunked loss, backward) makes no
    synchronising CUDA call but transformers' mask checks (module doc): one per packed forward, one or two per
    padded one."""
    data = pack_dataset(sft_data(96), 64) if config.get("packing") else sft_data()
    args = SFTConfig(output_dir=str(tmp_path), per_device_train_batch_size=2, gradient_accumulation_steps=ACCUMULATION,
                     max_steps=OPTIMIZER_STEPS, logging_steps=100, report_to="none", save_strategy="no",
                     dataloader_num_workers=0, **config)
    trainer = SyncCountingTrainer(model=make_llama(len(tokenizer), seed=1), args=args, processing_class=tokenizer,
                                  train_dataset=data)
    trainer.step_syncs = []
    backward = trainer.accelerator.backward

    def strict_backward(loss, **kwargs):  # autograd's CUDA thread has no Python frame for a warning: raise there
        torch.cuda.set_sync_debug_mode("error")
        try:
            return backward(loss, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("warn")

    trainer.accelerator.backward = strict_backward
    trainer.train()
    assert len(trainer.step_syncs) == OPTIMIZER_STEPS * ACCUMULATION
    assert all(site.split(":")[0].endswith("masking_utils.py") for step in trainer.step_syncs for site in step), \
        trainer.step_syncs
    flattened = config.get("packing") or config.get("padding_free")
    assert all(len(step) == 1 if flattened else 1 <= len(step) <= 2 for step in trainer.step_syncs), trainer.step_syncs
