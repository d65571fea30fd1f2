"""Generation metrics: exact match, ROUGE-1/2/L (rouge-score), corpus BLEU (sacrebleu), or a user function.

Every metric is a function (predictions, references) -> {name: value}; the trainer prefixes the names with
`eval_` as transformers does. A recipe names built-ins (`exact_match`, `rouge`, `bleu`) or a user function by
import path (`my_pkg.metrics:score`), called with the same two lists of strings and returning a dict of numbers.
"""

import difflib
import importlib
import re
import unicodedata
from typing import Callable

from sft.errors import SFTError

MetricFn = Callable[[list[str], list[str]], dict[str, float]]
DEFAULT_METRICS = ("exact_match", "rouge", "bleu")
ROUGE_KINDS = ("rouge1", "rouge2", "rougeL")
# What every evaluation reports (eval_ prefixed): sft's exact loss, then Trainer.evaluate's speed figures.
EVAL_KEYS = ("loss", "runtime", "samples_per_second", "steps_per_second")


def exact_match(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Fraction of predictions equal to their reference, ignoring surrounding whitespace."""
    hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references, strict=True))
    return {"exact_match": hits / max(len(references), 1)}


# Scripts written without spaces between words: each character is a ROUGE token, as Chinese ROUGE is scored
# (LCSTS, CLUE) and as sacrebleu's zh tokenizer splits them for BLEU. Han ideographs, kana, halfwidth katakana.
UNSPACED = re.compile("[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff66-\uff9f\U00020000-\U0003134f]")


class RougeTokenizer:
    """rouge-score's tokenizer (lowercase, words of letters and digits, Porter stemming of words over 3 characters)
    for every script: its own keeps [a-z0-9] only, scoring identical Chinese or Russian texts 0 and "Mädchen" as
    "m dchen". Words are runs of Unicode letters, marks and digits (NFC), an ideograph or kana is a word of its own;
    ASCII text gets exactly rouge-score's tokens."""

    def __init__(self) -> None:
        from nltk.stem import porter  # rouge-score's own stemmer (it depends on nltk)

        self.stemmer = porter.PorterStemmer()

    def tokenize(self, text: str) -> list[str]:
        text = unicodedata.normalize("NFC", text.lower())
        spaced = "".join(f" {c} " if UNSPACED.match(c) else c if unicodedata.category(c)[0] in "LMN" else " "
                         for c in text)
        return [self.stemmer.stem(word) if len(word) > 3 else word for word in spaced.split()]


def rouge(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Mean ROUGE-1, ROUGE-2 and ROUGE-L F1 (Google's rouge-score, Porter stemming, as summarisation papers use),
    on RougeTokenizer's words so that text in any script is scored."""
    from rouge_score import (
        rouge_scorer,  # imported on use: only generation evals pay for nltk
    )

    scorer = rouge_scorer.RougeScorer(list(ROUGE_KINDS), tokenizer=RougeTokenizer())
    totals = dict.fromkeys(ROUGE_KINDS, 0.0)
    for prediction, reference in zip(predictions, references, strict=True):
        scores = scorer.score(reference, prediction)  # rouge-score takes (target, prediction)
        for kind in ROUGE_KINDS:
            totals[kind] += scores[kind].fmeasure
    return {kind: total / max(len(references), 1) for kind, total in totals.items()}


def bleu(predictions: list[str], references: list[str]) -> dict[str, float]:
    """Corpus BLEU (sacrebleu defaults: 13a tokenization, exp smoothing), on sacrebleu's 0-100 scale; its zh
    tokenization (each ideograph a word, the rest as 13a) where references hold ideographs or kana, as sacrebleu
    picks for Chinese targets: 13a reads an unspaced sentence as one word, so an identical Chinese reply scored 0."""
    import sacrebleu

    tokenize = "zh" if any(UNSPACED.search(reference) for reference in references) else "13a"
    return {"bleu": sacrebleu.corpus_bleu(predictions, [references], tokenize=tokenize).score}


BUILTIN: dict[str, MetricFn] = {"exact_match": exact_match, "rouge": rouge, "bleu": bleu}
BUILTIN_KEYS = {"exact_match": ("exact_match",), "rouge": ROUGE_KINDS, "bleu": ("bleu",)}  # what each returns


def resolve_metrics(names: list[str] | None) -> list[MetricFn]:
    """The metric functions a recipe names (all built-ins when it names none), or an error naming the bad one."""
    return [resolve_metric(name) for name in (DEFAULT_METRICS if names is None else names)]


def resolve_metric(name: str) -> MetricFn:
    """A built-in metric by name, or a user function `module.path:function`."""
    if name in BUILTIN:
        return BUILTIN[name]
    if ":" not in name:
        close = difflib.get_close_matches(name, BUILTIN, n=1)
        hint = f"Did you mean `{close[0]}`? " if close else ""
        raise SFTError(f"Unknown metric `{name}` in `metrics`. {hint}Use {', '.join(BUILTIN)}, or a function of "
                       "your own as `module.path:function` (called with predictions and references, returning a dict).")
    module_name, _, attribute = name.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise SFTError(f"Metric `{name}`: cannot import module {module_name} ({err}). Is it installed or on "
                       "PYTHONPATH?") from None
    function = vars(module).get(attribute)
    if not callable(function):
        raise SFTError(f"Metric `{name}`: module {module_name} has no function `{attribute}`.")
    return function


def eval_keys(names: list[str] | None, generates: bool) -> list[str]:
    """The keys an evaluation reports, without the eval_ prefix: the loss and speed figures, plus the generation
    metrics' with predict_with_generate. A user function's keys are those of one trial call (trial_keys)."""
    names = (DEFAULT_METRICS if names is None else names) if generates else []
    metric_keys = [key for name in names for key in BUILTIN_KEYS.get(name) or trial_keys(name)]
    return [EVAL_KEYS[0], *metric_keys, *EVAL_KEYS[1:]]


# What a user function is called with once before training, so that its keys (and that it runs) are known then:
# a metric_for_best_model it does not report fails only at the first evaluation, with the Trainer's KeyError.
TRIAL = (["The capital of France is Paris."], ["The capital of France is Paris."])


def trial_keys(name: str) -> list[str]:
    """The keys the user function `name` reports, from one call on TRIAL (predictions, references)."""
    function = resolve_metric(name)
    try:
        return list(compute_metrics([function], *TRIAL))
    except SFTError:
        raise
    except Exception as err:  # the user's code: any error it raises is theirs to fix
        raise SFTError(f"Metric `{name}` failed on a trial call before training, with predictions={TRIAL[0]} and "
                       f"references={TRIAL[1]}: {type(err).__name__}: {err}. sft calls it after each evaluation "
                       "with two lists of strings of the same length; it must return a dict of numbers.") from None


def check_best_metric(name: str | None, reported: list[str], generates: bool) -> None:
    """metric_for_best_model is a key evaluation reports (with or without eval_): the Trainer looks it up after
    each evaluation and fails with a KeyError there, after training up to it and before that step's checkpoint."""
    if name is None or name.removeprefix("eval_") in reported:
        return
    close = difflib.get_close_matches(name.removeprefix("eval_"), reported, n=1)
    hint = f" Did you mean `{close[0]}`?" if close else ""
    generation = ("" if generates else " Generation metrics (exact_match, rouge1, rouge2, rougeL, bleu or your own) "
                  "need predict_with_generate: true.")
    raise SFTError(f"Bad value for `metric_for_best_model`: {name!r} is not a metric evaluation reports "
                   f"({', '.join(reported)}).{hint}{generation}")


def compute_metrics(functions: list[MetricFn], predictions: list[str], references: list[str]) -> dict[str, float]:
    """Every metric's values in one dict; a user function returning something else than a dict is an error."""
    results: dict[str, float] = {}
    for function in functions:
        values = function(predictions, references)
        if not isinstance(values, dict):
            raise SFTError(f"Metric function {function.__module__}.{function.__name__} returned "
                           f"{type(values).__name__}; it must return a dict of metric names to numbers.")
        results.update({str(key): float(value) for key, value in values.items()})
    return results
