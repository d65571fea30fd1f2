"""Shared test fixtures: an in-process tokenizer, tiny models from configs, data files, paths."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests are hermetic: never reach a hub
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Tiny models gain nothing from intra-op threads, and 2 threads per test process oversubscribe a 2-core CI box.
torch.set_num_threads(1)

REPO = Path(__file__).resolve().parents[1]
EMBEDDED_MODEL = REPO / "data" / "models" / "tiny-llama"
# Beside the checkout (CI, /work/main); SFT_FIXTURES points elsewhere (e.g. from a git worktree).
FIXTURES = Path(os.environ.get("SFT_FIXTURES", REPO.parent / "shared" / "fixtures"))
CORPUS = [
    "Below is an instruction that describes a task. Write a response that appropriately completes the request.",
    "### Instruction:\nAdd the two numbers.\n\n### Input:\n2 and 3\n\n### Response:5",
    "The capital of France is Paris. The quick brown fox jumps over the lazy dog.",
    "Hello, how are you today? I am fine, thank you. What is the weather like?",
    "def add(a, b):\n    return a + b\n# numbers 0 1 2 3 4 5 6 7 8 9 10",
]


def make_tokenizer():
    """A byte-level BPE tokenizer with <s>, </s>, <pad> (distinct from EOS) and offsets, trained in-process."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<pad>", "<s>", "</s>", "<unk>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    tok.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))]),
    ])
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")


def make_gemma3(vocab_size: int, seed: int = 0):
    """A tiny Gemma-3 as its 4B+ checkpoints load (Gemma3ForConditionalGeneration: a SigLIP vision tower and its
    projector beside the text decoder), random init from `seed`, fp32; image tokens past `vocab_size`."""
    from transformers import AutoModelForCausalLM, Gemma3Config

    torch.manual_seed(seed)
    text = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                head_dim=16, vocab_size=vocab_size + 8, max_position_embeddings=512, use_cache=False)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28,
                  patch_size=14)
    config = Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                          boi_token_index=vocab_size + 1, eoi_token_index=vocab_size + 2,
                          image_token_index=vocab_size + 3)
    return AutoModelForCausalLM.from_config(config).float()


@pytest.fixture(scope="session")
def tokenizer():
    return make_tokenizer()


def make_llama(vocab_size: int, seed: int = 0, **overrides):
    """A 2-layer Llama with hidden size 32 (`overrides` change its config), random init from `seed`, fp32."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    shape = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=512, tie_word_embeddings=False, use_cache=False)
    config = LlamaConfig(vocab_size=vocab_size, **(shape | overrides))
    return LlamaForCausalLM(config).float()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A saved tiny Llama + tokenizer folder."""
    path = tmp_path_factory.mktemp("tiny-model")
    make_llama(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def write_json(path: Path, rows: list, jsonl: bool = False) -> Path:
    """Write rows as a JSON list (or JSON Lines) file and return its path."""
    text = "\n".join(json.dumps(r) for r in rows) if jsonl else json.dumps(rows)
    path.write_text(text, encoding="utf-8")
    return path


def descendants(pid: int) -> list[int]:
    """The processes `pid` started, and theirs (Linux /proc)."""
    children = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            children += [int(child) for child in (task / "children").read_text().split()]
    return [pid for child in children for pid in (child, *descendants(child))]


LOCK_PROBE = """import fcntl, sys
try:
    fcntl.flock(open(sys.argv[1]), fcntl.LOCK_EX | fcntl.LOCK_NB)
except FileNotFoundError:
    pass
except BlockingIOError:
    sys.exit(3)
"""


def locked_by_another_process(folder: Path) -> bool:
    """Whether an sft command holds `folder`'s run lock (rundir.LOCK), as another process sees it: flock never
    refuses a lock to the process holding it, so a check in the test's own process would always pass."""
    return subprocess.run([sys.executable, "-c", LOCK_PROBE, str(folder / ".sft_run.lock")]).returncode == 3


def snapshot(folder: Path) -> dict[str, bytes] | None:
    """Every file under `folder` by relative path, with its bytes; None when `folder` does not exist."""
    if not folder.exists():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def reference_causal_loss(logits: torch.Tensor, labels: torch.Tensor, normalizer: torch.Tensor | int) -> torch.Tensor:
    """The plain formula sft's chunked loss must equal (the tests' reference, independent of sft's own losses):
    summed shifted cross entropy / normalizer."""
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(),
                                             ignore_index=-100, reduction="sum")
    return loss / normalizer
