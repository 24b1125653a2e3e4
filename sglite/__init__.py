"""sglite: a small SGLang-style inference engine built to be watched."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["Engine", "SamplingParams", "ServerArgs"]

if TYPE_CHECKING:
    from sglite.engine import Engine
    from sglite.sampling.sampling_params import SamplingParams
    from sglite.server_args import ServerArgs


def __getattr__(name: str) -> Any:
    # lazy, so `import sglite.events` does not pull in torch
    if name == "Engine":
        from sglite.engine import Engine

        return Engine
    if name == "SamplingParams":
        from sglite.sampling.sampling_params import SamplingParams

        return SamplingParams
    if name == "ServerArgs":
        from sglite.server_args import ServerArgs

        return ServerArgs
    raise AttributeError(name)
