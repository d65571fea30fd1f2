"""`sft merge`: fold a LoRA adapter into its base model and save a plain transformers model folder."""

import logging
import shutil
from pathlib import Path

from transformers import GenerationConfig
from transformers.utils import GENERATION_CONFIG_NAME

from sft import rundir
from sft.errors import SFTError
from sft.models.adapters import ADAPTER_CONFIG, is_adapter_folder
from sft.models.saved import check_folder, load_adapter, load_saved_tokenizer

log = logging.getLogger(__name__)
# Files of a training or eval run that a merged model folder never holds (with checkpoint-N and runs/ folders)
RUN_FILES = ("recipe.yaml", "trainer_state.json", "training_args.bin", ADAPTER_CONFIG, "eval_results.json")


def merge_adapter(adapter_dir: str | Path, output_dir: str | Path, dtype: str = "auto", overwrite: bool = False,
                  base_model: str | None = None, allow_pickle: bool = False) -> Path:
    """Merge the adapter into its base and save safetensors weights, config, tokenizer and chat template.

    A base the run quantized (QLoRA) is loaded quantized as in training and dequantized to `dtype` before the
    merge, so the merged model computes what the trained adapter did. The result loads without peft, with
    AutoModelForCausalLM.from_pretrained (AutoModelForSeq2SeqLM for an encoder-decoder such as T5).

    Args:
        adapter_dir: the output_dir (or a checkpoint-N folder) of a use_peft run.
        output_dir: where to write the merged model; must be empty or absent unless `overwrite`.
        dtype: weights dtype of the merged model: auto (the base's), bfloat16, float16 or float32.
        overwrite: replace what output_dir holds.
        base_model: merge into this base instead of the one named in adapter_config.json.
        allow_pickle: also load pickled (.bin) weights, adapter's or base's, where there are no safetensors.
    """
    folder = check_folder(adapter_dir)
    if not is_adapter_folder(folder):
        raise SFTError(f"{adapter_dir} has no {ADAPTER_CONFIG}: sft merge takes the output_dir (or a checkpoint-N "
                       "folder) of a run trained with use_peft: true. Full fine-tunes need no merge.")
    out = Path(output_dir).expanduser()
    try:
        return merge_into(folder, out, dtype, overwrite, base_model, allow_pickle)
    finally:  # the lock check_output took on out, however the merge ends
        rundir.release(out)


def merge_into(folder: Path, out: Path, dtype: str, overwrite: bool, base_model: str | None,
               allow_pickle: bool = False) -> Path:
    """merge_adapter() of a checked adapter folder, holding out's lock from check_output until it returns."""
    check_output(out, folder, overwrite)  # before the slow load
    tokenizer = load_saved_tokenizer(folder)
    # On the CPU: a merge needs the full-precision weights once, which host memory holds more easily than a GPU.
    model = load_adapter(folder, tokenizer, dtype, base_model, device="cpu", dequantize=True,
                         allow_pickle=allow_pickle)
    merged = model.merge_and_unload()
    merged.config.use_cache = True  # training switched the KV cache off; the merged model is for inference
    merged.generation_config = run_generation_config(folder) or merged.generation_config  # else the base's
    empty_output(out)
    merged.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    keep_trained_formats(folder, out)
    rundir.claim(out)
    # the base actually loaded (--base_model or adapter_config.json's), which peft_config does not record
    log.info("Merged %s into %s and saved it to %s", folder, merged.name_or_path, out)
    return out


def run_generation_config(folder: Path) -> GenerationConfig | None:
    """The generation config `sft train` saved with the adapter, holding the run's stop tokens (the template's end of
    turn, which the base's may lack): the folder's, or for a checkpoint saved before checkpoints carried one, its
    run's (same tokenizer and template, so the same stops). None, with a warning, when neither has one."""
    saved = rundir.run_file(folder, GENERATION_CONFIG_NAME)
    if saved is not None:
        return GenerationConfig.from_pretrained(str(saved.parent))
    log.warning("%s has no %s: the merged model keeps the base's stop tokens, which may lack the chat template's end "
                "of turn (sft generate adds it; check eos_token_id there for other servers).", folder,
                GENERATION_CONFIG_NAME)
    return None


def keep_trained_formats(folder: Path, out: Path) -> None:
    """Copy the run's data_stats.json beside the merged model: `sft generate` and `sft chat` read there which prompt
    the model learnt. Without it a merged Alpaca run whose tokenizer has a chat template (the quickstarts) was
    prompted with that template, which it never saw."""
    stats = rundir.run_file(folder, rundir.DATA_STATS)
    if stats is not None:
        shutil.copyfile(stats, out / rundir.DATA_STATS)


def check_output(out: Path, adapter: Path, overwrite: bool) -> None:
    """Refuse an output folder that holds files sft did not write, an earlier merge (unless overwrite), a training
    run, a file, the adapter itself, or a folder inside an sft run."""
    if out.resolve() == adapter.resolve() or out.resolve() in adapter.resolve().parents:
        raise SFTError(f"OUTPUT_DIR {out} contains the adapter {adapter}; choose another folder.")
    check_outside_runs(out)
    rundir.check_writable(out, "OUTPUT_DIR")
    rundir.hold(out, "OUTPUT_DIR")  # a training run into it (or another merge) is refused until this merge ends
    rundir.check_output_dir(out, "OUTPUT_DIR")
    run_files = training_run_entries(out)
    if run_files:  # --overwrite would delete the run: its adapter, checkpoints and recipe
        raise SFTError(f"OUTPUT_DIR {out} holds an sft training run ({rundir.describe(run_files)}), not an earlier "
                       "merge; sft merge never replaces a run. Choose another folder.")
    if out.is_dir() and any(rundir.entries(out)) and not overwrite:
        raise SFTError(f"OUTPUT_DIR {out} already holds a model sft wrote. Choose an empty folder or pass --overwrite "
                       "to replace it.")


def check_outside_runs(out: Path) -> None:
    """Refuse an output folder inside an sft run (`sft merge RUN RUN/merged`): the run's manifest does not list it, so
    a later `--overwrite_output_dir` of the run refused it as a foreign file, and named checkpoint-N it would be taken
    for the run's own checkpoint (resumed from, rotated away, deleted by the overwrite)."""
    run = next((folder for folder in out.resolve().parents if rundir.is_run(folder)), None)
    if run is not None:
        raise SFTError(f"OUTPUT_DIR {out} is inside the sft run {run}, which owns only the files it wrote. Merge "
                       f"into a folder outside it, e.g. {run.parent / (run.name + '-merged')}.")


def training_run_entries(out: Path) -> list[str]:
    """What `out` holds that `sft train` or `sft eval` writes and a merge never does: it is a run, not a merge."""
    if not out.is_dir():
        return []
    return sorted(p.name for p in out.iterdir()
                  if p.name in RUN_FILES or (p.is_dir() and rundir.CHECKPOINT_NAME.match(p.name)))


def empty_output(out: Path) -> None:
    """Create `out` empty; what an allowed overwrite replaces (sft's files only) goes once the merged model is ready."""
    if out.is_dir() and any(rundir.entries(out)):
        log.warning("--overwrite: removing the earlier %s from %s", rundir.describe(rundir.clear_run(out)), out)
    out.mkdir(parents=True, exist_ok=True)
