"""pdserve SDK: ``Client`` / ``AsyncClient`` over httpx (no torch, no ray).

Results are shaped like the ``openai`` package's (``out.choices[0].text``,
``out.choices[0].message.content``, ``out.usage.prompt_tokens``) and errors are typed like its
(``BadRequestError``, ``AuthenticationError``, ``NotFoundError``, ``RateLimitError``,
``InternalServerError``, ``APITimeoutError``, ``APIConnectionError``, all ``APIError``). What the SDK
adds: the token ids of every choice and chunk, the server's per-request timing split, and client-side
TTFT / TBT / e2e for streams. ``base_url`` and ``api_key`` default to ``PDSERVE_BASE_URL`` /
``PDSERVE_API_KEY`` (else ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``, else http://127.0.0.1:8000).

    client = Client()                        # or Client("http://127.0.0.1:8000", api_key=...)
    out = client.completions.create(prompt="Once upon a time", max_tokens=32)
    print(out.choices[0].text, out.token_ids, out.usage, out.timings)
    stream = client.chat.completions.create(messages=[{"role": "user", "content": "hi"}], stream=True)
    for delta in stream:                     # StreamDelta(text, token_ids, arrival_time, index, ...)
        print(delta.text, end="")
    print(stream.result.ttft_s, stream.result.tbt_s, stream.result.timings)

Besides OpenAI's fields the server sends ``token_ids`` on every choice and ``pdserve_timings`` (the
router's queue/prefill/transfer/decode split) on the chunk or choice that finishes a choice.

Retries (``max_retries``) happen only before the first byte of a response: a failed connect, or a 429 /
503 status line. Once a 200 arrived nothing is retried: a stream that fails midway raises ``APIError``.
Times are ``time.perf_counter()`` seconds.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal, overload

import httpx

from cluster.client.types import (
    DEFAULT_BASE_URL,
    APIConnectionError,
    APIError,
    APIStatusError,
    APITimeoutError,
    AuthenticationError,
    BadRequestError,
    Choice,
    ChunkChoice,
    ChunkDelta,
    InternalServerError,
    Message,
    NotFoundError,
    RateLimitError,
    Result,
    ServerRoute,
    ServerTimings,
    StreamDelta,
    StreamResult,
    ToolCall,
    ToolCallFunction,
    Usage,
    error_class,
)

__all__ = [
    "APIConnectionError",
    "APIError",
    "APIStatusError",
    "APITimeoutError",
    "AsyncClient",
    "AsyncStream",
    "AuthenticationError",
    "BadRequestError",
    "Choice",
    "ChunkChoice",
    "ChunkDelta",
    "Client",
    "InternalServerError",
    "Message",
    "NotFoundError",
    "RateLimitError",
    "Result",
    "ServerRoute",
    "ServerTimings",
    "Stream",
    "StreamDelta",
    "StreamResult",
    "ToolCall",
    "ToolCallFunction",
    "Usage",
    "error_class",
]

RETRY_STATUSES = (429, 503)


class _StreamState:
    """Parses SSE lines into StreamDeltas and accumulates one StreamResult per choice."""

    def __init__(self, start_time: float) -> None:
        self.start_time = start_time
        self.results: dict[int, StreamResult] = {}
        self.usage: Usage | None = None
        self.done = False

    def feed(self, line: str) -> list[StreamDelta]:
        if not line.startswith("data:"):
            return []  # blank separators and ": keep-alive" comments
        data = line[5:].strip()
        now = time.perf_counter()
        if data == "[DONE]":
            self.done = True
            for r in self.results.values():
                r.end_time = r.end_time or now
            return []
        chunk = json.loads(data)
        if "error" in chunk:
            e = chunk["error"]
            raise APIError(
                None, e.get("message", "stream failed"), e.get("type"), e.get("code"), e.get("param")
            )
        if chunk.get("usage"):
            self.usage = Usage.from_dict(chunk["usage"])
        deltas = []
        for c in chunk.get("choices") or []:
            index = int(c.get("index", 0))
            r = self.results.setdefault(index, StreamResult(index, self.start_time))
            text = c["text"] if "text" in c else (c.get("delta") or {}).get("content") or ""
            tool_calls = (c.get("delta") or {}).get("tool_calls")
            ids = list(c.get("token_ids") or [])
            if text or ids:
                if r.last_token_time is None:
                    r.first_token_time = now
                else:
                    r.tbt_s.append(now - r.last_token_time)
                r.last_token_time = now
                r.text += text
                r.token_ids += ids
            if c.get("finish_reason") is not None:
                r.finish_reason, r.end_time = c["finish_reason"], now
                r.timings = ServerTimings.from_dict(c.get("pdserve_timings"))
            if text or ids or tool_calls or c.get("finish_reason") is not None:
                deltas.append(StreamDelta(text, ids, now, index, c.get("finish_reason"), tool_calls))
        return deltas

    def result(self, index: int = 0) -> StreamResult:
        r = self.results.get(index) or StreamResult(index, self.start_time)
        r.usage = self.usage
        return r


def _parse_result(body: dict[str, Any], latency_s: float) -> Result:
    choices = []
    for c in body.get("choices", []):
        message = _parse_message(c["message"]) if isinstance(c.get("message"), dict) else None
        content = message.content if message is not None else None
        text = c.get("text", content or "")
        choices.append(
            Choice(
                int(c.get("index", 0)),
                text,
                c.get("token_ids"),
                c.get("finish_reason"),
                ServerTimings.from_dict(c.get("pdserve_timings")),
                c.get("logprobs"),
                message,
            )
        )
    usage = Usage.from_dict(body["usage"]) if body.get("usage") else None
    return Result(body.get("id", ""), body.get("model", ""), choices, usage, latency_s, body)


def _parse_message(m: dict[str, Any]) -> Message:
    calls = [
        ToolCall(c.get("id", ""), ToolCallFunction(c["function"]["name"], c["function"]["arguments"]))
        for c in m.get("tool_calls") or []
    ]
    return Message(m.get("role", "assistant"), m.get("content"), calls or None)


def _error_from(response: httpx.Response) -> APIStatusError:
    cls = error_class(response.status_code)
    try:
        e = response.json()["error"]
        return cls(response.status_code, e["message"], e.get("type"), e.get("code"), e.get("param"))
    except (ValueError, KeyError, TypeError):
        return cls(response.status_code, response.text[:500])


def _payload(body: dict[str, Any], stream: bool) -> dict[str, Any]:
    return {**{k: v for k, v in body.items() if v is not None}, "stream": stream}


def _backoff_s(attempt: int, base_s: float, response: httpx.Response | None) -> float:
    header = response.headers.get("retry-after") if response is not None else None
    if header is not None and header.replace(".", "", 1).isdigit():
        return min(float(header), 10.0)
    return base_s * 2**attempt


def _http_kwargs(
    base_url: str | None, api_key: str | None, timeout: float, connect_timeout: float
) -> dict[str, Any]:
    if base_url is None:
        base_url = os.environ.get("PDSERVE_BASE_URL") or os.environ.get("OPENAI_BASE_URL") or DEFAULT_BASE_URL
    if api_key is None:
        api_key = os.environ.get("PDSERVE_API_KEY") or os.environ.get("OPENAI_API_KEY")
    base = base_url.rstrip("/")
    base = base[:-3] if base.endswith("/v1") else base
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return {"base_url": base, "headers": headers, "timeout": httpx.Timeout(timeout, connect=connect_timeout)}


class Stream:
    """Iterator of StreamDeltas; ``result`` (choice 0) and ``results`` are complete after iteration."""

    def __init__(self, response: httpx.Response, state: _StreamState) -> None:
        self._response, self._state = response, state

    def __iter__(self) -> Iterator[StreamDelta]:
        try:
            for line in self._response.iter_lines():
                yield from self._state.feed(line)
                if self._state.done:
                    break
        except httpx.TimeoutException as e:
            raise APITimeoutError(f"no chunk within the timeout: {e!r}") from e
        except httpx.HTTPError as e:
            raise APIConnectionError(f"stream broke: {e!r}") from e
        finally:
            self._response.close()

    def close(self) -> None:
        self._response.close()

    @property
    def result(self) -> StreamResult:
        return self._state.result(0)

    @property
    def results(self) -> dict[int, StreamResult]:
        return {i: self._state.result(i) for i in self._state.results}


class AsyncStream:
    """Async iterator of StreamDeltas; ``result`` (choice 0) and ``results`` are complete after iteration."""

    def __init__(self, response: httpx.Response, state: _StreamState) -> None:
        self._response, self._state = response, state

    async def __aiter__(self) -> AsyncIterator[StreamDelta]:
        try:
            async for line in self._response.aiter_lines():
                for delta in self._state.feed(line):
                    yield delta
                if self._state.done:
                    break
        except httpx.TimeoutException as e:
            raise APITimeoutError(f"no chunk within the timeout: {e!r}") from e
        except httpx.HTTPError as e:
            raise APIConnectionError(f"stream broke: {e!r}") from e
        finally:
            await self._response.aclose()

    async def aclose(self) -> None:
        await self._response.aclose()

    @property
    def result(self) -> StreamResult:
        return self._state.result(0)

    @property
    def results(self) -> dict[int, StreamResult]:
        return {i: self._state.result(i) for i in self._state.results}


class Client:
    """Blocking client. ``timeout`` bounds each read (for streams: the gap between chunks)."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        *,
        connect_timeout: float = 10.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.25,
    ) -> None:
        self._http = httpx.Client(**_http_kwargs(base_url, api_key, timeout, connect_timeout))
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.completions = _Completions(self, "/v1/completions")
        self.chat = _Chat(_Completions(self, "/v1/chat/completions"))

    def _send(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        """POST and return a response with a 2xx status line and an unread body (caller closes it)."""
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                response = self._http.send(self._http.build_request("POST", path, json=payload), stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"cannot connect to {self._http.base_url}: {e!r}") from e
            except httpx.TimeoutException as e:
                raise APITimeoutError(f"no answer from {self._http.base_url} in time: {e!r}") from e
            if response is not None:
                if response.status_code < 400:
                    return response
                response.read()
                response.close()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise _error_from(response)
            time.sleep(_backoff_s(attempt, self.retry_backoff_s, response))
        raise AssertionError("unreachable")

    def _create(self, path: str, stream: bool, body: dict[str, Any]) -> Result | Stream:
        start = time.perf_counter()
        response = self._send(path, _payload(body, stream))
        if stream:
            return Stream(response, _StreamState(start))
        try:
            data = json.loads(response.read())
        except httpx.TimeoutException as e:
            raise APITimeoutError(f"no answer within the timeout: {e!r}") from e
        finally:
            response.close()
        return _parse_result(data, time.perf_counter() - start)

    def models(self) -> list[dict[str, Any]]:
        response = self._http.get("/v1/models")
        if response.status_code >= 400:
            raise _error_from(response)
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Completions:
    def __init__(self, client: Client, path: str) -> None:
        self._client, self._path = client, path

    @overload
    def create(self, *, stream: Literal[False] = False, **body: Any) -> Result: ...
    @overload
    def create(self, *, stream: Literal[True], **body: Any) -> Stream: ...
    def create(self, *, stream: bool = False, **body: Any) -> Result | Stream:
        """POST the OpenAI body (prompt= or messages=, max_tokens=, ...); model may be left out."""
        return self._client._create(self._path, stream, body)


class _Chat:
    def __init__(self, completions: _Completions) -> None:
        self.completions = completions


class AsyncClient:
    """asyncio client; the same surface as :class:`Client`, with awaitable ``create``."""

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        timeout: float = 600.0,
        *,
        connect_timeout: float = 10.0,
        max_retries: int = 2,
        retry_backoff_s: float = 0.25,
        max_connections: int = 1000,
    ) -> None:
        limits = httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections)
        self._http = httpx.AsyncClient(
            **_http_kwargs(base_url, api_key, timeout, connect_timeout), limits=limits
        )
        self.max_retries, self.retry_backoff_s = max_retries, retry_backoff_s
        self.completions = _AsyncCompletions(self, "/v1/completions")
        self.chat = _AsyncChat(_AsyncCompletions(self, "/v1/chat/completions"))

    async def _send(self, path: str, payload: dict[str, Any]) -> httpx.Response:
        for attempt in range(self.max_retries + 1):
            response = None
            try:
                request = self._http.build_request("POST", path, json=payload)
                response = await self._http.send(request, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout) as e:
                if attempt == self.max_retries:
                    raise APIConnectionError(f"cannot connect to {self._http.base_url}: {e!r}") from e
            except httpx.TimeoutException as e:
                raise APITimeoutError(f"no answer from {self._http.base_url} in time: {e!r}") from e
            if response is not None:
                if response.status_code < 400:
                    return response
                await response.aread()
                await response.aclose()
                if response.status_code not in RETRY_STATUSES or attempt == self.max_retries:
                    raise _error_from(response)
            await asyncio.sleep(_backoff_s(attempt, self.retry_backoff_s, response))
        raise AssertionError("unreachable")

    async def _create(self, path: str, stream: bool, body: dict[str, Any]) -> Result | AsyncStream:
        start = time.perf_counter()
        response = await self._send(path, _payload(body, stream))
        if stream:
            return AsyncStream(response, _StreamState(start))
        try:
            data = json.loads(await response.aread())
        except httpx.TimeoutException as e:
            raise APITimeoutError(f"no answer within the timeout: {e!r}") from e
        finally:
            await response.aclose()
        return _parse_result(data, time.perf_counter() - start)

    async def models(self) -> list[dict[str, Any]]:
        response = await self._http.get("/v1/models")
        if response.status_code >= 400:
            raise _error_from(response)
        data: list[dict[str, Any]] = response.json()["data"]
        return data

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


class _AsyncCompletions:
    def __init__(self, client: AsyncClient, path: str) -> None:
        self._client, self._path = client, path

    @overload
    async def create(self, *, stream: Literal[False] = False, **body: Any) -> Result: ...
    @overload
    async def create(self, *, stream: Literal[True], **body: Any) -> AsyncStream: ...
    async def create(self, *, stream: bool = False, **body: Any) -> Result | AsyncStream:
        return await self._client._create(self._path, stream, body)


class _AsyncChat:
    def __init__(self, completions: _AsyncCompletions) -> None:
        self.completions = completions
