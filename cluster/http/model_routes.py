"""The routes about the served model: GET /v1/models (and one model's card), and vLLM's POST /tokenize and
/detokenize (their logic: ``cluster/http/tokenizing.py``)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from cluster.http.errors import ApiError
from cluster.http.planning import Edge
from cluster.http.server_state import state_of
from cluster.http.tokenizing import detokenize_body, tokenize_body

routes = APIRouter()


def _model_card(edge: Edge) -> dict[str, Any]:
    info = edge.info
    # NOTE: "root" is the served name, never the checkpoint's directory: a filesystem path tells a
    # client nothing it can use and tells an attacker about the host.
    return {
        "id": edge.names[0],
        "object": "model",
        "created": 0,
        "owned_by": "pdserve",
        "root": edge.names[0],
        "max_model_len": info.max_model_len,
        "vocab_size": info.vocab_size,
    }


@routes.get("/v1/models")
async def models(request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.authorize(request)
    return {"object": "list", "data": [_model_card(state.edge)]}


@routes.get("/v1/models/{model_id:path}")
async def model(model_id: str, request: Request) -> dict[str, Any]:
    state = state_of(request)
    state.authorize(request)
    if model_id not in state.edge.names:
        raise ApiError(404, f"model {model_id!r} does not exist; served: {state.edge.names[0]!r}", "model")
    return _model_card(state.edge)


@routes.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    """vLLM's /tokenize: ``prompt`` text, or chat ``messages`` rendered through the template."""
    state = state_of(request)
    state.authorize(request)
    return await state.run_on_pool(request, tokenize_body)


@routes.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    """vLLM's /detokenize: token ids -> ``prompt`` text."""
    state = state_of(request)
    state.authorize(request)
    return await state.run_on_pool(request, detokenize_body)
