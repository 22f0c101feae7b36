"""Issue 34 at the HTTP edge, against the stub router: vLLM's sampling fields (penalties, logit_bias,
min_tokens, bad_words, allowed_token_ids, prompt_logprobs, include_stop_str_in_output,
skip_special_tokens) reach the router's ``SamplingParams`` exactly, every bad value is a 400 naming the
field before anything is queued, and completions' ``echo`` and ``prompt_logprobs`` render as vLLM renders
them (from a stub delta that carries the prompt's logprobs)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest

from cluster.http.app import create_app
from cluster.protocol import GenerateRequest, SamplingParams, TokenDelta, TokenLogprobs
from tests.support.stub_router import ServerThread, StubRouter, expected_tokens, make_tokenizer

PROMPT = "w10 w11 w12"
PROMPT_IDS = [10, 11, 12]  # the stub tokenizer adds no BOS
MESSAGES = [{"role": "user", "content": "w20 w21"}]


def prompt_entry(position: int, token_id: int, k: int) -> TokenLogprobs:
    """The stub's logprobs of prompt token ``token_id`` at ``position`` (>= 1): at an odd position the
    token itself leads its top k, at an even one it is not among them."""
    first = token_id if position % 2 else token_id + 1
    tops = [first + j for j in range(k)]
    logprob = -0.25 if position % 2 else -3.0 - position
    return TokenLogprobs(token_id, logprob, tops, [-0.25 - 0.5 * j for j in range(k)])


class PromptLogprobsRouter(StubRouter):
    """The stub router, with the prompt's logprobs on each request's first delta when asked (the
    worker's shape: one entry per prompt token, the first None)."""

    async def generate(self, req: GenerateRequest) -> AsyncIterator[TokenDelta]:
        k = req.params.prompt_logprobs
        is_first = True
        async for delta in super().generate(req):
            if is_first and k is not None:
                ids = req.prompt_token_ids
                delta.prompt_logprobs = [None] + [prompt_entry(i, t, k) for i, t in enumerate(ids) if i > 0]
            is_first = False
            yield delta


@pytest.fixture(scope="module")
def router() -> PromptLogprobsRouter:
    return PromptLogprobsRouter(max_model_len=128)


@pytest.fixture(scope="module")
def server(router: PromptLogprobsRouter) -> Iterator[ServerThread]:
    with ServerThread(create_app(router, make_tokenizer())) as s:
        yield s


@pytest.fixture
def stub(router: PromptLogprobsRouter) -> PromptLogprobsRouter:
    router.calls.clear()
    return router


def post(server: ServerThread, route: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, timeout=30)


def output_text(prompt_ids: list[int], params: SamplingParams) -> str:
    return "".join(f" w{t}" for t in expected_tokens(prompt_ids, params))


def sse_chunks(r: httpx.Response) -> list[dict[str, Any]]:
    lines = [line[len("data: ") :] for line in r.text.split("\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


FIELDS: dict[str, Any] = {
    "presence_penalty": 1.5,
    "frequency_penalty": -2,
    "repetition_penalty": 1.3,
    "logit_bias": {"7": 100, "300": -100, "42": 0.5},
    "min_tokens": 2,
    "bad_words": ["w10", "w11 w12", "  w13", "w10"],
    "allowed_token_ids": [6, 7, 300],
    "prompt_logprobs": 2,
    "include_stop_str_in_output": True,
    "skip_special_tokens": False,
}


def expected_params(max_tokens: int) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens,
        presence_penalty=1.5,
        frequency_penalty=-2.0,
        repetition_penalty=1.3,
        logit_bias={7: 100.0, 300: -100.0, 42: 0.5},
        min_tokens=2,
        # NOTE: repeats dropped (vLLM's); "  w13" keeps its spaces, its ids are those of "w13"
        bad_words=["w10", "w11 w12", "  w13"],
        bad_words_token_ids=[[10], [11, 12], [13]],
        allowed_token_ids=[6, 7, 300],
        prompt_logprobs=2,
        include_stop_str_in_output=True,
        skip_special_tokens=False,
    )


def test_every_field_reaches_sampling_params_exactly(
    stub: PromptLogprobsRouter, server: ServerThread
) -> None:
    r = post(server, "completions", {"prompt": PROMPT, "max_tokens": 4, **FIELDS})
    assert r.status_code == 200, r.text
    r = post(server, "chat/completions", {"messages": MESSAGES, "max_completion_tokens": 5, **FIELDS})
    assert r.status_code == 200, r.text
    assert [c.params for c in stub.calls] == [expected_params(4), expected_params(5)]
    # the resolved ids are the tokenizer's (vLLM's rule), and the edge passes the workers' own check
    assert make_tokenizer().bad_words_token_ids(FIELDS["bad_words"]) == [[10], [11, 12], [13]]
    for call in stub.calls:
        call.params.validate(512)


def test_defaults_leave_sampling_params_neutral(stub: PromptLogprobsRouter, server: ServerThread) -> None:
    assert post(server, "completions", {"prompt": PROMPT, "max_tokens": 3}).status_code == 200
    assert stub.calls[0].params == SamplingParams(max_tokens=3)
    assert not stub.calls[0].params.has_logits_processors


BAD: list[tuple[str, dict[str, Any], str, str]] = [
    ("completions", {"presence_penalty": 2.5}, "presence_penalty", "presence_penalty must be in [-2.0, 2.0], got 2.5"),
    ("chat/completions", {"frequency_penalty": -3}, "frequency_penalty", "frequency_penalty must be in [-2.0, 2.0], got -3.0"),
    ("completions", {"repetition_penalty": 0}, "repetition_penalty", "repetition_penalty must be > 0, got 0.0"),
    ("completions", {"logit_bias": {"abc": 1}}, "logit_bias", "logit_bias keys must be token ids in [0, 512), got 'abc'"),
    ("completions", {"logit_bias": {"512": 1}}, "logit_bias", "logit_bias keys must be token ids in [0, 512), got '512'"),
    ("chat/completions", {"logit_bias": {"-1": 1}}, "logit_bias", "logit_bias keys must be token ids in [0, 512), got '-1'"),
    ("completions", {"logit_bias": {"5": 100.5}}, "logit_bias", "logit_bias values must be in [-100.0, 100.0], got 100.5 for '5'"),
    ("completions", {"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias", "logit_bias may hold at most 1024 entries, got 1025"),
    ("completions", {"logit_bias": {"5": "up"}}, "logit_bias", "logit_bias.5: Input should be a valid number"),
    ("completions", {"min_tokens": -1}, "min_tokens", "min_tokens must be >= 0, got -1"),
    ("completions", {"min_tokens": 5, "max_tokens": 4}, "min_tokens", "min_tokens must be in [0, max_tokens=4], got 5"),
    ("chat/completions", {"min_tokens": 4, "max_tokens": 3}, "min_tokens", "min_tokens must be in [0, max_tokens=3], got 4"),
    ("completions", {"echo": True, "max_tokens": 0, "min_tokens": 1}, "min_tokens", "min_tokens must be in [0, max_tokens=0], got 1"),
    ("completions", {"bad_words": ["w1", " "]}, "bad_words", "bad_words entries must be non-empty (not only spaces)"),
    ("completions", {"bad_words": [f"w{i}" for i in range(257)]}, "bad_words", "bad_words may hold at most 256 words, got 257"),
    ("completions", {"bad_words": [" ".join(["w10"] * 65)]}, "bad_words", "bad_words entries may be at most 64 tokens, got 65"),
    ("completions", {"bad_words": "w10"}, "bad_words", "bad_words: Input should be a valid list"),
    ("completions", {"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids must hold at least one token id"),
    ("chat/completions", {"allowed_token_ids": [5, 512]}, "allowed_token_ids", "allowed_token_ids entry 512 is outside the vocabulary [0, 512)"),
    ("completions", {"prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs must be in [0, 20], got 21"),
    ("completions", {"prompt_logprobs": -1}, "prompt_logprobs", "prompt_logprobs must be in [0, 20], got -1"),
    ("completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "prompt_logprobs are not available when stream is true"),
    ("chat/completions", {"prompt_logprobs": 1, "stream": True}, "prompt_logprobs", "prompt_logprobs are not available when stream is true"),
    ("completions", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output", "include_stop_str_in_output: Input should be a valid boolean"),
    ("chat/completions", {"skip_special_tokens": 0}, "skip_special_tokens", "skip_special_tokens: Input should be a valid boolean"),
    ("completions", {"max_tokens": 0}, "max_tokens", "max_tokens must be >= 1, got 0"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("route", "fields", "param", "message"),
    BAD,
    ids=[f"{i}-{b[0].split('/')[0]}-{b[2]}" for i, b in enumerate(BAD)],
)
def test_bad_values_are_400s_naming_the_field(
    stub: PromptLogprobsRouter,
    server: ServerThread,
    route: str,
    fields: dict[str, Any],
    param: str,
    message: str,
) -> None:
    body = {"prompt": PROMPT} if route == "completions" else {"messages": MESSAGES}
    r = post(server, route, {**body, **fields})
    assert r.status_code == 400
    error = r.json()["error"]
    assert error["param"] == param
    assert error["message"].startswith(message), error["message"]
    assert stub.calls == []


def test_echo_puts_the_prompt_before_the_text(stub: PromptLogprobsRouter, server: ServerThread) -> None:
    body = {"prompt": PROMPT, "max_tokens": 3, "echo": True, "n": 2, "seed": 5}
    full = post(server, "completions", body).json()
    texts = [PROMPT + output_text(PROMPT_IDS, c.params) for c in stub.calls]
    assert [c["text"] for c in full["choices"]] == texts
    assert [c.params.prompt_logprobs for c in stub.calls] == [None, None]  # no logprobs: none computed
    assert full["usage"]["completion_tokens"] == 6  # the echo is not output
    # streamed: the prompt goes with each choice's first chunk
    stub.calls.clear()
    chunks = sse_chunks(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30))
    first: dict[int, str] = {}
    streamed = ["", ""]
    for chunk in chunks:
        (choice,) = chunk["choices"]
        first.setdefault(choice["index"], choice["text"])
        streamed[choice["index"]] += choice["text"]
    assert streamed == texts
    for i, call in enumerate(stub.calls):
        assert first[i] == PROMPT + f" w{expected_tokens(PROMPT_IDS, call.params)[0]}"
    # a token-id prompt echoes as its ids decode, special tokens kept
    stub.calls.clear()
    r = post(server, "completions", {"prompt": [1, 10, 11], "max_tokens": 2, "echo": True}).json()
    assert r["choices"][0]["text"] == "<s> w10 w11" + output_text([1, 10, 11], stub.calls[0].params)


def test_echo_with_logprobs_lists_the_prompt_tokens_first(
    stub: PromptLogprobsRouter, server: ServerThread
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "echo": True, "logprobs": 1}
    full = post(server, "completions", body).json()["choices"][0]
    (call,) = stub.calls
    assert call.params.prompt_logprobs == 1  # vLLM's: echo with logprobs asks the prompt's
    out = expected_tokens(PROMPT_IDS, call.params)
    tokens = ["w10", "w11", "w12", f"w{out[0]}", f"w{out[1]}"]
    assert full["logprobs"] == {
        "tokens": tokens,
        "token_logprobs": [None, -0.25, -5.0, -0.25, -0.25],
        "top_logprobs": [None, {"w11": -0.25}, {"w13": -0.25}, {tokens[3]: -0.25}, {tokens[4]: -0.25}],
        "text_offset": [0, 3, 6, 9, 9 + len(tokens[3])],
    }
    assert "prompt_logprobs" not in full  # not asked for itself
    # streamed, the first chunk carries the prompt's logprobs and its text
    stub.calls.clear()
    chunks = sse_chunks(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30))
    assert chunks[0]["choices"][0]["text"] == PROMPT + f" w{out[0]}"
    assert chunks[0]["choices"][0]["logprobs"]["tokens"] == ["w10", "w11", "w12", f"w{out[0]}"]
    assert chunks[0]["choices"][0]["logprobs"]["token_logprobs"] == [None, -0.25, -5.0, -0.25]
    assert chunks[1]["choices"][0]["logprobs"]["tokens"] == [f"w{out[1]}"]


def test_echo_with_max_tokens_0_answers_the_prompt_alone(
    stub: PromptLogprobsRouter, server: ServerThread
) -> None:
    body = {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 0}
    r = post(server, "completions", body).json()
    (call,) = stub.calls
    assert (call.params.max_tokens, call.params.prompt_logprobs) == (1, 0)
    (choice,) = r["choices"]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == (PROMPT, [], "length")
    assert choice["logprobs"]["tokens"] == ["w10", "w11", "w12"]
    assert choice["logprobs"]["token_logprobs"] == [None, -0.25, -5.0]
    assert choice["logprobs"]["top_logprobs"] == [None, {}, {}]
    assert r["usage"]["completion_tokens"] == 0
    chunks = sse_chunks(httpx.post(f"{server.url}/v1/completions", json={**body, "stream": True}, timeout=30))
    assert [(c["choices"][0]["text"], c["choices"][0]["finish_reason"]) for c in chunks] == [
        (PROMPT, "length")
    ]


def rendered_entry(token_id: int, logprob: float, rank: int | None) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": f"w{token_id}"}


def test_prompt_logprobs_render_as_vllm_renders_them(
    stub: PromptLogprobsRouter, server: ServerThread
) -> None:
    r = post(server, "completions", {"prompt": PROMPT, "max_tokens": 2, "prompt_logprobs": 2}).json()
    expected = [
        None,
        # odd position: the token leads its top 2 (rank 1)
        {"11": rendered_entry(11, -0.25, 1), "12": rendered_entry(12, -0.75, 2)},
        # even position: the token is outside the top 2 (its rank is unknown: null), listed first
        {
            "12": rendered_entry(12, -5.0, None),
            "13": rendered_entry(13, -0.25, 1),
            "14": rendered_entry(14, -0.75, 2),
        },
    ]
    assert r["choices"][0]["prompt_logprobs"] == expected
    assert r["choices"][0]["logprobs"] is None
    # chat: on the response, as vLLM puts it
    chat = post(
        server, "chat/completions", {"messages": MESSAGES, "max_tokens": 2, "prompt_logprobs": 0}
    ).json()
    tokenizer = make_tokenizer()
    ids = tokenizer.encode_chat(MESSAGES)
    assert stub.calls[-1].prompt_token_ids == ids
    # top 0: only each token's own entry, its rank unknown
    assert chat["prompt_logprobs"] == [None] + [
        {
            str(t): {
                "logprob": -0.25 if i % 2 else -3.0 - i,
                "rank": None,
                "decoded_token": tokenizer.decode([t]),
            }
        }
        for i, t in enumerate(ids)
        if i > 0
    ]
    assert "prompt_logprobs" not in chat["choices"][0]
