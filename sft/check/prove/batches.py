"""Proofs 2 and 3 on batches: a packed (or padded) batch gives each example the per-token loss it has alone, and
the recipe's micro-batch x gradient accumulation gives the loss and gradients of one big batch."""

import datasets
import torch
import torch.nn.functional as F
from torch import nn

from sft.check.prove.bench import Bench, exact_mode, no_dropout, weights
from sft.check.prove.result import Proof
from sft.data.boundaries import spans
from sft.data.collators import default_collator
from sft.data.encode import IGNORE_INDEX

EXAMPLES = 8  # examples packed (or padded) together for the packing proof
TOLERANCE = 1e-5  # fp32
MAX_ROWS = 8  # rows in the batching proof's optimizer step (micro-batches shrink to fit, accumulation stays)


def prove_packing(bench: Bench, model: nn.Module | None = None) -> Proof:
    """Per-token losses of `model` (default: the recipe's, as `sft train` loads it) on the recipe's batches."""
    config = bench.base
    train = bench.splits[0]  # packed: examples that fit a row whole (bfd_split cuts longer ones into pieces)
    fits = [i for i, n in enumerate(train["length"]) if n <= config.max_length or not config.packing]
    examples = train.select(fits[:EXAMPLES])
    rows = bench.packed(examples, config.packing)
    model = exact_mode(model if model is not None else bench.model())
    columns = [c for c in ("input_ids", "labels", "position_ids", "seq_lengths") if c in rows.column_names]
    batch = default_collator(bench.tokenizer, config)([{c: r[c] for c in columns} for r in rows])
    with torch.no_grad():
        together = split_rows(batch, token_losses(model, batch, bench.encoder_decoder), bench.encoder_decoder)
        alone = {tuple(e["input_ids"]): token_losses(model, {k: torch.tensor([e[k]]) for k in ("input_ids", "labels")},
                                                     bench.encoder_decoder)[0] for e in examples}
    gaps = [(together[key] - loss).abs().max().item() if key in together else float("inf")
            for key, loss in alone.items()]
    attn = model.config._attn_implementation
    note = f"; the recipe's {config_attn(bench)} does not run on CPU" if config_attn(bench) != attn else ""
    layout = (f"{len(examples)} examples in {len(rows)} packed rows" if config.packing else
              f"{len(examples)} examples in one {'padding-free' if config.padding_free else 'padded'} batch")
    tokens = sum(int((torch.tensor(e["labels"]) != IGNORE_INDEX).sum()) for e in examples)
    figure = f"max |Δ loss| {max(gaps):.1e} over {tokens} trained tokens, {layout} vs alone ({attn}{note})"
    worst = max(range(len(gaps)), key=gaps.__getitem__)
    evidence = f"example {worst + 1} of the sample: per-token loss differs by {gaps[worst]:.3g} when batched"
    return Proof("packing", max(gaps) <= TOLERANCE, figure, "" if max(gaps) <= TOLERANCE else evidence)


def config_attn(bench: Bench) -> str:
    """The attention implementation the recipe asks for (sft check swaps flash attention for sdpa on CPU)."""
    return bench.recipe.attn_implementation or bench.base.attn_implementation or "sdpa"


def token_losses(model: nn.Module, batch: dict, encoder_decoder: bool) -> torch.Tensor:
    """Loss of each label at its own position [B, L] (0 where untrained), as the model is called in training; a row at
    a time, so only one row's logits are held: 8 rows of 2,200 tokens over Qwen's 151,936-token vocabulary are 10.7 GB
    of logits (twice that with log-softmax), and `sft check --prove` was killed for memory on a 23 GB machine."""
    rows = batch["labels"].shape[0]
    if rows == 1:  # a padding-free batch is one row, with sequence boundaries (cu_seq_lens) that are no rows
        return row_losses(model, batch, encoder_decoder)
    return torch.cat([row_losses(model, {k: v[row:row + 1] for k, v in batch.items()}, encoder_decoder)
                      for row in range(rows)])


def row_losses(model: nn.Module, batch: dict, encoder_decoder: bool) -> torch.Tensor:
    """token_losses of a batch, in one forward pass."""
    labels = batch["labels"]
    inputs = {k: v for k, v in batch.items() if k != "labels" or encoder_decoder}  # T5 builds decoder inputs from them
    logits = model(**inputs).logits.float()
    target = labels if encoder_decoder else F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    # over [B*L, V], contiguous: over the transposed [B, V, L] it took 15 s a 2,200-token row of Qwen's vocabulary,
    # 1.5 s so
    losses = F.cross_entropy(logits.flatten(0, 1), target.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return losses.view(target.shape)


def split_rows(batch: dict, losses: torch.Tensor, encoder_decoder: bool) -> dict[tuple, torch.Tensor]:
    """Per-example loss vectors of a collated batch, keyed by the example's token ids."""
    ids, out = batch["input_ids"], {}
    if "position_ids" in batch:
        for row in range(ids.shape[0]):
            for start, end in spans(batch["position_ids"][row]):
                out[tuple(ids[row, start:end].tolist())] = losses[row, start:end]
        return out
    mask = batch["attention_mask"].bool()
    for row in range(ids.shape[0]):
        keep = batch["labels"][row] != IGNORE_INDEX if encoder_decoder else mask[row]
        out[tuple(ids[row][mask[row]].tolist())] = losses[row][keep]
    return out


def prove_batching(bench: Bench, trainer_cls: type | None = None) -> Proof:
    """One SGD step (lr 1) of micro-batches with accumulation vs one big batch: loss and gradients equal."""
    micro, accumulation = bench.recipe.per_device_train_batch_size, bench.recipe.gradient_accumulation_steps
    shape = f"micro-batch {micro} x accumulation {accumulation}"
    if accumulation == 1:  # the recipe does not accumulate: prove the same property on its batch, split in 4
        accumulation = min(4, micro)
        micro = max(1, micro // accumulation)
        shape = f"recipe batch {micro * accumulation} as {micro} x {accumulation} accumulated"
    rows = bench.train_rows
    budget = min(len(rows), MAX_ROWS)
    if micro * accumulation > budget:  # smaller micro-batches, same accumulation: the same property, faster
        accumulation = max(1, min(accumulation, budget))
        micro = max(1, budget // accumulation)
        shape += f", run as {micro} x {accumulation}"
    rows = rows.select(range(micro * accumulation))
    loss_big, grad_big = one_step(bench, rows, micro * accumulation, 1, trainer_cls)
    loss_acc, grad_acc = one_step(bench, rows, micro, accumulation, trainer_cls)
    d_loss = abs(loss_big - loss_acc)
    d_grad = max((grad_big[k] - grad_acc[k]).abs().max().item() for k in grad_big)
    moved = max(g.abs().max().item() for g in grad_big.values())
    passed = d_loss <= TOLERANCE and d_grad <= TOLERANCE and moved > 0
    figure = f"{shape} vs one batch of {len(rows)}: |Δ loss| {d_loss:.1e}, max |Δ grad| {d_grad:.1e} (fp32)"
    evidence = (f"loss {loss_acc:.7g} accumulated vs {loss_big:.7g} in one batch" if moved > 0 else
                "the step moved no weight: gradients are zero, nothing was compared")
    return Proof("batching", passed, figure, "" if passed else evidence)


def one_step(bench: Bench, rows: datasets.Dataset, micro: int, accumulation: int,
             trainer_cls: type | None) -> tuple[float, dict[str, torch.Tensor]]:
    """The training loss of one optimizer step and each trainable weight's gradient (SGD, lr 1: the weight change).

    Randomness is switched off (dropout, NEFTune) so both runs see the same function.
    """
    adapter = {"lora_dropout": 0.0} if bench.base.use_peft else {}  # a LoRA key without use_peft is refused
    config = bench.config(output_dir=str(bench.folder / f"batch-{micro}x{accumulation}"), max_steps=1,
                          per_device_train_batch_size=micro, gradient_accumulation_steps=accumulation, optim="sgd",
                          learning_rate=1.0, lr_scheduler_type="constant", warmup_steps=0, max_grad_norm=0.0,
                          weight_decay=0.0, neftune_noise_alpha=None, **adapter)
    trainer = bench.trainer(config, train_set=rows, trainer_cls=trainer_cls)
    no_dropout(trainer.model)
    before = weights(trainer.model, trainable_only=True)
    loss = trainer.train().training_loss
    after = weights(trainer.model, trainable_only=True)
    return loss, {k: before[k] - after[k] for k in before}


