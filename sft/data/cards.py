"""The splits a local folder's dataset card declares: the `configs` of a Hub dataset repository's README.md."""

from pathlib import Path

from datasets.data_files import get_data_patterns, sanitize_patterns
from datasets.utils.metadata import MetadataConfigs
from huggingface_hub import DatasetCard

from sft.errors import SFTError


def card_patterns(path: Path, config: str | None) -> dict[str, list[str]] | None:
    """The file patterns per split (relative to `path`) of config `config` (the card's default when None) in the
    README.md `configs` of folder `path`, as `datasets.load_dataset(path)` reads them; None when the card declares no
    configs. A folder cloned from the Hub names its splits there (data/mytrain.parquet as `train`, heldout.parquet as
    `test`), not always in file names: sft read every file as training data, the declared test rows included."""
    readme = path / "README.md"
    configs = MetadataConfigs.from_dataset_card_data(DatasetCard.load(readme).data) if readme.is_file() else {}
    if not configs:
        if config is not None:
            raise SFTError(f"Dataset folder {path}: the source's `name` ({config!r}) selects a config of a "
                           "README.md `configs` list, and the folder has none. Remove `name`, or point `path` at the "
                           "config's own folder.")
        return None
    name = config if config is not None else configs.get_default_config_name()
    if name not in configs:
        wanted = f"has no config {config!r}" if config is not None else "declares several configs and no default"
        raise SFTError(f"Dataset folder {path}: its README.md {wanted} (configs: {', '.join(configs)}). Set the "
                       "source's `name` to one of them.")
    declared = configs[name]
    if declared.get("data_files"):
        return sanitize_patterns(declared["data_files"])
    data_dir = declared.get("data_dir")
    if not data_dir:
        return None
    return {split: [f"{data_dir}/{p}" for p in found] for split, found in get_data_patterns(str(path / data_dir))
            .items()}
