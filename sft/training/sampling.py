"""The order training rows are drawn in, as a function of the seed and the epoch alone, so that a resumed run draws
the rows the uninterrupted run drew.

accelerate replaces the Trainer's RandomSampler with one seeded by seed + epoch; train_sampling_strategy
group_by_length's LengthGroupedSampler has no generator and drew its order from the global torch RNG when an epoch
began. A resume restores that RNG only after its first epoch has begun, so a run resumed in its second epoch or later
drew another order than the uninterrupted one (other rows each step: weights 3.5e-4 apart after 5 steps on one
process, 3.7e-4 on two).
"""

from typing import Any

import torch
from transformers.trainer_pt_utils import LengthGroupedSampler


class EpochSeededLengthGroupedSampler(LengthGroupedSampler):
    """LengthGroupedSampler whose shuffle is seeded by seed + epoch."""

    def __init__(self, grouped: LengthGroupedSampler, seed: int) -> None:
        super().__init__(grouped.batch_size, lengths=grouped.lengths, generator=torch.Generator())
        self.seed, self.epoch = seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Any:
        self.generator.manual_seed(self.seed + self.epoch)
        return super().__iter__()


class EpochSeededSampling:
    """The Trainer's training sampler, with group_by_length's order seeded by epoch. The epoch is set as the Trainer
    begins it: accelerate's set_epoch does not reach a sampler under two wrappers (a resume's skip of trained
    batches around each process's shard), so two processes resumed in epoch 1 drew epoch 0's order."""

    def _get_train_sampler(self, train_dataset: Any = None) -> Any:
        sampler = super()._get_train_sampler(train_dataset)
        if type(sampler) is LengthGroupedSampler and sampler.generator is None:
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed  # as the Trainer's
            sampler = EpochSeededLengthGroupedSampler(sampler, seed)
        self.epoch_seeded_sampler = sampler if isinstance(sampler, EpochSeededLengthGroupedSampler) else None
        return sampler

    def _run_epoch(self, *args: Any, **kwargs: Any) -> Any:
        """Trainer._run_epoch (which the Trainer calls with keywords), the sampler told the epoch first."""
        if getattr(self, "epoch_seeded_sampler", None) is not None:
            self.epoch_seeded_sampler.set_epoch(kwargs["epoch"])
        return super()._run_epoch(*args, **kwargs)
