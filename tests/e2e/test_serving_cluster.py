"""The HTTP front on a live cluster (1 prefill + 1 decode worker, CPU, gloo, the bundled model): the
official ``openai`` client against it, equality with the offline ``LLM``, 64 concurrent streams with
disconnects and no leaked block, every dashboard metric exported, and 400s that leave it serving."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from cluster.client.sdk import AsyncClient
from cluster.protocol import RequestOutput, SamplingParams
from deploy.http_host import HttpServerHandle, start_http
from deploy.launch import Cluster, build_cluster
from tests.cluster.test_metrics import (
    DASHBOARD,
    dashboard_metric_names,
    exported_families,
    samples,
    unresolved,
)
from tests.support.cluster_utils import cluster_config, wait_for
from workers.engine import BUNDLED_MODEL
from workers.llm import LLM

pytestmark = pytest.mark.slow

# NOTE: the offline LLM gets exactly the workers' engine options, so greedy outputs must match token for
# token (cluster_config's defaults; see tests/support/cluster_utils.py).
ENGINE_OPTIONS: dict[str, Any] = {
    "device": "cpu",
    "block_size": 4,
    "num_kv_blocks": 512,
    "max_num_batched_tokens": 256,
}
PROMPTS = ["Once upon a time", "The little robot", "One day, a girl named Lily"]
CHAT_TEXT = "Tell me a story about a cat."
CHAT: list[ChatCompletionMessageParam] = [{"role": "user", "content": CHAT_TEXT}]
MAX_TOKENS = 24
MODEL = "pdserve-tiny"
NUM_STREAMS = 64
NUM_DISCONNECTS = 7  # every tenth stream (~10%) goes away after a few chunks


def _ids(choice: Any) -> list[int]:
    """pdserve's ``token_ids`` extension field of an openai choice."""
    ids: list[int] = choice.model_extra["token_ids"]
    return ids


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cfg = cluster_config(BUNDLED_MODEL, engine=ENGINE_OPTIONS)
    handle = build_cluster(cfg)
    yield handle
    handle.shutdown()


@pytest.fixture(scope="module")
def http(cluster: Cluster) -> Iterator[HttpServerHandle]:
    with start_http(cluster) as server:
        yield server


@pytest.fixture(scope="module")
def oai(http: HttpServerHandle) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{http.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def offline_llm() -> LLM:
    return LLM(BUNDLED_MODEL, **ENGINE_OPTIONS)


@pytest.fixture(scope="module")
def offline(offline_llm: LLM) -> dict[str, RequestOutput]:
    """Greedy outputs (with 3 logprobs) of the offline engine for PROMPTS and the CHAT conversation."""
    llm = offline_llm
    chat_ids = llm.tokenizer.encode_chat([{"role": "user", "content": CHAT_TEXT}], True)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, logprobs=3)
    outs = llm.generate([llm.tokenizer.encode(p) for p in PROMPTS] + [chat_ids], params)
    llm.check_no_leaks()
    return dict(zip([*PROMPTS, "chat"], outs, strict=True))


def test_completions_and_chat_equal_offline_llm(
    oai: openai.OpenAI, offline: dict[str, RequestOutput]
) -> None:
    batch = oai.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=MAX_TOKENS, temperature=0)
    for choice, prompt in zip(batch.choices, PROMPTS, strict=True):
        ref = offline[prompt]
        assert (choice.text, _ids(choice)) == (ref.text, ref.token_ids)
        assert choice.finish_reason == ref.finish_reason.value if ref.finish_reason else None
    assert batch.usage is not None
    assert batch.usage.completion_tokens == sum(len(offline[p].token_ids) for p in PROMPTS)

    stream = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stream=True
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks) == offline[PROMPTS[0]].text
    assert [t for c in chunks for t in _ids(c.choices[0])] == offline[PROMPTS[0]].token_ids
    assert len(chunks) > 2  # it really streamed

    ref = offline["chat"]
    chat = oai.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=MAX_TOKENS, temperature=0)
    assert chat.choices[0].message.content == ref.text
    assert _ids(chat.choices[0]) == ref.token_ids
    chat_stream = oai.chat.completions.create(
        model=MODEL,
        messages=CHAT,
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts = list(chat_stream)
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ref.text
    assert parts[-1].usage is not None and parts[-1].usage.completion_tokens == len(ref.token_ids)


def test_stop_strings_seeds_and_logprobs(oai: openai.OpenAI, offline: dict[str, RequestOutput]) -> None:
    full = offline[PROMPTS[0]].text
    stop = full.split()[len(full.split()) // 2]
    cut = oai.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, stop=[stop]
    )
    assert (cut.choices[0].text, cut.choices[0].finish_reason) == (full[: full.index(stop)], "stop")

    def sample(seed: int, stream: bool = False) -> str:
        kwargs: dict[str, Any] = {
            "model": MODEL,
            "prompt": PROMPTS[1],
            "max_tokens": 16,
            "temperature": 1.0,
            "seed": seed,
        }
        if stream:
            return "".join(c.choices[0].text for c in oai.completions.create(stream=True, **kwargs))
        return oai.completions.create(**kwargs).choices[0].text

    first = sample(1234)
    assert sample(1234) == first
    assert sample(1234, stream=True) == first
    assert len({first, sample(1), sample(2), sample(3)}) > 1  # seeds do steer sampling

    for prompt in (PROMPTS[2], "chat"):
        ref = offline[prompt].logprobs
        assert ref is not None
        if prompt == "chat":
            c = oai.chat.completions.create(
                model=MODEL,
                messages=CHAT,
                max_tokens=MAX_TOKENS,
                temperature=0,
                logprobs=True,
                top_logprobs=3,
            )
            assert c.choices[0].logprobs is not None and c.choices[0].logprobs.content is not None
            got = [(e.logprob, [t.logprob for t in e.top_logprobs]) for e in c.choices[0].logprobs.content]
        else:
            r = oai.completions.create(
                model=MODEL, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=3
            )
            lp = r.choices[0].logprobs
            assert lp is not None and lp.token_logprobs is not None and lp.top_logprobs is not None
            got = [
                (x, sorted(top.values(), reverse=True))
                for x, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True)
            ]
        assert len(got) == len(ref)
        for (logprob, tops), want in zip(got, ref, strict=True):
            assert logprob == pytest.approx(want.logprob, abs=1e-4)
            # NOTE: completions key top logprobs by token text, so two ids with one spelling merge.
            assert tops == pytest.approx(sorted(want.top_logprobs, reverse=True)[: len(tops)], abs=1e-4)
            assert logprob == pytest.approx(max(tops), abs=1e-6)  # greedy picks the top token


def test_sampling_options_through_the_openai_client_equal_offline(
    oai: openai.OpenAI, offline_llm: LLM
) -> None:
    """A new user's request with vLLM's sampling options (OpenAI's fields, vLLM's in ``extra_body``) gives,
    through the live disaggregated cluster, the offline engine's tokens and text; echo puts the prompt
    first."""
    tok = offline_llm.tokenizer
    prompt_ids = tok.encode(PROMPTS[0])
    greedy = offline_llm.generate([prompt_ids], SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0))[0]
    bias = {str(greedy.token_ids[1]): -100}  # NOTE: the greedy second token banned: the output must change
    params = SamplingParams(
        max_tokens=MAX_TOKENS,
        temperature=0.0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        repetition_penalty=1.2,
        logit_bias={greedy.token_ids[1]: -100.0},
        min_tokens=4,
        bad_words=["the"],
    )
    want = offline_llm.generate([prompt_ids], params)[0]
    assert want.token_ids != greedy.token_ids
    got = oai.completions.create(
        model=MODEL,
        prompt=PROMPTS[0],
        max_tokens=MAX_TOKENS,
        temperature=0,
        presence_penalty=0.5,
        frequency_penalty=0.3,
        logit_bias=bias,  # type: ignore[arg-type]
        echo=True,
        extra_body={"repetition_penalty": 1.2, "min_tokens": 4, "bad_words": ["the"]},
    )
    assert _ids(got.choices[0]) == want.token_ids
    assert got.choices[0].text == PROMPTS[0] + want.text


def _abort_count(http: HttpServerHandle) -> float:
    text = httpx.get(f"{http.url}/metrics").text
    return sum(
        v
        for (name, labels), v in samples(text, model=MODEL).items()
        if name == "pdserve_requests_total" and ("finish_reason", "abort") in labels
    )


def test_64_concurrent_streams_equal_offline_tokens_disconnects_and_no_leaks(
    cluster: Cluster, http: HttpServerHandle, offline_llm: LLM
) -> None:
    rng = random.Random(7)
    prompts = [[rng.randrange(10, 600) for _ in range(rng.randint(4, 80))] for _ in range(NUM_STREAMS)]
    is_disconnect = [i % 10 == 0 for i in range(NUM_STREAMS)]
    # NOTE: a disconnect is an abort only while its request still runs, so those streams may run to the
    # full context (~2,000 decode steps: seconds, not the ~0.5 s of 400 tokens a busy client could lag).
    limit = cluster.model_info.max_model_len
    max_tokens = [limit - len(prompts[i]) if gone else 4 + i % 13 for i, gone in enumerate(is_disconnect)]
    # NOTE: greedy continuations are prefixes of each other: a disconnect's first tokens (3 or more: a
    # chunk carries what its stream's client had not taken yet) are checked against 8 offline ones
    offline_outs = offline_llm.generate(
        prompts,
        [SamplingParams(max_tokens=8 if gone else m, temperature=0.0, ignore_eos=True)
         for gone, m in zip(is_disconnect, max_tokens, strict=True)],
    )  # fmt: skip
    expected = [o.token_ids for o in offline_outs]
    aborts_before = _abort_count(http)

    async def one(client: AsyncClient, i: int) -> tuple[list[int], str | None]:
        stream = await client.completions.create(
            prompt=prompts[i], max_tokens=max_tokens[i], temperature=0, ignore_eos=True, stream=True
        )
        tokens: list[int] = []
        async for delta in stream:
            tokens += delta.token_ids
            if is_disconnect[i] and len(tokens) >= 3:
                await stream.aclose()  # disconnect mid-stream
                return tokens, None
        assert tokens == stream.result.token_ids
        return tokens, stream.result.finish_reason

    async def main() -> list[tuple[list[int], str | None]]:
        async with AsyncClient(http.url, max_retries=0, timeout=120) as client:
            return list(await asyncio.gather(*(one(client, i) for i in range(NUM_STREAMS))))

    results = asyncio.run(main())
    got = [tokens[:8] if gone else tokens for (tokens, _), gone in zip(results, is_disconnect, strict=True)]
    assert got == [
        exp[: len(tokens)] if gone else exp
        for exp, tokens, gone in zip(expected, got, is_disconnect, strict=True)
    ]
    assert [reason for _, reason in results] == [None if gone else "length" for gone in is_disconnect]
    assert [
        len(tokens) >= 3 if gone else len(tokens) == m
        for (tokens, _), gone, m in zip(results, is_disconnect, max_tokens, strict=True)
    ] == [True] * NUM_STREAMS
    assert sum(is_disconnect) == NUM_DISCONNECTS
    # every disconnect became an abort at the server (bounded wait: the server notices asynchronously)
    counts: list[float] = []

    def aborts_counted() -> bool:
        counts.append(_abort_count(http) - aborts_before)
        return counts[-1] >= NUM_DISCONNECTS

    try:
        wait_for(aborts_counted, 30, "aborts counted")
    except TimeoutError:
        raise AssertionError(f"aborts counted after the disconnects (last polls): {counts[-3:]}") from None
    cluster.wait_until_quiet(timeout_s=30)
    assert _abort_count(http) - aborts_before == NUM_DISCONNECTS, counts
    assert cluster.check_leaks() == {"prefill-0": None, "decode-0": None}


def test_every_dashboard_metric_is_exported_after_real_traffic(
    oai: openai.OpenAI, http: HttpServerHandle
) -> None:
    assert oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text
    with pytest.raises(openai.BadRequestError):  # an error, so the error counter has a series too
        oai.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=0)
    names = dashboard_metric_names(json.loads(DASHBOARD.read_text()))
    assert len(names) >= 20
    families = exported_families(httpx.get(f"{http.url}/metrics").text)
    assert unresolved(names, families) == []
    # the workers' own stats arrived through the router (both pools present)
    worker_kv = {
        labels
        for (name, labels) in samples(httpx.get(f"{http.url}/metrics").text, model=MODEL)
        if name == "pdserve_kv_cache_free_blocks"
    }
    assert worker_kv == {
        (("pool", "prefill"), ("worker", "prefill-0")),
        (("pool", "decode"), ("worker", "decode-0")),
    }


def test_prompt_over_max_model_len_is_400_and_the_cluster_keeps_serving(
    cluster: Cluster, oai: openai.OpenAI
) -> None:
    limit = cluster.model_info.max_model_len
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.completions.create(model=MODEL, prompt=[11] * (limit + 1), max_tokens=1)
    assert too_long.value.status_code == 400
    assert f"maximum context length is {limit} tokens" in str(too_long.value)
    assert too_long.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as overflow:
        oai.completions.create(model=MODEL, prompt=[11] * (limit - 4), max_tokens=8)
    assert f"you requested {limit + 4} tokens ({limit - 4} in your prompt; 8 for the completion)" in str(
        overflow.value
    )
    out = oai.completions.create(
        model=MODEL, prompt=[11] * (limit - 4), max_tokens=4, temperature=0, extra_body={"ignore_eos": True}
    )
    assert len(_ids(out.choices[0])) == 4
    cluster.wait_until_quiet(timeout_s=30)
    assert cluster.check_leaks() == {"prefill-0": None, "decode-0": None}
