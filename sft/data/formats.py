"""Dataset formats: detect a format from columns and render each row to text plus the character spans to train."""

import difflib
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from sft.errors import SFTError

# Stanford Alpaca's prompt templates, verbatim (tatsu-lab/stanford_alpaca train.py).
ALPACA_PROMPT_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
)
ALPACA_PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:"
)

# Columns each format needs, in detection order (the first format whose columns are all present wins).
REQUIRED_COLUMNS = {
    "messages": ("messages",),
    "sharegpt": ("conversations",),
    "alpaca": ("instruction", "output"),
    "prompt_completion": ("prompt", "completion"),
    "seq2seq": ("source", "target"),
    "text": ("text",),
}
CHAT_FORMATS = ("messages", "sharegpt")  # rendered by sft.data.chat.ChatRenderer through a chat template


@dataclass
class Rendered:
    """One example as text, the character spans whose tokens are trained, and how to tokenize it."""

    text: str
    spans: list[tuple[int, int]]
    append_eos: bool = True  # plain formats end with EOS; chat templates write their own end-of-turn tokens
    add_special_tokens: bool = True  # chat templates already contain BOS
    # Chat turns: labelled character pieces of the trained spans (reasoning, answer, tool_call, channel, end), and
    # whether this is an extra example a row made under `history: split`.
    kinds: list[tuple[int, int, str]] = field(default_factory=list)
    split: bool = False


def detect_format(columns: list[str], where: str) -> str:
    """The format implied by the dataset's columns, or an error suggesting a `columns` mapping."""
    for name, required in REQUIRED_COLUMNS.items():
        if all(c in columns for c in required):
            return name
    raise SFTError(f"Dataset {where}: cannot tell its format from columns {columns}. Expected one of: "
                   + "; ".join(f"{name} ({', '.join(cols)})" for name, cols in REQUIRED_COLUMNS.items())
                   + _rename_hint(columns) + ". Or set `dataset_format`.")


def check_one_format(raw: Any, fmt: str, where: str) -> None:
    """Refuse a source whose rows are in several formats, naming a row of each. The columns are the union of every
    row's keys, so one chat row among Alpaca rows made the whole file `messages`, and the error named row 1 (an
    Alpaca row: "no chat column"), not the stray row. A row of `fmt` holds one of its columns (any chat column for
    chat formats, whose rows may mix them); rows that miss only some are left to the renderers' field errors."""
    needed = ("messages", "conversations", "prompt") if fmt in CHAT_FORMATS else REQUIRED_COLUMNS[fmt]
    table = raw.select_columns([c for c in needed if c in raw.column_names]).with_format("arrow")[:]
    other = np.logical_and.reduce([column.is_null().to_numpy(zero_copy_only=False) for column in table.columns])
    if not other.any():
        return
    row, ours = int(np.flatnonzero(other)[0]), np.flatnonzero(~other)
    keys = [key for key, value in raw[row].items() if value is not None]
    if not keys:  # was "mixes formats: ... row N is in no format (keys )"
        raise SFTError(f"Dataset {where}, row {row + 1} is empty: every field is null or missing. Remove the row.")
    try:
        theirs = detect_format(keys, where)
    except SFTError:
        theirs = f"in no format (keys {', '.join(keys)})"
    mine = f"row {int(ours[0]) + 1} is {fmt}, " if ours.size else ""
    raise SFTError(f"Dataset {where} mixes formats: {mine}row {row + 1} is {theirs}. A source is read in one format: "
                   "save each format's rows in a file of their own and list the files under `dataset`.")


IMAGE_COLUMNS = ("images", "image", "image_url", "pixel_values", "videos", "audios")


def check_sft_data(columns: list[str], first_row: dict, where: str) -> None:
    """Refuse data made for another kind of training, before any column of it is mistaken for a conversation."""
    if "chosen" in columns and "rejected" in columns:
        raise SFTError(f"Dataset {where} holds preference pairs (columns `chosen` and `rejected`), data for DPO/ORPO "
                       "preference training, which sft does not do. sft trains on demonstrations: to fine-tune on the "
                       "preferred answers, map them with `columns: {chosen: completion}` (or save prompt + chosen "
                       "as messages) and leave `rejected` out.")
    kto = "kto_tag" if "kto_tag" in columns else "label" if isinstance(first_row.get("label"), bool) else None
    if kto:
        raise SFTError(f"Dataset {where} holds KTO data (a true/false `{kto}` per answer), for desirable/undesirable "
                       "preference training, which sft does not do. sft trains on demonstrations: keep only the rows "
                       f"whose `{kto}` is true and drop the column.")
    media = [c for c in IMAGE_COLUMNS if c in columns]
    if media:
        raise SFTError(f"Dataset {where} holds multimodal rows (column `{media[0]}`); sft fine-tunes text-only "
                       f"language models. Use text-only rows, or drop `{media[0]}` if the text stands on its own.")


def check_columns(fmt: str, columns: list[str], where: str) -> None:
    """Every column `fmt` needs is present, or an error naming the missing one and a likely rename."""
    missing = [c for c in REQUIRED_COLUMNS[fmt] if c not in columns]
    if missing:
        raise SFTError(f"Dataset {where}: format {fmt} needs column `{missing[0]}`, which is missing "
                       f"(columns: {', '.join(columns)}){_rename_hint(columns, missing)}.")


def _rename_hint(columns: list[str], wanted: list[str] | None = None) -> str:
    """A `columns:` mapping suggestion for a column that looks like an expected one."""
    targets = wanted or sorted({c for cols in REQUIRED_COLUMNS.values() for c in cols})
    for target in targets:
        close = difflib.get_close_matches(target, columns, n=1, cutoff=0.6)
        if close and close[0] != target:
            return f". Column `{close[0]}` looks like `{target}`: map it with `columns: {{{close[0]}: {target}}}`"
    return ""


def field_text(row: dict, name: str, where: str, row_number: int, required: bool = True) -> str:
    """A string field of a row, or an error naming the row and what is wrong with it."""
    value = row.get(name)
    if value is None and not required:
        return ""
    if not isinstance(value, str):
        kind = "missing" if value is None else f"{type(value).__name__} {str(value)[:40]!r}, not a string"
        raise SFTError(f"Dataset {where}, row {row_number}: field `{name}` is {kind}. Fix or remove the row.")
    if required and not value.strip():
        raise SFTError(f"Dataset {where}, row {row_number}: field `{name}` is empty. Fix or remove the row.")
    return value


# Columns a plain format has no place for: refused, not dropped. LLaMA-Factory's alpaca rows carry `system` and
# `history`; a `system` beside a text prompt (or source, or text) would otherwise vanish too. Chat rows, conversational
# prompt/completion ones included, render `system` as their system message (sft.data.messages.conversation).
UNUSED_COLUMNS = {"system": "the system prompt", "history": "the earlier turns"}
HISTORY_FORMATS = ("alpaca",)  # LLaMA-Factory's; in other formats a `history` column is not known to be turns
PLACES = {  # per plain format: what has no place for them, and how to keep them
    "alpaca": ("Stanford Alpaca's prompt", "Save such rows as `messages` (system, earlier user/assistant turns, then "
               "the instruction and its output)"),
    "prompt_completion": ("a prompt/completion row whose `prompt` is text", "Write `prompt` and `completion` as "
                          "message lists ([{role: system, ...}, {role: user, ...}] and [{role: assistant, ...}]), "
                          "so that the chat template renders it, or write it into the prompt text"),
    "seq2seq": ("a source/target pair", "Write it into the `source` text"),
    "text": ("plain text", "Write it into the `text`"),
}


def refuse_unused(row: dict, fmt: str, where: str, row_number: int) -> None:
    """Refuse a row of plain format `fmt` that sets a column the format cannot hold (UNUSED_COLUMNS)."""
    unused = next((name for name in UNUSED_COLUMNS if row.get(name)
                   and (name != "history" or fmt in HISTORY_FORMATS)), None)
    if unused:
        place, fix = PLACES[fmt]
        raise SFTError(f"Dataset {where}, row {row_number}: field `{unused}` is set, and {place} has no place for it: "
                       f"{UNUSED_COLUMNS[unused]} would be dropped without a word. {fix}, or train without it: "
                       f"`columns: {{{unused}: unused_{unused}}}` in the source.")


def render_alpaca(row: dict, where: str, row_number: int, completion_only: bool) -> Rendered:
    """Stanford Alpaca: the prompt template, then the output; the output (and EOS) are trained."""
    refuse_unused(row, "alpaca", where, row_number)
    instruction = field_text(row, "instruction", where, row_number)
    extra = field_text(row, "input", where, row_number, required=False)
    output = field_text(row, "output", where, row_number)
    template = ALPACA_PROMPT_INPUT if extra.strip() else ALPACA_PROMPT_NO_INPUT
    prompt = template.format(instruction=instruction, input=extra)
    return _prompt_completion(prompt, output, completion_only)


def render_prompt_completion(row: dict, where: str, row_number: int, completion_only: bool) -> Rendered:
    """Prompt followed directly by completion; the completion (and EOS) are trained."""
    refuse_unused(row, "prompt_completion", where, row_number)
    prompt = field_text(row, "prompt", where, row_number, required=False)
    completion = field_text(row, "completion", where, row_number)
    return _prompt_completion(prompt, completion, completion_only)


def render_seq2seq(row: dict, where: str, row_number: int, completion_only: bool) -> Rendered:
    """Source/target pairs for a decoder-only model: source, a newline so the boundary is visible, then target.

    Encoder-decoder models encode the two sides separately (sft.data.seq2seq) and never see this newline.
    """
    refuse_unused(row, "seq2seq", where, row_number)
    source = field_text(row, "source", where, row_number)
    return _prompt_completion(source + "\n", field_text(row, "target", where, row_number), completion_only)


def render_text(row: dict, where: str, row_number: int, completion_only: bool) -> Rendered:
    """Plain text, all trained."""
    refuse_unused(row, "text", where, row_number)
    text = field_text(row, "text", where, row_number)
    return Rendered(text, [(0, len(text))])


def _prompt_completion(prompt: str, completion: str, completion_only: bool) -> Rendered:
    text = prompt + completion
    return Rendered(text, [(len(prompt) if completion_only else 0, len(text))])


ANSWER_FIELDS = {"alpaca": "output", "prompt_completion": "completion", "seq2seq": "target"}  # what the model writes


@dataclass
class AnswerStops:
    """A plain format's renderer that refuses an answer holding a stop token before its end, as chat messages are.

    The tokenizer reads `</s>` (an HTML strike-through closing tag, say) or `<|endoftext|>` in the text as that
    token, so the model would learn to stop generating there, and generation eval would cut the reference there too.
    An answer ending with one (a completion written with its EOS) is kept: its EOS is trained once.
    """

    render: Callable[..., Rendered]
    field: str
    stops: tuple[str, ...]

    def __call__(self, row: dict, where: str, row_number: int, *rest: bool) -> Rendered:
        answer = row.get(self.field)
        if isinstance(answer, str):
            end = len(answer.rstrip())
            found = next((stop for stop in self.stops if -1 < answer.find(stop) < end - len(stop)), None)
            if found:
                raise SFTError(f"Dataset {where}, row {row_number}: field `{self.field}` contains {found!r} before its "
                               "end, a token generation stops on, so the model would learn to end its answer there. "
                               f"Remove {found!r}, or write it so that it is not that token (e.g. with a space "
                               "inside).")
        return self.render(row, where, row_number, *rest)


RENDERERS: dict[str, Callable[..., Rendered]] = {
    "alpaca": render_alpaca,
    "prompt_completion": render_prompt_completion,
    "seq2seq": render_seq2seq,
    "text": render_text,
}


def default_completion_only(fmt: str) -> bool:
    """completion_only_loss when the recipe leaves it unset: train only answers where prompts exist."""
    return fmt in ("alpaca", "prompt_completion", "seq2seq")


def row_renderer(fmt: str, completion_only: bool, chat: Any = None, stops: tuple[str, ...] = (),
                 ) -> Callable[[dict, str, int], Rendered | list[Rendered]]:
    """A function row -> Rendered (or a list of them) for `fmt`; chat formats render through `chat` (a
    sft.data.chat.ChatRenderer), which returns a list: empty for a row it drops (no assistant turn with
    `no_assistant_turn: drop`), several for a row split by `history: split`.
    prompt_completion rows whose prompt is a message list (conversational) also go through `chat` when given.
    An answer holding one of `stops` (the tokens generation stops on) before its end is refused (AnswerStops).
    """
    if fmt in CHAT_FORMATS:
        return chat.render_row
    render = RENDERERS[fmt]
    if fmt in ANSWER_FIELDS and stops:
        render = AnswerStops(render, ANSWER_FIELDS[fmt], stops)
    if fmt == "prompt_completion" and chat is not None:
        return lambda row, where, number: (chat.render_row(row, where, number) if isinstance(row.get("prompt"), list)
                                           else render(row, where, number, completion_only))
    return lambda row, where, number: render(row, where, number, completion_only)
