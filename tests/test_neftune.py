"""NEFTune: each example's noise uses its own length, inside packed rows too; embeddings are clean after train()."""

import math

import datasets
import pytest
import torch

from sft import SFTConfig, SFTTrainer
from sft.training.neftune import NEFTune, token_example_lengths

from conftest import make_llama

ALPHA, HIDDEN = 5.0, 32
# Expected norm of one example's noise: the sum of its L*d squared uniform(-s, s) draws, s = alpha / sqrt(L*d), has
# mean L*d * s^2 / 3 = alpha^2 / 3 whatever L is; the norm concentrates at its square root, alpha / sqrt(3).
EXPECTED_NORM = ALPHA / math.sqrt(3.0)


def noise_per_example(lengths: list[int], packed: bool, trials: int = 200) -> torch.Tensor:
    """Mean noise norm of each example, from the hook applied to zero embeddings."""
    embed = torch.nn.Embedding(10, HIDDEN).train()
    torch.nn.init.zeros_(embed.weight)
    if packed:
        inputs = {"input_ids": torch.zeros(1, sum(lengths), dtype=torch.long),
                  "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}
    else:
        longest = max(lengths)
        mask = torch.tensor([[1] * n + [0] * (longest - n) for n in lengths])
        inputs = {"input_ids": torch.zeros_like(mask), "attention_mask": mask}
    hook = NEFTune(ALPHA)
    hook.attach(embed)
    hook.lengths = token_example_lengths(inputs)
    norms = torch.zeros(len(lengths))
    for _ in range(trials):
        out = embed(inputs["input_ids"])
        if packed:
            norms += torch.stack([chunk.norm() for chunk in out[0].split(lengths)])
        else:
            norms += torch.stack([out[i, :n].norm() for i, n in enumerate(lengths)])
            assert torch.all(out[inputs["attention_mask"] == 0] == 0)  # padding gets no noise
    hook.detach()
    return norms / trials


@pytest.mark.parametrize("packed", [True, False])
def test_noise_norm_per_example_is_alpha_over_sqrt3_whatever_the_length(packed):
    lengths = [4, 20, 100]
    norms = noise_per_example(lengths, packed)
    assert torch.allclose(norms, torch.full((3,), EXPECTED_NORM), rtol=0.05)
    # transformers' hook would give sqrt(L_i / row_length) of that: 0.2, 0.45, 1.0 for these lengths
    row = sum(lengths) if packed else max(lengths)
    naive = EXPECTED_NORM * torch.sqrt(torch.tensor(lengths) / row)
    assert not torch.allclose(norms, naive, rtol=0.2)


def test_training_with_neftune_restores_deterministic_embeddings(tmp_path, tokenizer):
    model = make_llama(len(tokenizer))
    data = datasets.Dataset.from_list([{"input_ids": [1, 5, 6, 7, 8], "labels": [-100, 5, 6, 7, 8]}] * 8)
    args = SFTConfig(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, neftune_noise_alpha=5.0,
                     report_to="none", save_strategy="no")
    trainer = SFTTrainer(model=model, args=args, processing_class=tokenizer, train_dataset=data)
    embed = model.get_input_embeddings()
    seen = []  # what the first decoder layer receives: noisy embeddings during training
    probe = model.model.layers[0].register_forward_pre_hook(
        lambda m, args, kwargs: seen.append(kwargs.get("hidden_states", args[0] if args else None)), with_kwargs=True)
    clean = embed.weight[torch.tensor([[1, 5, 6, 7, 8]])].detach().clone()
    trainer.train()
    probe.remove()
    assert len(seen) == 2 and not torch.allclose(seen[0][:1].detach(), clean, atol=1e-3)
    model.train()
    ids = torch.tensor([[1, 5, 6, 7]])
    assert torch.equal(embed(ids), embed(ids)) and torch.equal(embed(ids), embed.weight[ids])
