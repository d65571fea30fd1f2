"""What a finished run leaves for people: loss.png and a model card README.md."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # headless: no display on training machines
import matplotlib.pyplot as plt  # noqa: E402
from huggingface_hub import ModelCardData  # noqa: E402
from huggingface_hub.errors import HFValidationError  # noqa: E402
from huggingface_hub.utils import validate_repo_id  # noqa: E402

from sft.config.arguments import SFTConfig  # noqa: E402
from sft.data.sources import parse_sources  # noqa: E402
from sft.models.loading import base_model, is_encoder_decoder, looks_local  # noqa: E402


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
    """A README.md naming the base model, data, recipe and final metrics, with Hub metadata (ModelCardData's YAML)."""
    base = base_model(config)
    sources = parse_sources(config.dataset)
    for source in sources:  # a local file by its name: the card is published, the machine's folders are not its news
        formats = formats.replace(source.path, shown(source.path))
    data = ModelCardData(
        library_name="peft" if config.use_peft else "transformers", base_model=hub_id(base),
        tags=["sft", "lora"] if config.use_peft else ["sft"],
        datasets=[source.path for source in sources if hub_id(source.path)] or None,
        pipeline_tag="text2text-generation" if is_encoder_decoder(config) else "text-generation")
    lines = [
        "---", data.to_yaml(), "---", "",
        f"# {Path(config.output_dir).name}", "",
        f"Fine-tuned from `{shown(base)}` with [sft](https://pypi.org/project/sft) "
        "(supervised fine-tuning on transformers.Trainer).", "",
        "## Data", "", f"- dataset: {', '.join(f'`{shown(source.path)}`' for source in sources)}",
        f"- format: {formats}; max_length {config.max_length}",
        *[f"- {k.replace('_', ' ')}: {v:.4g}" if isinstance(v, float) else f"- {k.replace('_', ' ')}: {v}"
          for k, v in data_stats.items() if v is not None], "",
        "## Results", "", "| metric | value |", "| --- | --- |",
        *[f"| {k} | {v:.4g} |" if isinstance(v, float) else f"| {k} | {v} |" for k, v in sorted(metrics.items())], "",
        "![loss](loss.png)", "",
        "## Reproduce", "", "```bash", "sft train recipe.yaml", "```", "",
        "The full resolved recipe is in `recipe.yaml` beside this file.", "",
    ]
    path.write_text("\n".join(lines), encoding="utf-8")


def hub_id(name: str) -> str | None:
    """`name` when it names a Hub repository, else None: a card's base_model and datasets must be Hub ids (the Hub
    refuses a card naming a local path there, and it names nothing a reader elsewhere can open)."""
    if looks_local(name) or Path(name).expanduser().exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def shown(name: str) -> str:
    """How the card names a model or data source: a Hub id as is, a local path by its last part."""
    return name if hub_id(name) else Path(name).name
