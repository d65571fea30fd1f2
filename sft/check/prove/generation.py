"""Proof 6, generation eval: no reference token reaches generate() during the recipe's evaluation."""

from typing import Any

import torch

from sft.check.prove.bench import Bench
from sft.check.prove.result import Proof
from sft.data.encode import IGNORE_INDEX

EXAMPLES = 8
NEW_TOKENS = 4  # enough to run generate(); the proof is about its inputs


def prove_generation(bench: Bench) -> Proof:
    """Run the recipe's evaluation with generation on eval rows, recording what generate() is given."""
    if not bench.base.predict_with_generate:
        return Proof("generation", None, "the recipe does not evaluate with generation")
    examples = bench.splits[1] or bench.splits[0]
    examples = examples.select(range(min(EXAMPLES, len(examples))))
    config = bench.config(output_dir=str(bench.folder / "generation"), max_new_tokens=NEW_TOKENS)
    packs = config.packs_eval
    model, calls = bench.model(config), []
    generate = model.generate

    def recording_generate(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return generate(*args, **kwargs)

    model.generate = recording_generate
    bench.trainer(config, model, eval_set=bench.packed(examples, packs)).evaluate()
    leaks, unknown, prompts, evidence = 0, 0, 0, ""
    for call in calls:
        leaks += sum(int(call[k].numel()) for k in ("decoder_input_ids", "labels") if call.get(k) is not None)
        for row, mask in zip(call["input_ids"], call["attention_mask"].bool()):
            prompts += 1
            leaked = leaked_tokens(row[mask].tolist(), examples, bench)
            unknown += leaked is None
            leaks += leaked or 0
            if (leaked is None or leaked) and not evidence:
                text = bench.tokenizer.decode(row[mask], skip_special_tokens=False)
                evidence = f"generate() was given ...{text[-160:]!r}: " + (
                    f"its last {leaked} tokens are the reference" if leaked else "not an eval example's prompt")
    figure = f"{prompts} prompts given to generate(): {leaks} reference tokens among them"
    figure += f", {unknown} prompts match no eval example" if unknown else ""
    passed = prompts > 0 and leaks == 0 and unknown == 0
    return Proof("generation", passed, figure, "" if passed else evidence or "generate() was never called")


def leaked_tokens(prompt: list[int], examples: Any, bench: Bench) -> int | None:
    """Reference tokens in `prompt`, by the example it is the prompt of (the fewest, where several begin alike);
    None when it is no example's.

    Decoder-only: the prompt is the tokens before the first trained label, plus at most a strict part of that
    label's own text (where a token merges the prompt's end with the answer's start, e.g. `:5` after
    `### Response`, generation must start from `:`); encoder-decoder: the encoder input itself.
    """
    counts = [leaked_in(prompt, example, bench) for example in examples]
    return min((c for c in counts if c is not None), default=None)


def leaked_in(prompt: list[int], example: dict, bench: Bench) -> int | None:
    ids, labels = example["input_ids"], torch.tensor(example["labels"])
    if bench.encoder_decoder:
        return 0 if prompt == ids else None
    trained = (labels != IGNORE_INDEX).nonzero()
    first = int(trained[0]) if len(trained) else len(ids)
    if prompt[:first] != ids[:first] or len(prompt) < first:
        return None
    tail, straddling = (bench.tokenizer.decode(part) for part in (prompt[first:], ids[first:first + 1]))
    return 0 if not tail or (len(tail) < len(straddling) and straddling.startswith(tail)) else len(prompt) - first
