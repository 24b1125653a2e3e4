"""llama.cpp as its users run it, built here from source: the peers of ``sglite bench``.

llama.cpp's tools (``llama-server``, ``llama-batched-bench``, ``llama-bench``,
``llama-quantize``) are built with cmake from the llama.cpp source that the
llama-cpp-python sdist vendors (a pinned version, downloaded from PyPI with pip, so a
clean clone reproduces the same build), for this machine's CPU (``GGML_NATIVE``), once,
under ``$SGLITE_CACHE_DIR/llama.cpp/<version>/`` (default ``~/.cache/sglite``). A build
takes a few minutes on 2 cores and prints what it is doing; later runs find it.

The default model ships as a Q4_1 GGUF; ``model_file("F32" | "BF16")`` makes the same
weights in that type with ``llama-quantize --allow-requantize`` (dequantized, the same
values sglite loads), cached beside the build.

    python -m benchmarks.llama_cpp              # build (or find) and print the paths
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

SDIST = "llama-cpp-python==0.3.36"
VERSION = SDIST.split("==")[1]
TOOLS = ("llama-server", "llama-batched-bench", "llama-bench", "llama-quantize")
CMAKE_FLAGS = ["-DCMAKE_BUILD_TYPE=Release", "-DGGML_NATIVE=ON", "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF"]
MODEL_TYPES = ("F32", "BF16", "Q4_1")


class BuildUnavailable(RuntimeError):
    """llama.cpp cannot be built or run here; the message says why in one line."""


def _say(msg: str) -> None:
    print(f"llama.cpp: {msg}", file=sys.stderr, flush=True)


def home() -> Path:
    root = Path(os.environ.get("SGLITE_CACHE_DIR") or Path.home() / ".cache" / "sglite")
    return root / "llama.cpp" / VERSION


def bin_dir() -> Path:
    return home() / "bin"


def tool(name: str) -> Path:
    """The path of a built tool (``build()`` first)."""
    return bin_dir() / name


def built() -> bool:
    return all(tool(t).is_file() for t in TOOLS)


def _missing_prerequisite() -> str:
    for prog in ("cmake", "c++"):
        if shutil.which(prog) is None:
            return f"no {prog} on PATH (apt-get install cmake g++)"
    return ""


def build(jobs: int | None = None) -> Path:
    """The tools' directory, building them first if they are not there; raises
    BuildUnavailable (no compiler, no network for the sdist, a failed build)."""
    if built():
        return bin_dir()
    why = _missing_prerequisite()
    if why:
        raise BuildUnavailable(why)
    with tempfile.TemporaryDirectory(prefix="sglite-llama-cpp-") as tmp:
        src = _fetch_source(Path(tmp))
        _cmake(src, Path(tmp) / "build", jobs or os.cpu_count() or 2)
        out = bin_dir()
        out.mkdir(parents=True, exist_ok=True)
        for t in TOOLS:
            shutil.copy2(Path(tmp) / "build" / "bin" / t, out / t)
    _say(f"built {', '.join(TOOLS)} into {out}")
    return out


def _fetch_source(tmp: Path) -> Path:
    _say(f"downloading the {SDIST} sdist (llama.cpp's source, about 75 MB) ...")
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                           "--retries", "1", "--timeout", "30", SDIST, "-d", str(tmp)],
                          capture_output=True, text=True)
    archives = list(tmp.glob("*.tar.gz"))
    if proc.returncode != 0 or not archives:
        last = (proc.stderr or "").strip().splitlines()[-1:] or ["no output"]
        raise BuildUnavailable(f"could not download the {SDIST} sdist: {last[0]}")
    with tarfile.open(archives[0]) as tf:
        tf.extractall(tmp, filter="data")
    src = next(tmp.glob("llama_cpp_python-*/vendor/llama.cpp"), None)
    if src is None:
        raise BuildUnavailable(f"{archives[0].name} holds no vendor/llama.cpp")
    return src


def _cmake(src: Path, build_dir: Path, jobs: int) -> None:
    steps = [["cmake", "-S", str(src), "-B", str(build_dir), "-G", "Ninja" if shutil.which("ninja") else
              "Unix Makefiles", *CMAKE_FLAGS],
             ["cmake", "--build", str(build_dir), "-j", str(jobs), "--target", *TOOLS]]
    for i, cmd in enumerate(steps):
        _say(("configuring" if i == 0 else f"compiling {', '.join(TOOLS)} ({jobs} jobs, a few minutes)") + " ...")
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            lines = (proc.stdout + proc.stderr).strip().splitlines()
            why = next((ln.strip() for ln in lines if "error" in ln.lower()), lines[-1] if lines else "no output")
            raise BuildUnavailable(f"building llama.cpp failed: {why[:300]}")


def model_file(gguf: Path, kind: str) -> Path:
    """``gguf`` in type ``kind`` (F32, BF16, or Q4_1 = the file as shipped)."""
    if kind not in MODEL_TYPES:
        raise ValueError(f"model type must be one of {', '.join(MODEL_TYPES)}, not {kind}")
    if kind == "Q4_1":
        return gguf
    target = home() / "models" / f"{gguf.stem}.{kind}.gguf"
    if target.is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    _say(f"writing {target.name} (llama-quantize --allow-requantize {kind}) ...")
    proc = subprocess.run([str(tool("llama-quantize")), "--allow-requantize", str(gguf), str(partial), kind],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        raise BuildUnavailable(f"llama-quantize {kind} failed: {last[0]}")
    partial.replace(target)
    return target


def main() -> int:
    try:
        path = build()
    except BuildUnavailable as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    for t in TOOLS:
        print(path / t)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
