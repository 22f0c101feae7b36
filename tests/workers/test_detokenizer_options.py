"""Issue 34, the worker's text options, against the bundled pdserve-tiny tokenizer (byte-level BPE; <s>,
</s>, <|im_start|>, <|im_end|> are special): include_stop_str_in_output keeps a matched stop string (the
text ends where it ends), skip_special_tokens False keeps special tokens, the token that ends a request
stays out of the text (vLLM's), min_tokens defers stop strings; the request's params reach the
detokenizer on the step thread and on the DetokenizerStage; bad_words resolve by vLLM's rule, offline
as at the edge."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path

import pytest

from cluster.protocol import FinishReason, SamplingParams, TokenDelta
from cluster.tokenizer import Tokenizer
from workers.detokenizer import (
    DetokenizerStage,
    IncrementalDetokenizer,
    detokenizes_on_step_thread,
    update_all,
)
from workers.llm import LLM

TINY = Path(__file__).resolve().parents[2] / "workers" / "assets" / "pdserve-tiny"
TEXT = "Hello world, the end. More words here"
# TEXT's tokens: 'Hello' ' w' 'or' 'ld' ',' ' the' ' end' '.' ' M' 'ore' ' w' 'or' 'd' 's' ' he' 're'
CHAT = "<|im_start|>assistant\nHi there<|im_end|>"  # <|im_end|> (4) is one of the model's EOS ids
IM_END = 4


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    t = Tokenizer.from_pretrained(TINY)
    assert t is not None
    return t


def feed(
    detok: IncrementalDetokenizer, ids: list[int], stop_terminated: bool = False
) -> tuple[list[str], int]:
    """Each id in turn (the last one ends the request when ``stop_terminated``): the streamed deltas and
    the index of the id whose update matched a stop string (-1: none)."""
    deltas, matched_at = [], -1
    for i, token_id in enumerate(ids):
        is_last = i == len(ids) - 1
        if detok.update([token_id], stop_terminated and is_last) is not None:
            matched_at = i
        deltas.append(detok.get_delta(finished=is_last or detok.stop_matched is not None))
        if detok.stop_matched is not None:
            break
    return deltas, matched_at


def test_include_stop_str_in_output_ends_the_text_where_the_stop_string_ends(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    kept = IncrementalDetokenizer(tok, [], ["the e"], include_stop_str_in_output=True)
    cut = IncrementalDetokenizer(tok, [], ["the e"])
    kept_deltas, kept_at = feed(kept, ids)
    cut_deltas, cut_at = feed(cut, ids)
    # "the e" ends inside the token ' end' (index 6): the text ends mid-token, as vLLM's
    assert (kept.output_text, kept.stop_matched, kept_at) == ("Hello world, the e", "the e", 6)
    assert (cut.output_text, cut.stop_matched, cut_at) == ("Hello world, ", "the e", 6)
    assert "".join(kept_deltas) == "Hello world, the e" and "".join(cut_deltas) == "Hello world, "
    # nothing is trimmed when the stop string stays, so nothing is held back while streaming
    assert kept_deltas[:2] == ["Hello", " w"]
    assert cut_deltas[:2] == ["H", "el"]  # the last len("the e") - 1 characters wait


def test_min_tokens_defers_stop_strings(tok: Tokenizer) -> None:
    ids = tok.encode(TEXT, add_special_tokens=False)
    early = IncrementalDetokenizer(tok, [], [" w"])
    late = IncrementalDetokenizer(tok, [], [" w"], min_tokens=5)
    assert feed(early, ids)[1] == 1 and early.output_text == "Hello"
    # the ' w' of token 1 falls within the first 5 tokens: only the next one (token 10) stops it
    assert feed(late, ids)[1] == 10 and late.output_text == "Hello world, the end. More"


def test_skip_special_tokens_false_keeps_them_in_the_text(tok: Tokenizer) -> None:
    ids = tok.encode(CHAT, add_special_tokens=False)
    assert ids[0] in tok.special_token_ids and ids[-1] == IM_END
    kept = IncrementalDetokenizer(tok, [1], [], skip_special_tokens=False)
    skipped = IncrementalDetokenizer(tok, [1], [])
    assert "".join(feed(kept, ids)[0]) == CHAT
    assert "".join(feed(skipped, ids)[0]) == "assistant\nHi there"


def test_the_token_that_ends_a_request_stays_out_of_the_text(tok: Tokenizer) -> None:
    chat_ids = tok.encode(CHAT, add_special_tokens=False)
    kept = IncrementalDetokenizer(tok, [], [], skip_special_tokens=False)
    assert "".join(feed(kept, chat_ids, stop_terminated=True)[0]) == "<|im_start|>assistant\nHi there"
    with_stop = IncrementalDetokenizer(
        tok, [], [], skip_special_tokens=False, include_stop_str_in_output=True
    )
    assert "".join(feed(with_stop, chat_ids, stop_terminated=True)[0]) == CHAT
    # a stop token id that is plain text (' the') is left out likewise
    text_ids = tok.encode(TEXT, add_special_tokens=False)[:6]
    plain = IncrementalDetokenizer(tok, [], [])
    assert "".join(feed(plain, text_ids, stop_terminated=True)[0]) == "Hello world,"


def test_update_all_with_options_matches_one_by_one(tok: Tokenizer) -> None:
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    chat_ids = tok.encode(CHAT, add_special_tokens=False)
    options = [
        ({"stop": ["the e"], "include_stop_str_in_output": True}, text_ids),
        ({"stop": [" w"], "min_tokens": 5}, text_ids),
        ({"stop": [], "skip_special_tokens": False}, chat_ids),
        ({"stop": [], "skip_special_tokens": False, "include_stop_str_in_output": True}, chat_ids),
        ({"stop": []}, chat_ids),
    ]
    one = [IncrementalDetokenizer(tok, [1], **kw) for kw, _ in options]  # type: ignore[arg-type]
    batch = [IncrementalDetokenizer(tok, [1], **kw) for kw, _ in options]  # type: ignore[arg-type]
    num_steps = max(len(ids) for _, ids in options)
    for step in range(num_steps):
        new = [ids[step : step + 1] for _, ids in options]
        ends = [step == len(ids) - 1 for _, ids in options]
        expected = [d.update(n, e) for d, n, e in zip(one, new, ends, strict=True)]
        assert update_all(tok, batch, new, ends) == expected
    assert [d.output_text for d in batch] == [d.output_text for d in one]
    assert [d.output_text for d in one] == [
        "Hello world, the e",
        "Hello world, the end. More",
        "<|im_start|>assistant\nHi there",
        CHAT,
        "assistant\nHi there",
    ]


def test_the_request_params_reach_the_detokenizer_and_the_stage(tok: Tokenizer) -> None:
    params = SamplingParams(
        stop=["x"], skip_special_tokens=False, include_stop_str_in_output=True, min_tokens=3
    )
    detok = IncrementalDetokenizer.for_request(tok, [1], params)
    assert (detok.stop, detok.skip_special_tokens, detok.include_stop_str_in_output, detok.min_tokens) == (
        ["x"],
        False,
        True,
        3,
    )
    # the text options alone leave a request's text to the stage (the fast path); stop strings do not
    assert not detokenizes_on_step_thread(SamplingParams(skip_special_tokens=False), False)
    assert not detokenizes_on_step_thread(SamplingParams(include_stop_str_in_output=True), False)
    assert detokenizes_on_step_thread(SamplingParams(stop=["x"], include_stop_str_in_output=True), False)

    emitted: list[TokenDelta] = []
    stage = DetokenizerStage(tok, emitted.extend, name="test-detok-options")
    chat_ids = tok.encode(CHAT, add_special_tokens=False)
    stage.add_request("kept", [1], SamplingParams(skip_special_tokens=False))
    stage.add_request("skipped", [1], SamplingParams())
    for i, token_id in enumerate(chat_ids):
        end = FinishReason.STOP if i == len(chat_ids) - 1 else None  # ends on its EOS, <|im_end|>
        stage.submit(
            [
                TokenDelta("kept", [token_id], finish_reason=end),
                TokenDelta("skipped", [token_id], finish_reason=end),
            ]
        )
    stage.flush(10.0)
    stage.close(10.0)
    texts = {"kept": "", "skipped": ""}
    for delta in emitted:
        texts[delta.request_id] += delta.text
    assert texts == {"kept": "<|im_start|>assistant\nHi there", "skipped": "assistant\nHi there"}
    assert stage.num_requests == 0


def test_bad_words_resolve_by_vllms_rule(tok: Tokenizer) -> None:
    # 'hello' and ' hello' start with different tokens and are as long: both kept; ' the' is one token
    # where 'the' is two: only the bare form; leading spaces are stripped first; repeats are dropped;
    # a special token's text is that token
    words = ["hello", "the", " world", "hello", "<|im_end|>"]
    expected = [[261, 680], [302, 680], [88, 261], [91, 306, 1084], [266, 306, 1084], [IM_END]]
    assert tok.bad_words_token_ids(words) == expected
    assert expected[0] == tok.encode("hello", add_special_tokens=False)
    assert expected[1] == tok.encode(" hello", add_special_tokens=False)
    assert tok.encode(" the", add_special_tokens=False) == [265]
    with pytest.raises(ValueError, match="encodes to no token"):
        tok.bad_words_token_ids(["   "])


@pytest.fixture(scope="module", params=[False, True], ids=["inline", "stage"])
def llm(request: pytest.FixtureRequest) -> Iterator[LLM]:
    yield LLM(device="cpu", block_size=4, num_kv_blocks=64, detokenize_thread=request.param)


def test_offline_llm_serves_the_text_options(llm: LLM, tok: Tokenizer) -> None:
    prompt = tok.encode("Once upon a time")
    free = llm.generate([prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))[0]
    # a stop token id (here a plain-text token): its id ends the output, its text does not (vLLM's)
    k = next(i for i, t in enumerate(free.token_ids) if i >= 3 and t not in tok.special_token_ids)
    stop_id = free.token_ids[k]
    k = free.token_ids.index(stop_id)
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_token_ids=[stop_id])
    cut = llm.generate([prompt], params)[0]
    kept = llm.generate([prompt], dataclasses.replace(params, include_stop_str_in_output=True))[0]
    assert cut.token_ids == kept.token_ids == free.token_ids[: k + 1]
    piece = tok.decode(free.token_ids[: k + 1])[len(tok.decode(free.token_ids[:k])) :]
    assert piece and kept.text == cut.text + piece and free.text.startswith(kept.text)
    # a stop string kept in the text: it ends where the stop string ends
    stop = free.text[len(free.text) // 2 :][:3]
    at = free.text.index(stop)
    with_stop = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, stop=[stop])
    assert llm.generate([prompt], with_stop)[0].text == free.text[:at]
    with_stop.include_stop_str_in_output = True
    assert llm.generate([prompt], with_stop)[0].text == free.text[: at + len(stop)]
    # bad_words resolve as at the edge; the caller's params stay as they were
    words = SamplingParams(bad_words=["hello", "the"])
    assert llm._with_bad_words(words).bad_words_token_ids == tok.bad_words_token_ids(["hello", "the"])
    assert words.bad_words_token_ids == []
    llm.check_no_leaks()
