"""Test utilities (not a test module): the tensor-parallel oracle's rule.

Outputs at TP=N equal TP=1's token for token, or diverge only at a near-tie: at the first position where
the tokens differ, both tokens are among the reference's top logprobs and their logprobs differ by less
than ``tol``; every logprob before it is within ``tol`` of the reference's. (A partial sum all-reduced
over ranks rounds differently from one matmul, by ~1e-6 in float32, so an exact tie may break either way.)
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.protocol import RequestOutput, TokenLogprobs

TOLERANCE = 1e-4


@dataclass
class Agreement:
    num_requests: int = 0
    num_tokens: int = 0  # positions compared
    num_diverged: int = 0  # requests that diverged at a near-tie
    max_logprob_diff: float = 0.0

    @property
    def divergence_rate(self) -> float:
        return self.num_diverged / max(1, self.num_requests)


def _lp(entry: TokenLogprobs, token: int) -> float | None:
    if entry.token_id == token:
        return entry.logprob
    for t, lp in zip(entry.top_token_ids, entry.top_logprobs, strict=True):
        if t == token:
            return lp
    return None


def compare(
    reference: list[RequestOutput], outputs: list[RequestOutput], tol: float = TOLERANCE
) -> Agreement:
    """Checks the rule (module docstring) request by request; raises AssertionError naming the request
    and the position that breaks it. Both runs must have asked for logprobs (>= 2 top)."""
    agreement = Agreement()
    assert len(reference) == len(outputs), (len(reference), len(outputs))
    for ref, out in zip(reference, outputs, strict=True):
        agreement.num_requests += 1
        assert ref.error is None and out.error is None, (ref.error, out.error)
        assert ref.logprobs is not None and out.logprobs is not None, "the oracle needs logprobs"
        for k, (a, b) in enumerate(zip(ref.token_ids, out.token_ids, strict=False)):
            ra, rb = ref.logprobs[k], out.logprobs[k]
            agreement.num_tokens += 1
            if a == b:
                diff = abs(ra.logprob - rb.logprob)
                agreement.max_logprob_diff = max(agreement.max_logprob_diff, diff)
                assert diff < tol, f"{ref.request_id} position {k}: logprob {ra.logprob} vs {rb.logprob}"
                continue
            ref_a, ref_b = _lp(ra, a), _lp(ra, b)
            assert ref_a is not None and ref_b is not None, (
                f"{ref.request_id} position {k}: token {b} is not in the reference's top logprobs {ra}"
            )
            assert abs(ref_a - ref_b) < tol, (
                f"{ref.request_id} position {k}: {a} vs {b} is no near-tie (gap {abs(ref_a - ref_b):.2e})"
            )
            agreement.num_diverged += 1
            break
        else:
            assert ref.token_ids == out.token_ids, (ref.request_id, ref.token_ids, out.token_ids)
            assert ref.finish_reason == out.finish_reason, (ref.finish_reason, out.finish_reason)
    return agreement


def check_tokens(reference: RequestOutput, token_ids: list[int], tol: float = TOLERANCE) -> bool:
    """``token_ids`` (from a run that reports no logprobs we can use) against the reference's, by the
    rule: equal, or the first difference is a near-tie in the reference's own logprobs. Returns whether
    they diverged; raises AssertionError when the rule is broken."""
    ref = reference.token_ids
    if token_ids == ref:
        return False
    k = next(i for i, (a, b) in enumerate(zip(ref, token_ids, strict=False)) if a != b)
    assert reference.logprobs is not None, "the reference needs logprobs"
    entry = reference.logprobs[k]
    ref_a, ref_b = _lp(entry, ref[k]), _lp(entry, token_ids[k])
    assert ref_a is not None and ref_b is not None and abs(ref_a - ref_b) < tol, (
        f"{reference.request_id} position {k}: {ref[k]} vs {token_ids[k]} is no near-tie ({entry})"
    )
    return True
