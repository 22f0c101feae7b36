"""Logits processors (workers/logits_processors.py): vLLM v1's semantics, checked against transformers.

* ``test_batched_processors_equal_a_per_row_reference``: the batched ops equal vLLM's rules written out
  row by row (allowed ids, bad words matched against the output tokens only, min_tokens, logit_bias,
  repetition / frequency / presence penalties), bit for bit, on logits with zeros, -inf and repeated
  tokens; rows without processors are untouched.
* ``test_outputs_equal_transformers_processors``, on every architecture: greedy outputs equal
  transformers' model + transformers' own processors (RepetitionPenalty, NoBadWords, MinNewTokensLength,
  SequenceBias with one-token keys, SuppressTokens as the complement of allowed_token_ids) and OpenAI's
  presence / frequency formula (a reference here), token for token. Seeded outputs equal the same
  transformers run whose last processor draws the token with pdserve's sampler and the request's seeded
  stream: an exact comparison with transformers' own sampler is impossible (another RNG), so this proves
  that what pdserve's random race sees each step is transformers' processed distribution. Logprobs stay
  those of the raw logits.
* The engine paths: asynchronous scheduling, preemption, a handoff and a migration give the tokens of one
  uninterrupted synchronous run (the history is rebuilt from the request's prompt and outputs each step).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    LogitsProcessor,
    LogitsProcessorList,
    MinNewTokensLengthLogitsProcessor,
    NoBadWordsLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
    SuppressTokensLogitsProcessor,
)

from cluster.protocol import RequestOutput, SamplingParams
from tests.support.handoff_fakes import DecodeSide, PrefillEngine
from tests.support.hf_models import ARCHS, EOS_TOKEN_ID, VOCAB_SIZE, make_random_hf_model
from tests.support.oracle_cache import qwen3_model
from workers.async_scheduler import AsyncScheduler
from workers.engine import Engine
from workers.llm import LLM
from workers.logits_processors import LogitsProcessors
from workers.request import Request
from workers.sampler import Sampler, is_argmax_only

_rng = random.Random(34)
PROMPTS = [[_rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in (7, 12, 18)]
MAX_TOKENS = 12
MIN_TOKENS = 6


def greedy(**options: Any) -> SamplingParams:
    return SamplingParams(**{"max_tokens": MAX_TOKENS, "temperature": 0.0, "ignore_eos": True, **options})


def seeded(seed: int, **options: Any) -> SamplingParams:
    base = {"max_tokens": MAX_TOKENS, "temperature": 0.9, "top_p": 0.95, "seed": seed, "ignore_eos": True}
    return SamplingParams(**{**base, **options})


# ---- the batched ops against vLLM's rules, row by row ---------------------------------------------------
def _reference_row(row: torch.Tensor, request: Request, n: int) -> torch.Tensor:
    """vLLM v1's processors on one row, written out plainly (dense, one rule at a time)."""
    p, row = request.params, row.clone()
    outputs = request.output_token_ids[:n]
    if p.allowed_token_ids is not None:
        keep = torch.zeros_like(row, dtype=torch.bool)
        keep[p.allowed_token_ids] = True
        row[~keep] = float("-inf")
    for word in p.bad_words_token_ids:  # vLLM's _apply_bad_words_single_batch
        prefix = word[:-1]
        if len(word) <= n + 1 and (not prefix or outputs[-len(prefix) :] == prefix):
            row[word[-1]] = float("-inf")
    if n < p.min_tokens:
        row[sorted(request.stop_ids)] = float("-inf")
    for token, bias in p.logit_bias.items():
        row[token] += bias
    counts = torch.bincount(torch.tensor(outputs, dtype=torch.int64), minlength=len(row))
    seen = counts > 0
    seen[request.prompt_token_ids] = True
    penalized = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
    row = torch.where(seen, penalized, row)
    row = row - p.frequency_penalty * counts
    return row - p.presence_penalty * (counts > 0)


def test_batched_processors_equal_a_per_row_reference() -> None:
    vocab = 40
    prompt = [3, 9, 9, 21, 5]
    requests = [
        Request("plain", prompt, greedy()),  # not registered: its row must stay as it was
        Request("allowed", prompt, greedy(allowed_token_ids=[4, 7, 7, 30], logit_bias={7: 2.5, 12: 9.0})),
        # [5, 11]: the prompt ends with 5, but vLLM matches the output only (transformers would mask 11)
        Request(
            "bad",
            prompt,
            greedy(bad_words_token_ids=[[5, 11], [6, 6, 13], [8, 6, 16], [6, 14], [2], [1, 8, 6, 9, 15]]),
        ),
        Request(
            "penalties", prompt, greedy(repetition_penalty=0.7, frequency_penalty=0.5, presence_penalty=-1.25)
        ),
        Request(
            "all",
            prompt,
            greedy(
                min_tokens=5,
                stop_token_ids=[17],
                ignore_eos=False,
                repetition_penalty=1.6,
                presence_penalty=2.0,
                bad_words_token_ids=[[6, 19]],
                logit_bias={21: -3.0, 22: 1.5},
            ),
            eos_token_ids=(2,),
        ),
    ]
    outputs = [[], [7], [8, 6, 6, -1], [6, 6, 9, 0, 6, 21], [4, 6, 4]]
    num_outputs = [0, 1, 3, 6, 3]  # "bad": its 4th output is the placeholder of this very step
    processors = LogitsProcessors(vocab)
    for request, tokens in zip(requests, outputs, strict=True):
        request.output_token_ids.extend(tokens)
        if request.params.has_logits_processors:
            processors.add(request)
    logits = torch.randn(len(requests), vocab, generator=torch.Generator().manual_seed(0)) * 4
    logits[:, [0, 6]] = 0.0
    logits[3, 9] = float("-inf")
    expected = torch.stack(
        [logits[0]]
        + [
            _reference_row(logits[i], r, n)
            for i, (r, n) in enumerate(zip(requests, num_outputs, strict=True))
            if i
        ]
    )
    step = processors.prepare([r.request_id for r in requests], num_outputs)
    assert step is not None
    processed = logits.clone()
    step.apply(processed)
    assert torch.equal(processed, expected)
    # the bad words that match the output's end (or have no prefix) are masked, the others not
    assert [bool(processed[2, t] == float("-inf")) for t in (11, 13, 16, 14, 2, 15)] == [0, 1, 0, 1, 1, 0]

    # nothing to apply (min_tokens reached) is no step; a history that ends in a placeholder is refused
    done = Request("done", prompt, greedy(min_tokens=2, stop_token_ids=[17]), output_token_ids=[4, 6])
    processors.add(done)
    assert processors.prepare(["done"], [2]) is None and processors.prepare(["done"], [1]) is not None
    with pytest.raises(RuntimeError, match="bad: its logits processors read output token 3"):
        processors.prepare(["plain", "bad"], [0, 4])
    assert processors.num_needing_history == 3 and not processors.needs_history("allowed")
    for request in [*requests, done]:
        processors.remove(request.request_id)
    assert len(processors) == 0 and processors.num_needing_history == 0

    params = [greedy(), greedy(logit_bias={1: 1.0})]
    assert is_argmax_only(params[:1]) and not is_argmax_only(params)
    assert not is_argmax_only(params[:1], has_processors=True)


# ---- transformers oracles on every architecture ----------------------------------------------------------
class OpenAIPenalties(LogitsProcessor):
    """The reference: OpenAI's ``mu[j] - c[j] * frequency - (c[j] > 0) * presence`` over output tokens."""

    def __init__(self, num_prompt: int, frequency: float, presence: float) -> None:
        self.num_prompt, self.frequency, self.presence = num_prompt, frequency, presence

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        scores = scores.clone()
        tokens, counts = input_ids[0, self.num_prompt :].unique(return_counts=True)
        scores[0, tokens] = scores[0, tokens] - counts * self.frequency - self.presence
        return scores


class PdserveRace(LogitsProcessor):
    """Last processor of a seeded run: draws the token with pdserve's sampler and the request's seeded
    stream (as the engine's CPU path: one ``torch.Generator`` per request) and leaves only it."""

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator().manual_seed(params.seed or 0)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        token = Sampler()(scores.contiguous(), [self.params], [self.generator]).token_ids
        return torch.full_like(scores, float("-inf")).index_fill_(1, token, 0.0)


def _cases(prompt: list[int], base: list[int]) -> dict[str, tuple[dict[str, Any], list[LogitsProcessor]]]:
    """Each processor alone and all together, from a request's output without them (``base``), so each
    changes the output: (SamplingParams fields, transformers' processors in vLLM's order)."""
    ban = next(t for t in base[2:] if t not in base[:2])
    # NOTE: [base[0], base[1]] masks base[1] once base[0] is out. vLLM matches bad words against the output
    # tokens only, transformers against prompt + output: both agree here, as the prompt does not end with
    # base[0] (asserted below) and [7, 8, 9] cannot straddle it.
    bad = [[base[0], base[1]], [ban], [7, 8, 9]]
    stop = base[1]
    bias = {base[0]: -4.0, base[2]: -4.0, 17: 3.0}
    allowed = list(range(3, VOCAB_SIZE, 7))
    n = len(prompt)
    min_tokens = {"min_tokens": MIN_TOKENS, "stop_token_ids": [stop], "ignore_eos": False}

    def every() -> list[LogitsProcessor]:
        return [
            NoBadWordsLogitsProcessor(bad),
            MinNewTokensLengthLogitsProcessor(n, MIN_TOKENS, [stop, EOS_TOKEN_ID]),
            SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]),
            RepetitionPenaltyLogitsProcessor(1.75),
            OpenAIPenalties(n, 1.5, 0.75),
        ]

    # NOTE: alone, the penalties reward repetition (a random model rarely repeats itself, so penalizing it
    # could leave the output as it was); together, they penalize it
    processors = every()
    return {
        "repetition": ({"repetition_penalty": 0.5}, [RepetitionPenaltyLogitsProcessor(0.5)]),
        "bad_words": ({"bad_words_token_ids": bad}, [processors[0]]),
        "min_tokens": (min_tokens, [processors[1]]),
        "logit_bias": ({"logit_bias": bias}, [processors[2]]),
        "presence_frequency": (
            {"frequency_penalty": -1.5, "presence_penalty": -0.75},
            [OpenAIPenalties(n, -1.5, -0.75)],
        ),
        "allowed": (
            {"allowed_token_ids": allowed},
            [SuppressTokensLogitsProcessor(sorted(set(range(VOCAB_SIZE)) - set(allowed)))],
        ),
        "all": (
            {
                "repetition_penalty": 1.75,
                "bad_words_token_ids": bad,
                "logit_bias": bias,
                "logprobs": 2,
                "frequency_penalty": 1.5,
                "presence_penalty": 0.75,
                **min_tokens,
            },
            every(),
        ),
    }


def hf_decode(
    model: Any, prompts: list[list[int]], processors: list[LogitsProcessorList], num_steps: int
) -> tuple[list[list[int]], list[list[torch.Tensor]]]:
    """transformers' model and processors, step by step as ``generate``'s greedy loop (argmax of the
    processed scores), every row in one right-padded batch per step (no cache: the whole sequence again,
    cheap at these sizes). Returns each row's tokens and its raw logits at each step."""
    seqs = [list(p) for p in prompts]
    raw: list[list[torch.Tensor]] = [[] for _ in prompts]
    for _ in range(num_steps):
        width = max(map(len, seqs))
        ids = torch.tensor([s + [0] * (width - len(s)) for s in seqs])
        mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        with torch.inference_mode():
            logits = model(input_ids=ids, attention_mask=mask).logits.float()
        for i, s in enumerate(seqs):
            scores = logits[i, len(s) - 1].unsqueeze(0).clone()
            raw[i].append(scores[0].clone())
            s.append(int(processors[i](torch.tensor([s]), scores).argmax()))
    return [s[len(p) :] for s, p in zip(seqs, prompts, strict=True)], raw


@pytest.fixture(scope="module")
def arch_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, Any]]:
    """arch -> (checkpoint, transformers model), each built once per module (qwen3: the session's)."""
    cache: dict[str, tuple[str, Any]] = {}

    def get(arch: str) -> tuple[str, Any]:
        if arch not in cache:
            if arch == "qwen3":
                path = qwen3_model(tmp_path_factory)
            else:
                path = str(make_random_hf_model(arch, tmp_path_factory.mktemp(f"processors-{arch}")))
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=torch.float32, attn_implementation="eager"
            )
            cache[arch] = path, model.eval()
        return cache[arch]

    return get


def _until_stop(tokens: list[int], stop_ids: set[int]) -> list[int]:
    return next((tokens[: i + 1] for i, t in enumerate(tokens) if t in stop_ids), tokens)


def _params(mode: str, prompt_index: int, **fields: Any) -> SamplingParams:
    """A greedy run, or a seeded one (one seed per prompt, so a case and its baseline share a stream)."""
    return greedy(**fields) if mode == "greedy" else seeded(100 + prompt_index, **fields)


CASES = ("repetition", "bad_words", "min_tokens", "logit_bias", "presence_frequency", "allowed", "all")


@pytest.mark.parametrize("arch", ARCHS)
def test_outputs_equal_transformers_processors(
    arch: str, arch_models: Callable[[str], tuple[str, Any]]
) -> None:
    path, model = arch_models(arch)
    llm = LLM(path, block_size=4, num_kv_blocks=256, max_num_batched_tokens=256)
    modes = ("greedy", "seeded")
    base_params = [_params(mode, j) for mode in modes for j in range(len(PROMPTS))]
    base_outs = [o.token_ids for o in llm.generate(PROMPTS + PROMPTS, base_params)]
    baselines = {"greedy": base_outs[: len(PROMPTS)], "seeded": base_outs[len(PROMPTS) :]}

    rows: list[tuple[str, int, SamplingParams, list[LogitsProcessor]]] = []
    for mode in modes:
        for k, name in enumerate(CASES):
            j = k % len(PROMPTS)
            assert PROMPTS[j][-1] != baselines[mode][j][0]  # where vLLM's and transformers' bad words agree
            fields, hf = _cases(PROMPTS[j], baselines[mode][j])[name]
            rows.append((f"{mode}/{name}", j, _params(mode, j, **fields), hf))
    outs = llm.generate([PROMPTS[j] for _, j, _, _ in rows], [p for _, _, p, _ in rows])
    llm.check_no_leaks()

    hf_lists = [
        LogitsProcessorList(hf + ([PdserveRace(p)] if p.seed is not None else [])) for _, _, p, hf in rows
    ]
    hf_tokens, hf_raw = hf_decode(model, [PROMPTS[j] for _, j, _, _ in rows], hf_lists, MAX_TOKENS)
    eos = {EOS_TOKEN_ID}
    for (name, j, params, _), out, expected in zip(rows, outs, hf_tokens, strict=True):
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else eos)
        assert out.token_ids == _until_stop(expected, stop_ids), name
        base = baselines[name.split("/")[0]][j]
        assert out.token_ids != base, f"{name}: the processor changed nothing"
        if name.endswith("/bad_words"):  # the two-token word fired at step 1
            assert out.token_ids[0] == base[0] and out.token_ids[1] != base[1], name
        if name.endswith("/min_tokens"):  # its stop id is the baseline's second token
            assert len(out.token_ids) > MIN_TOKENS, name
        if name.endswith("/allowed"):
            assert set(out.token_ids) <= set(params.allowed_token_ids or []), name
    for (name, _, _, _), out, raw in zip(rows, outs, hf_raw, strict=True):
        if name.endswith("/all"):
            _assert_raw_logprobs(name, out, raw)


def _assert_raw_logprobs(name: str, out: RequestOutput, raw: list[torch.Tensor]) -> None:
    """The logprobs reported are the model's raw distribution's (transformers' logits, float tolerance)."""
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids), name
    for step, (token, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        logprobs = raw[step].log_softmax(-1)
        assert lp.token_id == token and lp.logprob == pytest.approx(float(logprobs[token]), abs=1e-4), name
        assert lp.top_token_ids == logprobs.topk(2).indices.tolist(), name


# ---- the engine's paths: async scheduling, preemption, handoff, migration --------------------------------
HISTORY = {"repetition_penalty": 1.4, "frequency_penalty": 1.0, "presence_penalty": 0.5}


STOP = 217  # pushed up by a bias, so the request it ends stops right after its min_tokens
ENGINE_PARAMS = [
    greedy(**HISTORY, bad_words_token_ids=[[5, 100], [55]]),
    seeded(7, **HISTORY, min_tokens=4, stop_token_ids=[STOP], ignore_eos=False),
    greedy(logit_bias={STOP: 10.0}, min_tokens=3, stop_token_ids=[STOP]),
    seeded(8, frequency_penalty=2.0, bad_words_token_ids=[[9, 10, 11], [55]]),
    greedy(),
]


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory: pytest.TempPathFactory) -> str:
    return qwen3_model(tmp_path_factory)


def _run(model_dir: str, params: list[SamplingParams], **options: Any) -> tuple[list[list[int]], Engine]:
    llm = LLM(model_dir, block_size=4, max_num_batched_tokens=64, **{"num_kv_blocks": 128, **options})
    outs = llm.generate(PROMPTS + PROMPTS[:2], params)
    llm.check_no_leaks()
    return [o.token_ids for o in outs], llm.engine


def test_async_scheduling_and_preemption_give_the_synchronous_tokens(qwen3: str) -> None:
    params = ENGINE_PARAMS
    reference, engine = _run(qwen3, params)
    assert engine.stats().num_preemptions == 0 and reference[2][-1] == STOP and len(reference[2]) == 4
    tokens, engine = _run(qwen3, params, async_scheduling=True)
    assert isinstance(engine.scheduler, AsyncScheduler)
    assert tokens == reference
    tokens, engine = _run(qwen3, params, num_kv_blocks=16)
    assert engine.stats().num_preemptions > 0
    assert tokens == reference
    tokens, engine = _run(qwen3, params, num_kv_blocks=16, async_scheduling=True)
    assert engine.stats().num_preemptions > 0
    assert tokens == reference


def test_a_handoff_and_a_migration_continue_the_token_history(qwen3: str) -> None:
    prompt = PROMPTS[1]
    # NOTE: penalties that reward the output tokens, so counting them as prompt tokens would show
    history = {"repetition_penalty": 1.2, "frequency_penalty": -1.5, "presence_penalty": -1.0}
    params = [greedy(**history), seeded(5, **history)]
    reference = [
        o.token_ids for o in LLM(qwen3, block_size=4, num_kv_blocks=64).generate([prompt] * 2, params)
    ]

    # the decode side of a handoff: the prompt's KV moved, the first token an output, not a prompt token
    prefill, decode = PrefillEngine(qwen3, num_kv_blocks=32), DecodeSide(qwen3, num_kv_blocks=32)
    for i, p in enumerate(params):
        first, rows = prefill.prefill(f"h{i}", prompt, p)
        decode.handoff(f"h{i}", prompt, first, p)
        decode.receiver.land(f"h{i}", rows[:, decode.receiver.fetches[f"h{i}"].skip_first_n_blocks :])
        decode.run_until_idle()
        assert [first, *decode.tokens[f"h{i}"]] == reference[i]
    decode.check_no_leaks()

    # a migration: the tokens streamed before it are outputs (penalized as outputs), the rest sampled on
    engine = LLM(qwen3, block_size=4, num_kv_blocks=64).engine
    engine.add_request("as-prompt0", prompt + reference[0][:5], greedy(**history, max_tokens=MAX_TOKENS - 5))
    engine.add_request("aborted", prompt, greedy(**history))
    assert engine.abort("aborted")  # its processors' state goes with it (the leak check below)
    for i, p in enumerate(params):
        engine.add_request(f"m{i}", prompt, p, output_token_ids=reference[i][:5])
    seen: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for delta in engine.step():
            seen.setdefault(delta.request_id, []).extend(delta.token_ids)
    engine.check_no_leaks()
    for i in range(len(params)):
        assert reference[i][:5] + seen[f"m{i}"] == reference[i]
    # NOTE: the test can tell: the same tokens counted as prompt tokens are penalized otherwise
    assert seen["as-prompt0"] != reference[0][5:]
