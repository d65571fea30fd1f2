"""Prepare `.gpu/`, the one folder a lent GPU machine needs beside the checkout (issue 19), and print the call.

The device gets the checkout only: not ../shared (the fixtures), and its image lacks datasets, trl, bitsandbytes and
liger-kernel and has an older transformers (5.17; sft needs >= 5.24). So `.gpu/` holds
- `wheels/`: those packages, pinned to the versions installed here (CI's), for the device's Python 3.12. The
  bitsandbytes wheel (43 MB) is cut to its CUDA 13 and CPU libraries (the device runs torch cu130), because the
  working tree, fixtures and wheels must fit in 64 MiB together;
- `fixtures/`: the part of ../shared/fixtures the GPU benchmarks read (Alpaca rows, three tokenizers; 7 MB), found
  there through SFT_FIXTURES (the gpu test tier needs none).

    python scripts/gpu_carry.py            # then: device call with carry [".gpu"] and the printed command prefix
"""

import argparse
import importlib.metadata as meta
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
OUT = REPO / ".gpu"
# Missing on the device image or older there (peft: the image had 0.21.0); liger-kernel is not installed here, so
# its newest release is taken. Not huggingface_hub: the image's 1.33 serves transformers 5.24 and datasets 5.2
# (>= 1.31), and this machine's 2.x imports httpx2, which the image lacks (seen on the H100, 2026-11-26).
PACKAGES = ("transformers", "peft", "datasets", "trl", "bitsandbytes", "dill", "multiprocess", "xxhash",
            "rouge_score", "liger-kernel")
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64")
# What scripts/bench.py and scripts/bench_gpu.py read (MODELS' tokenizers, the CPU default's, the Alpaca rows).
FIXTURE_PATHS = ("alpaca/alpaca_data_1k.json", "tokenizers/qwen2.5-coder-3b-instruct",
                 "tokenizers/meta-llama-3-8b-instruct", "tokenizers/mistral-7b-instruct-v0.3")
KEEP_NATIVE = re.compile(r"libbitsandbytes_(cpu|cuda13\d)\.so$")  # the device: torch 2.11+cu130
PREFIX = ("rm -rf /tmp/site; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir "
          "--target /tmp/site .gpu/wheels/*.whl && export PYTHONPATH=/tmp/site:$PWD SFT_FIXTURES=$PWD/.gpu/fixtures HF_HUB_OFFLINE=1 "
          "HF_DATASETS_OFFLINE=1 PYTHONUNBUFFERED=1 || exit;")  # unbuffered: a call cut at its limit keeps the log;
# rm: a warm machine keeps /tmp/site, and pip --target leaves an installed package as it was


def pinned(name: str) -> str:
    """`name==version` as installed here, or the bare name when it is not installed (or, like rouge_score after
    0.0.4, released as source only)."""
    try:
        if name == "rouge_score":
            return name
        return f"{name}=={meta.version(name)}"
    except meta.PackageNotFoundError:
        return name


def slim_wheel(wheel: Path, keep: re.Pattern = KEEP_NATIVE) -> int:
    """Drop the native libraries of a wheel that `keep` does not match (and their RECORD lines); bytes saved."""
    before = wheel.stat().st_size
    slim = wheel.with_suffix(".slim")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(slim, "w", zipfile.ZIP_DEFLATED) as dst:
        dropped = {i.filename for i in src.infolist() if i.filename.endswith(".so") and not keep.search(i.filename)}
        for info in src.infolist():
            if info.filename in dropped:
                continue
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = [ln for ln in data.decode().splitlines() if ln.split(",")[0] not in dropped]
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    slim.replace(wheel)
    return before - wheel.stat().st_size


def download(wheels: Path) -> None:
    platforms = [arg for p in PLATFORMS for arg in ("--platform", p)]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(wheels),
                    *map(pinned, PACKAGES)], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fixtures", type=Path, default=REPO.parent / "shared" / "fixtures")
    args = parser.parse_args()
    exclude = REPO / ".git" / "info" / "exclude"
    exclude.parent.mkdir(parents=True, exist_ok=True)
    if "/.gpu/" not in (exclude.read_text().split() if exclude.exists() else []):
        with exclude.open("a") as f:
            f.write("/.gpu/\n")
    shutil.rmtree(OUT, ignore_errors=True)
    download(OUT / "wheels")
    for wheel in (OUT / "wheels").glob("bitsandbytes-*.whl"):
        print(f"{wheel.name}: {slim_wheel(wheel) / 1e6:.1f} MB of other CUDA/ROCm libraries dropped")
    for part in FIXTURE_PATHS:
        (OUT / "fixtures" / part).parent.mkdir(parents=True, exist_ok=True)
        copy = shutil.copytree if (args.fixtures / part).is_dir() else shutil.copy2
        copy(args.fixtures / part, OUT / "fixtures" / part)
    size = sum(f.stat().st_size for f in OUT.rglob("*") if f.is_file())
    tracked = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    tree = sum((REPO / p).stat().st_size for p in tracked.decode().split("\0") if p and (REPO / p).is_file())
    print(f".gpu: {size / 2**20:.1f} MiB; with the tracked tree ({tree / 2**20:.1f} MiB): "
          f"{(size + tree) / 2**20:.1f} MiB of the 64 MiB a device call may carry")
    print(f'device call: carry [".gpu"], command starting with:\n{PREFIX}')


if __name__ == "__main__":
    main()
