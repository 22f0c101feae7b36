"""OpenAI response shapes for pdserve's HTTP edge (no FastAPI here, no torch).

:class:`ChoiceBuilder` accumulates one choice's deltas and renders it as a stream chunk choice or a
full choice (as ``tool_calls`` when the request forced a tool call); ``usage``, ``envelope`` and
``sse_event`` complete the bodies. pdserve adds ``token_ids`` to every choice and ``pdserve_timings`` to
the chunk or choice that finishes one.

What a choice shows of its prompt (:class:`PromptView`) follows vLLM: ``echo`` puts the prompt's text
before the output's (in the first chunk when streaming), its tokens' logprobs before the output's (the
first token's null); ``prompt_logprobs`` is a list whose first entry is null and whose others map token-id
strings to ``{logprob, rank, decoded_token}``: on each choice (completions) or on the response (chat).
"""

from __future__ import annotations

import dataclasses
import json
import json.encoder
import uuid
from dataclasses import asdict, dataclass
from typing import Any

from cluster.http.output_constraints import ToolCalls
from cluster.http.planning import Plan
from cluster.http.tool_parsers import ToolParser, create_tool_parser
from cluster.protocol import FinishReason, RequestTimings, TokenDelta, TokenLogprobs
from cluster.tokenizer import Tokenizer

_json_str = json.encoder.encode_basestring_ascii  # NOTE: what json.dumps(str) runs (ensure_ascii)
MIN_LOGPROB = -9999.0  # NOTE: vLLM's (and OpenAI's) stand-in for -inf, which JSON cannot carry


@dataclass(frozen=True)
class PromptView:
    """What a choice shows of its prompt (``token_ids``): ``echo`` its text (None: not echoed), with its
    tokens' logprobs (top ``num_logprobs``) when logprobs are asked; ``echo_only``: the output is dropped
    (echo with max_tokens 0: the prompt alone, finish_reason "length"); ``prompt_logprobs``: render
    vLLM's ``prompt_logprobs`` with the top that many (None: not asked)."""

    token_ids: list[int]
    echo: str | None = None
    echo_only: bool = False
    num_logprobs: int = 0
    prompt_logprobs: int | None = None


def _prompt_view(plan: Plan, p: int) -> PromptView | None:
    if plan.echo is None and plan.prompt_logprobs is None:
        return None
    return PromptView(
        plan.prompts[p],
        None if plan.echo is None else plan.echo[p],
        plan.echo_only,
        plan.num_logprobs or 0,
        plan.prompt_logprobs,
    )


def choice_builders(plan: Plan, tokenizer: Tokenizer | None) -> dict[int, ChoiceBuilder]:
    """A builder per choice of ``plan`` (choice ``i`` answers prompt ``i // n``)."""
    n = len(plan.jobs) // len(plan.prompts)
    return {
        i: ChoiceBuilder(plan.kind, tokenizer, plan.logprobs, plan.tool_calls, _prompt_view(plan, i // n))
        for i, _ in plan.jobs
    }


class ChoiceBuilder:
    """One choice's output so far, and its OpenAI shapes (stream chunk choice or full choice).

    With ``tool_calls`` (chat with tool_choice "required" or a named function) the constrained output
    is rendered as ``tool_calls`` instead of ``content``: a named function's arguments stream as they
    come; a "required" list is parsed once complete and sent with the finishing chunk. With tool_choice
    "auto" the output is free text in which the server's tool-call parser finds the calls.
    """

    def __init__(
        self,
        kind: str,
        tokenizer: Tokenizer | None,
        want_logprobs: bool,
        tool_calls: ToolCalls | None = None,
        prompt: PromptView | None = None,
    ) -> None:
        self.kind, self.tokenizer, self.want_logprobs = kind, tokenizer, want_logprobs
        self.tool_mode = tool_calls
        self.tool_parser: ToolParser | None = (
            create_tool_parser(tool_calls.parser) if tool_calls is not None and tool_calls.parser else None
        )
        self.prompt = prompt
        self.prompt_entries: list[TokenLogprobs | None] | None = None  # from the first delta
        self._echo_pending = prompt is not None and prompt.echo is not None
        self._call_id: str | None = None
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: FinishReason | None = None
        self.timings: RequestTimings | None = None
        self.num_cached_tokens = 0
        self._text_offset = 0
        # NOTE: a chunk of such a choice is its text and token ids alone (SseChunks' fast path)
        self.is_plain = tool_calls is None and not want_logprobs and prompt is None

    @property
    def call_id(self) -> str:
        """The id of the choice's first tool call, made when first asked for (most choices call none)."""
        if self._call_id is None:
            self._call_id = f"call_{uuid.uuid4().hex[:24]}"
        return self._call_id

    def add(self, delta: TokenDelta) -> None:
        delta = self._shown(delta)
        if delta.prompt_logprobs is not None:
            self.prompt_entries = delta.prompt_logprobs
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.timings = delta.finish_reason, delta.timings

    def _shown(self, delta: TokenDelta) -> TokenDelta:
        """``delta`` as the client sees it: with ``echo_only`` its output is dropped (and it ends by length)."""
        if self.prompt is None or not self.prompt.echo_only:
            return delta
        finish = delta.finish_reason
        if finish in (FinishReason.STOP, FinishReason.LENGTH):
            finish = FinishReason.LENGTH
        return dataclasses.replace(delta, token_ids=[], text="", logprobs=None, finish_reason=finish)

    def _echo_rows(self) -> list[tuple[int, TokenLogprobs | None]]:
        """The echoed prompt's tokens with their logprobs entries (top ``num_logprobs``; None for the first
        token, or for all when the worker sent none)."""
        if self.prompt is None:
            return []
        entries = self.prompt_entries or []
        k = self.prompt.num_logprobs
        rows: list[tuple[int, TokenLogprobs | None]] = []
        for i, token_id in enumerate(self.prompt.token_ids):
            e = entries[i] if i < len(entries) else None
            if e is not None:
                tops = [max(lp, MIN_LOGPROB) for lp in e.top_logprobs[:k]]
                e = TokenLogprobs(e.token_id, max(e.logprob, MIN_LOGPROB), e.top_token_ids[:k], tops)
            rows.append((token_id, e))
        return rows

    def rendered_prompt_logprobs(self) -> list[dict[str, dict[str, Any]] | None] | None:
        """vLLM's ``prompt_logprobs`` (top ``PromptView.prompt_logprobs``); None when not asked.

        NOTE: a prompt token's own rank is known only when it is among the top entries the worker sent
        (``TokenLogprobs`` carries no rank): otherwise it is null."""
        if self.prompt is None or self.prompt.prompt_logprobs is None:
            return None
        k = self.prompt.prompt_logprobs
        rendered: list[dict[str, dict[str, Any]] | None] = []
        for e in self.prompt_entries or []:
            if e is None:
                rendered.append(None)
                continue
            rank = e.top_token_ids.index(e.token_id) + 1 if e.token_id in e.top_token_ids else None
            row = {str(e.token_id): self._logprob_entry(e.token_id, e.logprob, rank)}
            for r, (t, lp) in enumerate(zip(e.top_token_ids[:k], e.top_logprobs[:k], strict=True), start=1):
                row.setdefault(str(t), self._logprob_entry(t, lp, r))
            rendered.append(row)
        return rendered

    def _logprob_entry(self, token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
        return {"logprob": max(logprob, MIN_LOGPROB), "rank": rank, "decoded_token": self._token(token_id)}

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _format_logprobs(self, entries: list[TokenLogprobs], echoed: bool = False) -> dict[str, Any] | None:
        """The logprobs of ``entries`` (after the echoed prompt's when ``echoed``)."""
        if not self.want_logprobs:
            return None
        if self.kind == "chat":
            content = []
            for e in entries:
                tok = self._token(e.token_id)
                tops = [(self._token(t), lp) for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)]
                content.append(
                    {
                        "token": tok,
                        "logprob": e.logprob,
                        "bytes": list(tok.encode()),
                        "top_logprobs": [
                            {"token": s, "logprob": lp, "bytes": list(s.encode())} for s, lp in tops
                        ],
                    }
                )
            return {"content": content}
        out: dict[str, list[Any]] = {
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        }
        rows = self._echo_rows() if echoed else []
        rows += [(entry.token_id, entry) for entry in entries]
        for token_id, row in rows:
            tok = self._token(token_id)
            out["tokens"].append(tok)
            out["token_logprobs"].append(None if row is None else row.logprob)
            out["top_logprobs"].append(
                None
                if row is None
                else {self._token(t): lp for t, lp in zip(row.top_token_ids, row.top_logprobs, strict=True)}
            )
            out["text_offset"].append(self._text_offset)
            self._text_offset += len(tok)
        return out

    def _tail(
        self,
        choice: dict[str, Any],
        finish: FinishReason | None,
        timings: RequestTimings | None,
        has_calls: bool = False,
    ) -> None:
        reason = finish.value if finish is not None else None
        # NOTE: vLLM's: calls a parser found ("auto") make "tool_calls" of a length finish too
        ended = finish == FinishReason.STOP or (
            finish == FinishReason.LENGTH and self.tool_parser is not None
        )
        choice["finish_reason"] = "tool_calls" if has_calls and ended else reason
        if timings is not None:
            choice["pdserve_timings"] = asdict(timings)

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The complete output as OpenAI tool calls; None when it is not valid JSON of the right shape
        (cut short by max_tokens, say): then it is returned as content."""
        if self.tool_mode is None or self.tool_parser is not None:
            return None
        try:
            value = json.loads(self.text)
        except json.JSONDecodeError:
            return None
        if self.tool_mode.mode == "named":
            calls = [(self.tool_mode.name, self.text)] if isinstance(value, dict) else []
        else:
            items = value if isinstance(value, list) else []
            calls = [
                (item["name"], json.dumps(item["parameters"], ensure_ascii=False))
                for item in items
                if isinstance(item, dict) and isinstance(item.get("name"), str) and "parameters" in item
            ]
            if len(calls) != len(items):
                calls = []
        if not calls:
            return None
        return [
            {
                "id": self.call_id if i == 0 else f"{self.call_id}_{i}",
                "type": "function",
                "function": {"name": name, "arguments": arguments},
            }
            for i, (name, arguments) in enumerate(calls)
        ]

    def _chat_delta(self, delta: TokenDelta) -> tuple[dict[str, Any], bool]:
        """The chunk's ``delta`` object and whether it carries tool calls."""
        mode = self.tool_mode
        if mode is None:
            return {"content": delta.text}, False
        if self.tool_parser is not None:
            step = self.tool_parser.feed(delta.text, final=delta.finish_reason is not None)
            content = {"content": step.content} if step.content else {}
            tool_calls = {"tool_calls": step.tool_calls} if step.tool_calls else {}
            return {**content, **tool_calls}, self.tool_parser.num_calls > 0
        if mode.mode == "named":
            head = len(self.text) == len(delta.text)  # NOTE: this delta is the output's first text
            call: dict[str, Any] = {"index": 0, "function": {"arguments": delta.text}}
            if head:
                call = {
                    "index": 0,
                    "id": self.call_id,
                    "type": "function",
                    "function": {"name": mode.name, "arguments": delta.text},
                }
            return ({"tool_calls": [call]} if delta.text or head else {}), True
        if delta.finish_reason is None:
            return {}, False
        calls = self.tool_calls()
        if calls is None:
            return {"content": self.text}, False
        return {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]}, True

    def stream_choice(self, index: int, delta: TokenDelta) -> dict[str, Any]:
        delta = self._shown(delta)
        self.add(delta)
        body: dict[str, Any]
        has_calls = False
        echoed, self._echo_pending = self._echo_pending, False  # NOTE: the prompt goes with the first chunk
        if self.kind == "chat":
            chat_delta, has_calls = self._chat_delta(delta)
            body = {"index": index, "delta": chat_delta}
        else:
            echo = self.prompt.echo if echoed and self.prompt is not None else None
            body = {"index": index, "text": (echo or "") + delta.text}
        body["logprobs"] = self._format_logprobs(delta.logprobs or [], echoed)
        body["token_ids"] = list(delta.token_ids)
        if self.tool_mode is not None and self.tool_mode.mode == "named" and delta.finish_reason is not None:
            has_calls = self.tool_calls() is not None
        self._tail(body, delta.finish_reason, delta.timings, has_calls)
        return body

    def full_choice(self, index: int) -> dict[str, Any]:
        body: dict[str, Any]
        calls = self.tool_calls() if self.kind == "chat" else None
        content = None
        if self.tool_parser is not None:  # tool_choice "auto": the calls the parser finds in the text
            content, found = self.tool_parser.extract(self.text)
            calls = found or None
        if calls is not None:
            body = {"index": index, "message": {"role": "assistant", "content": content, "tool_calls": calls}}
        elif self.kind == "chat":
            body = {"index": index, "message": {"role": "assistant", "content": self.text}}
        else:
            echo = self.prompt.echo if self.prompt is not None else None
            body = {"index": index, "text": (echo or "") + self.text}
        body["logprobs"] = self._format_logprobs(self.logprobs, self._echo_pending)
        body["token_ids"] = self.token_ids
        if self.kind == "completion" and self.prompt is not None and self.prompt.prompt_logprobs is not None:
            body["prompt_logprobs"] = self.rendered_prompt_logprobs()
        self._tail(body, self.finish_reason, self.timings, calls is not None)
        return body


def usage(plan: Plan, choices: dict[int, ChoiceBuilder]) -> dict[str, Any]:
    n = len(plan.jobs) // len(plan.prompts)
    completion = sum(len(c.token_ids) for c in choices.values())
    prompt = sum(len(p) for p in plan.prompts)
    cached = sum(
        max(choices[p * n + j].num_cached_tokens for j in range(n)) for p in range(len(plan.prompts))
    )
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


def response_prompt_logprobs(plan: Plan, choices: dict[int, ChoiceBuilder]) -> dict[str, Any]:
    """Chat's ``prompt_logprobs`` field, on the response as vLLM puts it ({} when not asked)."""
    if plan.kind != "chat" or plan.prompt_logprobs is None:
        return {}
    return {"prompt_logprobs": choices[min(choices)].rendered_prompt_logprobs()}


def envelope(plan: Plan, *, chunk: bool) -> dict[str, Any]:
    obj = (
        ("chat.completion.chunk" if chunk else "chat.completion")
        if plan.kind == "chat"
        else "text_completion"
    )
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class SseChunks:
    """A streamed plan's chunk events: ``chunk(index, delta)`` is byte for byte
    ``sse_event({**envelope(plan, chunk=True), "choices": [choice.stream_choice(index, delta)], **usage})``
    (``usage``: ``{"usage": None}`` when the plan includes usage) and updates the choice the same way.

    NOTE: the hot path of the edge (a chunk per token per stream): a plain choice's chunk that does not
    finish it is the envelope's precomputed bytes around its text (escaped by the json module's own C
    escaper, as ``json.dumps`` does) and token ids, without a dict or an encoder per chunk."""

    def __init__(self, plan: Plan, choices: dict[int, ChoiceBuilder]) -> None:
        self.choices = choices
        self.envelope = envelope(plan, chunk=True)
        self.usage: dict[str, Any] = {"usage": None} if plan.include_usage else {}
        head = json.dumps(self.envelope, separators=(",", ":"))[:-1]  # without its closing brace
        self._head = f'data: {head},"choices":[{{"index":'
        is_chat = plan.kind == "chat"
        self._text_key = ',"delta":{"content":' if is_chat else ',"text":'
        self._ids_key = ("}," if is_chat else ",") + '"logprobs":null,"token_ids":['
        self._tail = '],"finish_reason":null}]' + (',"usage":null}' if plan.include_usage else "}") + "\n\n"

    def is_plain(self, index: int, delta: TokenDelta) -> bool:
        """Whether ``delta``'s chunk is a plain one (rendered without the general path)."""
        return self.choices[index].is_plain and delta.finish_reason is None and delta.timings is None

    def chunk(self, index: int, delta: TokenDelta) -> bytes:
        choice = self.choices[index]
        if choice.is_plain and delta.finish_reason is None and delta.timings is None:
            choice.add(delta)
            ids = delta.token_ids
            return (
                f"{self._head}{index}{self._text_key}{_json_str(delta.text)}{self._ids_key}"
                f"{ids[0] if len(ids) == 1 else ','.join(map(str, ids))}{self._tail}"
            ).encode()
        return sse_event({**self.envelope, "choices": [choice.stream_choice(index, delta)], **self.usage})
