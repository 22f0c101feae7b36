"""Issue 31 row 1 at the HTTP edge: a grammar over the rule cap is a 400 naming the field and the limit
before anything reaches the router, and a worker's ``structured_output_too_complex`` failure is a 400
with that code (RequestFailed's code, through the router, to the HTTP status)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from cluster.config import ServerConfig
from cluster.http.app import create_app
from cluster.http.errors import ApiError
from cluster.http.output_constraints import MAX_GRAMMAR_RULES
from cluster.protocol import ErrorCode, StructuredOutput, StructuredOutputTooComplexError, router_error
from tests.support.stub_router import ServerThread, StubRouter, make_tokenizer


def grammar(num_rules: int) -> str:
    lines = ["root ::= r0"] + [f'r{i} ::= "a" r{i + 1} | "b"' for i in range(num_rules - 2)]
    return "\n".join([*lines, f'r{num_rules - 2} ::= "z"'])


@pytest.fixture(scope="module")
def router() -> StubRouter:
    return StubRouter()


@pytest.fixture(scope="module")
def server(router: StubRouter) -> Iterator[ServerThread]:
    with ServerThread(
        create_app(router, make_tokenizer(), ServerConfig(api_key="k"), structured_outputs=True)
    ) as s:
        yield s


def post(server: ServerThread, body: dict[str, Any]) -> httpx.Response:
    headers = {"Authorization": "Bearer k"}
    return httpx.post(f"{server.url}/v1/completions", json=body, headers=headers, timeout=30)


@pytest.mark.parametrize(
    ("field", "wrap"),
    [
        ("guided_grammar", lambda g: g),
        ("structured_outputs", lambda g: {"grammar": g}),
    ],
)
def test_issue31_row1_a_grammar_over_the_rule_cap_is_a_400_before_queueing(
    router: StubRouter, server: ServerThread, field: str, wrap: Any
) -> None:
    router.calls.clear()
    at_cap = grammar(MAX_GRAMMAR_RULES)
    assert StructuredOutput("grammar", at_cap).num_grammar_rules == MAX_GRAMMAR_RULES
    ok = post(server, {"prompt": "w1", "max_tokens": 2, field: wrap(at_cap)})
    assert ok.status_code == 200
    over = post(server, {"prompt": "w1", "max_tokens": 2, field: wrap(grammar(MAX_GRAMMAR_RULES + 1))})
    assert over.status_code == 400
    error = over.json()["error"]
    where = "guided_grammar" if field == "guided_grammar" else "structured_outputs.grammar"
    assert (error["param"], error["code"]) == (where, "structured_output_too_complex")
    assert (
        error["message"]
        == f"{where} has {MAX_GRAMMAR_RULES + 1} rules, over the limit of {MAX_GRAMMAR_RULES}"
    )
    assert len(router.calls) == 1  # NOTE: only the request at the cap was queued


def test_issue31_row1_a_worker_compile_failure_is_a_400_structured_output_too_complex(
    router: StubRouter, server: ServerThread
) -> None:
    message = "structured output did not compile within 5 s (structured_compile_timeout_s; 5.0 s so far)"
    error = router_error(ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX, message)
    assert isinstance(error, StructuredOutputTooComplexError)
    api = ApiError.from_router(error)
    assert (api.status, api.code, api.message) == (400, "structured_output_too_complex", message)
    router.fail_next.append(error)
    response = post(server, {"prompt": "w1", "max_tokens": 2, "guided_regex": "a+"})
    assert response.status_code == 400
    assert response.json()["error"]["code"] == "structured_output_too_complex"
    assert response.json()["error"]["message"] == message
