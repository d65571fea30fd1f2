"""Which weight files sft loads: safetensors; pickled ones (`.bin`: loading them can run arbitrary code) only when the
user allows it, for a model and for a LoRA adapter alike, whichever verb loads them."""

from pathlib import Path

# How each caller's user allows pickled weights
RECIPE_ALLOW = "set allow_pickle: true in the recipe (or --allow_pickle true)"
FLAG_ALLOW = "pass --allow_pickle"
# The pickled weight files transformers and peft fall back to when a folder has no safetensors (training_args.bin,
# which every sft run holds, is the Trainer's arguments and never loaded as weights)
PICKLED_WEIGHTS = ("pytorch_model*.bin", "adapter_model.bin")


def safetensors_kwargs(allow_pickle: bool) -> dict:
    """from_pretrained's `use_safetensors`: True (no pickle fallback) unless pickles are allowed."""
    return {"use_safetensors": None if allow_pickle else True}


def pickle_problem(folder: str | Path, allow_pickle: bool, how: str, origin: str = "") -> str | None:
    """Why local model or adapter `folder` (`origin`: where its name came from) may not be loaded: it holds pickled
    weights and no safetensors, and pickles are not allowed (`how` says how to allow them). None when it may (a Hub
    id is checked by from_pretrained)."""
    folder = Path(folder).expanduser()
    if allow_pickle or not folder.is_dir() or any(folder.glob("*.safetensors")):
        return None
    pickled = sorted({path.name for pattern in PICKLED_WEIGHTS for path in folder.glob(pattern)})
    if not pickled:
        return None
    return pickle_refusal(f"{folder}{origin} holds only pickled weights ({', '.join(pickled)})", how)


def pickle_refusal(what: str, how: str) -> str:
    """The one message refusing pickled weights: what holds them, why not, how to allow or avoid them."""
    return (f"{what}: sft loads safetensors only, since loading pickled weights can run arbitrary code. If you trust "
            f"them, {how}; or convert them once to safetensors (model.save_pretrained saves safetensors).")


def unloadable_hint(err: Exception, allow_pickle: bool, how: str) -> str:
    """What to add to a from_pretrained error: the pickle refusal's how, when safetensors-only loading is why it failed
    (a Hub model without safetensors: transformers says no `model.safetensors` was found)."""
    if allow_pickle or "safetensors" not in str(err):
        return ""
    return f" ({pickle_refusal('it may have only pickled weights', how)})"
