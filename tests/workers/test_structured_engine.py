"""Structured outputs inside the engine (bundled model, CPU): every sampled token of a constrained request
is one its grammar allowed at that point (replayed through a fresh matcher), outputs parse and validate,
asynchronous scheduling gives the same tokens as synchronous (seeded, temperature 1.0), greedy rows are
masked too, logprobs are those of the masked distribution, both halves of a handoff and a preempted
request continue their grammar, and nothing per-request is left behind (the leak check covers the
matchers).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest

from cluster.protocol import FinishReason, SamplingParams, StructuredOutput, TokenDelta
from tests.support.schema_gen import random_schema
from workers.engine import Engine
from workers.llm import LLM
from workers.model_runner import ForwardStep, PendingStep
from workers.request import RequestStatus
from workers.sampler import MIN_LOGPROB

PROMPT = "Give me some JSON: "
MAX_TOKENS = 256
SCHEMAS = [random_schema(seed) for seed in range(20)]
CHOICES = ["yes", "no", "maybe not"]
REGEX = r"(cat|dog)-[0-9]{2,4}"


def json_spec(schema: dict[str, Any]) -> StructuredOutput:
    return StructuredOutput("json", json.dumps(schema))


def make_engine(is_async: bool = False, **options: Any) -> Engine:
    return LLM(block_size=4, async_scheduling=is_async, detokenize_thread=False, **options).engine


def drive(engine: Engine, on_delta: Callable[[TokenDelta], None] | None = None) -> dict[str, TokenDelta]:
    """Step until idle; returns one merged delta per request (tokens, text, logprobs, finish)."""
    seen: dict[str, TokenDelta] = {}
    for _ in range(5000):
        if not engine.has_unfinished():
            return seen
        for delta in engine.step():
            got = seen.setdefault(delta.request_id, TokenDelta(delta.request_id, [], logprobs=[]))
            assert got.finish_reason is None, f"delta after the end of {delta.request_id}"
            got.token_ids += delta.token_ids
            got.text += delta.text
            got.logprobs = (got.logprobs or []) + (delta.logprobs or [])
            got.finish_reason, got.error = delta.finish_reason, delta.error
            if on_delta is not None:
                on_delta(delta)
    raise AssertionError("engine still busy after 5000 steps")


def assert_every_token_allowed(engine: Engine, spec: StructuredOutput, token_ids: list[int]) -> None:
    """Replay through a fresh matcher: each token was in the mask of its position (the mask the engine
    applied is a function of the matcher's state), and the last one ended the grammar."""
    state = engine.structured.cache.matcher(spec)
    for i, token_id in enumerate(token_ids):
        assert token_id in state.allowed_token_ids(), f"token {token_id} at {i} was not allowed"
        assert state.accept(token_id)
    assert state.is_terminated


def count_deferred_steps(engine: Engine) -> list[int]:
    """Spy: how many steps the engine sampled in a second half (``runner.sample`` outside ``launch``)."""
    runner, count = engine.runner, [0, 0]  # [launches, samples]
    launch, sample = runner.launch, runner.sample

    def counting_launch(*args: Any) -> PendingStep:
        count[0] += 1
        return launch(*args)

    def counting_sample(forward: ForwardStep, mask: Any = None) -> PendingStep:
        count[1] += 1
        return sample(forward, mask)

    runner.launch, runner.sample = counting_launch, counting_sample  # type: ignore[method-assign]
    return count


def test_random_schemas_every_token_allowed_and_async_equals_sync() -> None:
    """20 seeded schemas at temperature 1.0 beside two free-text requests in one batch."""
    runs: list[dict[str, TokenDelta]] = []
    free = SamplingParams(max_tokens=12, temperature=1.0, seed=7, ignore_eos=True)
    for is_async in (False, True):
        engine = make_engine(is_async)
        spy = count_deferred_steps(engine)
        prompt = engine.tokenizer.encode(PROMPT)
        for i, schema in enumerate(SCHEMAS):
            params = SamplingParams(
                max_tokens=MAX_TOKENS, temperature=1.0, seed=100 + i, structured=json_spec(schema)
            )
            engine.add_request(f"s{i}", prompt, params)
        engine.add_request("free0", prompt, free)
        engine.add_request("free1", prompt[:3], free)
        seen = drive(engine)
        for i, schema in enumerate(SCHEMAS):
            out = seen[f"s{i}"]
            assert out.finish_reason == FinishReason.STOP, (i, out.text)
            jsonschema.validate(json.loads(out.text), schema)
            assert_every_token_allowed(engine, json_spec(schema), out.token_ids)
        engine.check_no_leaks()
        # NOTE: a structured step waits for the previous step's tokens only under async scheduling.
        assert spy[1] - spy[0] > 0 if is_async else spy[1] == spy[0]
        runs.append(seen)
    sync, async_ = runs
    assert {r: d.token_ids for r, d in async_.items()} == {r: d.token_ids for r, d in sync.items()}
    # The free-text rows are untouched by the masks of their batch: as when they run alone.
    alone = make_engine()
    prompt = alone.tokenizer.encode(PROMPT)
    alone.add_request("free0", prompt, free)
    alone.add_request("free1", prompt[:3], free)
    assert {r: d.token_ids for r, d in drive(alone).items()} == {
        r: sync[r].token_ids for r in ("free0", "free1")
    }


def test_greedy_rows_are_masked_and_ignore_eos_ends_with_the_grammar() -> None:
    """All rows greedy: without a mask this batch takes the argmax-only fast path; with one it must not."""
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    specs = {
        "schema": json_spec(SCHEMAS[3]),
        "regex": StructuredOutput("regex", REGEX),
        "choice": StructuredOutput("choice", choices=CHOICES),
        "grammar": StructuredOutput("grammar", 'root ::= "(" [a-z]{1,6} ")"'),
    }
    for name, spec in specs.items():
        engine.add_request(
            name, prompt, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, structured=spec)
        )
    engine.add_request("ignore_eos", prompt, SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True,
                                                            structured=specs["choice"]))  # fmt: skip
    engine.add_request("free", prompt, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))
    seen = drive(engine)
    assert all(seen[name].finish_reason == FinishReason.STOP for name in [*specs, "ignore_eos"])
    jsonschema.validate(json.loads(seen["schema"].text), SCHEMAS[3])
    assert re.fullmatch(REGEX, seen["regex"].text)
    assert seen["choice"].text in CHOICES and seen["ignore_eos"].text == seen["choice"].text
    assert re.fullmatch(r"\([a-z]{1,6}\)", seen["grammar"].text)
    for name, spec in specs.items():
        assert_every_token_allowed(engine, spec, seen[name].token_ids)
    # The same prompt unconstrained is none of these (the masks did the work).
    alone = LLM(block_size=4).generate([prompt], greedy)[0].text
    assert alone not in CHOICES and not re.fullmatch(REGEX, alone) and not alone.startswith("{")
    assert len(seen["free"].token_ids) == 12
    engine.check_no_leaks()


def test_logprobs_are_of_the_masked_distribution() -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    spec = StructuredOutput("choice", choices=CHOICES)
    engine.add_request(
        "c", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=3, logprobs=20, structured=spec)
    )
    out = drive(engine)["c"]
    assert out.finish_reason == FinishReason.STOP and out.text in CHOICES and out.logprobs
    state = engine.structured.cache.matcher(spec)
    for token_id, entry in zip(out.token_ids, out.logprobs, strict=True):
        allowed = set(state.allowed_token_ids())
        assert entry.top_token_ids[: len(allowed)] and len(allowed) <= 20
        # Allowed tokens share all the mass; every other one is reported as MIN_LOGPROB (-inf masked).
        assert set(entry.top_token_ids[: len(allowed)]) == allowed
        assert entry.top_logprobs[len(allowed) :] == [MIN_LOGPROB] * (20 - len(allowed))
        assert math.fsum(math.exp(lp) for lp in entry.top_logprobs[: len(allowed)]) == pytest.approx(
            1.0, abs=1e-5
        )
        assert math.isfinite(entry.logprob) and entry.logprob > MIN_LOGPROB
        assert state.accept(token_id)
    engine.check_no_leaks()


@pytest.mark.parametrize("is_async", [False, True])
def test_handoff_and_recompute_continue_the_grammar(is_async: bool) -> None:
    """Prefill engine (held after its first token, sampled under the mask) -> its KV copied into the
    blocks a decode engine reserved -> the decode engine's matcher starts after that token. Equal to the
    request run whole, and to the recompute fallback (``add_request(output_token_ids=[first])``), and to
    a decode engine that reserved its blocks before the prefill ran (early admission: the first token
    comes with the commit)."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=42, structured=json_spec(SCHEMAS[9]))
    whole = make_engine(is_async)
    prompt = whole.tokenizer.encode(PROMPT)
    whole.add_request("r", prompt, params)
    ref = drive(whole)["r"]
    assert ref.finish_reason == FinishReason.STOP

    prefill, decode, recompute = make_engine(is_async), make_engine(is_async), make_engine(is_async)
    early = make_engine(is_async)
    early_reserved = early.add_prefilled_request("r", prompt, None, params)
    assert early_reserved is not None and early_reserved[1] == 0
    prefill.add_request("r", prompt, params, hold_after_prefill=True)
    first = drive(prefill)["r"]
    assert first.token_ids == ref.token_ids[:1] and prefill.request_status("r") == RequestStatus.SENDING_KV
    bad = prefill.tokenizer.encode("x", add_special_tokens=False)[0]
    decode.validate(prompt, params)  # NOTE: compiles the grammar (blocking), so the token is checked now
    with pytest.raises(ValueError, match=f"token {bad} .output position 0. does not fit"):
        decode.add_prefilled_request("r", prompt, bad, params)
    decode.check_no_leaks()
    reserved = decode.add_prefilled_request("r", prompt, first.token_ids[0], params)
    assert reserved is not None
    blocks, num_cached = reserved
    source = prefill.held_block_ids("r")
    assert source is not None and num_cached == 0
    decode.runner.kv_cache[:, blocks] = prefill.runner.kv_cache[:, source[: len(blocks)]]
    early.runner.kv_cache[:, early_reserved[0]] = prefill.runner.kv_cache[:, source[: len(blocks)]]
    prefill.release("r")
    decode.commit_prefilled("r")
    rest = drive(decode)["r"]
    early.commit_prefilled("r", first.token_ids[0])
    assert drive(early)["r"].token_ids == ref.token_ids[1:]
    recompute.add_request("r", prompt, params, output_token_ids=first.token_ids)
    recomputed = drive(recompute)["r"]
    assert rest.token_ids == recomputed.token_ids == ref.token_ids[1:]
    assert rest.finish_reason == recomputed.finish_reason == FinishReason.STOP
    for engine in (whole, prefill, decode, recompute, early):
        engine.check_no_leaks()


@pytest.mark.parametrize("is_async", [False, True])
def test_preempted_requests_resume_their_grammar(is_async: bool) -> None:
    """A KV pool too small for the batch: requests are preempted (recomputed from their tokens so far)
    and their matchers, which keep standing after those tokens, carry on. Same tokens as a roomy pool."""
    runs = []
    for num_blocks in (None, 64):
        engine = make_engine(is_async, num_kv_blocks=num_blocks)
        prompt = engine.tokenizer.encode(PROMPT)
        for i in range(6):
            params = SamplingParams(max_tokens=160, temperature=1.0, seed=i, structured=json_spec(SCHEMAS[i]))
            engine.validate(prompt, params)  # NOTE: compiled now, so all six join the same first step
            engine.add_request(f"s{i}", prompt, params)
        seen = drive(engine)
        for i in range(6):
            assert seen[f"s{i}"].finish_reason == FinishReason.STOP
            jsonschema.validate(json.loads(seen[f"s{i}"].text), SCHEMAS[i])
            assert_every_token_allowed(engine, json_spec(SCHEMAS[i]), seen[f"s{i}"].token_ids)
        engine.check_no_leaks()
        runs.append((engine.stats().num_preemptions, {r: d.token_ids for r, d in seen.items()}))
    (roomy_preemptions, roomy), (tight_preemptions, tight) = runs
    assert roomy_preemptions == 0 and tight_preemptions > 0
    assert tight == roomy


def test_bad_specs_are_value_errors_and_aborts_free_the_matcher() -> None:
    llm = LLM(block_size=4, detokenize_thread=False)  # driven directly below: its deltas carry text
    engine = llm.engine
    prompt = engine.tokenizer.encode(PROMPT)
    good = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "a+"))
    bad = SamplingParams(max_tokens=8, structured=StructuredOutput("regex", "(unclosed"))
    with pytest.raises(ValueError, match="invalid regex for structured output"):
        engine.validate(prompt, bad)
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate([prompt, prompt], [good, bad])  # validated (compiled) before anything is queued
    engine.check_no_leaks()
    engine.add_request(
        "a", prompt, SamplingParams(max_tokens=64, temperature=1.0, seed=1, structured=json_spec(SCHEMAS[0]))
    )
    engine.add_request("w", prompt, good)

    def abort_a(delta: TokenDelta) -> None:
        if delta.request_id == "a" and "a" in engine.structured:
            assert engine.abort("a")

    seen = drive(engine, abort_a)
    assert len(seen["a"].token_ids) == 1 and seen["a"].finish_reason is None
    assert seen["w"].text == "a" * len(seen["w"].text) and seen["w"].text
    assert len(engine.structured) == 0
    engine.check_no_leaks()
    # Compiled once each (a failed compile is not cached), then found: validate() and add_request().
    cache = engine.structured.cache
    assert (cache.num_misses, len(cache)) == (2, 2) and cache.num_hits > 0


def test_a_token_the_grammar_forbids_ends_the_request_with_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's own check: with the mask kept from the sampler, the first forbidden token fails the
    request (never text outside the grammar) and its state is freed."""
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    spec = StructuredOutput("choice", choices=CHOICES)
    engine.add_request("c", prompt, SamplingParams(max_tokens=16, temperature=1.0, seed=5, structured=spec))
    monkeypatch.setattr(engine.structured, "step_mask", lambda sample_ids: None)
    out = drive(engine)["c"]
    assert out.finish_reason == FinishReason.ERROR and out.error is not None
    assert re.fullmatch(r"sampled token \d+ is not allowed by the request's structured output", out.error)
    state = engine.structured.cache.matcher(spec)
    assert all(state.accept(t) for t in out.token_ids[:-1]) and not state.accept(out.token_ids[-1])
    engine.check_no_leaks()
