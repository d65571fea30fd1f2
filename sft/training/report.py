"""What a finished run leaves for people: loss.png and a model card README.md."""

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402

from sft.config.arguments import SFTConfig  # noqa: E402
from sft.training.recipe import resolved_recipe  # noqa: E402


def plot_loss(log_history: list[dict], path: Path) -> bool:
    """Save train and eval loss against step as a PNG; False when nothing was logged."""
    train = [(e["step"], e["loss"]) for e in log_history if "loss" in e and "step" in e]
    evals = [(e["step"], e["eval_loss"]) for e in log_history if "eval_loss" in e and "step" in e]
    if not train and not evals:
        return False
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    for points, label, style in ((train, "train loss", "-"), (evals, "eval loss", "o--")):
        if points:
            ax.plot(*zip(*points), style, label=label)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over trained tokens)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return True


def write_model_card(config: SFTConfig, metrics: dict, data_stats: dict, path: Path, formats: str) -> None:
    """A README.md naming the base model, data, recipe and final metrics."""
    recipe = resolved_recipe(config)
    lines = [
        "---", f"library_name: {'peft' if config.use_peft else 'transformers'}",
        f"base_model: {config.model_name_or_path}", "tags: [sft, lora]" if config.use_peft else "tags: [sft]",
        "---", "",
        f"# {Path(config.output_dir).name}", "",
        f"Fine-tuned from `{config.model_name_or_path}` with [sft](https://pypi.org/project/sft) "
        "(supervised fine-tuning on transformers.Trainer).", "",
        "## Data", "", f"- dataset: `{json.dumps(recipe.get('dataset'))}`",
        f"- format: {formats}; max_length {config.max_length}",
        *[f"- {k.replace('_', ' ')}: {v}" for k, v in data_stats.items() if v is not None], "",
        "## Results", "", "| metric | value |", "| --- | --- |",
        *[f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in sorted(metrics.items())], "",
        "![loss](loss.png)", "",
        "## Reproduce", "", "```bash", "sft train recipe.yaml", "```", "",
        "The full resolved recipe is in `recipe.yaml` beside this file.", "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")
