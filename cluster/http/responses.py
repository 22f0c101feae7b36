"""OpenAI response shapes for pdserve's HTTP edge (no FastAPI here, no torch).

:class:`ChoiceBuilder` accumulates one choice's deltas and renders it as a stream chunk choice or a
full choice (as ``tool_calls`` when the request forced a tool call); ``usage``, ``envelope`` and
``sse_event`` complete the bodies. pdserve adds ``token_ids`` to every choice and ``pdserve_timings`` to
the chunk or choice that finishes one.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict
from typing import Any

from cluster.http.output_constraints import ToolCalls
from cluster.http.planning import Plan
from cluster.protocol import FinishReason, RequestTimings, TokenDelta, TokenLogprobs
from cluster.tokenizer import Tokenizer


class ChoiceBuilder:
    """One choice's output so far, and its OpenAI shapes (stream chunk choice or full choice).

    With ``tool_calls`` (chat with tool_choice "required" or a named function) the constrained output
    is rendered as ``tool_calls`` instead of ``content``: a named function's arguments stream as they
    come; a "required" list is parsed once complete and sent with the finishing chunk.
    """

    def __init__(
        self, kind: str, tokenizer: Tokenizer | None, want_logprobs: bool, tool_calls: ToolCalls | None = None
    ) -> None:
        self.kind, self.tokenizer, self.want_logprobs = kind, tokenizer, want_logprobs
        self.tool_mode = tool_calls
        self.call_id = f"call_{uuid.uuid4().hex[:24]}"
        self.text = ""
        self.token_ids: list[int] = []
        self.logprobs: list[TokenLogprobs] = []
        self.finish_reason: FinishReason | None = None
        self.timings: RequestTimings | None = None
        self.num_cached_tokens = 0
        self._text_offset = 0

    def add(self, delta: TokenDelta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.num_cached_tokens = delta.num_cached_tokens
        if delta.finish_reason is not None:
            self.finish_reason, self.timings = delta.finish_reason, delta.timings

    def _token(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _format_logprobs(self, entries: list[TokenLogprobs]) -> dict[str, Any] | None:
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
        for e in entries:
            tok = self._token(e.token_id)
            out["tokens"].append(tok)
            out["token_logprobs"].append(e.logprob)
            out["top_logprobs"].append(
                {self._token(t): lp for t, lp in zip(e.top_token_ids, e.top_logprobs, strict=True)}
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
        choice["finish_reason"] = "tool_calls" if has_calls and finish == FinishReason.STOP else reason
        if timings is not None:
            choice["pdserve_timings"] = asdict(timings)

    def tool_calls(self) -> list[dict[str, Any]] | None:
        """The complete output as OpenAI tool calls; None when it is not valid JSON of the right shape
        (cut short by max_tokens, say): then it is returned as content."""
        if self.tool_mode is None:
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
        self.add(delta)
        body: dict[str, Any]
        has_calls = False
        if self.kind == "chat":
            chat_delta, has_calls = self._chat_delta(delta)
            body = {"index": index, "delta": chat_delta}
        else:
            body = {"index": index, "text": delta.text}
        body["logprobs"] = self._format_logprobs(delta.logprobs or [])
        body["token_ids"] = list(delta.token_ids)
        if self.tool_mode is not None and self.tool_mode.mode == "named" and delta.finish_reason is not None:
            has_calls = self.tool_calls() is not None
        self._tail(body, delta.finish_reason, delta.timings, has_calls)
        return body

    def full_choice(self, index: int) -> dict[str, Any]:
        body: dict[str, Any]
        calls = self.tool_calls() if self.kind == "chat" else None
        if calls is not None:
            body = {"index": index, "message": {"role": "assistant", "content": None, "tool_calls": calls}}
        elif self.kind == "chat":
            body = {"index": index, "message": {"role": "assistant", "content": self.text}}
        else:
            body = {"index": index, "text": self.text}
        body["logprobs"] = self._format_logprobs(self.logprobs)
        body["token_ids"] = self.token_ids
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


def envelope(plan: Plan, *, chunk: bool) -> dict[str, Any]:
    obj = (
        ("chat.completion.chunk" if chunk else "chat.completion")
        if plan.kind == "chat"
        else "text_completion"
    )
    return {"id": plan.id, "object": obj, "created": plan.created, "model": plan.model}


def sse_event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"
