"""scripts/gpu_carry.py's wheel slimming: the device's CUDA 13 and CPU libraries stay, with their RECORD lines, and
pip still installs the result (the other CUDA/ROCm builds would push the carried folder over the 64 MiB limit)."""

import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

from gpu_carry import slim_wheel  # noqa: E402

LIBS = ["libbitsandbytes_cpu.so", "libbitsandbytes_cuda118.so", "libbitsandbytes_cuda128.so",
        "libbitsandbytes_cuda130.so", "libbitsandbytes_cuda132.so", "libbitsandbytes_rocm72.so"]


def fake_wheel(folder: Path) -> Path:
    wheel = folder / "fakebnb-1.0-py3-none-any.whl"
    files = {f"fakebnb/{lib}": b"\0" * 1000 for lib in LIBS} | {"fakebnb/__init__.py": b"VERSION = 1\n"}
    info = "fakebnb-1.0.dist-info"
    files[f"{info}/METADATA"] = b"Metadata-Version: 2.1\nName: fakebnb\nVersion: 1.0\n"
    files[f"{info}/WHEEL"] = b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    record = "".join(f"{name},,\n" for name in files) + f"{info}/RECORD,,\n"
    with zipfile.ZipFile(wheel, "w") as z:
        for name, data in files.items():
            z.writestr(name, data)
        z.writestr(f"{info}/RECORD", record)
    return wheel


def test_slim_wheel_keeps_cuda13_and_cpu_and_installs(tmp_path):
    wheel = fake_wheel(tmp_path)
    saved = slim_wheel(wheel)
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
        record = z.read("fakebnb-1.0.dist-info/RECORD").decode()
    kept = {f"fakebnb/{lib}" for lib in ("libbitsandbytes_cpu.so", "libbitsandbytes_cuda130.so",
                                         "libbitsandbytes_cuda132.so")}
    assert {n for n in names if n.endswith(".so")} == kept
    assert "fakebnb/__init__.py" in names
    assert {line.split(",")[0] for line in record.splitlines() if line.endswith(".so,,")} == kept
    assert saved > 0
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--target", str(site),
                    str(wheel)], check=True)
    assert sorted(p.name for p in (site / "fakebnb").glob("*.so")) == sorted(Path(k).name for k in kept)
