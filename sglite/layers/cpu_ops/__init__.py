"""sglite's C++ kernels for the CPU, compiled on first use (``torch.utils.cpp_extension``):
paged decode attention (``decode_attention.cpp``), the fused RMSNorm, SiLU-and-mul and
RoPE (``fused_ops.cpp``), and a Llama-family model's whole decode forward as one call
(``decode_graph.cpp``, run by ``model_executor/cpu_graph_runner.py``).

SGLang ships its CPU kernels prebuilt (sgl-kernel); sglite compiles its kernels from
source the first time a CPU engine starts, for this machine's CPU (``-march=native``),
where torch keeps JIT-built extensions (``$TORCH_EXTENSIONS_DIR``, default
``~/.cache/torch_extensions``); later starts load the built module in well under a
second. A change of source, flags, torch (or its environment), Python or CPU gets a
fresh build (the hash in the module's name). Needs a C++ compiler, Python's headers and
ninja (a dependency of sglite).
"""

from __future__ import annotations

import hashlib
import os
import platform
import struct
import sys
import time
from pathlib import Path
from types import ModuleType

import torch

_HERE = Path(__file__).parent
SOURCES = [_HERE / "bindings.cpp", _HERE / "decode_attention.cpp", _HERE / "fused_ops.cpp", _HERE / "gemm.cpp",
           _HERE / "decode_graph.cpp"]
HEADERS = [_HERE / "common.h", _HERE / "kernels.h"]
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fno-trapping-math"]
LDFLAGS = ["-fopenmp"]

_module: ModuleType | None = None
_error: "KernelBuildError | None" = None


class KernelBuildError(RuntimeError):
    """The C++ kernels could not be compiled or loaded; the message says why, in one line."""


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line
    except OSError:
        pass
    return platform.processor()


def build_name() -> str:
    """The extension's name: what it was built from and where torch is, hashed (a
    different hash, a new build)."""
    h = hashlib.sha256()
    for src in (*SOURCES, *HEADERS):
        h.update(src.read_bytes())
    # torch's install directory too: its headers' paths are in the build's command lines, so
    # two environments sharing one build directory would rebuild it at every switch
    for part in (*CFLAGS, *LDFLAGS, torch.__version__, str(Path(torch.__file__).parent), sys.version,
                 platform.machine(), _cpu_flags()):
        h.update(part.encode())
    return f"sglite_cpu_ops_{h.hexdigest()[:16]}"


def load_cpu_ops() -> ModuleType:
    """The compiled module; compiles it the first time on this machine.

    Raises KernelBuildError when it cannot be built; the failure is remembered for the
    process, so a second engine does not retry a minute-long build.
    """
    global _module, _error
    if _module is not None:
        return _module
    if _error is not None:
        raise _error
    try:
        _module = _build()
    except KernelBuildError as e:
        _error = e
        raise
    return _module


def _build() -> ModuleType:
    name = build_name()
    build_dir = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions") / name
    try:
        build_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KernelBuildError(f"cannot create {build_dir}: {e.strerror}") from None
    try:
        from torch.utils.cpp_extension import verify_ninja_availability

        verify_ninja_availability()
    except (ImportError, RuntimeError) as e:
        raise KernelBuildError(f"cannot build C++ extensions here: {e}") from None
    try:
        import fcntl
    except ImportError:  # not a POSIX system
        raise KernelBuildError("the CPU kernels are built on Linux and macOS only") from None
    so = build_dir / f"{name}.so"
    built = so.exists()
    # one build at a time across processes; the lock goes with a killed process, whereas
    # torch's own lock file would stay behind and make every later load wait forever
    with open(build_dir / "sglite.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        if not built:
            print(f"sglite: compiling the CPU kernels into {build_dir} (once per machine, one to three minutes)",
                  file=sys.stderr, flush=True)
        t0 = time.monotonic()
        # a build that a killed process left half-written can look up to date to ninja;
        # loading a truncated module kills the process (SIGBUS), so check it first
        if built and not _complete(so):
            print(f"sglite: {so} is incomplete (a build was killed?); linking it again", file=sys.stderr, flush=True)
            so.unlink()
            built = False
        retry = built  # a build that is there and does not load: once more, from scratch
        while True:
            try:
                module = _load(name, build_dir)
                break
            except Exception as e:  # noqa: BLE001 - compiler and loader errors come as several exception types
                why = _first_error(str(e))
                if not retry:
                    raise KernelBuildError(f"compiling the CPU kernels failed: {why} (is a C++ compiler with "
                                           f"Python's headers installed? build dir: {build_dir})") from None
                print(f"sglite: the CPU kernels in {build_dir} did not load ({why}); compiling them again",
                      file=sys.stderr, flush=True)
                _clear(build_dir)
                retry = built = False
        if not built:
            print(f"sglite: compiled in {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
    return module


def _load(name: str, build_dir: Path) -> ModuleType:
    from torch.utils.cpp_extension import load

    return load(name, [str(s) for s in SOURCES], extra_cflags=CFLAGS, extra_ldflags=LDFLAGS,
                build_directory=str(build_dir), verbose=False)


def _complete(so: Path) -> bool:
    """False for an ELF file shorter than its own header says (the section table is the
    file's last part, so any cut shows); other formats (macOS) are not checked."""
    with open(so, "rb") as f:
        head = f.read(64)
    if head[:4] != b"\x7fELF":
        return sys.platform != "linux"
    if head[4] != 2 or head[5] != 1:  # only 64-bit little-endian is checked
        return True
    shoff, = struct.unpack_from("<Q", head, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", head, 0x3A)
    return so.stat().st_size >= shoff + shentsize * shnum


def _clear(build_dir: Path) -> None:
    for path in build_dir.iterdir():
        if path.is_file() and path.name != "sglite.lock":
            path.unlink()


def _first_error(log: str) -> str:
    """The compiler's first ``error:`` line of a failed build's log (it echoes whole
    command lines first), else the log's last line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    why = next((ln for ln in lines if "error:" in ln), lines[-1] if lines else "no output")
    return why if len(why) <= 300 else why[:297] + "..."
