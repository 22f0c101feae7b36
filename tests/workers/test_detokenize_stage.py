"""Detokenization off the step thread: the same outputs as inline, stop strings end on the same token.

The engine with ``detokenize=False`` leaves text to a ``DetokenizerStage`` except for requests whose
text decides their end (stop strings) or travels with a handoff (held prefills); the offline LLM runs
the stage on its own thread.
"""

from __future__ import annotations

import threading

import pytest

from cluster.config import EngineConfig
from cluster.protocol import FinishReason, SamplingParams, TokenDelta
from workers.detokenizer import DetokenizerStage, IncrementalDetokenizer, detokenizes_on_step_thread
from workers.engine import BUNDLED_MODEL, Engine
from workers.llm import LLM

PROMPTS = ["Once upon a time", "The little dog", "In the morning the", "She said"]


@pytest.fixture(scope="module")
def inline_llm() -> LLM:
    return LLM(BUNDLED_MODEL, detokenize_thread=False)


@pytest.fixture(scope="module")
def threaded_llm() -> LLM:
    return LLM(BUNDLED_MODEL)


def _mixed_params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=24, temperature=0.0),
        SamplingParams(max_tokens=40, temperature=0.0, stop=[stop]),
        SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7),
        SamplingParams(max_tokens=30, temperature=0.0, stop=["zzzz-never"], ignore_eos=True),
    ]


def test_threaded_outputs_equal_inline_outputs(inline_llm: LLM, threaded_llm: LLM) -> None:
    free = inline_llm.generate([PROMPTS[1]], SamplingParams(max_tokens=40, temperature=0.0))[0]
    words = free.text.split()
    stop = " " + words[len(words) // 2]  # a word from the middle of the greedy text: the stop matches
    params = _mixed_params(stop)
    inline = inline_llm.generate(PROMPTS, params)
    threaded = threaded_llm.generate(PROMPTS, params)
    assert inline[1].finish_reason == FinishReason.STOP and stop not in inline[1].text
    assert inline[1].text == free.text[: free.text.index(stop)]
    for a, b in zip(inline, threaded, strict=True):
        assert (b.token_ids, b.text, b.finish_reason) == (a.token_ids, a.text, a.finish_reason)
    threaded_llm.check_no_leaks()


def test_engine_leaves_text_to_the_stage_except_stop_strings() -> None:
    engine = Engine(EngineConfig.from_options(BUNDLED_MODEL), detokenize=False)
    tok = engine.tokenizer
    assert tok is not None
    plain, stopped = SamplingParams(max_tokens=6, temperature=0.0), SamplingParams(max_tokens=6, stop=["zz"])
    engine.add_request("plain", tok.encode(PROMPTS[0]), plain)
    engine.add_request("stop", tok.encode(PROMPTS[0]), stopped)
    assert sorted(engine.detokenizers) == ["stop"]
    texts: dict[str, str] = {"plain": "", "stop": ""}
    while engine.has_unfinished():
        for delta in engine.step():
            texts[delta.request_id] += delta.text
    assert texts["plain"] == "" and texts["stop"] != ""
    engine.check_no_leaks()
    assert not detokenizes_on_step_thread(plain, False)
    assert detokenizes_on_step_thread(stopped, False) and detokenizes_on_step_thread(plain, True)


def test_stage_orders_deltas_passes_others_through_and_drops_state() -> None:
    engine = Engine(EngineConfig.from_options(BUNDLED_MODEL), detokenize=False)
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode(" the little dog ran home")
    seen: list[tuple[str, str]] = []
    stage = DetokenizerStage(tok, lambda ds: seen.extend((d.request_id, d.text) for d in ds), name="t")
    try:
        stage.add_request("a", [1, 2], SamplingParams())
        stage.add_request("b", [1, 2], SamplingParams())
        stage.add_request("s", [1, 2], SamplingParams(stop=["x"]))  # the engine's: not registered
        stage.submit([TokenDelta("a", ids[:2]), TokenDelta("s", [ids[0]], text="kept")])
        stage.call(lambda: seen.append(("call", "")))
        stage.submit([TokenDelta("a", ids[2:], finish_reason=FinishReason.LENGTH), TokenDelta("b", [ids[0]])])
        stage.drop("b")
        stage.flush(10.0)
        assert seen[1:3] == [("s", "kept"), ("call", "")]
        assert seen[0][0] == "a" and seen[3][0] == "a" and seen[4][0] == "b"
        assert seen[0][1] + seen[3][1] == tok.decode(ids)
        assert stage.num_requests == 0  # "a" finished, "b" dropped, "s" never registered
    finally:
        stage.close(10.0)
    assert not stage.thread.is_alive()


def test_stage_takes_two_deltas_of_one_request_in_one_submission_in_order() -> None:
    engine = Engine(EngineConfig.from_options(BUNDLED_MODEL), detokenize=False)
    tok = engine.tokenizer
    assert tok is not None
    ids = tok.encode(" the little dog ran home", add_special_tokens=False)
    texts: list[str] = []
    stage = DetokenizerStage(tok, lambda ds: texts.extend(d.text for d in ds), name="t")
    try:
        stage.add_request("a", [1, 2], SamplingParams())
        stage.add_request("b", [1, 2], SamplingParams())
        stage.submit(
            [
                TokenDelta("a", ids[:2]),
                TokenDelta("b", ids[:1]),
                TokenDelta("a", ids[2:], finish_reason=FinishReason.LENGTH),
            ]
        )
        stage.flush(10.0)
        a, b = (IncrementalDetokenizer(tok, [1, 2], []) for _ in range(2))
        a.update(ids[:2])
        b.update(ids[:1])
        assert texts[:2] == [a.get_delta(False), b.get_delta(False)] and texts[0]
        assert texts[0] + texts[2] == tok.decode(ids)
    finally:
        stage.close(10.0)


def test_stage_error_is_raised_by_flush() -> None:
    engine = Engine(EngineConfig.from_options(BUNDLED_MODEL), detokenize=False)
    assert engine.tokenizer is not None
    emitted = threading.Event()

    def emit(deltas: list[TokenDelta]) -> None:
        emitted.set()
        raise ValueError("sink broke")

    stage = DetokenizerStage(engine.tokenizer, emit, name="t")
    try:
        stage.submit([TokenDelta("x", [5])])
        with pytest.raises(RuntimeError, match="detokenizer stage failed") as info:
            stage.flush(10.0)
        assert isinstance(info.value.__cause__, ValueError) and emitted.is_set()
    finally:
        stage.close(10.0)
