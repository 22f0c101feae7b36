"""vLLM's /tokenize and /detokenize for pdserve's HTTP edge: their bodies and answers (no FastAPI here, no
torch). The routes are in ``cluster/http/model_routes.py``."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.http.chat import encode_messages
from cluster.http.errors import ApiError
from cluster.http.output_constraints import ConstraintError, parse_constraints
from cluster.http.planning import Edge
from cluster.http.schema import ChatMessage, check, check_model, check_prompt_chars, validation_message


class _TokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    return_token_strs: bool = False


class _DetokenizeBody(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


def tokenize_body(raw: dict[str, Any], edge: Edge) -> dict[str, Any]:
    """POST /tokenize: ``prompt`` (special tokens added unless ``add_special_tokens`` is false) or chat
    ``messages`` rendered through the template (none added unless asked) -> ids, count, max_model_len."""
    try:
        body = _TokenizeBody.model_validate(raw)
    except ValidationError as e:
        raise ApiError(400, *validation_message(e)) from None
    check_model(body.model, edge.names)
    check(
        (body.prompt is None) != (body.messages is None), "give exactly one of prompt or messages", "prompt"
    )
    tokenizer = edge.tokenizer
    if tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", "prompt")
    if body.prompt is not None:
        check_prompt_chars(
            len(body.prompt), edge.max_prompt_chars, edge.max_prompt_chars_reason, "prompt", "the prompt"
        )
        ids = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        try:
            tools = parse_constraints({"tools": body.tools, "tool_choice": "none"}, chat=True).tools
        except ConstraintError as e:
            raise ApiError(400, str(e), e.param) from None
        ids = encode_messages(
            tokenizer,
            body.messages or [],
            add_generation_prompt=body.add_generation_prompt,
            tools=tools,
            template_kwargs=body.chat_template_kwargs,
            max_chars=edge.max_prompt_chars,
            max_chars_reason=edge.max_prompt_chars_reason,
            add_special_tokens=bool(body.add_special_tokens),
        )
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
        raise ApiError(400, *validation_message(e)) from None
    check_model(body.model, edge.names)
    if edge.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", "tokens")
    for t in body.tokens:
        check(
            0 <= t < edge.info.vocab_size,
            f"tokens: id {t} is outside the vocabulary [0, {edge.info.vocab_size})",
            "tokens",
        )
    return {"prompt": edge.tokenizer.decode(body.tokens, skip_special_tokens=False)}
