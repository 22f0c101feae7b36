"""workers/structured.py alone: xgrammar compilation (cached), per-request matchers, the logits mask.

A "walk" samples uniformly among the tokens the mask allows (temperature sampling under the mask with
a model that has no opinion), so every property checked here holds for any model: whatever the mask
lets through parses and validates. The spec also survives the router -> worker wire.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import jsonschema
import pytest
import torch

from cluster.protocol import SamplingParams, StructuredOutput
from cluster.tokenizer import Tokenizer
from cluster.wire import OPS, Generate, WireDecoder, WireEncoder
from tests.support.schema_gen import random_schema
from workers.structured import GrammarCache, GrammarState, allocate_bitmask, apply_bitmask, choice_grammar

TINY = Path(__file__).resolve().parents[2] / "workers" / "assets" / "pdserve-tiny"
TOK = Tokenizer.from_pretrained(TINY)
assert TOK is not None
VOCAB = 1229
STOP_IDS = TOK.eos_token_ids


@pytest.fixture(scope="module")
def cache() -> GrammarCache:
    assert TOK is not None
    return GrammarCache(TOK, VOCAB, STOP_IDS, max_entries=64)


def walk(
    state: GrammarState, rng: random.Random, max_steps: int = 400, prefer: frozenset[int] = frozenset()
) -> list[int]:
    """Sample among the allowed tokens until the grammar takes a stop token: uniformly, or, when some
    allowed tokens are in ``prefer``, one of those with probability 0.7 (still always an allowed one)."""
    out: list[int] = []
    for _ in range(max_steps):
        allowed = state.allowed_token_ids()
        preferred = [t for t in allowed if t in prefer]
        token = rng.choice(preferred if preferred and rng.random() < 0.7 else allowed)
        assert state.accept(token)
        out.append(token)
        if state.is_terminated:
            return out
    raise AssertionError(f"no stop token within {max_steps} steps: {TOK.decode(out)!r}")  # type: ignore[union-attr]


def _closing_tokens() -> frozenset[int]:
    assert TOK is not None
    vocab = TOK.backend.get_vocab()
    return frozenset(vocab[c] for c in ['"', "}", "]", "1", ":", ","] if c in vocab) | frozenset(STOP_IDS)


CLOSING = _closing_tokens()


def text_of(ids: list[int]) -> str:
    assert ids[-1] in STOP_IDS
    assert TOK is not None
    return TOK.decode(ids[:-1], skip_special_tokens=False)


@pytest.mark.parametrize("seed", range(20))
def test_random_schemas_every_masked_walk_validates(cache: GrammarCache, seed: int) -> None:
    schema = random_schema(seed)
    spec = StructuredOutput("json", json.dumps(schema))
    rng = random.Random(1000 + seed)
    for _ in range(2):
        text = text_of(walk(cache.matcher(spec), rng))
        jsonschema.validate(json.loads(text), schema)


def test_json_object_regex_choice_and_grammar(cache: GrammarCache) -> None:
    rng = random.Random(7)
    for _ in range(3):
        value = json.loads(text_of(walk(cache.matcher(StructuredOutput("json_object")), rng, prefer=CLOSING)))
        assert isinstance(value, dict)
    pattern = r"(cat|dog)-[0-9]{2,4}"
    for _ in range(5):
        assert re.fullmatch(pattern, text_of(walk(cache.matcher(StructuredOutput("regex", pattern)), rng)))
    choices = ["yes", "no", 'say "hi"\n', "ünïcode ✓"]
    seen = {text_of(walk(cache.matcher(StructuredOutput("choice", choices=choices)), rng)) for _ in range(40)}
    assert seen == set(choices)
    grammar = 'root ::= "(" digits ")"\ndigits ::= [0-9] | [0-9] digits'
    for _ in range(3):
        assert re.fullmatch(
            r"\([0-9]+\)", text_of(walk(cache.matcher(StructuredOutput("grammar", grammar)), rng))
        )
    assert choice_grammar(["a", 'b"']) == 'root ::= "a" | "b\\""'


def test_compiled_grammars_are_cached_lru() -> None:
    assert TOK is not None
    small = GrammarCache(TOK, VOCAB, STOP_IDS, max_entries=2)
    specs = [StructuredOutput("regex", p) for p in ("a+", "b+", "c+")]
    first = small.compile(specs[0])
    assert small.compile(StructuredOutput("regex", "a+")) is first
    assert (small.num_hits, small.num_misses, len(small)) == (1, 1, 1)
    small.compile(specs[1])
    small.compile(specs[0])  # a+ is now the most recent; b+ the least
    small.compile(specs[2])  # evicts b+
    assert (small.num_hits, small.num_misses, len(small)) == (2, 3, 2)
    assert small.compile(specs[0]) is first
    small.compile(specs[1])
    assert (small.num_hits, small.num_misses) == (3, 4)


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (StructuredOutput("json", '{"type": "object", "properties": 5}'), "invalid json"),
        (StructuredOutput("json", "not json"), "invalid json"),
        (StructuredOutput("regex", "(unclosed"), "invalid regex"),
        (StructuredOutput("grammar", "root ::= missing_rule"), "invalid grammar"),
        (StructuredOutput("choice", choices=[]), "choice needs"),
        (StructuredOutput("yaml", "x"), "kind must be one of"),
    ],
)
def test_invalid_specs_raise_value_error_naming_the_kind(
    cache: GrammarCache, spec: StructuredOutput, words: str
) -> None:
    with pytest.raises(ValueError, match=words):
        cache.compile(spec)


def test_decode_side_advances_over_the_first_token_then_continues(cache: GrammarCache) -> None:
    """The prefill side sampled '{' under the mask; the decode side replays it and masks from there."""
    spec = StructuredOutput(
        "json", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]})
    )
    prefill = cache.matcher(spec)
    first = random.Random(3).choice(prefill.allowed_token_ids())
    assert prefill.accept(first)
    decode = cache.matcher(spec)
    decode.accept_all([first])
    assert decode.allowed_token_ids() == prefill.allowed_token_ids()
    rest = walk(decode, random.Random(4))
    assert json.loads(text_of([first, *rest])) in ({"ok": True}, {"ok": False})
    fresh = cache.matcher(spec)
    assert TOK is not None
    bad = TOK.encode("x", add_special_tokens=False)[0]
    with pytest.raises(ValueError, match=f"token {bad} .output position 0. does not fit"):
        fresh.accept_all([bad])
    assert fresh.num_accepted == 0 and not fresh.accept(bad)


def test_apply_bitmask_masks_only_the_given_rows(cache: GrammarCache) -> None:
    state = cache.matcher(StructuredOutput("choice", choices=["yes", "no"]))
    allowed = state.allowed_token_ids()
    assert 0 < len(allowed) < 10
    bitmask = allocate_bitmask(3, VOCAB)
    assert state.fill(bitmask, 1)
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    apply_bitmask(logits, bitmask, rows=[1])
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    finite = torch.nonzero(torch.isfinite(logits[1])).flatten().tolist()
    assert finite == allowed
    assert torch.equal(logits[1, allowed], before[1, allowed])


def test_structured_output_survives_the_wire() -> None:
    spec = StructuredOutput("choice", choices=["a", "b"])
    params = SamplingParams(max_tokens=4, temperature=1.0, seed=5, structured=spec)
    op = Generate("r1", [1, 2, 3], params, deadline=1e12)
    decoder = WireDecoder(b"k" * 32, "worker-0", OPS)
    decoded = decoder.decode(WireEncoder(b"k" * 32).encode("worker-0", op))
    assert decoded == op and decoded.params.structured == spec
    plain = decoder.decode(
        WireEncoder(b"k" * 32).encode("worker-0", Generate("r2", [1], SamplingParams(), 1e12))
    )
    assert plain is not None and plain.params.structured is None
    with pytest.raises(ValueError, match="kind must be one of"):
        SamplingParams(structured=StructuredOutput("xml", "x")).validate()
