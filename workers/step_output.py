"""StepOutput: what one engine step produced, with its deltas built later, on whichever thread sends them.

A step's results are snapshotted on the step thread (each request's new token, its end, its logprobs
entry: what a later step could change) in a plain tuple per request; the ``TokenDelta`` objects are
built by ``deltas()``, which a worker calls on its detokenizer stage's thread.

NOTE: a tuple costs ~0.1 us on the step thread where a delta cost ~0.3 us: at 256 running the step's
thread CPU fell 0.55 -> 0.48 ms (bench.offline's host overhead, null forward), and the stage's rose
0.21 -> 0.31 ms. The stage shares the GIL: it runs while the step thread waits on a forward (a GPU
step), but with nothing to wait on (the null forward) the two serialize and the step's wall time rose
0.75 -> 0.82 ms. vLLM v1 builds its request outputs apart from the engine core's loop likewise (in
another process).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from cluster.protocol import FinishReason, TokenDelta, TokenLogprobs
from workers.request import Request

# (request, index of its new output token, that token, its end if it ended, its logprobs entry if asked)
StepItem = tuple[Request, int, int, FinishReason | None, TokenLogprobs | None]


@dataclass(slots=True)
class StepOutput:
    """One step's results (``items``, in the step's order); ``texts``: the new text of the requests the
    engine detokenized on the step thread (None: none), by request id.

    ``deltas()`` may run on another thread, after later steps: everything a later step could change is
    in the items; the rest is fixed once the request runs (its prefix-cache hit, when it was first
    scheduled), once it has its first token (its prompt logprobs: the first token's delta carries them)
    or once it ended (its error).
    """

    items: list[StepItem] = field(default_factory=list)
    texts: dict[str, str] | None = None

    def __len__(self) -> int:
        return len(self.items)

    def deltas(self) -> list[TokenDelta]:
        texts = self.texts
        # NOTE: positional, in TokenDelta's field order: half the cost of keywords
        return [
            TokenDelta(
                request.request_id,
                [token_id],
                "" if texts is None else texts.get(request.request_id, ""),
                None if logprobs is None else [logprobs],
                finish_reason,
                request.num_cached_tokens,
                None if finish_reason is None else request.error,
                None,
                request.first_scheduled_time if index == 0 else None,
                request.prompt_logprobs if index == 0 else None,
            )
            for request, index, token_id, finish_reason, logprobs in self.items
        ]

    def split(self, keep: list[bool]) -> tuple[StepOutput, StepOutput]:
        """(the items where `keep` is true, the others), each with the texts."""
        kept = [item for item, k in zip(self.items, keep, strict=True) if k]
        rest = [item for item, k in zip(self.items, keep, strict=True) if not k]
        return StepOutput(kept, self.texts), StepOutput(rest, self.texts)
