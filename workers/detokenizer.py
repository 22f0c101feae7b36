"""Incremental detokenization with stop strings, one instance per request.

Decoding the whole output again after every token costs O(length) per token. Instead we decode a short
window: ``ids[prefix_offset:read_offset]`` is text already emitted (kept only as context, since many
decoders render a token differently at the start of a string), and ``ids[prefix_offset:]`` adds the new
tokens. The difference between the two decodes is the new text. When it ends in U+FFFD the last token
ended inside a multi-byte character, so we emit nothing and wait for the bytes that complete it.

With ``skip_special_tokens`` the special tokens never enter the window: they render as nothing, and a run
of them (a model repeating ``<|im_start|>``) would otherwise widen the window by one token a step, every
step decoding it all again.

The request's text options follow vLLM's detokenizer: the token that ends a request (EOS, a stop token
id) is not rendered unless ``include_stop_str_in_output``, which also keeps a matched stop string (the
text then ends where the stop string ends); stop strings are looked for only once more than
``min_tokens`` tokens are out.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from cluster.protocol import FinishReason, SamplingParams, TokenDelta
from cluster.tokenizer import Tokenizer
from workers.step_output import StepOutput

# NOTE: the first output tokens are decoded with a few prompt tokens in front of them so a leading
# space or a character split across the prompt/output boundary renders as it does in the full text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated ids into text as they arrive and watches for stop strings.

    ``update`` appends ids and returns the stop string it matched (None if none); on a match
    ``output_text`` is cut just before the stop string (just after it with
    ``include_stop_str_in_output``) and later updates do nothing. ``stop_terminated``: the last id
    ended the request (EOS, a stop token id); it is left out of the text unless
    ``include_stop_str_in_output``. ``get_delta`` returns the text not yet handed out, holding back the
    last ``len(longest stop) - 1`` characters until ``finished`` (or a stop matched), so a streaming
    client never sees part of a stop string that is later trimmed (nothing is trimmed, so nothing is
    held back, when the stop string stays in the text).
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
        include_stop_str_in_output: bool = False,
        min_tokens: int = 0,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self.min_tokens = min_tokens
        self.stop = [s for s in stop if s]
        longest = max((len(s) for s in self.stop), default=1)
        self._holdback = 0 if include_stop_str_in_output else longest - 1
        self._num_generated = 0  # every generated id, the skipped ones included (min_tokens counts them)
        self._skipped = tokenizer.special_token_ids if skip_special_tokens else frozenset()
        # Only the prompt's tail is kept: the window never reaches further back than this.
        context = self._rendered(prompt_token_ids)[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self.stop_matched: str | None = None
        self._num_returned = 0

    @classmethod
    def for_request(
        cls, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams
    ) -> IncrementalDetokenizer:
        """The detokenizer of a request: its stop strings and text options (the one place they are read)."""
        return cls(
            tokenizer,
            prompt_token_ids,
            params.stop,
            params.skip_special_tokens,
            params.include_stop_str_in_output,
            params.min_tokens,
        )

    @property
    def output_token_ids(self) -> list[int]:
        """The generated ids that render (special ones left out when they are skipped)."""
        return self._token_ids[self._num_context :]

    def _rendered(self, token_ids: list[int]) -> list[int]:
        skipped = self._skipped
        if not skipped or skipped.isdisjoint(token_ids):
            return token_ids
        return [t for t in token_ids if t not in skipped]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Append generated ids; return the stop string now found in the output, else None."""
        windows = self._extend(new_token_ids, stop_terminated)
        if windows is None:
            return None
        return self._take(self._decode(windows[0]), self._decode(windows[1]))

    def _extend(
        self, new_token_ids: list[int], stop_terminated: bool = False
    ) -> tuple[list[int], list[int]] | None:
        """Append generated ids; the two windows ``_take`` wants decoded (None: nothing to decode)."""
        if self.stop_matched is not None:
            return None
        self._num_generated += len(new_token_ids)
        if stop_terminated and not self.include_stop_str_in_output and new_token_ids:
            new_token_ids = new_token_ids[:-1]  # NOTE: vLLM's: the ending token is not text
        new_token_ids = self._rendered(new_token_ids)
        if not new_token_ids:
            return None
        ids = self._token_ids
        ids.extend(new_token_ids)
        return ids[self._prefix_offset : self._read_offset], ids[self._prefix_offset :]

    def _take(self, prefix_text: str, full_text: str) -> str | None:
        """The rest of ``update``, given its two windows' text."""
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return None  # nothing printable yet, or a character is still incomplete
        old_len = len(self.output_text)
        self.output_text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if self.stop and self._num_generated > self.min_tokens:
            return self._find_stop(old_len)
        return None

    def _find_stop(self, old_len: int) -> str | None:
        # A stop string may begin up to len(stop) - 1 characters before the new text.
        best: tuple[int, str] | None = None
        for stop in self.stop:
            idx = self.output_text.find(stop, max(0, old_len - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        end = best[0] + len(best[1]) if self.include_stop_str_in_output else best[0]
        self.output_text = self.output_text[:end]
        self.stop_matched = best[1]
        return best[1]

    def get_delta(self, finished: bool) -> str:
        """Text not returned before; while unfinished, the last len(longest stop) - 1 chars wait."""
        end = len(self.output_text)
        if not finished and self.stop_matched is None:
            end = max(end - self._holdback, self._num_returned)
        delta = self.output_text[self._num_returned : end]
        self._num_returned = end
        return delta


def update_all(
    tokenizer: Tokenizer,
    detokenizers: Sequence[IncrementalDetokenizer],
    new_token_ids: Sequence[list[int]],
    stop_terminated: Sequence[bool] | None = None,
) -> list[str | None]:
    """``detokenizers[i].update(new_token_ids[i], stop_terminated[i])`` for every i, with every window
    decoded by one call to the tokenizer: the same results and state as updating one by one
    (``detokenizers`` are distinct).

    NOTE: the tokenizer's batch decode releases the GIL while it decodes (its single decode does not),
    so the step thread of the process runs meanwhile; it also costs less per window (~1 us against
    ~1.4 us on the 2-core box, bundled tokenizer)."""
    results: list[str | None] = [None] * len(detokenizers)
    pending: dict[bool, tuple[list[int], list[list[int]]]] = {}
    for i, (detok, ids) in enumerate(zip(detokenizers, new_token_ids, strict=True)):
        windows = detok._extend(ids, stop_terminated is not None and stop_terminated[i])
        if windows is not None:
            owners, flat = pending.setdefault(detok.skip_special_tokens, ([], []))
            owners.append(i)
            flat += windows
    for skip, (owners, flat) in pending.items():
        texts = tokenizer.decode_batch(flat, skip_special_tokens=skip)
        for j, i in enumerate(owners):
            results[i] = detokenizers[i]._take(texts[2 * j], texts[2 * j + 1])
    return results


def detokenizes_on_step_thread(params: SamplingParams, hold_after_prefill: bool) -> bool:
    """Whether a request's text is produced by the engine even when detokenization runs elsewhere.

    Stop strings decide when a request ends, so their matching stays where the decision is taken (the
    step thread): such a request ends on exactly the token it ends on when everything is detokenized
    inline. A prefill worker's held request sends its one token's text with the handoff.
    """
    return hold_after_prefill or any(params.stop)


class DetokenizerStage:
    """Produces the text of the engine's token deltas on its own thread (``thread``), in order.

    The step thread calls ``add_request`` when it adds a request to the engine (with the tokens already
    streamed, for a resumed one), ``submit`` with each step's deltas, and ``drop`` when a request ends
    without a final delta (abort); everything is queued, so the step thread never decodes. The stage
    fills in ``delta.text`` of the requests it owns (those ``detokenizes_on_step_thread`` leaves to it)
    and hands every delta, in submission order, to ``emit`` on its thread; other requests' deltas pass
    through as they are. ``call(fn)`` runs ``fn`` on the stage after everything queued before it, for
    messages that must stay ordered with the deltas. A request's detokenizer lives from ``add_request``
    until its final delta or ``drop``. An error on the stage thread is raised again by ``flush``.
    """

    def __init__(self, tokenizer: Tokenizer, emit: Callable[[list[TokenDelta]], None], name: str) -> None:
        self.tokenizer = tokenizer
        self._emit = emit
        self._queue: queue.SimpleQueue[tuple[Any, ...]] = queue.SimpleQueue()
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.busy_time_s = 0.0  # CPU time the stage thread spent producing text
        # NOTE: monotonic time the item in hand was taken (None: waiting): a watchdog's view of a hang
        self.busy_since: float | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    # ---- step thread ---------------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        hold_after_prefill: bool = False,
        output_token_ids: list[int] | None = None,
    ) -> None:
        if not detokenizes_on_step_thread(params, hold_after_prefill):
            self._queue.put(("add", request_id, prompt_token_ids, params, output_token_ids))

    def submit(self, deltas: list[TokenDelta] | StepOutput) -> None:
        """Deltas, or a step's output whose deltas the stage builds (``StepOutput.deltas()``)."""
        if deltas:
            self._queue.put(("deltas", deltas))

    def drop(self, request_id: str) -> None:
        self._queue.put(("drop", request_id))

    def call(self, fn: Callable[[], None]) -> None:
        self._queue.put(("call", fn))

    def flush(self, timeout_s: float) -> None:
        """Wait until everything queued so far went through ``emit``; raise the stage's error if any."""
        done = threading.Event()
        self._queue.put(("call", done.set))
        if not done.wait(timeout_s) and self.error is None:
            raise TimeoutError(f"detokenizer stage did not drain in {timeout_s} s")
        if self.error is not None:
            raise RuntimeError("detokenizer stage failed") from self.error

    def close(self, timeout_s: float) -> None:
        """Stop the thread after what is queued; per-request state left behind is discarded."""
        self._queue.put(("stop",))
        self.thread.join(timeout_s)

    @property
    def num_requests(self) -> int:
        return len(self._detokenizers)

    # ---- stage thread --------------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            item = self._queue.get()
            self.busy_since = time.monotonic()
            kind = item[0]
            if kind == "stop":
                return
            if self.error is not None:
                if kind == "call":
                    item[1]()  # NOTE: keep waking flushers so they see the error
                continue
            try:
                self._handle(item)
            except BaseException as e:  # noqa: BLE001 - kept and raised again on the step thread
                self.error = e
            finally:
                self.busy_since = None

    def _handle(self, item: tuple[Any, ...]) -> None:
        kind = item[0]
        if kind == "deltas":
            t0 = time.thread_time()
            deltas = item[1] if isinstance(item[1], list) else item[1].deltas()
            self._detokenize(deltas)
            self.busy_time_s += time.thread_time() - t0
            self._emit(deltas)
        elif kind == "add":
            _, request_id, prompt_token_ids, params, output_token_ids = item
            detok = IncrementalDetokenizer.for_request(self.tokenizer, prompt_token_ids, params)
            if output_token_ids:
                detok.update(output_token_ids)
                detok.get_delta(finished=False)  # that text was streamed before (a resumed request)
            self._detokenizers[request_id] = detok
        elif kind == "drop":
            self._detokenizers.pop(item[1], None)
        elif kind == "call":
            item[1]()
        else:
            raise RuntimeError(f"detokenizer stage: unknown item {kind!r}")

    def _detokenize(self, deltas: list[TokenDelta]) -> None:
        detokenizers = self._detokenizers
        owned = [(d, detok) for d in deltas if (detok := detokenizers.get(d.request_id)) is not None]
        # NOTE: this thread shares the GIL with the step thread, which waits for it after each torch op.
        # The batched decode lets go of the GIL while it decodes, so the stage holds it only for short
        # Python passes (~0.2 ms at 256 deltas). Handing it over more often (time.sleep(0) every 16
        # deltas, as before batching) cost the stage 20 us of CPU each and bought the step thread
        # nothing measurable (bench.offline's host overhead at 256 running).
        # NOTE: a request owned here has no stop strings, so a STOP is its stop token (EOS, a stop id)
        ended = [d.finish_reason is FinishReason.STOP for d, _ in owned]
        batched = len({id(detok) for _, detok in owned}) == len(owned)
        if batched:
            update_all(self.tokenizer, [detok for _, detok in owned], [d.token_ids for d, _ in owned], ended)
        for (delta, detok), stop_terminated in zip(owned, ended, strict=True):
            if not batched:  # two deltas of one request: each update, then its text, in order
                detok.update(delta.token_ids, stop_terminated)
            finished = delta.finish_reason is not None
            delta.text = detok.get_delta(finished=finished)
            if finished:
                del detokenizers[delta.request_id]
