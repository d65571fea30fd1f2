"""sft check --prove: every proof passes on a sound recipe, and each one FAILs on the fault it exists to catch."""

import json
import logging
import resource
import time
from collections import Counter
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import pytest
import torch
import transformers
import yaml
from peft import LoraConfig, get_peft_model
from safetensors.torch import load_file, save_file
from test_template_masks import FAMILIES
from transformers import GenerationConfig

import sft.evaluation.predict
from sft.check.prove import prove_recipe
from sft.check.prove.batches import prove_batching, prove_packing
from sft.check.prove.bench import Bench
from sft.check.prove.generation import prove_generation
from sft.check.prove.masks import check_chat_row, prove_masks
from sft.check.prove.result import Proof
from sft.check.prove.runs import prove_resume, prove_save_load, save_like_train
from sft.check.prove.sharded import compare_saved, prove_sharded_save, reloaded
from sft.cli.main import main
from sft.data.chat import ChatRenderer
from sft.data.chat_templates import PRESETS
from sft.data.encode import Encoding
from sft.data.proven_templates import unproven_template_hint
from sft.data.stops import stop_token_ids
from sft.errors import SFTError
from sft.evaluation.predict import Example
from sft.training.trainer import SFTTrainer

from conftest import EMBEDDED_MODEL, FIXTURES, REPO, make_llama

# A LoRA chat recipe on the embedded model that uses every proof: packing, accumulation, dropout after the resume
# point, an adapter to save and merge, generation eval.
SOUND = dict(model_name_or_path=str(EMBEDDED_MODEL), dataset=str(REPO / "data" / "chat_sample.jsonl"),
             dataset_format="messages", chat_template="chatml", max_length=128, packing=True, use_peft=True, lora_r=4,
             lora_alpha=8, lora_dropout=0.1, per_device_train_batch_size=2, gradient_accumulation_steps=2,
             predict_with_generate=True, max_new_tokens=4, learning_rate=1e-2, dtype="float32", seed=0)
# Turns end with <|end|>, plain text to this tokenizer: generation (EOS, <|im_end|>) would never stop on it.
MISDECLARED_END = ("{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|end|>\n{% endfor %}"
                   "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def write_recipe(folder: Path, **changes) -> Path:
    path = folder / "recipe.yaml"
    path.write_text(yaml.safe_dump({**SOUND, **changes}))
    return path


@pytest.fixture(autouse=True)
def cache_home(tmp_path, monkeypatch):
    """Proven-template records go to a temporary cache, never the user's."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> Bench:
    folder = tmp_path_factory.mktemp("prove")
    bench = Bench.build(str(write_recipe(folder)), None, folder / "bench")
    bench.splits  # noqa: B018 - tokenize once for every test
    return bench


def test_a_sound_recipe_passes_every_proof(bench):
    proofs = [prove_masks(bench, 16), prove_packing(bench), prove_batching(bench), prove_resume(bench),
              prove_save_load(bench), prove_generation(bench)]
    for proof in proofs:
        print(proof.line())
    assert [p.passed for p in proofs] == [True] * 6
    assert "packed rows" in proofs[1].figure and "dropout" in proofs[3].figure
    assert "merged vs adapter" in proofs[4].figure


def test_masks_fail_when_the_end_of_turn_token_is_misdeclared(tmp_path):
    bench = Bench.build(str(write_recipe(tmp_path, chat_template=MISDECLARED_END)), None, tmp_path / "bench")
    proof = prove_masks(bench, 8)
    assert proof.passed is False
    assert "without a token generation stops on" in proof.evidence and "[[" in proof.evidence  # the marked row


def test_masks_fail_when_the_encoder_trains_the_prompt(bench):
    encode = bench.row_encoder()

    def trains_everything(row, number):
        return [{**e, "labels": [-100] + e["input_ids"][1:]} for e in encode(row, number)]

    proof = prove_masks(bench, 8, trains_everything)
    assert proof.passed is False and "tokens outside the trained answers are trained" in proof.evidence


def test_packing_fails_when_packed_rows_run_with_a_kv_cache(bench):
    model = bench.model()
    model.config.use_cache = True  # a cache switches transformers' packed-sequence detection off: examples leak
    proof = prove_packing(bench, model)
    assert proof.passed is False and "differs" in proof.evidence


class PerBatchMeanTrainer(SFTTrainer):
    """The classic accumulation bug: each micro-batch averaged on its own, then the averages averaged."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs["labels"]
        logits = model(**{k: v for k, v in inputs.items() if k != "labels"}).logits
        return torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())


def test_batching_fails_with_a_per_batch_mean_loss(bench):
    proof = prove_batching(bench, PerBatchMeanTrainer)
    assert proof.passed is False and "accumulated vs" in proof.evidence


def test_resume_fails_when_the_rng_state_is_not_restored(bench, monkeypatch):
    monkeypatch.setattr(transformers.Trainer, "_load_rng_state", lambda self, checkpoint: None)
    proof = prove_resume(bench)
    assert proof.passed is False and proof.evidence.startswith("differ: ")


def test_save_load_fails_for_an_adapter_saved_without_its_weights(bench):
    def save_empty_adapter(trainer, bench):
        folder = save_like_train(trainer, bench)
        save_file({}, folder / "adapter_model.safetensors")  # the ZeRO-3 empty-adapter bug
        return folder

    proof = prove_save_load(bench, save_empty_adapter)
    assert proof.passed is False and "different logits" in proof.evidence


def test_the_sharded_proof_compares_every_tensor_an_adapter_trains(tmp_path):
    """A ZeRO checkpoint holds every trained tensor: the LoRA matrices, the rows of tokens a chat template added and
    modules_to_save. Reading back the LoRA matrices alone, a LoRA recipe whose template adds tokens FAILed on zero3
    ("28/30 trained tensors saved bitwise", the 2 rows tensors "wrong") though they were saved."""
    config = LoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["norm"],
                        trainable_token_indices={"embed_tokens": [30, 31]})
    model = get_peft_model(make_llama(32), config)
    (tmp_path / "adapter_config.json").write_text("{}")  # an adapter folder
    read = reloaded(tmp_path, SimpleNamespace(model=lambda config: model, config=lambda **changes: None))
    assert set(read) == {name for name, param in model.named_parameters() if param.requires_grad}
    assert any("trainable_tokens_delta" in name for name in read) and any(".modules_to_save." in name for name in read)


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("preset", ["fsdp", "fsdp_offload"])
def test_the_sharded_proof_runs_fsdp_as_fsdp2_on_cpu_and_catches_a_save_that_differs(tmp_path, preset):
    """FSDP was "not provable on CPU" (accelerate turns it into DDP there): the proof now trains the recipe's LoRA
    adapter as FSDP2 units on 2 gloo processes, puts the sharded checkpoint back together and compares it with the
    saved adapter, named as peft saves it; fsdp_offload runs as fsdp (its pinned CPU offload needs CUDA). A saved
    adapter that differs from the checkpoint by one tensor FAILs (the negative control)."""
    bench = Bench.build(str(write_recipe(tmp_path, distributed=preset)), None, tmp_path / "bench")
    passed, figure = prove_sharded_save(bench)
    assert passed is True, figure
    label = "fsdp" if preset == "fsdp" else "fsdp_offload (as fsdp: CPU offload needs CUDA)"
    assert figure == f"{label} on 2 CPU processes: 28/28 trained tensors saved bitwise"  # A and B of 14 linears
    run = bench.folder / "sharded"
    assert (run / "checkpoint-2" / "pytorch_model_fsdp_0" / "__1_0.distcp").is_file()  # sharded: one file per rank
    adapter = load_file(run / "adapter_model.safetensors")
    name = next(key for key in adapter if "lora_B" in key)
    save_file({**adapter, name: adapter[name] + 1e-3}, run / "adapter_model.safetensors")
    passed, counts = compare_saved(run, "fsdp", bench)
    assert passed is False and counts.startswith("27/28 trained tensors saved bitwise (wrong: [")


def test_generation_fails_when_the_prompt_builder_leaks_the_reference(bench, monkeypatch):
    def leaky(ids, labels, offsets=None):
        trained = (labels != -100).nonzero()
        return Example(ids.tolist(), labels[int(trained[0]):].tolist()) if len(trained) else None

    monkeypatch.setattr(sft.evaluation.predict, "causal_example", leaky)
    proof = prove_generation(bench)
    assert proof.passed is False and "reference tokens" in proof.figure
    assert not proof.figure.split(": ")[1].startswith("0 reference") and "are the reference" in proof.evidence


def fake_proofs(monkeypatch, failing: str | None = None) -> None:
    """Replace the proofs with instant ones (the CLI contract is under test here, not the proofs)."""
    for name in ("masks", "packing", "batching", "resume", "save_load", "generation"):
        proof = Proof(name, name != failing, "figure", "evidence" if name == failing else "")
        monkeypatch.setattr(f"sft.check.prove.prove_{name}", lambda *args, _p=proof, **kwargs: _p)


def test_json_prints_one_object_per_proof_and_exit_0(tmp_path, monkeypatch, capsys):
    fake_proofs(monkeypatch)
    assert main(["check", str(write_recipe(tmp_path)), "--prove", "--json"]) == 0
    objects = json.loads(capsys.readouterr().out)
    assert [o["name"] for o in objects] == ["masks", "packing", "batching", "resume", "save_load", "generation"]
    assert all(set(o) == {"name", "passed", "figure", "evidence"} for o in objects)


def test_a_failing_proof_exits_1_with_its_evidence(tmp_path, monkeypatch, capsys):
    fake_proofs(monkeypatch, failing="resume")
    assert main(["check", str(write_recipe(tmp_path)), "--prove"]) == 1
    out = capsys.readouterr().out
    assert "FAIL resume" in out and "evidence" in out and out.count("PASS") == 5


def test_recipe_errors_exit_2_without_a_traceback(tmp_path, capsys):
    assert main(["check", str(write_recipe(tmp_path, learning_rat=1)), "--prove"]) == 2
    err = capsys.readouterr().err
    assert "learning_rate" in err and "Traceback" not in err


def test_train_hints_at_prove_until_the_template_passed(tmp_path, monkeypatch):
    template = PRESETS["chatml"].template  # the recipe's chat_template
    assert "sft check RECIPE --prove" in unproven_template_hint(template)
    fake_proofs(monkeypatch)
    prove_recipe(str(write_recipe(tmp_path)))
    assert unproven_template_hint(template) is None  # the chatml preset passed; other templates still get the hint
    assert unproven_template_hint(template + " ") is not None


def cpu_seconds() -> float:
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def test_sft_train_logs_the_hint_for_chat_data_only(tmp_path, caplog):
    from sft.data.tokenizer import load_tokenizer
    from sft.training.flows import hint_unproven_template
    from sft.training.recipe import load_recipe

    tokenizer = load_tokenizer(load_recipe(write_recipe(tmp_path)))
    with caplog.at_level(logging.INFO, logger="sft.training.flows"):
        hint_unproven_template(["messages"], tokenizer)
        hint_unproven_template(["alpaca"], tokenizer)
    assert [r.getMessage().count("--prove") for r in caplog.records] == [1]


SHIPPED = sorted(p for p in (REPO / "recipes").rglob("*.yaml") if p.parent.name != "accelerate")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", SHIPPED, ids=lambda p: str(p.relative_to(REPO / "recipes")))
def test_every_shipped_recipe_passes_prove(recipe, monkeypatch):
    monkeypatch.chdir(REPO)  # recipes name data/ relative to the repository
    start, cpu = time.perf_counter(), cpu_seconds()
    proofs = prove_recipe(str(recipe.relative_to(REPO)))
    # Reported, not asserted: wall time depends on what else the machine runs; CPU time (2-process runs included)
    # is what an otherwise idle 2-core machine would need.
    print(f"{recipe.relative_to(REPO)}: {time.perf_counter() - start:.1f} s wall, {cpu_seconds() - cpu:.1f} s CPU")
    for proof in proofs:
        print(proof.line())
    assert all(p.passed is not False for p in proofs), [p.line() for p in proofs if not p.passed]
    # Not every proof may skip: the masks proof applies to every recipe, and passed.
    assert [p.passed for p in proofs if p.name == "masks"] == [True], [p.line() for p in proofs]


# ---------------------------------------------------------------------------------------------------------------
# The mask proof on every fixture chat template (../shared/fixtures/templates), called per row with a light bench
# ---------------------------------------------------------------------------------------------------------------

def chat_row_proof(name: str, row: dict, unstop: tuple[str, ...] = (), edit: Callable[[list[int]], list[int]] = list,
                   wild: bool = False) -> tuple[list[str], Counter] | None:
    """The mask proof's problems and tally on one conversation as sft encodes it with the family's
    publisher stop tokens (the proof told that `unstop` are none; `edit` applied to each example's labels);
    None when sft refuses the row. `wild`: a template of tests/templates (test_wild_templates)."""
    if wild:
        from test_wild_templates import family_tokenizer
    else:
        from test_template_masks import family_tokenizer

    tok, stops = family_tokenizer(name)
    try:
        rendered = ChatRenderer(tok, generation_eos=stops).render_row(row, "chat.jsonl", 3)
    except SFTError:  # a refusal is sft's answer for the row (prove_masks lets the SFTError through), no mask
        return None
    out = Encoding(tok, max_length=10**6).encode(rendered)
    examples = [{"input_ids": ids, "labels": edit(labels)} for ids, labels in zip(out["input_ids"], out["labels"])]
    bench = SimpleNamespace(tokenizer=tok, base=SimpleNamespace(train_on_last_turn_only=False,
                                                                 assistant_only_loss=True, chat_template_kwargs=None))
    tally: Counter = Counter()
    ids = stop_token_ids(tok, stops) - set(tok.convert_tokens_to_ids(list(unstop)))
    problems, _ = check_chat_row(bench, row, "messages", examples, ids, tally)
    return problems, tally


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_mask_proof_passes_every_fixture_template_wherever_sft_trains_the_row(name):
    """Each sample conversation sft trains passes (the four kinds, and reasoning written as a <think> block in the
    content); the rows it refuses are asserted refused in test_template_masks, and the proof never sees them."""
    from test_template_masks import CONVERSATIONS, TEMPLATES, reasoning_row

    if not TEMPLATES.is_dir():
        pytest.skip(f"fixture chat templates not found at {TEMPLATES}")
    rows = {**CONVERSATIONS, "think_in_content": reasoning_row(content="<think>\n{0}\n</think>\n\n{1}")}
    results = {kind: chat_row_proof(name, row) for kind, row in rows.items()}
    failures = {kind: result for kind, result in results.items()
                if result is not None and (result[0] or not result[1]["turns"] or result[1]["unplaced"])}
    assert not failures
    assert any(results.values())  # every family trains some conversation: the test is not vacuous


def test_mask_proof_passes_reasoning_passed_as_thinking_parts():
    """Ministral-3 Reasoning renders reasoning only from a thinking content part, as sft now passes it; the proof
    rendered the expected turns from reasoning_content, which the template ignores, and failed every such row
    ("the encoder's tokens are not the template's rendering of this conversation")."""
    from test_template_masks import CALL, CONVERSATIONS, RESULT, SUNNY, TOOLS, WEATHER, reasoning_row

    if not (FIXTURES / "tokenizers").is_dir():
        pytest.skip(f"fixture tokenizers not found at {FIXTURES / 'tokenizers'}")
    rows = {**CONVERSATIONS, "think_in_content": reasoning_row(content="<think>\n{0}\n</think>\n\n{1}"),
            "call": {"messages": [WEATHER, dict(CALL, reasoning_content="Need it."), RESULT, SUNNY], "tools": TOOLS}}
    results = {kind: chat_row_proof("ministral_3_reasoning", row, wild=True) for kind, row in rows.items()}
    assert results == {kind: ([], Counter(turns=2, missing=0, cut=0, extra=0, no_stop=0, unplaced=0))
                       for kind in rows}


@pytest.mark.parametrize("kind", ["multi", "tool"])
def test_mask_proof_fails_glm_without_its_continuation_stop(kind):
    """GLM's turns end with the next role tag the model writes, appended by sft. Negative controls: the proof
    FAILs when that tag is not a stop token, and when sft would leave the appended tag untrained."""
    from test_template_masks import CONVERSATIONS, TEMPLATES

    if not TEMPLATES.is_dir():
        pytest.skip(f"fixture chat templates not found at {TEMPLATES}")
    row = CONVERSATIONS[kind]
    assert chat_row_proof("glm4moe", row)[0] == []
    problems, tally = chat_row_proof("glm4moe", row, unstop=("<|user|>", "<|observation|>"))
    assert problems and tally["no_stop"] + tally["unplaced"] > 0
    problems, tally = chat_row_proof("glm4moe", row, edit=lambda labels: labels[:-1] + [-100])
    assert problems and tally["missing"] == 1


def test_mask_proof_passes_a_glm_recipe_end_to_end(tmp_path):
    """`sft check --prove`'s bench on a GLM-4.5 model folder: its tiny model keeps the recipe model's stop tokens
    (with the default's, sft refused the tool-call row), and every sample conversation's masks are proven."""
    from test_template_masks import CONVERSATIONS, TEMPLATES, family_tokenizer

    if not TEMPLATES.is_dir():
        pytest.skip(f"fixture chat templates not found at {TEMPLATES}")
    tok, stops = family_tokenizer("glm4moe")
    tok.save_pretrained(tmp_path / "model")
    transformers.LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=4).save_pretrained(tmp_path / "model")
    GenerationConfig(eos_token_id=stops).save_pretrained(tmp_path / "model")
    (tmp_path / "chat.jsonl").write_text("\n".join(json.dumps(row) for row in CONVERSATIONS.values()))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"model_name_or_path": str(tmp_path / "model"), "max_length": 512,
                                      "dataset": str(tmp_path / "chat.jsonl"), "output_dir": str(tmp_path / "run")}))
    proof = prove_masks(Bench.build(str(recipe), None, tmp_path / "bench"), 8)
    assert proof.passed, proof.evidence
    assert proof.figure.startswith("4 rows, 8 trained answers")


def test_mask_proof_passes_sharegpt_function_call_rows():
    """ShareGPT `function_call` turns (LLaMA-Factory's glaive tool-call demo) are assistant tool calls, read by the
    proof as sft reads them (sft.data.messages): the template renders them as tool calls and the proof PASSes."""
    from test_template_masks import TEMPLATES

    data = FIXTURES / "datasets" / "chat" / "llamafactory_glaive_toolcall_en_demo.json"
    if not TEMPLATES.is_dir() or not data.is_file():
        pytest.skip(f"shared fixtures (templates, glaive tool-call demo) not found under {FIXTURES}")
    rows = [row for row in json.loads(data.read_text())
            if any(turn["from"] == "function_call" for turn in row["conversations"])][:3]
    for row in rows:
        problems, tally = chat_row_proof("qwen2_5", row)
        assert problems == [] and tally["turns"] >= 2 and not tally["unplaced"]


def test_mask_proof_reads_role_content_dicts_under_conversations():
    """A `conversations` column of role/content messages (no ShareGPT from/value) is read as messages."""
    from test_template_masks import CONVERSATIONS, TEMPLATES

    if not TEMPLATES.is_dir():
        pytest.skip(f"fixture chat templates not found at {TEMPLATES}")
    problems, tally = chat_row_proof("qwen2_5", {"conversations": CONVERSATIONS["multi"]["messages"]})
    assert problems == [] and tally["turns"] == 2


def test_token_losses_hold_one_rows_logits_at_a_time():
    """The packing proof took the logits of its 8 examples in one forward pass: 8 rows of 2,200 tokens over Qwen's
    151,936 tokens are 10.7 GB (twice that with log-softmax), and `--prove` on a recipe with long prompts was killed
    for memory. Row by row, the losses are the batch's."""
    from sft.check.prove.batches import token_losses

    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=50, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1)).eval()
    ids = torch.randint(3, 50, (3, 7))
    mask = torch.ones_like(ids)
    mask[1, 5:] = 0  # a padded row
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
    shapes = []
    model.register_forward_pre_hook(lambda _, args, kwargs: shapes.append(tuple(kwargs["input_ids"].shape)),
                                    with_kwargs=True)
    with torch.no_grad():
        together = token_losses(model, batch, False)
        assert shapes == [(1, 7)] * 3
        alone = [token_losses(model, {k: v[row:row + 1] for k, v in batch.items()}, False) for row in range(3)]
        assert torch.equal(together, torch.cat(alone))
