"""Where an assistant turn's answer starts in the chat template's rendering: the rule sft.data.chat masks by and
`sft check --prove` checks by (sft.check.prove.masks), so the two cannot read a rendering differently."""

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase


def turn_text(prompt: str, final: str, previous: str, history: Callable[[], str],
              tokenizer: PreTrainedTokenizerBase) -> tuple[str, int]:
    """Turn i's example text and where its answer starts, from P = `prompt` (messages[:i] and the generation prompt),
    F = `final` (messages[:i + 1]), the previous message's stripped content and `history` (messages[:i] alone).

    P is a prefix of F (the usual case): the answer starts where P ends. Where only earlier text differs (Mistral
    v0.3 writes the system prompt before the last user message only; Hermes-3 closes a tool result with another
    newline once more messages follow) the example is P, as the model sees it, plus what follows the same
    generation prompt after the previous message in F. Otherwise (DeepSeek-R1 / Nemotron-3 open a think block in
    the prompt alone) the example is F and the answer starts where P and F first differ (answer_start).
    """
    if final.startswith(prompt):
        return final, len(prompt)
    at = prompt.rfind(previous) if previous else -1
    if at >= 0:
        opening = prompt[at:]  # the previous message's end and the generation prompt
        found = final.rfind(opening)
        if found >= 0 and len(opening) > len(previous):
            return prompt + final[found + len(opening):], len(prompt)
        before = history()
        header = prompt[len(before):] if prompt.startswith(before) else ""  # what add_generation_prompt writes
        end = at + len(previous)  # the previous message, where P and F still agree
        found = final.find(header, end) if header.strip() and end <= common_prefix(prompt, final) else -1
        if found >= 0:
            return prompt + final[found + len(header):], len(prompt)
    return final, answer_start(prompt, final, tokenizer)


def answer_start(prompt: str, final: str, tokenizer: PreTrainedTokenizerBase) -> int:
    """Where an answer starts in its rendering `final` when `prompt` is not a prefix of it: where the two first
    differ, moved back to the start of an added token of the prompt that point cuts. DeepSeek-R1's prompt ends
    with <think>; an answer "<div>" shares its "<", which is the answer's: no text holds part of an added token."""
    start = common_prefix(prompt, final)
    window = max(start - 64, 0)  # the prompt's tokens around that point, not the whole conversation again
    tokens = tokenizer(prompt[window:start + 64], add_special_tokens=False, return_offsets_mapping=True)
    added = tokenizer.added_tokens_decoder
    return next((window + a for token, (a, b) in zip(tokens["input_ids"], tokens["offset_mapping"])
                 if window + a < start < window + b and token in added), start)


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of a and b."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # binary search on prefix equality: fast on long conversations
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid - 1
    return lo
