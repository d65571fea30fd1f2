"""An unreachable Hub is found once per process, and every lookup of a Hub id then reads the HF cache only: no
huggingface_hub retries (about 23 s and a warning per retry, per file) before the offline answer."""

import fnmatch
import logging
import os
import subprocess
import sys
from pathlib import Path

import huggingface_hub.constants
import pytest
from transformers import GenerationConfig

from sft.models import hub
from sft.models.loading import generation_eos

from conftest import REPO


class FakeSession:
    """get_session() stand-in: counts HEAD requests; raises `error` when given one."""

    def __init__(self, error: Exception | None = None) -> None:
        self.error, self.heads = error, []

    def head(self, url: str, timeout: float) -> None:
        self.heads.append((url, timeout))
        if self.error is not None:
            raise self.error


def hub_mode(monkeypatch, offline: bool):
    """HF_HUB_OFFLINE set to `offline`, the probe's answer forgotten before and after the test."""
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", offline)
    hub.hub_reachable.cache_clear()
    yield
    hub.hub_reachable.cache_clear()


@pytest.fixture
def online(monkeypatch):
    yield from hub_mode(monkeypatch, offline=False)


@pytest.fixture
def offline(monkeypatch):
    yield from hub_mode(monkeypatch, offline=True)


def use_session(monkeypatch, session: FakeSession) -> FakeSession:
    monkeypatch.setattr(hub, "get_session", lambda: session)
    return session


def test_offline_mode_is_unreachable_without_a_request(offline, monkeypatch):
    session = use_session(monkeypatch, FakeSession())
    assert hub.hub_reachable() is False and hub.local_files_only("org/model") is True
    assert session.heads == []


def test_an_unreachable_endpoint_is_probed_once_and_said_once(online, monkeypatch, caplog):
    session = use_session(monkeypatch, FakeSession(ConnectionError("Name or service not known")))
    with caplog.at_level(logging.WARNING, logger="sft.models.hub"):
        assert [hub.local_files_only("org/a"), hub.local_files_only("org/b"), hub.hub_reachable()] == [True, True, False]
    assert session.heads == [(huggingface_hub.constants.ENDPOINT, hub.PROBE_TIMEOUT_S)]
    assert len(caplog.records) == 1 and "cannot be reached" in caplog.text and "HF_HUB_OFFLINE=1" in caplog.text


def test_a_reachable_hub_is_asked(online, monkeypatch):
    session = use_session(monkeypatch, FakeSession())
    assert hub.local_files_only("org/model") is False and len(session.heads) == 1


def test_a_local_folder_never_probes(online, monkeypatch, tmp_path):
    session = use_session(monkeypatch, FakeSession(AssertionError("a local folder must not probe the Hub")))
    assert hub.local_files_only(tmp_path) is False and session.heads == []


def test_generation_config_of_a_hub_id_is_read_from_the_cache_only_when_unreachable(online, monkeypatch, tmp_path):
    use_session(monkeypatch, FakeSession(ConnectionError("unreachable")))
    asked = []

    def from_pretrained(name, **kwargs):
        asked.append((str(name), kwargs.get("local_files_only")))
        raise OSError("not cached")

    monkeypatch.setattr(GenerationConfig, "from_pretrained", from_pretrained)
    assert generation_eos("org/not-cached") is None and generation_eos(str(tmp_path)) is None
    assert asked == [("org/not-cached", True), (str(tmp_path), False)]


@pytest.mark.slow
def test_sft_check_of_a_hub_recipe_with_the_hub_down_makes_no_retries():
    """The user's path: `sft check` of a shipped Hub-model recipe, with no HF_HUB_OFFLINE and an endpoint that refuses
    connections. Before this rule the same command spent 76 s in huggingface_hub's retries (7 s with it)."""
    env = {key: value for key, value in os.environ.items() if key not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", PYTHONPATH=str(REPO))
    done = subprocess.run([sys.executable, "-m", "sft", "check", "mistral-7b/full-zero3"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "OK: the recipe is sound." in out
    assert "cannot be reached" in out and "Retry" not in out


def test_a_hub_dataset_is_read_from_the_cache_only_when_unreachable(online, monkeypatch, caplog):
    """A Hub dataset id on a machine without network (HF_HUB_OFFLINE unset) failed after huggingface_hub's retries,
    about 23 s and a warning per retry per dataset; now the probe's answer puts `datasets` in offline mode for the
    load: one unreachable-Hub warning, then an error that says the Hub is unreachable and the cache lacks it."""
    import time

    import datasets.config

    from sft.data.sources import Source, load_source
    from sft.errors import SFTError

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    use_session(monkeypatch, FakeSession(ConnectionError("Name or service not known")))
    start = time.monotonic()
    with caplog.at_level(logging.WARNING), pytest.raises(SFTError) as caught:
        load_source(Source("sft-tests/never-cached", split="train[:4]"))
    assert time.monotonic() - start < 5
    assert str(caught.value).startswith("Could not load dataset sft-tests/never-cached [train[:4]]: the Hugging Face "
                                        "Hub cannot be reached (no network, or HF_HUB_OFFLINE is set) and the datasets "
                                        "cache (")
    assert (f"nor does the Hub cache ({huggingface_hub.constants.HF_HUB_CACHE}, where `hf download --repo-type "
            "dataset sft-tests/never-cached` puts it)") in str(caught.value)
    assert "Point `dataset` at a local file or folder" in str(caught.value)
    assert not any("Retrying" in r.getMessage() for r in caplog.records)
    assert (datasets.config.HF_HUB_OFFLINE, huggingface_hub.constants.HF_HUB_OFFLINE) == (False, False)  # restored


@pytest.mark.parametrize("mode", ["offline", "unreachable"])
def test_push_to_hub_without_a_hub_is_refused_before_any_work(mode, online, monkeypatch, tmp_path, tiny_model_dir,
                                                               capsys):
    """push_to_hub with the Hub unreachable: the Trainer creates the repository when it is built, so the run used to
    tokenize the data and load the model, then die with huggingface_hub's OfflineModeIsEnabled traceback (exit 1).
    Now exit 2 before any data is read, naming the repository and the way to upload later; the token is not said."""
    from sft.cli.main import main

    if mode == "offline":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    else:
        use_session(monkeypatch, FakeSession(ConnectionError("Connection refused")))
    monkeypatch.delenv("HF_TOKEN", raising=False)
    tokenized = []
    monkeypatch.setattr("sft.training.flows.prepare_splits", lambda *args: tokenized.append(args))
    out, recipe = tmp_path / "run", tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {REPO / 'data' / 'alpaca_sample.json'}\n"
                      f"output_dir: {out}\nreport_to: none\npush_to_hub: true\nhub_model_id: me/tiny-run\n")
    code = main(["train", str(recipe), "--hub_token", "hf_NotToBeSaid123"])
    err = capsys.readouterr().err
    assert code == 2 and tokenized == [] and not out.exists()
    why = "HF_HUB_OFFLINE is set" if mode == "offline" else f"{huggingface_hub.constants.ENDPOINT} does not answer"
    assert (f"push_to_hub: true, but the Hugging Face Hub cannot be reached ({why}), so the run could not create or "
            f"push to me/tiny-run. Train with --push_to_hub false and upload the finished run later with `hf upload "
            f"me/tiny-run {out}`") in err
    assert "Traceback" not in err and "hf_NotToBeSaid123" not in err


def test_sft_eval_of_a_pushing_recipe_creates_no_repository(offline, tmp_path, tiny_model_dir, capsys):
    """`sft eval RUN/recipe.yaml` of a run that pushed: eval uploads nothing, yet the Trainer it builds created the
    Hub repository (with no Hub: OfflineModeIsEnabled traceback, exit 1). Now it evaluates, exit 0."""
    import json

    from sft.cli.main import main

    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": f"Say {w}", "output": w} for w in ("hi", "yo", "hey", "ho")]))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {data}\neval_split_size: 2\nreport_to: none\n"
                      f"output_dir: {tmp_path / 'eval'}\npush_to_hub: true\nhub_model_id: me/tiny-run\nuse_cpu: true\n")
    code = main(["eval", str(recipe)])
    captured = capsys.readouterr()
    assert code == 0, captured.err[-2000:]
    assert "eval_loss" in json.loads((tmp_path / "eval" / "eval_results.json").read_text())


def test_a_cached_hub_model_loads_without_asking_the_hub(online, monkeypatch, tmp_path, tiny_model_dir, tokenizer):
    """A Hub id held in the HF cache, the Hub unreachable: `sft train` and `sft generate` load it from the cache with
    no request. transformers (5.24) probes the id's adapter_config.json without local_files_only, which cost 23 s of
    huggingface_hub retries and 10 warnings per load (41 s vs 15 s for `sft generate` of an adapter on a cached base)."""
    import huggingface_hub.file_download

    from sft.models.loading import load_model
    from sft.models.saved import load_pretrained
    from sft.training.recipe import load_recipe

    cache_model(monkeypatch, tmp_path, tiny_model_dir, "sft-tests/tiny")
    use_session(monkeypatch, FakeSession(ConnectionError("Connection refused")))
    asked = []

    def metadata(url, *args, **kwargs):
        asked.append(url)
        raise ConnectionError("the Hub is unreachable")

    monkeypatch.setattr(huggingface_hub.file_download, "get_hf_file_metadata", metadata)
    generated = load_pretrained("sft-tests/tiny", "auto", "cpu")
    trained = load_model(load_recipe({"model_name_or_path": "sft-tests/tiny", "use_cpu": True}), tokenizer)
    assert generated.name_or_path == trained.name_or_path == "sft-tests/tiny"
    assert asked == []


def cache_model(monkeypatch, tmp_path, folder, repo_id: str, kind: str = "models") -> Path:
    """`folder`'s files (subfolders too) as Hub repository `repo_id` of `kind` (models, datasets) in an HF cache
    (huggingface_hub's layout) under tmp_path, in use; returns its snapshot folder."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / f"{kind}--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    for file in (f for f in folder.rglob("*") if f.is_file()):
        (snapshot / file.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
        (snapshot / file.relative_to(folder)).write_bytes(file.read_bytes())
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return snapshot


CARD = """---
configs:
- config_name: default
  data_files:
  - split: train
    path: data/mytrain.jsonl
  - split: test
    path: heldout.jsonl
---
# A dataset whose splits only its card names
"""


@pytest.mark.parametrize("mode", ["offline", "unreachable"])
def test_a_hub_dataset_downloaded_to_the_hub_cache_is_read_when_the_hub_is_unreachable(mode, online, monkeypatch,
                                                                                      tmp_path):
    """`hf download --repo-type dataset NAME` keeps a dataset's files in the huggingface_hub cache, which `datasets`
    does not read: with the Hub unreachable `dataset: NAME` failed (exit 2, "the datasets cache does not hold it").
    Now the snapshot is read as the repository's files, its README `configs` splits included: the rows `datasets`
    reads from the same files, the card's test split left out of training. No request is made."""
    import json

    import datasets

    from sft.data.sources import Source, load_source

    if mode == "offline":
        monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    session = use_session(monkeypatch, FakeSession(ConnectionError("Connection refused")))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "datasets-cache")  # which lacks it
    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    (repo / "README.md").write_text(CARD)
    train = [{"instruction": f"Say {w}", "output": w} for w in ("hi", "yo", "hey")]
    test = [{"instruction": "Say ho", "output": "ho"}, {"instruction": "Say ha", "output": "ha"}]
    (repo / "data" / "mytrain.jsonl").write_text("".join(json.dumps(row) + "\n" for row in train))
    (repo / "heldout.jsonl").write_text("".join(json.dumps(row) + "\n" for row in test))
    snapshot = cache_model(monkeypatch, tmp_path, repo, "sft-tests/card-splits", kind="datasets")
    assert load_source(Source("sft-tests/card-splits")).to_list() == train
    assert load_source(Source("sft-tests/card-splits", split="test[:1]")).to_list() == test[:1]
    assert load_source(Source("sft-tests/card-splits")).to_list() == datasets.load_dataset(str(snapshot),
                                                                                          split="train").to_list()
    assert session.heads == ([] if mode == "offline" else [(huggingface_hub.constants.ENDPOINT, hub.PROBE_TIMEOUT_S)])


@pytest.mark.parametrize("base", ["local", "hub"])
def test_the_model_card_is_valid_hub_metadata(base, offline, monkeypatch, tmp_path, tiny_model_dir):
    """The card's metadata through huggingface_hub's own parser: base_model and datasets only as Hub ids (a local
    base was written as `base_model: /tmp/...`, which the Hub refuses and no reader can open), a pipeline_tag (none
    was written), and no machine-local path anywhere in the card."""
    from huggingface_hub import ModelCard

    from sft.training.recipe import load_recipe
    from sft.training.report import write_model_card

    cache_model(monkeypatch, tmp_path, tiny_model_dir, "sft-tests/tiny")
    model = str(tiny_model_dir) if base == "local" else "sft-tests/tiny"
    data = tmp_path / "private" / "rows.jsonl"
    config = load_recipe({"model_name_or_path": model, "use_peft": True, "output_dir": str(tmp_path / "run"),
                          "dataset": [str(data), {"path": "tatsu-lab/alpaca", "split": "train[:10]"}]})
    card = tmp_path / "README.md"
    write_model_card(config, {"train_loss": 1.5}, {"rows": 10, "length_p95": 98.04999999999998}, card,
                     f"{data}: alpaca; tatsu-lab/alpaca: alpaca")
    metadata = ModelCard.load(card).data.to_dict()
    assert metadata == {"library_name": "peft", "tags": ["sft", "lora"], "datasets": ["tatsu-lab/alpaca"],
                        "pipeline_tag": "text-generation", **({"base_model": model} if base == "hub" else {})}
    text = card.read_text()
    assert str(tmp_path) not in text and str(tiny_model_dir) not in text
    assert "- dataset: `rows.jsonl`, `tatsu-lab/alpaca`" in text and "- format: rows.jsonl: alpaca;" in text
    assert "- length p95: 98.05" in text


def test_a_pushing_run_stopped_after_a_checkpoint_can_resume(online, monkeypatch, tmp_path, tiny_model_dir):
    """push_to_hub's checkpoint push (hub_strategy every_save) copies the model, tokenizer and training_args.bin into
    output_dir. Unrecorded, a run killed after that held 7 files counted as the user's: its resume was refused
    ("holds files sft did not write"). A fake Hub API stands in for the Hub; nothing is sent."""
    import json
    import types

    import transformers.trainer

    from sft import rundir
    from sft.training.flows import check_before_loading, train
    from sft.training.recipe import load_recipe
    from sft.training.trainer import SFTTrainer

    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, **kwargs):
            uploads.append(kwargs["commit_message"])
            return types.SimpleNamespace(done=lambda: True)

    class Killed(Exception):
        pass

    use_session(monkeypatch, FakeSession())  # the Hub answers the probe
    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    step = SFTTrainer.training_step

    def training_step(self, *args, **kwargs):
        if self.state.global_step == 3:  # after the checkpoint of step 2 and its push
            raise Killed
        return step(self, *args, **kwargs)

    monkeypatch.setattr(SFTTrainer, "training_step", training_step)
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": f"Say {i}", "output": str(i)} for i in range(16)]))
    out = tmp_path / "run"
    settings = {"model_name_or_path": str(tiny_model_dir), "dataset": str(data), "output_dir": str(out),
                "max_steps": 4, "save_steps": 2, "per_device_train_batch_size": 2, "report_to": "none",
                "push_to_hub": True, "hub_model_id": "me/tiny-run", "use_cpu": True}
    with pytest.raises(Killed):
        train(load_recipe(settings))
    assert uploads == ["Training in progress, step 2"] and (out / "model.safetensors").is_file()
    assert rundir.foreign_entries(out) == []
    check_before_loading(load_recipe({**settings, "resume_from_checkpoint": "true"}), True)  # not refused
    rundir.release(out)


def train_pushing(monkeypatch, tmp_path, tiny_model_dir, settings: str) -> tuple[list[dict], Path]:
    """`sft train` of a pushing recipe (+ `settings` lines) on a fake Hub API that records each folder upload: its
    commit, folder, path in the repository and the names it sends, listed when asked (a background upload reads the
    folder after upload_folder returns). Nothing is sent."""
    import json
    import types

    import transformers.trainer

    from sft.cli.main import main

    use_session(monkeypatch, FakeSession())  # the Hub answers the probe
    uploads = []

    class FakeApi:
        def create_repo(self, repo_id, **kwargs):
            return types.SimpleNamespace(repo_id=repo_id)

        def upload_folder(self, folder_path, commit_message, ignore_patterns=(), path_in_repo=None, **kwargs):
            folder = Path(folder_path)
            sent = sorted(p.name for p in folder.iterdir() if not any(fnmatch.fnmatch(p.name, pattern)
                                                                       for pattern in ignore_patterns or []))
            uploads.append({"commit": commit_message, "folder": folder, "where": path_in_repo, "sent": sent,
                            "card": (folder / "README.md").read_text() if "README.md" in sent else ""})
            return types.SimpleNamespace(done=lambda: True)

    monkeypatch.setattr(transformers.trainer, "hf_api", lambda: FakeApi())
    data = tmp_path / "data.json"
    data.write_text(json.dumps([{"instruction": f"Say {i}", "output": str(i)} for i in range(16)]))
    out = tmp_path / "run"
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(f"model_name_or_path: {tiny_model_dir}\ndataset: {data}\noutput_dir: {out}\nmax_steps: 2\n"
                      "report_to: none\npush_to_hub: true\nhub_model_id: me/tiny-run\nuse_cpu: true\n" + settings)
    assert main(["train", str(recipe)]) == 0
    return uploads, out


@pytest.mark.parametrize("strategy", ["every_save", "checkpoint", "all_checkpoints"])
def test_a_checkpoint_push_sends_the_promoted_checkpoint_and_no_run_files(online, monkeypatch, tmp_path,
                                                                        tiny_model_dir, strategy):
    """The Trainer pushes while it saves a checkpoint, when sft still writes it in `.staging-N` (renamed into place
    after the save, while the upload ran in the background), and its folder upload skipped `_*` and `checkpoint-*`
    only: the run's lock went to the Hub. Now the push starts once the checkpoint is in place, without the lock."""
    uploads, out = train_pushing(monkeypatch, tmp_path, tiny_model_dir, f"save_steps: 2\nhub_strategy: {strategy}\n")
    pushes = [push for push in uploads if push["commit"].startswith("Training in")]
    assert pushes and all(".sft_run.lock" not in push["sent"] and not any(".staging" in name for name in push["sent"])
                          for push in pushes)
    checkpoints = [push for push in pushes if push["folder"] != out]
    assert len(checkpoints) == (strategy != "every_save")
    for push in checkpoints:  # the promoted folder, which stays: not the staging one, renamed away
        assert push["folder"] == out / "checkpoint-2" and push["folder"].is_dir()
        assert "trainer_state.json" in push["sent"]
        assert push["where"] == ("last-checkpoint" if strategy == "checkpoint" else "checkpoint-2")


def test_the_final_push_sends_the_finished_run(online, monkeypatch, tmp_path, tiny_model_dir):
    """The Trainer pushed from save_model, before the final evaluation and sft's model card: the Hub got
    transformers' generated card (tags generated_from_trainer), no eval_results.json, no loss.png, and the run's lock
    file. Now the last upload holds the finished folder: sft's card and every result, no lock, no checkpoints."""
    uploads, out = train_pushing(monkeypatch, tmp_path, tiny_model_dir, "eval_split_size: 4\nsave_strategy: 'no'\n")
    assert [push["commit"] for push in uploads] == ["End of training"]
    sent, card = uploads[0]["sent"], uploads[0]["card"]
    assert {"README.md", "eval_results.json", "all_results.json", "loss.png", "recipe.yaml", "model.safetensors",
            "tokenizer.json", "generation_config.json"} <= set(sent) and ".sft_run.lock" not in sent
    assert card == (out / "README.md").read_text() and "- sft" in card and "generated_from_trainer" not in card
