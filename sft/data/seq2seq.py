"""Encoder-decoder data: source -> input_ids (with the tokenizer's special tokens), target + EOS -> labels.

Rows render through the same format renderers as decoder-only data (alpaca, prompt_completion, seq2seq), always
completion-only: the text before the trained span is the source, the span is the target.
"""

from typing import Callable

from sft.data.encode import Encoding
from sft.data.formats import RENDERERS, Rendered, field_text, refuse_unused
from sft.errors import SFTError

SEQ2SEQ_FORMATS = ("seq2seq", "prompt_completion", "alpaca")


def render_pair(row: dict, where: str, row_number: int) -> Rendered:
    """A seq2seq row as source text followed by the trained target text (no separator: they are split again)."""
    refuse_unused(row, "seq2seq", where, row_number)
    source = field_text(row, "source", where, row_number)
    target = field_text(row, "target", where, row_number)
    return Rendered(source + target, [(len(source), len(source) + len(target))])


def pair_renderer(fmt: str) -> Callable[[dict, str, int], Rendered]:
    """row -> Rendered whose single span is the target, for an encoder-decoder model."""
    if fmt == "seq2seq":
        return render_pair
    if fmt not in SEQ2SEQ_FORMATS:
        raise SFTError(f"Encoder-decoder models need source/target pairs: dataset_format {fmt} is for decoder-only "
                       f"models. Use {', '.join(SEQ2SEQ_FORMATS)} data (map columns with `columns:`).")
    render = RENDERERS[fmt]
    return lambda row, where, number: render(row, where, number, True)


class Seq2SeqEncoding(Encoding):
    """Encoding's settings, turning Rendered source+target rows into encoder input_ids and decoder labels."""

    def encode(self, rows: list[Rendered]) -> dict[str, list]:
        """input_ids, labels, length (source + target tokens), truncated and trained per row."""
        sources = [r.text[:r.spans[0][0]] for r in rows]
        targets = [r.text[r.spans[0][0]:r.spans[0][1]] for r in rows]
        enc = self.tokenizer(sources, return_special_tokens_mask=True, return_attention_mask=False)
        dec = self.tokenizer(targets, add_special_tokens=False, return_attention_mask=False)
        out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "truncated": [], "trained": []}
        eos = self.tokenizer.eos_token_id
        for ids, special, target in zip(enc["input_ids"], enc["special_tokens_mask"], dec["input_ids"]):
            ids, cut_source = fit_keeping_special(ids, special, self.max_length, self.truncation_side)
            target = target[:-1] if target[-1:] == [eos] else target  # a target written with its EOS: trained once
            labels, cut_target = target[:self.max_length - 1], len(target) > self.max_length - 1
            labels = labels + [eos]  # the model learns to stop
            out["input_ids"].append(ids)
            out["labels"].append(labels)
            out["length"].append(len(ids) + len(labels))
            out["truncated"].append(cut_source or cut_target)
            out["trained"].append(len(labels))
        return out


def fit_keeping_special(ids: list[int], special: list[int], max_length: int, side: str) -> tuple[list[int], bool]:
    """Cut `ids` to max_length from `side`, keeping the special tokens the tokenizer put at either end."""
    if len(ids) <= max_length:
        return ids, False
    head = next((i for i, s in enumerate(special) if not s), len(ids))
    tail = next((i for i, s in enumerate(reversed(special)) if not s), 0)
    body = ids[head:len(ids) - tail]
    room = max(max_length - head - tail, 0)
    body = body[len(body) - room:] if side == "left" else body[:room]
    return ids[:head] + body + ids[len(ids) - tail:], True

