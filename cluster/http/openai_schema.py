"""OpenAI request and response shapes for pdserve's HTTP edge (no FastAPI here, no torch).

Requests: pydantic models give the types only; ranges are checked by hand so a 400 names the field and
its limit. ``plan_completion`` / ``plan_chat`` turn a raw JSON body into a :class:`Plan` (the router
requests to send and how to shape the answer) or raise :class:`ApiError` before anything is queued.

Response shapes live in ``cluster/http/responses.py``. What constrains the output (structured outputs,
tools) is parsed by ``cluster/http/output_constraints.py``.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.http.output_constraints import ConstraintError, Constraints, ToolCalls, parse_constraints
from cluster.protocol import (
    MAX_LOGPROBS,
    ErrorCode,
    GenerateRequest,
    ModelInfo,
    RouterError,
    SamplingParams,
)
from cluster.tokenizer import Tokenizer

MAX_N = 16
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_JSON_DEPTH = 32
CHAT_ROLES = ("system", "user", "assistant", "tool", "developer")

# NOTE: the one place an error code becomes an HTTP status.
HTTP_STATUS: dict[ErrorCode, int] = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.SLO_UNATTAINABLE: 429,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.UNAVAILABLE: 503,
    ErrorCode.ABORTED: 499,  # nginx's "client closed request": nobody is left to read it
    ErrorCode.WORKER_FAILED: 500,
    ErrorCode.KV_TRANSFER_FAILED: 500,
    ErrorCode.INTERNAL: 500,
}


class ApiError(Exception):
    """A request answered with an OpenAI-shaped error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after_s: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.retry_after_s = retry_after_s  # the Retry-After of a 429 / 503 (None: the server's default)
        self.code = code or {
            400: "invalid_request",
            401: "invalid_api_key",
            404: "model_not_found",
            413: "request_too_large",
        }.get(status, "error")

    @classmethod
    def from_router(cls, e: RouterError) -> ApiError:
        status = HTTP_STATUS[e.code]
        return cls(status, str(e) or type(e).__name__, code=e.code.value, retry_after_s=e.retry_after_s)


def _error_type(status: int) -> str:
    if status == 401:
        return "authentication_error"
    if status == 404:
        return "not_found_error"
    return "invalid_request_error" if status < 500 else "server_error"


def error_body(e: ApiError) -> dict[str, Any]:
    return {"error": {"message": e.message, "type": _error_type(e.status), "param": e.param, "code": e.code}}


# ---- the body: strict JSON ----


def _reject_constant(name: str) -> Any:
    raise ApiError(400, f"request body contains {name}, which is not a JSON number")


def parse_body(body: bytes) -> dict[str, Any]:
    """The body as a JSON object, strictly: no NaN/Infinity, nesting at most MAX_JSON_DEPTH, no lone
    surrogate in any string (key or value). Raises ApiError 400 naming what is wrong."""
    try:
        raw = json.loads(body, parse_constant=_reject_constant)
    except RecursionError:
        raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"request body is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ApiError(400, "request body must be a JSON object")
    _check_tree(raw)
    return raw


def _check_tree(root: dict[str, Any]) -> None:
    stack: list[tuple[Any, int, str]] = [(root, 1, "")]
    while stack:
        node, depth, path = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise ApiError(400, f"request body nests deeper than {MAX_JSON_DEPTH} levels", path or None)
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, value in items:
            # NOTE: the name may itself hold a lone surrogate; the error must still encode
            where = path or str(key).encode("utf-8", "backslashreplace").decode()
            if isinstance(key, str):
                _check_text(key, where)
            if isinstance(value, str):
                _check_text(value, where)
            elif isinstance(value, (dict, list)):
                stack.append((value, depth + 1, where))


def _check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ApiError(400, f"{param} contains a lone surrogate (not valid UTF-8 text)", param) from None


# ---- request schemas: types only; ranges are checked by hand for messages that name the limit ----


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    max_tokens: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: dict[str, bool] | None = None
    timeout: float | None = None  # seconds; pdserve extension -> GenerateRequest.deadline
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[str, float] | None = None


class CompletionBody(_Body):
    prompt: str | list[int] | list[str] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class _ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: str
    text: str | None = None


class _FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str


class _ToolCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: _FunctionCall


class _Message(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: str
    content: str | list[_ContentPart] | None = None
    name: str | None = None
    tool_calls: list[_ToolCall] | None = None
    tool_call_id: str | None = None


class ChatBody(_Body):
    messages: list[_Message]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


@dataclass
class Plan:
    """A validated request: what to send to the router and how to shape the answer."""

    kind: Literal["completion", "chat"]
    id: str
    model: str
    stream: bool
    include_usage: bool
    logprobs: bool
    prompts: list[list[int]]
    jobs: list[tuple[int, GenerateRequest]]  # (choice index, router request)
    created: int = field(default_factory=lambda: int(time.time()))
    tool_calls: ToolCalls | None = None  # render the output as tool calls (chat, tool_choice)


def _check(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise ApiError(400, message, param)


def _validation_message(e: ValidationError) -> tuple[str, str | None]:
    err = e.errors()[0]
    param = str(err["loc"][0]) if err["loc"] else None
    if param == "prompt" and len(e.errors()) > 1:  # NOTE: one error per union member; say it once
        return (
            "prompt must be a string, a list of token ids, a list of strings or a list of token-id lists",
            param,
        )
    loc = ".".join(str(p) for p in err["loc"])
    return f"{loc}: {err['msg']} (got {str(err.get('input'))[:60]!r})", param


def _check_common(body: _Body, info: ModelInfo, names: Sequence[str]) -> None:
    if body.model is not None and body.model not in names:
        raise ApiError(404, f"model {body.model!r} does not exist; served: {names[0]!r}", "model")
    _check(1 <= body.n <= MAX_N, f"n must be in [1, {MAX_N}], got {body.n}", "n")
    _check(body.temperature >= 0, f"temperature must be >= 0, got {body.temperature}", "temperature")
    _check(0 < body.top_p <= 1, f"top_p must be in (0, 1], got {body.top_p}", "top_p")
    _check(body.top_k >= -1, f"top_k must be -1, 0 (disabled) or >= 1, got {body.top_k}", "top_k")
    _check(0 <= body.min_p <= 1, f"min_p must be in [0, 1], got {body.min_p}", "min_p")
    for name, value, neutral in (
        ("presence_penalty", body.presence_penalty, 0.0),
        ("frequency_penalty", body.frequency_penalty, 0.0),
        ("repetition_penalty", body.repetition_penalty, 1.0),
    ):
        _check(value == neutral, f"{name} is not supported (must be {neutral}), got {value}", name)
    _check(not body.logit_bias, "logit_bias is not supported", "logit_bias")
    stops = [body.stop] if isinstance(body.stop, str) else body.stop or []
    _check(all(stops), "stop strings must be non-empty", "stop")
    _check(
        len(stops) <= MAX_STOP_STRINGS,
        f"stop may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}",
        "stop",
    )
    longest = max((len(x) for x in stops), default=0)
    _check(
        longest <= MAX_STOP_STRING_CHARS,
        f"stop strings may be at most {MAX_STOP_STRING_CHARS} characters, got {longest}",
        "stop",
    )
    num_stop_ids = len(body.stop_token_ids or [])
    _check(
        num_stop_ids <= MAX_STOP_TOKEN_IDS,
        f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got {num_stop_ids}",
        "stop_token_ids",
    )
    for t in body.stop_token_ids or []:
        _check(
            0 <= t < info.vocab_size,
            f"stop_token_ids entry {t} is outside the vocabulary [0, {info.vocab_size})",
            "stop_token_ids",
        )
    _check(
        body.seed is None or 0 <= body.seed < 2**63, f"seed must be in [0, 2**63), got {body.seed}", "seed"
    )
    _check(
        body.timeout is None or body.timeout > 0,
        f"timeout must be > 0 seconds, got {body.timeout}",
        "timeout",
    )
    _check(
        body.stream or body.stream_options is None,
        "stream_options is only allowed when stream is true",
        "stream_options",
    )


def _check_prompt_ids(ids: list[int], info: ModelInfo, param: str) -> None:
    _check(len(ids) > 0, f"{param} must not be empty", param)
    for t in ids:
        _check(
            0 <= t < info.vocab_size,
            f"{param} token id {t} is outside the vocabulary [0, {info.vocab_size})",
            param,
        )


CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"


def _context_error(chat: bool, limit: int, prompt_len: int, max_tokens: int | None) -> ApiError:
    """OpenAI's wording and code for a request that does not fit the context window."""
    where = "messages" if chat else "prompt"
    if max_tokens is None:
        message = (
            f"This model's maximum context length is {limit} tokens. However, your {where} resulted in "
            f"{prompt_len} tokens. Please reduce the length of the {where}."
        )
    elif chat:
        message = (
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in the messages, {max_tokens} in the "
            "completion). Please reduce the length of the messages or completion."
        )
    else:
        message = (
            f"This model's maximum context length is {limit} tokens, however you requested "
            f"{prompt_len + max_tokens} tokens ({prompt_len} in your prompt; {max_tokens} for the "
            "completion). Please reduce your prompt; or completion length."
        )
    return ApiError(400, message, where, CONTEXT_LENGTH_EXCEEDED)


def _resolve_max_tokens(
    requested: int | None, default: int | None, prompt_len: int, info: ModelInfo, param: str
) -> int:
    chat = param != "max_tokens" or default is None
    room = info.max_model_len - prompt_len
    if room < 1:
        raise _context_error(chat, info.max_model_len, prompt_len, None)
    max_tokens = requested if requested is not None else min(default or room, room)
    _check(max_tokens >= 1, f"{param} must be >= 1, got {max_tokens}", param)
    if prompt_len + max_tokens > info.max_model_len:
        raise _context_error(chat, info.max_model_len, prompt_len, max_tokens)
    return max_tokens


def _build_plan(
    kind: Literal["completion", "chat"],
    body: _Body,
    prompts: list[list[int]],
    max_tokens: list[int],
    num_logprobs: int | None,
    model: str,
    deadline: float | None,
    constraints: Constraints,
) -> Plan:
    plan_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    jobs: list[tuple[int, GenerateRequest]] = []
    for p, ids in enumerate(prompts):
        for j in range(body.n):
            params = SamplingParams(
                max_tokens=max_tokens[p],
                temperature=body.temperature,
                top_p=body.top_p,
                top_k=body.top_k,
                min_p=body.min_p,
                seed=None if body.seed is None else body.seed + j,
                stop=stop,
                stop_token_ids=list(body.stop_token_ids or []),
                ignore_eos=body.ignore_eos,
                logprobs=num_logprobs,
                structured=constraints.structured,
            )
            jobs.append((p * body.n + j, GenerateRequest(f"{plan_id}-{p}-{j}", ids, params, deadline)))
    include_usage = bool((body.stream_options or {}).get("include_usage", False))
    return Plan(
        kind,
        plan_id,
        model,
        body.stream,
        include_usage,
        num_logprobs is not None,
        prompts,
        jobs,
        tool_calls=constraints.tool_calls,
    )


@dataclass(frozen=True)
class Edge:
    """What validation knows of the served model and the server's limits.

    names: the served model name first, then aliases. default_timeout_s bounds requests without a
    ``timeout`` field (None leaves it to the router); max_timeout_s caps every client deadline.
    structured_outputs: whether the workers apply structured-output masks (when False, a request that
    asks for one is a 400 naming the field instead of free text).
    """

    info: ModelInfo
    tokenizer: Tokenizer | None
    names: Sequence[str]
    default_timeout_s: float | None = None
    max_timeout_s: float | None = None
    structured_outputs: bool = False

    def constraints(self, raw: dict[str, Any], *, chat: bool) -> Constraints:
        """The body's output constraints (ApiError 400 naming the field when refused)."""
        try:
            constraints = parse_constraints(raw, chat=chat)
        except ConstraintError as e:
            raise ApiError(400, str(e), e.param) from None
        if constraints.structured is not None and not self.structured_outputs:
            raise ApiError(
                400,
                f"{constraints.param}: structured outputs are not enabled on this server "
                "(its workers do not apply grammar masks yet)",
                constraints.param,
            )
        return constraints

    def deadline(self, timeout: float | None) -> float | None:
        t = timeout if timeout is not None else self.default_timeout_s
        if t is not None and self.max_timeout_s is not None:
            t = min(t, self.max_timeout_s)
        return None if t is None else time.time() + t


def plan_completion(raw: dict[str, Any], edge: Edge) -> Plan:
    """Validate a /v1/completions body; raises ApiError (400/404) before anything is queued."""
    info, tokenizer, names = edge.info, edge.tokenizer, edge.names
    try:
        body = CompletionBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_common(body, info, names)
    constraints = edge.constraints(raw, chat=False)
    _check(not body.echo, "echo is not supported", "echo")
    _check(body.suffix is None, "suffix is not supported", "suffix")
    _check(body.best_of in (None, body.n), f"best_of must equal n ({body.n}), got {body.best_of}", "best_of")
    _check(
        body.logprobs is None or 0 <= body.logprobs <= MAX_LOGPROBS,
        f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}",
        "logprobs",
    )
    single = isinstance(body.prompt, str) or (bool(body.prompt) and isinstance(body.prompt[0], int))
    items = cast("list[str | list[int]]", [body.prompt] if single else list(body.prompt))
    _check(len(items) > 0, "prompt must not be empty", "prompt")
    _check(
        len(items) * body.n <= MAX_N, f"prompts x n must be <= {MAX_N}, got {len(items) * body.n}", "prompt"
    )
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            _check(
                tokenizer is not None,
                "text prompts need a tokenizer; this model has none: send token ids",
                "prompt",
            )
            _check(item != "", "prompt must not be empty", "prompt")
            ids = tokenizer.encode(item) if tokenizer is not None else []
        else:
            ids = list(item)
        _check_prompt_ids(ids, info, "prompt")
        prompts.append(ids)
    max_tokens = [_resolve_max_tokens(body.max_tokens, 16, len(ids), info, "max_tokens") for ids in prompts]
    deadline = edge.deadline(body.timeout)
    return _build_plan(
        "completion", body, prompts, max_tokens, body.logprobs, names[0], deadline, constraints
    )


def plan_chat(raw: dict[str, Any], edge: Edge) -> Plan:
    """Validate a /v1/chat/completions body and render its chat template; raises ApiError."""
    info, tokenizer, names = edge.info, edge.tokenizer, edge.names
    try:
        body = ChatBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_common(body, info, names)
    _check(len(body.messages) > 0, "messages must not be empty", "messages")
    _check(
        body.top_logprobs is None or body.logprobs,
        "top_logprobs requires logprobs to be true",
        "top_logprobs",
    )
    _check(
        body.top_logprobs is None or 0 <= body.top_logprobs <= MAX_LOGPROBS,
        f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
        "top_logprobs",
    )
    _check(
        tokenizer is not None, "chat needs a tokenizer with a chat template; this model has none", "messages"
    )
    constraints = edge.constraints(raw, chat=True)
    messages = [_template_message(i, m) for i, m in enumerate(body.messages)]
    kwargs = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & {"messages", "tools", "add_generation_prompt"})
    _check(not reserved, f"chat_template_kwargs may not set {reserved}", "chat_template_kwargs")
    try:
        ids = (
            tokenizer.encode_chat(messages, body.add_generation_prompt, tools=constraints.tools, **kwargs)
            if tokenizer is not None
            else []
        )
    except ValueError as e:
        raise ApiError(400, str(e), "messages") from None
    _check_prompt_ids(ids, info, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = [_resolve_max_tokens(requested, None, len(ids), info, param)]
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    deadline = edge.deadline(body.timeout)
    return _build_plan("chat", body, [ids], max_tokens, num_logprobs, names[0], deadline, constraints)


def _template_message(i: int, m: _Message) -> dict[str, Any]:
    """One message as chat templates expect it (transformers' shape: tool call arguments as objects)."""
    _check(
        m.role in CHAT_ROLES,
        f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {m.role!r}"[:300],
        "messages",
    )
    if isinstance(m.content, list):
        _check(
            all(p.type == "text" and p.text is not None for p in m.content),
            f"messages[{i}].content: only text parts are supported",
            "messages",
        )
        text: str | None = "".join(p.text or "" for p in m.content)
    else:
        text = m.content
    message: dict[str, Any] = {"role": m.role, "content": text if text is not None or m.tool_calls else ""}
    if m.name is not None:
        message["name"] = m.name
    if m.tool_call_id is not None:
        message["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        _check(
            m.role == "assistant", f"messages[{i}].tool_calls: only assistant messages carry them", "messages"
        )
        message["tool_calls"] = [
            {
                "id": call.id,
                "type": "function",
                "function": {"name": call.function.name, "arguments": _arguments(call.function.arguments)},
            }
            for call in m.tool_calls
        ]
    return message


def _arguments(text: str) -> Any:
    # NOTE: OpenAI sends arguments as JSON text; Hugging Face chat templates (Qwen, Llama 3.1, Mistral)
    # iterate or tojson them as an object, so a JSON object is passed on decoded (as vLLM does).
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return text
    return value if isinstance(value, dict) else text


def as_api_error(e: BaseException) -> ApiError:
    if isinstance(e, ApiError):
        return e
    if isinstance(e, RouterError):
        return ApiError.from_router(e)
    return ApiError(500, f"internal error: {type(e).__name__}: {e}", code="internal_error")


# ---- /tokenize and /detokenize (vLLM's shapes) ----


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[_Message] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def _check_model(model: str | None, names: Sequence[str]) -> None:
    if model is not None and model not in names:
        raise ApiError(404, f"model {model!r} does not exist; served: {names[0]!r}", "model")


def tokenize_body(raw: dict[str, Any], edge: Edge) -> dict[str, Any]:
    """POST /tokenize: ``prompt`` (special tokens added unless ``add_special_tokens`` is false) or chat
    ``messages`` rendered through the template (none added unless asked) -> ids, count, max_model_len."""
    try:
        body = _TokenizeBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_model(body.model, edge.names)
    _check(
        (body.prompt is None) != (body.messages is None), "give exactly one of prompt or messages", "prompt"
    )
    tokenizer = edge.tokenizer
    _check(tokenizer is not None, "this model has no tokenizer", "prompt")
    assert tokenizer is not None
    if body.prompt is not None:
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        messages = [_template_message(i, m) for i, m in enumerate(body.messages or [])]
        try:
            tools = parse_constraints({"tools": body.tools, "tool_choice": "none"}, chat=True).tools
        except ConstraintError as e:
            raise ApiError(400, str(e), e.param) from None
        try:
            text = tokenizer.apply_chat_template(
                messages, body.add_generation_prompt, tools, **(body.chat_template_kwargs or {})
            )
        except ValueError as e:
            raise ApiError(400, str(e), "messages") from None
        ids = tokenizer.encode(text, add_special_tokens=bool(body.add_special_tokens))
    return {
        "count": len(ids),
        "max_model_len": edge.info.max_model_len,
        "tokens": ids,
        "token_strs": tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None,
    }


def detokenize_body(raw: dict[str, Any], edge: Edge) -> dict[str, Any]:
    """POST /detokenize: ``tokens`` -> ``prompt`` (the text, special tokens included)."""
    try:
        body = _DetokenizeBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *_validation_message(e)) from None
    _check_model(body.model, edge.names)
    _check(edge.tokenizer is not None, "this model has no tokenizer", "tokens")
    for t in body.tokens:
        _check(
            0 <= t < edge.info.vocab_size,
            f"tokens: id {t} is outside the vocabulary [0, {edge.info.vocab_size})",
            "tokens",
        )
    assert edge.tokenizer is not None
    return {"prompt": edge.tokenizer.decode(body.tokens, skip_special_tokens=False)}
