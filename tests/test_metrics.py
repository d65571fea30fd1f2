"""Generation metrics against their definitions on fixed strings; user metric functions by import path."""

import math
import re
from collections import Counter

import pytest

from sft import SFTError
from sft.evaluation.metrics import (
    TRIAL,
    bleu,
    check_best_metric,
    compute_metrics,
    eval_keys,
    exact_match,
    resolve_metrics,
    rouge,
)

from conftest import REPO


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9]+", text.lower())


def ngrams(tokens: list[str], n: int) -> Counter:
    return Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))


def f1(overlap: int, predicted: int, reference: int) -> float:
    precision, recall = overlap / predicted, overlap / reference
    return 2 * precision * recall / (precision + recall) if overlap else 0.0


def lcs(a: list[str], b: list[str]) -> int:
    table = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i, x in enumerate(a):
        for j, y in enumerate(b):
            table[i + 1][j + 1] = table[i][j] + 1 if x == y else max(table[i][j + 1], table[i + 1][j])
    return table[-1][-1]


def reference_rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-N and ROUGE-L F1 from their definitions (Lin, 2004), for text where stemming changes nothing."""
    p, r = words(prediction), words(reference)
    scores = {f"rouge{n}": f1(sum((ngrams(p, n) & ngrams(r, n)).values()), len(p) - n + 1, len(r) - n + 1)
              for n in (1, 2)}
    return {**scores, "rougeL": f1(lcs(p, r), len(p), len(r))}


def reference_bleu(predictions: list[str], references: list[str]) -> float:
    """Corpus BLEU (Papineni et al., 2002): clipped n-gram precisions 1-4, geometric mean, brevity penalty; 0-100."""
    matches, totals, hyp_len, ref_len = [0] * 4, [0] * 4, 0, 0
    for prediction, reference in zip(predictions, references):
        p, r = prediction.split(), reference.split()
        hyp_len, ref_len = hyp_len + len(p), ref_len + len(r)
        for n in range(1, 5):
            matches[n - 1] += sum((ngrams(p, n) & ngrams(r, n)).values())
            totals[n - 1] += max(len(p) - n + 1, 0)
    log_precision = sum(math.log(m / t) for m, t in zip(matches, totals)) / 4
    brevity = 1.0 if hyp_len > ref_len else math.exp(1 - ref_len / hyp_len)
    return 100 * brevity * math.exp(log_precision)


PAIRS = [("the cat sat on the mat", "the cat is on the mat"),
         ("a quick brown fox jumps over the dog", "the quick brown fox jumps over the lazy dog"),
         ("completely different words", "nothing in common here")]


def test_exact_match_ignores_only_surrounding_whitespace():
    assert exact_match([" Paris", "paris", "Paris\n", "Lyon"], ["Paris", "Paris", "Paris", "Paris"]) == \
        {"exact_match": 0.5}


def test_rouge_matches_its_definition():
    scores = rouge([p for p, _ in PAIRS], [r for _, r in PAIRS])
    expected = [reference_rouge(p, r) for p, r in PAIRS]
    for kind in ("rouge1", "rouge2", "rougeL"):
        assert scores[kind] == pytest.approx(sum(e[kind] for e in expected) / len(PAIRS), abs=1e-9)
    assert rouge(["the cat sat on the mat"], ["the cat is on the mat"]) == pytest.approx(
        {"rouge1": 5 / 6, "rouge2": 3 / 5, "rougeL": 5 / 6})  # worked by hand


def test_rouge_stems_words_as_summarisation_papers_do():
    assert rouge(["the cats running"], ["the cat runs"])["rouge1"] == pytest.approx(1.0)


ENGLISH = [*PAIRS, ("Jack's cats are running home, he'll see them at 5 p.m.", "The cat ran home at 5pm; Jack sees it."),
           ("Tara and Jack will go to the garden on Sunday.", "Tara & Jack are going to the gardens this Sunday!")]


def test_rouge_on_english_text_is_rouge_scores_own():
    from rouge_score import rouge_scorer

    scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)  # its default tokenizer
    expected = {kind: sum(scorer.score(r, p)[kind].fmeasure for p, r in ENGLISH) / len(ENGLISH)
                for kind in ("rouge1", "rouge2", "rougeL")}
    assert rouge([p for p, _ in ENGLISH], [r for _, r in ENGLISH]) == expected  # exactly


@pytest.mark.parametrize("text, other", [
    ("一只猫坐在垫子上。", "狗跑得很快"), ("猫がマットの上に座っています。", "犬は公園を走る"),
    ("Кошка сидит на ковре.", "Собака бежит в парке"), ("Ein Mädchen läuft über die Straße.", "Zwei Hunde spielen"),
    ("नमस्ते दुनिया", "अलविदा दोस्त")])
def test_rouge_scores_text_in_any_script(text, other):
    # rouge-score's own tokenizer keeps [a-z0-9] only: it scored each identical pair 0 (German: on "ein", "m",
    # "dchen", "l", "uft", ...)
    assert rouge([text], [text]) == {"rouge1": 1.0, "rouge2": 1.0, "rougeL": 1.0}
    assert rouge([other], [text]) == {"rouge1": 0.0, "rouge2": 0.0, "rougeL": 0.0}


def test_rouge_scores_unspaced_scripts_by_character_and_others_by_word():
    # "Кошка сидит 2024" against "Собака лежит 2024" scored rouge1 1.0 on "2024" alone
    assert rouge(["Кошка сидит 2024"], ["Собака лежит 2024"])["rouge1"] == pytest.approx(1 / 3)
    assert rouge(["一只猫"], ["一只狗"]) == pytest.approx({"rouge1": 2 / 3, "rouge2": 1 / 2, "rougeL": 2 / 3})
    assert rouge(["Ein Mädchen"], ["Ein Mdchen"])["rouge1"] == pytest.approx(1 / 2)  # was 0.4 on "m dchen"


def test_bleu_matches_its_definition():
    predictions = ["the quick brown fox jumps over the dog", "a cat sat on the mat today"]
    references = ["the quick brown fox jumps over the lazy dog", "a cat sat on the mat"]
    assert bleu(predictions, references)["bleu"] == pytest.approx(reference_bleu(predictions, references), abs=1e-6)
    assert bleu(["a b c d e"], ["a b c d e"])["bleu"] == pytest.approx(100.0)


def test_bleu_reads_chinese_by_character_as_sacrebleu_does_for_chinese_targets():
    import sacrebleu

    # 13a read each unspaced sentence as one word: an identical Chinese or Japanese reply scored 0
    assert bleu(["一只猫坐在垫子上。"], ["一只猫坐在垫子上。"])["bleu"] == pytest.approx(100.0)
    assert bleu(["猫がマットの上に座っています。"], ["猫がマットの上に座っています。"])["bleu"] == pytest.approx(100.0)
    assert bleu(["一只狗坐在垫子上。"], ["一只猫坐在垫子上。"])["bleu"] == pytest.approx(
        sacrebleu.corpus_bleu(["一 只 狗 坐 在 垫 子 上 。"], [["一 只 猫 坐 在 垫 子 上 。"]]).score)
    english = ["the quick brown fox &amp; the dog", "Ein Mädchen läuft über die Straße."]
    assert bleu(english[::-1], english) == {"bleu": sacrebleu.corpus_bleu(english[::-1], [english]).score}  # 13a


def test_user_metric_by_import_path(tmp_path, monkeypatch):
    (tmp_path / "my_metrics.py").write_text(
        "def score(predictions, references):\n"
        "    return {'longer': sum(len(p) > len(r) for p, r in zip(predictions, references))}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    functions = resolve_metrics(["exact_match", "my_metrics:score"])
    assert compute_metrics(functions, ["abc", "x"], ["ab", "x"]) == {"exact_match": 0.5, "longer": 1.0}


def test_default_metrics_are_the_builtins():
    assert compute_metrics(resolve_metrics(None), ["a b"], ["a b"]).keys() == {
        "exact_match", "rouge1", "rouge2", "rougeL", "bleu"}


@pytest.mark.parametrize("name, message", [("rogue", "Did you mean `rouge`"), ("no_such_module_xyz:f", "cannot import"),
                                           ("math:no_such_function", "has no function `no_such_function`")])
def test_bad_metric_names_are_config_errors(name, message):
    with pytest.raises(SFTError, match=message):
        resolve_metrics([name])


def test_a_user_function_must_return_a_dict(tmp_path, monkeypatch):
    (tmp_path / "bad_metrics.py").write_text("def score(predictions, references):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SFTError, match="must return a dict"):
        compute_metrics(resolve_metrics(["bad_metrics:score"]), ["a"], ["a"])


def test_eval_keys_are_the_loss_speed_and_builtin_metric_keys():
    speed = ["runtime", "samples_per_second", "steps_per_second"]
    assert eval_keys(None, True) == ["loss", "exact_match", "rouge1", "rouge2", "rougeL", "bleu", *speed]
    assert eval_keys(["rouge"], True) == ["loss", "rouge1", "rouge2", "rougeL", *speed]
    assert eval_keys(["rouge"], False) == ["loss", *speed]  # no generation, no generation metrics
    # the keys the built-ins really return
    assert set(eval_keys(None, True)) >= set(compute_metrics(resolve_metrics(None), ["a b"], ["a b"]))


@pytest.mark.parametrize("name, message", [
    ("rouge", "'rouge' is not a metric evaluation reports (loss, rouge1, rouge2, rougeL, runtime"),
    ("rouge", "Did you mean `rougeL`?"), ("eval_rogueL", "Did you mean `rougeL`?"), ("los", "Did you mean `loss`?")])
def test_a_misspelt_metric_for_best_model_is_refused_with_the_nearest_key(name, message):
    with pytest.raises(SFTError, match=re.escape(message)):
        check_best_metric(name, eval_keys(["rouge"], True), generates=True)


def test_metric_for_best_model_takes_reported_keys_with_or_without_eval_prefix():
    for name in (None, "loss", "eval_loss", "rougeL", "eval_rougeL"):
        check_best_metric(name, eval_keys(["rouge"], True), generates=True)
    with pytest.raises(SFTError, match="need predict_with_generate: true"):
        check_best_metric("rougeL", eval_keys(["rouge"], False), generates=False)


def test_a_user_functions_keys_are_those_of_a_trial_call(tmp_path, monkeypatch):
    (tmp_path / "trial_metrics.py").write_text(
        "CALLS = []\n"
        "def score(predictions, references):\n"
        "    CALLS.append((predictions, references))\n"
        "    return {'overlap': 1.0, 'length': 2}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    speed = ["runtime", "samples_per_second", "steps_per_second"]
    assert eval_keys(["exact_match", "trial_metrics:score"], True) == ["loss", "exact_match", "overlap", "length",
                                                                       *speed]
    import trial_metrics

    assert trial_metrics.CALLS == [TRIAL]
    assert eval_keys(["trial_metrics:score"], False) == ["loss", *speed]  # no generation: not called
    assert len(trial_metrics.CALLS) == 1


@pytest.mark.parametrize("module, body, message", [
    ("best_keys", "return {'score': 1.0}",
     "'scores' is not a metric evaluation reports (loss, score, runtime, samples_per_second, steps_per_second). "
     "Did you mean `score`?"),
    ("best_raises", "return {'scores': 1 / 0}",
     "Metric `best_raises:score` failed on a trial call before training, with predictions=['The capital of France "
     "is Paris.'] and references=['The capital of France is Paris.']: ZeroDivisionError: division by zero"),
    ("best_not_dict", "return 0.5", "returned float; it must return a dict of metric names to numbers")])
def test_sft_train_checks_metric_for_best_model_against_a_user_function_before_loading(
        tmp_path, monkeypatch, capsys, module, body, message):
    # the Trainer looks metric_for_best_model up after the first evaluation: a KeyError there, steps of work lost
    from sft.cli.main import main

    (tmp_path / f"{module}.py").write_text(f"def score(predictions, references):\n    {body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(REPO)
    out = tmp_path / "run"
    flags = ["--predict_with_generate", "true", "--metrics", f"{module}:score", "--metric_for_best_model", "scores",
             "--eval_strategy", "steps", "--eval_steps", "2", "--save_strategy", "steps", "--save_steps", "2",
             "--load_best_model_at_end", "true", "--output_dir", str(out)]
    assert main(["train", "recipes/quickstart.yaml", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert not out.exists()  # refused before any work


def test_a_user_function_reporting_metric_for_best_model_passes_the_check(tmp_path, monkeypatch):
    from sft import rundir
    from sft.training.flows import check_before_loading
    from sft.training.recipe import load_recipe

    (tmp_path / "best_ok.py").write_text("def score(predictions, references):\n    return {'scores': 1.0}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(REPO)
    config = load_recipe("recipes/quickstart.yaml", flags=[
        "--predict_with_generate", "true", "--metrics", "best_ok:score", "--metric_for_best_model", "eval_scores",
        "--output_dir", str(tmp_path / "run")])
    try:
        assert check_before_loading(config, None).metric_for_best_model == "eval_scores"
    finally:
        rundir.release(tmp_path / "run")  # the output_dir lock train() releases when the run ends
