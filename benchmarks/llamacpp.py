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

    python -m benchmarks.llamacpp              # build (or find) and print the paths

Two ways of running it, both as its users do (``benchmarks/runners.py`` calls them):

- ``run_server``: ``llama-server --parallel N`` (continuous batching, prompt cache on,
  defaults otherwise: f16 KV cache), every request of a workload sent at once to its
  ``/completion`` endpoint as token ids, streamed, greedy, EOS ignored;
- ``run_batched_bench``: ``llama-batched-bench`` with the workload's mean prompt and
  output lengths and its number of requests (``-pps``: one prompt shared by all, the
  tool's way of measuring a shared prefix; its prompts are its own tokens).
"""

from __future__ import annotations

import http.client
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

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


def source_gguf(model_path: str) -> Path:
    """The GGUF behind a bench's ``--model-path`` (llama.cpp reads GGUF only)."""
    if model_path == "smollm2-135m":
        from sglite.model_loader.registry import resolve_smollm2_gguf

        return resolve_smollm2_gguf()
    if not model_path.endswith(".gguf"):
        raise BuildUnavailable(f"llama.cpp needs a GGUF model, not {model_path}")
    return Path(model_path).expanduser()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``llama-server`` in a child process on a free loopback port, stopped on exit."""

    def __init__(self, model: Path, threads: int, parallel: int, ctx: int, log: Path):
        self.port = _free_port()
        cmd = [str(tool("llama-server")), "-m", str(model), "-t", str(threads), "-tb", str(threads),
               "-np", str(parallel), "-c", str(ctx), "--host", "127.0.0.1", "--port", str(self.port)]
        self.log = log
        with open(log, "w") as err:  # the child keeps its own descriptor
            self.proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err)

    def wait_ready(self, timeout_s: float = 180.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                tail = self.log.read_text().strip().splitlines()[-1:] or ["no output"]
                raise RuntimeError(f"llama-server exited with code {self.proc.returncode}: {tail[0]}")
            try:
                conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=2)
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise RuntimeError(f"llama-server did not answer /health within {timeout_s:.0f} s")

    def complete(self, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
        """One streamed greedy completion of exactly ``n`` tokens: the ids and the
        monotonic time each arrived."""
        body = json.dumps({"prompt": prompt, "n_predict": n, "temperature": 0, "top_k": 1, "ignore_eos": True,
                           "cache_prompt": True, "stream": True, "return_tokens": True})
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        conn.request("POST", "/completion", body, {"Content-Type": "application/json"})
        resp = conn.getresponse()
        if resp.status != 200:
            raise RuntimeError(f"llama-server answered {resp.status}: {resp.read()[:200]!r}")
        ids: list[int] = []
        stamps: list[float] = []
        for line in resp:
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            now = time.monotonic()
            for t in event.get("tokens") or []:
                ids.append(int(t))
                stamps.append(now)
            if event.get("stop"):
                break
        conn.close()
        return ids, stamps

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def run_server(spec: dict[str, Any], say: Callable[[str], None],
               progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """A workload through ``llama-server --parallel N`` (N = the spec's ``parallel``, or
    every request at once); all requests are sent together from one thread each."""
    build()
    model = model_file(source_gguf(spec["model_path"]), spec["model_type"])
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    parallel = min(spec.get("parallel") or len(prompts), len(prompts))
    ctx = parallel * (max(len(p) + o for p, o in zip(prompts, output_lens)) + 16)
    tic = time.perf_counter()
    server = Server(model, spec["threads"], parallel, ctx, Path(tempfile.mkdtemp(prefix="sglite-llama-")) / "log")
    try:
        server.wait_ready()
        load_s = time.perf_counter() - tic
        server.complete(list(range(100, 132)), 4)  # warm-up
        results: list[tuple[list[int], list[float]] | BaseException] = [([], [])] * len(prompts)
        done = [0, 0]
        lock = threading.Lock()

        def one(i: int) -> None:
            try:
                results[i] = server.complete(prompts[i], output_lens[i])
            except BaseException as e:  # noqa: BLE001 - reported below
                results[i] = e
            with lock:
                done[0] += 1
                done[1] += output_lens[i]
                if progress is not None:
                    progress(done[0], done[1])

        t0 = time.monotonic()
        threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.monotonic() - t0
    finally:
        server.stop()
    errors = [r for r in results if isinstance(r, BaseException)]
    if errors:
        raise RuntimeError(f"{len(errors)} requests failed, first: {errors[0]}")
    outs = [r for r in results if not isinstance(r, BaseException)]
    return {"wall_s": wall, "load_s": load_s, "output_ids": [ids for ids, _ in outs],
            "ttft_s": [st[0] - t0 for _, st in outs],
            "itl_s": [b - a for _, st in outs for a, b in zip(st, st[1:])],
            "prefill_computed": None, "cache_hit_tokens": None,
            "details": {"weights": spec["model_type"], "parallel": parallel, "ctx": ctx, "dtype": spec["model_type"]}}


_ROW = re.compile(r"^\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|\s*(\d+)\s*\|(.*)$")


def parse_batched_bench(text: str) -> dict[str, float]:
    """The first result row of ``llama-batched-bench``'s table: PP, TG, B, N_KV, T_PP,
    S_PP, T_TG, S_TG, T, S."""
    for line in text.splitlines():
        m = _ROW.match(line.strip())
        if m:
            rest = [float(c) for c in m.group(5).strip().strip("|").split("|")]
            keys = ("T_PP", "S_PP", "T_TG", "S_TG", "T", "S")
            return {"PP": int(m.group(1)), "TG": int(m.group(2)), "B": int(m.group(3)), "N_KV": int(m.group(4)),
                    **dict(zip(keys, rest))}
    raise RuntimeError("llama-batched-bench printed no result row")


def run_batched_bench(spec: dict[str, Any], say: Callable[[str], None]) -> dict[str, Any]:
    """``llama-batched-bench -npp PP -ntg TG -npl B [-pps]`` with the workload's mean
    lengths and request count; output ids are not printed by the tool (None)."""
    build()
    model = model_file(source_gguf(spec["model_path"]), spec["model_type"])
    prompts, output_lens = spec["prompts"], spec["output_lens"]
    pp = round(sum(map(len, prompts)) / len(prompts))
    tg = round(sum(output_lens) / len(output_lens))
    b = len(prompts)
    shared = spec.get("shared_prompt", False)
    ctx = b * (pp + tg) + 64  # -pps computes the prompt once, but every sequence holds a copy of its KV
    cmd = [str(tool("llama-batched-bench")), "-m", str(model), "-t", str(spec["threads"]), "-tb",
           str(spec["threads"]), "-c", str(ctx), "-b", "2048", "-ub", "512", "-npp", str(pp), "-ntg", str(tg),
           "-npl", str(b)] + (["-pps"] if shared else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    if proc.returncode != 0:
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"llama-batched-bench exited with code {proc.returncode}: {tail[0]}")
    r = parse_batched_bench(proc.stdout + proc.stderr)
    step = r["T_TG"] / max(1, r["TG"])
    return {"wall_s": r["T"], "load_s": 0.0, "output_ids": None, "ttft_s": [r["T_PP"]] * b,
            "itl_s": [step] * (b * max(0, r["TG"] - 1)), "prefill_computed": None, "cache_hit_tokens": None,
            "details": {"weights": spec["model_type"], "dtype": spec["model_type"], "table": r,
                        "command": " ".join(["llama-batched-bench", "-m", model.name, *cmd[3:]])}}


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
