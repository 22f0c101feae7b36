"""Issue 31 row 1: structured-output grammars compile off the engine's step thread. A request whose
grammar is still compiling waits outside the batch while other requests run to the end; a compile over
the time budget fails its requests with structured_output_too_complex (and a repeat of that spec fails
at admission); identical specs share one compile; specs over the size caps or a full compile queue
fail at admission, keeping nothing. The compiles are held on a gate (xgrammar's compile_regex, wrapped)
so every case is decided by the test, never by how fast a compile happens to be."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import xgrammar

from cluster.protocol import ErrorCode, FinishReason, SamplingParams, StructuredOutput, TokenDelta
from workers.engine import Engine
from workers.llm import LLM
from workers.structured_compile import CompileFailed, RequestFailure

GATE_BOUND_S = 30.0  # bound on a compile held at the gate (the test opens it long before)
PROMPT = "Say a or b: "


class Gate:
    """Holds every compile_regex call until ``open()``; counts calls and returns."""

    def __init__(self) -> None:
        self.opened = threading.Event()
        self.entered = threading.Semaphore(0)
        self.num_calls = 0
        self.num_returned = 0

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def gated(compiler: Any, *args: Any, **kwargs: Any) -> Any:
            self.num_calls += 1
            self.entered.release()
            self.opened.wait(GATE_BOUND_S)
            try:
                return original(compiler, *args, **kwargs)
            finally:
                self.num_returned += 1

        return gated

    def wait_entered(self, count: int = 1) -> None:
        for _ in range(count):
            assert self.entered.acquire(timeout=GATE_BOUND_S), "no compile reached the gate"


@pytest.fixture
def gate(monkeypatch: pytest.MonkeyPatch) -> Iterator[Gate]:
    g = Gate()
    monkeypatch.setattr(
        xgrammar.GrammarCompiler, "compile_regex", g.wrap(xgrammar.GrammarCompiler.compile_regex)
    )
    yield g
    g.opened.set()


def make_engine(**options: Any) -> Engine:
    return LLM(block_size=4, detokenize_thread=False, **options).engine


def regex(pattern: str, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=StructuredOutput("regex", pattern))


def step_until(engine: Engine, done: Callable[[], bool], seen: dict[str, list[TokenDelta]]) -> None:
    for _ in range(20000):
        if done():
            return
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).append(delta)
    raise AssertionError("condition not reached in 20000 steps")


def finished(seen: dict[str, list[TokenDelta]], request_id: str) -> bool:
    return bool(seen.get(request_id)) and seen[request_id][-1].finish_reason is not None


def test_issue31_row1_a_compiling_grammar_waits_outside_the_batch(gate: Gate) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("g", prompt, regex("(a|b)+"))  # returns at once: the compile waits at the gate
    engine.add_request("free", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    seen: dict[str, list[TokenDelta]] = {}
    step_until(engine, lambda: finished(seen, "free"), seen)
    assert sum(len(d.token_ids) for d in seen["free"]) == 4
    assert "g" not in seen and gate.num_returned == 0  # still compiling while "free" ran to its end
    assert "g" in engine.structured and engine.has_unfinished()
    gate.opened.set()
    step_until(engine, lambda: not engine.has_unfinished(), seen)
    text = "".join(d.text for d in seen["g"])
    assert seen["g"][-1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
    assert text and set(text) <= {"a", "b"}
    assert engine.take_failed() == []
    engine.check_no_leaks()


def test_issue31_row1_over_the_time_budget_is_too_complex_and_remembered(gate: Gate) -> None:
    engine = make_engine(structured_compile_timeout_s=0.2)
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("g", prompt, regex("(a|b)+"))
    engine.add_request("free", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    gate.wait_entered()
    seen: dict[str, list[TokenDelta]] = {}
    failed: list[RequestFailure] = []
    step_until(engine, lambda: bool(failed.extend(engine.take_failed()) or failed), seen)
    assert len(failed) == 1
    assert (failed[0].request_id, failed[0].code) == ("g", ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX)
    assert failed[0].message.startswith(
        "structured output did not compile within 0.2 s (structured_compile_timeout_s;"
    )
    assert "g" not in seen and "g" not in engine.structured  # ended without a delta, nothing kept
    # The same spec again fails at admission, without compiling (the first compile is still held).
    with pytest.raises(CompileFailed, match=r"did not compile within 0\.2 s") as refused:
        engine.add_request("again", prompt, regex("(a|b)+"))
    assert refused.value.code is ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX and gate.num_calls == 1
    gate.opened.set()
    step_until(engine, lambda: not engine.has_unfinished(), seen)
    assert finished(seen, "free")
    engine.check_no_leaks()


def test_issue31_row1_identical_specs_share_one_compile(gate: Gate) -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    for i in range(3):
        engine.add_request(f"same{i}", prompt, regex("(a|b)+", max_tokens=4))
    engine.add_request("other", prompt, regex("c+", max_tokens=4))
    gate.wait_entered(2)
    assert gate.num_calls == 2 and engine.structured.pool.num_shared == 2
    gate.opened.set()
    seen: dict[str, list[TokenDelta]] = {}
    step_until(engine, lambda: not engine.has_unfinished(), seen)
    assert sorted(seen) == ["other", "same0", "same1", "same2"]
    assert all(seen[r][-1].finish_reason is not None for r in seen)
    assert gate.num_calls == 2
    engine.check_no_leaks()


def test_issue31_row1_caps_and_a_full_queue_fail_at_admission(gate: Gate) -> None:
    engine = make_engine(
        structured_max_grammar_rules=3, structured_max_spec_chars=40, structured_max_pending_compiles=1
    )
    prompt = engine.tokenizer.encode(PROMPT)
    rules = 'root ::= a\na ::= b\nb ::= c\nc ::= "x"'
    with pytest.raises(CompileFailed) as over_rules:
        engine.add_request("rules", prompt, SamplingParams(structured=StructuredOutput("grammar", rules)))
    assert over_rules.value.code is ErrorCode.STRUCTURED_OUTPUT_TOO_COMPLEX
    assert str(over_rules.value) == (
        "structured output grammar has 4 rules, over the limit of 3 (structured_max_grammar_rules)"
    )
    with pytest.raises(
        CompileFailed, match=r"is 41 characters, over the limit of 40 \(structured_max_spec_chars\)"
    ):
        engine.add_request("chars", prompt, regex("a" * 41))
    engine.add_request("first", prompt, regex("(a|b)+", max_tokens=2))
    with pytest.raises(CompileFailed, match=r"the limit \(structured_max_pending_compiles\)") as full:
        engine.add_request("second", prompt, regex("b+", max_tokens=2))
    assert full.value.code is ErrorCode.QUEUE_FULL
    gate.opened.set()
    seen: dict[str, list[TokenDelta]] = {}
    step_until(engine, lambda: not engine.has_unfinished(), seen)
    assert sorted(seen) == ["first"] and gate.num_calls == 1
    engine.check_no_leaks()


def test_issue31_row1_a_spec_xgrammar_rejects_fails_after_admission() -> None:
    engine = make_engine()
    prompt = engine.tokenizer.encode(PROMPT)
    engine.add_request("bad", prompt, regex("(unclosed"))
    failed: list[RequestFailure] = []
    seen: dict[str, list[TokenDelta]] = {}
    step_until(engine, lambda: bool(failed.extend(engine.take_failed()) or failed), seen)
    assert [(f.request_id, f.code) for f in failed] == [("bad", ErrorCode.INVALID_REQUEST)]
    assert failed[0].message.startswith("invalid regex for structured output: ")
    assert not seen and not engine.has_unfinished()
    engine.check_no_leaks()


def test_issue31_row1_a_committed_handoff_waits_for_its_grammar(gate: Gate) -> None:
    """Decode side: the request is reserved and its KV lands while its grammar still compiles; it joins
    the batch once compiled, its matcher advanced over the first token (greedy: same as a whole run)."""
    whole = make_engine()
    prompt = whole.tokenizer.encode(PROMPT)
    params = SamplingParams(max_tokens=6, temperature=0.0, structured=StructuredOutput("regex", "(a|b)+"))
    gate.opened.set()
    whole.add_request("r", prompt, params)
    ref: dict[str, list[TokenDelta]] = {}
    step_until(whole, lambda: not whole.has_unfinished(), ref)
    ref_ids = [t for d in ref["r"] for t in d.token_ids]
    gate.opened.clear()
    decode = make_engine()
    reserved = decode.add_prefilled_request("r", prompt, ref_ids[0], params)
    assert reserved is not None
    decode.commit_prefilled("r")  # NOTE: the tiny model's KV is not copied: greedy tokens come from it alone
    assert decode.request_status("r") is not None and not decode.scheduler.running
    seen: dict[str, list[TokenDelta]] = {}
    for _ in range(5):
        seen_now = decode.step()
        assert seen_now == []  # nothing runs while the grammar is held
    gate.opened.set()
    step_until(decode, lambda: not decode.has_unfinished(), seen)
    assert seen["r"][-1].finish_reason is not None and len(decode.take_failed()) == 0
    decode.check_no_leaks()
