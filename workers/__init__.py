"""pdserve data plane: the paged-KV engine, its offline API and (later) the Ray worker actors."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from cluster.protocol import RequestOutput, SamplingParams

if TYPE_CHECKING:
    from workers.engine import Engine
    from workers.llm import LLM

__all__ = ["LLM", "Engine", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # NOTE: lazy so `import workers` (e.g. for SamplingParams) does not pull torch in.
    if name == "LLM":
        from workers.llm import LLM

        return LLM
    if name == "Engine":
        from workers.engine import Engine

        return Engine
    raise AttributeError(name)
