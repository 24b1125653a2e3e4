from __future__ import annotations

import os

import pytest

# Triton picks interpreter mode when @triton.jit decorates a kernel, i.e. when a kernel
# module is imported, so the switch must be on before any test imports sglite's kernels.
# It changes nothing else: every other test runs the torch path. With CUDA the kernels
# run for real; TRITON_INTERPRET=0 in the environment keeps them off.
if "TRITON_INTERPRET" not in os.environ:
    import torch

    if not torch.cuda.is_available():
        os.environ["TRITON_INTERPRET"] = "1"


# --dtype auto picks bfloat16 on CPUs with bfloat16 dot products and float32 elsewhere;
# the suite's exact expected outputs (transformers' float32 tokens, snapshots, worked
# examples) are float32's, so auto means float32 here on every CPU, in every process the
# tests start. The bfloat16 tests ask for it by name.
os.environ["SGLITE_CPU_DTYPE"] = "float32"


def pytest_collection_modifyitems(config, items):
    if os.environ.get("SGLITE_SKIP_REAL_MODEL") == "1":
        skip = pytest.mark.skip(reason="SGLITE_SKIP_REAL_MODEL=1")
        for item in items:
            if "real_model" in item.keywords:
                item.add_marker(skip)


def pytest_sessionstart(session):
    """Build the CPU kernels before any test (a first run compiles it for about
    a minute): no test pays for it, and the CLI tests' stderr carries no build message.
    A failed build is reported here; the CPU-kernel tests then fail with its reason."""
    from sglite.layers.cpu_ops import KernelBuildError, load_cpu_ops

    try:
        load_cpu_ops()
    except KernelBuildError as e:
        print(f"warning: {e}", flush=True)
