"""Request planning for pdserve's HTTP edge (no FastAPI here, no torch).

``plan_completion`` / ``plan_chat`` turn a raw JSON body into a :class:`Plan` (the router requests to
send and how to shape the answer) or raise :class:`ApiError` before anything is queued. :class:`Edge` is
what they know of the served model and the server's limits.

The bodies and their field checks live in ``cluster/http/schema.py``; response shapes in
``cluster/http/responses.py``. What constrains the output (structured outputs, tools) is parsed by
``cluster/http/output_constraints.py``.
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, cast

from pydantic import ValidationError

from cluster.http.chat import encode_messages
from cluster.http.errors import ApiError
from cluster.http.output_constraints import ConstraintError, Constraints, ToolCalls, parse_constraints
from cluster.http.schema import (
    MAX_N,
    ChatBody,
    CommonBody,
    CompletionBody,
    check,
    check_common,
    check_prompt_chars,
    check_prompt_ids,
    logit_bias_ids,
    validation_message,
)
from cluster.protocol import MAX_BAD_WORD_TOKENS, MAX_LOGPROBS, GenerateRequest, ModelInfo, SamplingParams
from cluster.tokenizer import Tokenizer

CONTEXT_LENGTH_EXCEEDED = "context_length_exceeded"
_PARAM_NAMES = frozenset(f.name for f in dataclasses.fields(SamplingParams))


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
    num_logprobs: int | None = None  # top logprobs per token (None: no logprobs)
    # prompt_logprobs the client asked for (None: not asked): rendered on each choice (completions) or on
    # the response (chat), vLLM's places
    prompt_logprobs: int | None = None
    # echo (completions): each prompt's text, put before its choices' text (and its tokens' logprobs
    # before theirs); echo_only: max_tokens was 0, so a choice is the prompt alone
    echo: list[str] | None = None
    echo_only: bool = False


@dataclass(frozen=True)
class Edge:
    """What validation knows of the served model and the server's limits.

    names: the served model name first, then aliases. default_timeout_s bounds requests without a
    ``timeout`` field (None leaves it to the router); max_timeout_s caps every client deadline.
    structured_outputs: whether the workers apply structured-output masks (when False, a request that
    asks for one is a 400 naming the field instead of free text). tool_call_parser: the parser that
    serves tool_choice "auto" (``--enable-auto-tool-choice --tool-call-parser``; None: "auto" is a 400).
    """

    info: ModelInfo
    tokenizer: Tokenizer | None
    names: Sequence[str]
    default_timeout_s: float | None = None
    max_timeout_s: float | None = None
    structured_outputs: bool = False
    tool_call_parser: str | None = None

    def constraints(self, raw: dict[str, Any], *, chat: bool) -> Constraints:
        """The body's output constraints (ApiError 400 naming the field when refused)."""
        try:
            constraints = parse_constraints(raw, chat=chat, tool_call_parser=self.tool_call_parser)
        except ConstraintError as e:
            raise ApiError(400, str(e), e.param, code=e.code) from None
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

    @property
    def max_prompt_chars(self) -> int:
        """The most characters a prompt may have: max_model_len x the tokenizer's longest token, so a
        longer text cannot fit the context however it tokenizes. It is refused before tokenizing."""
        return self.info.max_model_len * self._chars_per_token

    @property
    def max_prompt_chars_reason(self) -> str:
        return (
            f"max_model_len {self.info.max_model_len} x {self._chars_per_token} characters per token, "
            "the longest token of the model's tokenizer"
        )

    @property
    def _chars_per_token(self) -> int:
        # NOTE: a tokenizer-like object that does not know its longest token (a test double) gets a bound
        # no text can reach, never an AttributeError.
        per_token = getattr(self.tokenizer, "max_chars_per_token", None)
        return per_token if isinstance(per_token, int) else 1 << 40


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
    check(max_tokens >= 1, f"{param} must be >= 1, got {max_tokens}", param)
    if prompt_len + max_tokens > info.max_model_len:
        raise _context_error(chat, info.max_model_len, prompt_len, max_tokens)
    return max_tokens


def _bad_words_token_ids(words: list[str], edge: Edge) -> list[list[int]]:
    """``bad_words`` resolved with the served tokenizer (``Tokenizer.bad_words_token_ids``: vLLM's rule)."""
    if not words:
        return []
    if edge.tokenizer is None:
        raise ApiError(400, "bad_words need the model's tokenizer; this model has none", "bad_words")
    try:
        token_ids = edge.tokenizer.bad_words_token_ids(words)
    except ValueError as e:
        raise ApiError(400, str(e), "bad_words") from None
    longest = max(len(ids) for ids in token_ids)
    check(
        longest <= MAX_BAD_WORD_TOKENS,
        f"bad_words entries may be at most {MAX_BAD_WORD_TOKENS} tokens, got {longest}",
        "bad_words",
    )
    return token_ids


def _validated(params: SamplingParams, vocab_size: int | None) -> SamplingParams:
    """``params`` once ``SamplingParams.validate`` passes (what the workers check again): 400 naming the
    field its message starts with."""
    try:
        params.validate(vocab_size)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        raise ApiError(400, str(e), name if name in _PARAM_NAMES else None) from None
    return params


def _build_plan(
    kind: Literal["completion", "chat"],
    body: CommonBody,
    prompts: list[list[int]],
    max_tokens: list[int],
    num_logprobs: int | None,
    edge: Edge,
    constraints: Constraints,
    *,
    prompt_logprobs: int | None = None,
    echo: list[str] | None = None,
    echo_only: bool = False,
) -> Plan:
    """The plan's router requests: one per prompt and choice. ``prompt_logprobs``: what the workers
    compute (the client's, raised to ``num_logprobs`` for an echo with logprobs)."""
    plan_id = f"{'cmpl' if kind == 'completion' else 'chatcmpl'}-{uuid.uuid4().hex}"
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    bad_words = list(dict.fromkeys(body.bad_words or []))  # NOTE: vLLM drops repeats too
    deadline = edge.deadline(body.timeout)
    base = SamplingParams(
        max_tokens=max_tokens[0],
        temperature=body.temperature,
        top_p=body.top_p,
        top_k=body.top_k,
        min_p=body.min_p,
        stop=stop,
        stop_token_ids=list(body.stop_token_ids or []),
        ignore_eos=body.ignore_eos,
        logprobs=num_logprobs,
        structured=constraints.structured,
        presence_penalty=body.presence_penalty,
        frequency_penalty=body.frequency_penalty,
        repetition_penalty=body.repetition_penalty,
        logit_bias=logit_bias_ids(body, edge.info),
        min_tokens=body.min_tokens,
        bad_words=bad_words,
        bad_words_token_ids=_bad_words_token_ids(bad_words, edge),
        allowed_token_ids=None if body.allowed_token_ids is None else list(body.allowed_token_ids),
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=body.include_stop_str_in_output,
        skip_special_tokens=body.skip_special_tokens and constraints.skip_special_tokens,
    )
    jobs: list[tuple[int, GenerateRequest]] = []
    for p, ids in enumerate(prompts):
        limit = 0 if echo_only else max_tokens[p]
        check(
            body.min_tokens <= limit,
            f"min_tokens must be in [0, max_tokens={limit}], got {body.min_tokens}",
            "min_tokens",
        )
        for j in range(body.n):
            seed = None if body.seed is None else body.seed + j
            params = dataclasses.replace(base, max_tokens=max_tokens[p], seed=seed)
            # NOTE: the vocabulary checks once (the same ids in every job); the rest per job
            _validated(params, edge.info.vocab_size if not jobs else None)
            jobs.append((p * body.n + j, GenerateRequest(f"{plan_id}-{p}-{j}", ids, params, deadline)))
    include_usage = bool((body.stream_options or {}).get("include_usage", False))
    return Plan(
        kind,
        plan_id,
        edge.names[0],
        body.stream,
        include_usage,
        num_logprobs is not None,
        prompts,
        jobs,
        tool_calls=constraints.tool_calls,
        num_logprobs=num_logprobs,
        prompt_logprobs=body.prompt_logprobs,
        echo=echo,
        echo_only=echo_only,
    )


# NOTE: the /v1/completions fields whose planning never calls the tokenizer (no text, no template, no
# grammar to compile): a body of these with a token-id prompt is planned on the event loop
_LOOP_FIELDS = frozenset(
    {
        "model",
        "prompt",
        "max_tokens",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "n",
        "stream",
        "stream_options",
        "ignore_eos",
        "stop",
        "stop_token_ids",
        "timeout",
        "user",
    }
)


def completion_plans_on_loop(raw: dict[str, Any]) -> bool:
    """Whether ``plan_completion(raw)`` can need no tokenizer: a token-id prompt and none but plain
    sampling fields. Such a small body is planned on the loop (``ServerState.plan``): ~40 us, where the
    hop to the edge's pool and back costs ~135 us of CPU."""
    prompt = raw.get("prompt")
    return raw.keys() <= _LOOP_FIELDS and type(prompt) is list and all(type(x) is int for x in prompt)


def plan_completion(raw: dict[str, Any], edge: Edge) -> Plan:
    """Validate a /v1/completions body; raises ApiError (400/404) before anything is queued."""
    info, tokenizer, names = edge.info, edge.tokenizer, edge.names
    try:
        body = CompletionBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *validation_message(e)) from None
    check_common(body, info, names)
    constraints = edge.constraints(raw, chat=False)
    check(body.suffix is None, "suffix is not supported", "suffix")
    check(body.best_of in (None, body.n), f"best_of must equal n ({body.n}), got {body.best_of}", "best_of")
    check(
        body.logprobs is None or 0 <= body.logprobs <= MAX_LOGPROBS,
        f"logprobs must be in [0, {MAX_LOGPROBS}], got {body.logprobs}",
        "logprobs",
    )
    single = isinstance(body.prompt, str) or (bool(body.prompt) and isinstance(body.prompt[0], int))
    items = cast("list[str | list[int]]", [body.prompt] if single else list(body.prompt))
    check(len(items) > 0, "prompt must not be empty", "prompt")
    check(
        len(items) * body.n <= MAX_N, f"prompts x n must be <= {MAX_N}, got {len(items) * body.n}", "prompt"
    )
    prompts: list[list[int]] = []
    for item in items:
        if isinstance(item, str):
            check(
                tokenizer is not None,
                "text prompts need a tokenizer; this model has none: send token ids",
                "prompt",
            )
            check(item != "", "prompt must not be empty", "prompt")
            what = "the prompt" if single else f"prompt[{len(prompts)}]"
            check_prompt_chars(len(item), edge.max_prompt_chars, edge.max_prompt_chars_reason, "prompt", what)
            ids = tokenizer.encode(item) if tokenizer is not None else []
        else:
            ids = list(item)
        check_prompt_ids(ids, info, "prompt")
        prompts.append(ids)
    # NOTE: vLLM's echo with max_tokens 0 answers the prompt alone: one token is generated (its prefill
    # computes the prompt's logprobs) and dropped
    echo_only = body.echo and body.max_tokens == 0
    requested = 1 if echo_only else body.max_tokens
    max_tokens = [_resolve_max_tokens(requested, 16, len(ids), info, "max_tokens") for ids in prompts]
    echo: list[str] | None = None
    if body.echo:
        if tokenizer is None:
            raise ApiError(
                400, "echo needs the model's tokenizer to render the prompt; this model has none", "echo"
            )
        # NOTE: vLLM's: a text prompt echoes as sent, token ids as they decode (special tokens kept)
        echo = [
            item if isinstance(item, str) else tokenizer.decode(ids, skip_special_tokens=False)
            for item, ids in zip(items, prompts, strict=True)
        ]
    prompt_logprobs = body.prompt_logprobs
    if body.echo and body.logprobs is not None:  # NOTE: vLLM's: the echoed tokens get their logprobs too
        prompt_logprobs = max(body.logprobs, prompt_logprobs or 0)
    return _build_plan(
        "completion",
        body,
        prompts,
        max_tokens,
        body.logprobs,
        edge,
        constraints,
        prompt_logprobs=prompt_logprobs,
        echo=echo,
        echo_only=echo_only,
    )


def plan_chat(raw: dict[str, Any], edge: Edge) -> Plan:
    """Validate a /v1/chat/completions body and render its chat template; raises ApiError."""
    info, tokenizer, names = edge.info, edge.tokenizer, edge.names
    try:
        body = ChatBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *validation_message(e)) from None
    check_common(body, info, names)
    check(len(body.messages) > 0, "messages must not be empty", "messages")
    check(
        body.top_logprobs is None or body.logprobs,
        "top_logprobs requires logprobs to be true",
        "top_logprobs",
    )
    check(
        body.top_logprobs is None or 0 <= body.top_logprobs <= MAX_LOGPROBS,
        f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {body.top_logprobs}",
        "top_logprobs",
    )
    if tokenizer is None:
        raise ApiError(400, "chat needs a tokenizer with a chat template; this model has none", "messages")
    constraints = edge.constraints(raw, chat=True)
    ids = encode_messages(
        tokenizer,
        body.messages,
        add_generation_prompt=body.add_generation_prompt,
        tools=constraints.tools,
        template_kwargs=body.chat_template_kwargs,
        max_chars=edge.max_prompt_chars,
        max_chars_reason=edge.max_prompt_chars_reason,
    )
    check_prompt_ids(ids, info, "messages")
    requested = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    param = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
    max_tokens = [_resolve_max_tokens(requested, None, len(ids), info, param)]
    num_logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _build_plan(
        "chat", body, [ids], max_tokens, num_logprobs, edge, constraints, prompt_logprobs=body.prompt_logprobs
    )
