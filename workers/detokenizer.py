"""Incremental detokenization with stop strings, one instance per request.

Decoding the whole output again after every token costs O(length) per token. Instead we decode a short
window: ``ids[prefix_offset:read_offset]`` is text already emitted (kept only as context, since many
decoders render a token differently at the start of a string), and ``ids[prefix_offset:]`` adds the new
tokens. The difference between the two decodes is the new text. When it ends in U+FFFD the last token
ended inside a multi-byte character, so we emit nothing and wait for the bytes that complete it.
"""

from __future__ import annotations

from cluster.tokenizer import Tokenizer

# NOTE: the first output tokens are decoded with a few prompt tokens in front of them so a leading
# space or a character split across the prompt/output boundary renders as it does in the full text.
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    """Turns a request's generated ids into text as they arrive and watches for stop strings.

    ``update`` appends ids and returns the stop string it matched (None if none); on a match
    ``output_text`` is cut just before the stop string and later updates do nothing. ``get_delta``
    returns the text not yet handed out, holding back the last ``len(longest stop) - 1`` characters
    until ``finished`` (or a stop matched), so a streaming client never sees part of a stop string that
    is later trimmed.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: list[int],
        stop: list[str],
        skip_special_tokens: bool = True,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = [s for s in stop if s]
        self._holdback = max((len(s) for s in self.stop), default=1) - 1
        # Only the prompt's tail is kept: the window never reaches further back than this.
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._num_context = len(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_text = ""
        self.stop_matched: str | None = None
        self._num_returned = 0

    @property
    def output_token_ids(self) -> list[int]:
        return self._token_ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Append generated ids; return the stop string now found in the output, else None."""
        if self.stop_matched is not None or not new_token_ids:
            return None
        self._token_ids.extend(new_token_ids)
        prefix_text = self._decode(self._token_ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._token_ids[self._prefix_offset :])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return None  # nothing printable yet, or a character is still incomplete
        old_len = len(self.output_text)
        self.output_text += full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        if self.stop:
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
        self.output_text = self.output_text[: best[0]]
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
