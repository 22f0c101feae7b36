"""The mock engine's model (``load_format: mock``): everything real but the forward.

``ModelRunner`` keeps all of its own work: the KV cache (the model's real layout, dtype and size), the
step inputs, block tables, attention metadata and the sampling path. ``MockModel`` stands in for the
model; its forward, for one step:

1. writes every new token's K and V slots, in every layer, with deterministic bytes (``kv_signature``:
   the token, its position, the layer and K or V), so a KV handoff moves real bytes that a test can
   check against the rule;
2. picks each row's next token by a rule of (the row's token, its position) (``MockTokens``) that never
   gives an end-of-sequence or special token: a request runs to ``max_tokens`` unless one of its stop
   tokens or strings ends it, and its output is the same offline, colocated and disaggregated;
3. waits (sleeps, so the other threads of the worker run) until the step has taken the time its cost
   profile predicts for the step's shape (``cluster/cost_model.py``).

Its KV handoffs take the time of the profile's link (``paced_link``, transfer/paced_link.py): each moves
the first word of every block's K and V in every layer (the signature of the block's first slot) over the
real transfer path and waits out the rest of what the link predicts for the whole KV: NVLink inside a
node, the NIC between. Its host KV tier's copies do the same at the profile's host link, PCIe
(``paced_host_copies``, workers/host_kv.py).

No weights are read (config.json and the tokenizer only), so a worker of an 8B model config starts in
seconds on a CPU, with the memory of its KV cache (``num_kv_blocks``, or ``cpu_kv_cache_bytes``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from torch import nn

from cluster.config import EngineConfig
from cluster.cost_model import CostProfile, StepShape, default_profile_path
from cluster.tokenizer import Tokenizer
from transfer.channel import layout_of
from transfer.paced_link import SIGNATURE_BYTES, PacedLink
from workers.attention.base import AttentionMetadata
from workers.forward_context import get_forward_context
from workers.host_kv import PacedHostCopies
from workers.models.arch import ArchConfig
from workers.models.layers import CausalLM

logger = logging.getLogger(__name__)

# NOTE: the rule's hash is exact in int64 for torch and Python alike: every product stays below 2^63.
_PRIME = 2**31 - 1
_MUL_A, _MUL_B, _MUL_C = 48271, 69621, 16807
# Logits of every token but the rule's (the rule's is 0): far enough below that no temperature, penalty
# or bias the sampler allows makes another token win, finite so logprobs stay numbers. The ids the rule
# never gives sit lower still, so a row whose rule token is banned (a stop token under min_tokens, a bad
# word) falls back to the lowest allowed id the request does not ban.
_OTHER_LOGIT = -1.0e4
_EXCLUDED_LOGIT = -2.0e4
# kv_signature packs (position, layer, K/V) into 31 bits
MAX_LAYERS = 128
MAX_POSITIONS = 1 << 23


def rule_hash(token: int, position: int) -> int:
    """The hash the next-token rule takes of (token, position), in [0, 2^31 - 1)."""
    h = (token * _MUL_A + position * _MUL_B + 12345) % _PRIME
    h = (h * _MUL_C) % _PRIME
    return (h * _MUL_A) % _PRIME


def kv_signature(token: int, position: int, layer: int, kv: int) -> int:
    """The 8 bytes (little-endian int64) a mock forward writes at the start of the K (``kv`` 0) or V (1)
    row of ``layer`` in the slot of ``token`` at ``position``: the token in bytes 0-3, then
    ``position << 8 | layer << 1 | kv``. The rest of a slot's bytes stay zero."""
    return ((position << 8 | layer << 1 | kv) << 32) | token


class MockTokens:
    """The next-token rule: ``allowed_ids[rule_hash(token, position) % len(allowed_ids)]`` for the last
    token of a row and its position. ``allowed_ids``: the model's vocabulary (no larger than the
    tokenizer's) less its end-of-sequence ids and the tokenizer's special tokens."""

    def __init__(self, allowed_ids: list[int], vocab_size: int) -> None:
        if not allowed_ids:
            raise ValueError("the mock's next-token rule needs at least one allowed token id")
        self.allowed_ids = allowed_ids
        self._allowed = torch.tensor(allowed_ids, dtype=torch.int64)
        # the logits of a row before its rule token is set (see _OTHER_LOGIT)
        self.base_logits = torch.full((vocab_size,), _EXCLUDED_LOGIT, dtype=torch.float32)
        self.base_logits[self._allowed] = _OTHER_LOGIT

    @classmethod
    def for_model(cls, arch: ArchConfig, tokenizer: Tokenizer | None) -> MockTokens:
        vocab_size = arch.vocab_size
        excluded = set(arch.eos_token_ids)
        if tokenizer is not None:
            vocab_size = min(vocab_size, tokenizer.vocab_size)
            excluded.update(tokenizer.eos_token_ids)
            excluded.update(tokenizer.special_token_ids)
        return cls([i for i in range(vocab_size) if i not in excluded], arch.vocab_size)

    def next_token(self, token: int, position: int) -> int:
        """The rule for one row (the reference the tests check the engine's output against)."""
        return self.allowed_ids[rule_hash(token, position) % len(self.allowed_ids)]

    def continuation(self, prompt: Sequence[int], num_tokens: int) -> list[int]:
        """What the mock generates after ``prompt`` (greedy, no stop): each token from the one before it
        and its position."""
        out: list[int] = []
        token, position = prompt[-1], len(prompt) - 1
        for _ in range(num_tokens):
            token, position = self.next_token(token, position), position + 1
            out.append(token)
        return out

    def next_tokens(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """The rule for every row at once: ``[N]`` int64 tokens and positions -> ``[N]`` int64."""
        h = (tokens * _MUL_A + positions * _MUL_B + 12345) % _PRIME
        h = (h * _MUL_C) % _PRIME
        h = (h * _MUL_A) % _PRIME
        return self._allowed[h % len(self.allowed_ids)]


def step_shape(meta: AttentionMetadata) -> StepShape:
    """The shape of a step from its attention metadata: sequences ``[0, num_decodes)`` (one query token
    each) are decodes, the rest prompt chunks. NOTE: a one-token prompt chunk counts as a decode here
    (what the attention kernels see, and what it costs); the scheduler's ``shape_of`` counts it as a
    prefill."""
    cu = meta.query_start_loc_cpu.numpy().astype(np.int64)
    seq_lens = meta.seq_lens_cpu.numpy().astype(np.int64)
    query_lens = np.diff(cu)
    starts = seq_lens - query_lens
    d = meta.num_decodes
    decode_starts, n, s = starts[:d], query_lens[d:], starts[d:]
    longest = int(decode_starts.max()) if d else 0
    return StepShape(
        num_prefill_tokens=int(n.sum()),
        num_prefill_seqs=len(n),
        num_decode_seqs=d,
        num_context_tokens=int(decode_starts.sum()),
        num_attention_pairs=int((n * s + n * (n + 1) // 2).sum()),
        num_padded_context_tokens=d * longest,
    )


def load_mock_profile(name: str) -> CostProfile | None:
    """``EngineConfig.mock_cost_profile``: a path, "default" (``pdserve plan calibrate``'s), or "" (None)."""
    if not name:
        return None
    return CostProfile.load(default_profile_path() if name == "default" else Path(name).expanduser())


class MockModel(CausalLM):
    """Stands in for a ``CausalLM`` in the real ``ModelRunner`` (see the module docstring).

    ``forward`` returns each token's next token by the rule (``[T]`` int64) in place of hidden states;
    ``compute_logits`` turns rows of those into logits whose only finite maximum is that token (``[N, V]``
    float32, built only where the sampler needs logits), and ``argmax_tokens`` returns them as they are
    (greedy rows never build logits). ``clock`` and ``sleep`` are injectable (tests); ``num_waits`` and
    ``waited_s`` count the waits and the seconds asked for.
    """

    def __init__(self, arch: ArchConfig, profile: CostProfile | None, tokens: MockTokens) -> None:
        # NOTE: a CausalLM by interface only: no modules, no weights, so CausalLM.__init__ is not run.
        nn.Module.__init__(self)
        if arch.num_hidden_layers > MAX_LAYERS:
            raise ValueError(f"the mock engine packs the layer in 7 bits: at most {MAX_LAYERS} layers")
        self.arch = arch
        self.profile = profile
        self.tokens = tokens
        self.clock: Callable[[], float] = time.perf_counter
        self.sleep: Callable[[float], None] = time.sleep
        self.num_waits = 0
        self.waited_s = 0.0
        self._kv_words: torch.Tensor | None = None  # every layer's KV cache as one flat int64 view
        self._kv_key: tuple[int, int] = (0, 0)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        t0 = self.clock()
        ctx = get_forward_context()
        slots = ctx.attn_metadata.slot_mapping
        written = slots >= 0
        if not bool(written.any()):
            # NOTE: every slot -1 is a warm-up (the runner's throwaway steps): it writes and waits nothing
            return self.tokens.next_tokens(input_ids, positions)
        self._write_kv(ctx.kv_caches, input_ids[written], positions[written], slots[written])
        next_ids = self.tokens.next_tokens(input_ids, positions)
        if self.profile is not None:
            step_s = self.profile.step_s(step_shape(ctx.attn_metadata))
            self.num_waits += 1
            self.waited_s += step_s
            remaining = step_s - (self.clock() - t0)
            if remaining > 0:
                self.sleep(remaining)
        return next_ids

    def compute_logits(self, hidden: torch.Tensor, raw: bool = False, fused: bool = False) -> torch.Tensor:
        """Rows of next-token ids (``[N]`` int64) -> ``[N, V]`` float32: 0 at the row's token, -1e4 at the
        other ids the rule can give, -2e4 at the rest."""
        logits = self.tokens.base_logits.expand(hidden.shape[0], -1).clone()
        logits.scatter_(1, hidden.view(-1, 1), 0.0)
        return logits

    def argmax_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    # NOTE: under tensor parallelism every rank computes the same next tokens: the head gathers nothing
    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def finish_logits(self, logits: torch.Tensor, raw: bool = False, fused: bool = False) -> torch.Tensor:
        return self.compute_logits(logits)

    def argmax_logits(self, logits: torch.Tensor) -> torch.Tensor:
        return logits

    def _write_kv(
        self,
        kv_caches: list[torch.Tensor],
        tokens: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
    ) -> None:
        """``kv_signature`` of each token into the first 8 bytes of its K and V rows in every layer: one
        indexed write into a flat int64 view of the whole cache (measured on the 2-core box, 28 layers:
        0.2 ms for 256 decode tokens, 3.2 ms for a 2048-token prompt chunk)."""
        first = kv_caches[0]
        num_blocks, _, block_size = first.shape[:3]
        words_per_row = first[0, 0, 0].numel() * first.element_size() // 8
        words = self._flat_words(kv_caches)
        layer_words = num_blocks * 2 * block_size * words_per_row
        num_layers = len(kv_caches)
        # word offset of a slot's K row in layer 0 (its V row is block_size rows further)
        base = (slots + (slots // block_size) * block_size) * words_per_row
        layer_kv = (
            torch.arange(num_layers).view(-1, 1) * layer_words + torch.arange(2) * block_size * words_per_row
        )
        index = base.view(-1, 1, 1) + layer_kv.view(1, num_layers, 2)
        tags = (torch.arange(num_layers).view(-1, 1) * 2 + torch.arange(2)).view(1, num_layers, 2)
        high = positions.view(-1, 1, 1) * 256 + tags
        values = high * (1 << 32) + tokens.view(-1, 1, 1)
        words.index_put_((index.view(-1),), values.view(-1))

    def _flat_words(self, kv_caches: list[torch.Tensor]) -> torch.Tensor:
        """The runner's one KV tensor (its per-layer views, consecutive) as a flat int64 view."""
        first = kv_caches[0]
        key = (first.data_ptr(), len(kv_caches))
        if self._kv_words is not None and self._kv_key == key:
            return self._kv_words
        nbytes = first.numel() * first.element_size()
        row_bytes = first[0, 0, 0].numel() * first.element_size()
        consecutive = all(
            c.is_contiguous() and c.data_ptr() == first.data_ptr() + i * nbytes
            for i, c in enumerate(kv_caches)
        )
        if not consecutive or row_bytes % 8:
            raise RuntimeError(
                "the mock engine writes KV through one flat view: the layers' caches must be consecutive "
                f"views of one tensor with rows of a multiple of 8 bytes (rows of {row_bytes} bytes)"
            )
        flat = torch.as_strided(first, (len(kv_caches) * first.numel(),), (1,), first.storage_offset())
        self._kv_words, self._kv_key = flat.view(torch.uint8).view(torch.int64), key
        return self._kv_words


def paced_link(model: nn.Module, kv_cache: torch.Tensor, host: str) -> PacedLink | None:
    """How a worker whose model is ``model`` moves its KV (``kv_cache``; ``host``: the address it binds):
    a mock with a cost profile at that profile's link, moving the first word of each block's K and V
    (logged, with the fraction of every block that is); None (every byte, at the channel's own speed) for
    a real model or a mock without a profile."""
    if not isinstance(model, MockModel) or model.profile is None:
        return None
    link = PacedLink(model.profile.transfer, host, SIGNATURE_BYTES)
    logger.info("mock engine: %s", link.describe(layout_of(kv_cache)))
    return link


def paced_host_copies(model: nn.Module) -> PacedHostCopies | None:
    """How a worker whose model is ``model`` copies between its KV tiers (workers/host_kv.py): a mock whose
    cost profile names a host link moves the first word of each block's K and V per layer and waits that
    link's time for the whole blocks; None (every byte, at this host's speed) for a real model or a mock
    whose profile says nothing of a host link."""
    if not isinstance(model, MockModel) or model.profile is None or model.profile.host_link_bytes_per_s <= 0:
        return None
    return PacedHostCopies(model.profile, SIGNATURE_BYTES)


def build_mock_model(config: EngineConfig, arch: ArchConfig, model_dir: str) -> MockModel:
    """The mock model of ``model_dir`` (config.json and the tokenizer, no weights) and its cost profile."""
    limit = config.max_model_len(arch.max_position_embeddings)
    if limit > MAX_POSITIONS:
        raise ValueError(
            f"the mock engine packs positions in 23 bits: max_model_len must be <= {MAX_POSITIONS}, got {limit}"
        )
    profile = load_mock_profile(config.mock_cost_profile)
    tokens = MockTokens.for_model(arch, Tokenizer.from_pretrained(model_dir))
    logger.info(
        "mock engine: %s, %d allowed next tokens; steps wait %s",
        arch.architecture,
        len(tokens.allowed_ids),
        f"the cost profile {profile.name!r}" if profile is not None else "nothing (no mock_cost_profile)",
    )
    if profile is not None and config.tensor_parallel_size > 1:
        # NOTE: each rank's share of the step and its all-reduces (cluster/cost_model.py)
        profile = profile.with_tensor_parallel(config.tensor_parallel_size)
    return MockModel(arch, profile, tokens)
