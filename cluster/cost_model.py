"""Cost profiles: how long one engine step and one KV handoff take, and the hops around them.

A profile is data (JSON). ``pdserve plan calibrate`` fits a :class:`LinearStepCost` to this machine's
engine; GPU profiles are :class:`RooflineStepCost` estimates from stated hardware figures and a model's
shape (deploy/planner/profiles.py) until a GPU run calibrates them. The simulator (deploy/planner/) and
the router's predictions (cluster/router/predict.py) read the same profile, so what the planner recommends and
what the router predicts at run time cannot drift apart.

A step is described by its :class:`StepShape` (what ``Scheduler.schedule()`` packed), never by tensors.
This module imports nothing of the project.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any


@dataclass(frozen=True, slots=True)
class StepShape:
    """What one engine step computes.

    ``num_context_tokens``: KV positions the decode sequences read (their positions before the new
    token); ``num_padded_context_tokens``: the decode sequences times the longest of those contexts
    (what a kernel that pads the batch to its longest sequence reads, as the torch backend's batched
    gather does); ``num_attention_pairs``: query x key pairs of the prompt chunks (a chunk of n tokens
    starting at position s attends to n * s + n (n + 1) / 2 pairs), the quadratic part of prefill."""

    num_prefill_tokens: int = 0
    num_prefill_seqs: int = 0
    num_decode_seqs: int = 0
    num_context_tokens: int = 0
    num_attention_pairs: int = 0
    num_padded_context_tokens: int = 0

    @property
    def num_tokens(self) -> int:
        return self.num_prefill_tokens + self.num_decode_seqs

    @property
    def is_empty(self) -> bool:
        return self.num_tokens == 0


def shape_of(chunks: Iterable[tuple[int, int, bool]]) -> StepShape:
    """Shape of a step from its (start position, number of tokens, is decode) per sequence."""
    prefill_tokens = prefill_seqs = decode_seqs = context = pairs = longest = 0
    for start, n, is_decode in chunks:
        if is_decode:
            decode_seqs += 1
            context += start
            longest = start if start > longest else longest
        else:
            prefill_seqs += 1
            prefill_tokens += n
            pairs += n * start + n * (n + 1) // 2
    return StepShape(prefill_tokens, prefill_seqs, decode_seqs, context, pairs, decode_seqs * longest)


@dataclass(frozen=True)
class LinearStepCost:
    """step_s = base + per prefill token + per prefill sequence + per decode sequence + per context token
    read by decodes + per prefill attention pair + per padded decode context position + per padded
    position beyond ``padded_knee_tokens`` (a hinge: the padded batch outgrows the CPU's caches) + once
    per step that computes any prompt chunk (``prefill_step_s``). Fitted (non-negative, knee by search)
    by ``pdserve plan calibrate``; ``prefill_step_s`` is not in the engine sweep's fit: the cluster probe
    measures it, what a prefill step costs in place (a worker's held prefills) beyond the sweep's model."""

    base_s: float
    prefill_token_s: float
    prefill_seq_s: float
    decode_seq_s: float
    context_token_s: float
    attention_pair_s: float
    padded_context_token_s: float = 0.0
    padded_excess_token_s: float = 0.0
    padded_knee_tokens: float = 0.0
    prefill_step_s: float = 0.0
    # NOTE: a fit measures one worker as it ran: this many ranks. It says nothing of another size.
    tensor_parallel_size: int = 1

    kind = "linear"
    FEATURES = (
        "base_s",
        "prefill_token_s",
        "prefill_seq_s",
        "decode_seq_s",
        "context_token_s",
        "attention_pair_s",
        "padded_context_token_s",
        "padded_excess_token_s",
    )
    PREFILL_TERMS = ("prefill_token_s", "prefill_seq_s", "attention_pair_s")

    @staticmethod
    def features(shape: StepShape, knee: float = 0.0) -> tuple[float, ...]:
        """The regressors, in FEATURES order, for a hinge at ``knee`` padded positions."""
        padded = float(shape.num_padded_context_tokens)
        return (
            1.0,
            float(shape.num_prefill_tokens),
            float(shape.num_prefill_seqs),
            float(shape.num_decode_seqs),
            float(shape.num_context_tokens),
            float(shape.num_attention_pairs),
            padded,
            max(0.0, padded - knee) if knee > 0 else 0.0,
        )

    def step_s(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        padded = shape.num_padded_context_tokens
        excess = padded - self.padded_knee_tokens if self.padded_knee_tokens > 0 else 0.0
        return (
            self.base_s
            + self.prefill_token_s * shape.num_prefill_tokens
            + self.prefill_seq_s * shape.num_prefill_seqs
            + self.decode_seq_s * shape.num_decode_seqs
            + self.context_token_s * shape.num_context_tokens
            + self.attention_pair_s * shape.num_attention_pairs
            + self.padded_context_token_s * padded
            + (self.padded_excess_token_s * excess if excess > 0 else 0.0)
            + (self.prefill_step_s if shape.num_prefill_seqs else 0.0)
        )

    def scaled(self, prefill: float, decode: float, base: float | None = None) -> LinearStepCost:
        """Prefill terms times ``prefill``, decode terms times ``decode``, the base times ``base`` (by
        default their geometric mean): what the cluster probe measured of each kind of step in place."""
        values = {
            name: getattr(self, name) * (prefill if name in self.PREFILL_TERMS else decode)
            for name in self.FEATURES
        }
        values["base_s"] = self.base_s * (math.sqrt(prefill * decode) if base is None else base)
        return LinearStepCost(
            **values,
            padded_knee_tokens=self.padded_knee_tokens,
            prefill_step_s=self.prefill_step_s * prefill,
            tensor_parallel_size=self.tensor_parallel_size,
        )


@dataclass(frozen=True)
class RooflineStepCost:
    """A roofline estimate: overhead + max(FLOPs / achievable FLOP/s, bytes moved / memory bandwidth), per
    rank of a worker of ``tensor_parallel_size`` GPUs, plus its all-reduces.

    FLOPs: 2 per matmul parameter per token plus attention; bytes: the weights once per step plus every
    KV position read (decode context, and each prompt chunk's own prefix). The FLOP and byte figures are
    the whole model's; at TP = N each rank computes 1/N of the FLOPs (Megatron-style: QKV and gate/up
    column-parallel, o and down row-parallel, the vocabulary split) and reads 1/N of the weights and its
    share of the KV heads (one head each when there are fewer KV heads than ranks: they are replicated).
    The ranks then all-reduce ``allreduces_per_step`` times a step (two a layer: after o_proj and after
    down_proj), each a message of tokens x ``allreduce_bytes_per_token`` (hidden x dtype bytes): a ring
    all-reduce moves 2 (N - 1) / N of it through each GPU's link, after ``allreduce_latency_s``. The
    all-reduces sit between the layers' matmuls, so their time adds to the roofline's.

    The TP fields default to what a profile saved before them meant: one GPU a worker, no link figures
    (``CostProfile.with_tensor_parallel`` refuses to take such a profile to TP > 1)."""

    overhead_s: float
    flops_per_s: float
    bytes_per_s: float
    flops_per_token: float  # 2 x matmul parameters
    attention_flops_per_pair: float  # 4 x layers x query heads x head_dim (QK^T and PV)
    weight_bytes: float
    kv_bytes_per_token: float
    tensor_parallel_size: int = 1
    allreduces_per_step: int = 0  # 2 x layers
    allreduce_bytes_per_token: float = 0.0  # hidden x dtype bytes
    link_bytes_per_s: float = 0.0  # one direction between two GPUs of a node (NVLink; PCIe)
    allreduce_latency_s: float = 0.0  # the fixed cost of one all-reduce (launch + link hops)
    num_kv_heads: int = 0  # 0: the KV splits evenly over the ranks

    kind = "roofline"

    def __post_init__(self) -> None:
        tp, heads = self.tensor_parallel_size, self.num_kv_heads
        if tp < 1:
            raise ValueError(f"roofline tensor_parallel_size must be >= 1, got {tp}")
        if heads and heads % tp and tp % heads:
            raise ValueError(
                f"tensor_parallel_size {tp} must divide the {heads} KV heads or be a multiple of them"
            )

    @property
    def kv_share(self) -> float:
        """The fraction of each token's KV one rank holds and reads."""
        tp, heads = self.tensor_parallel_size, self.num_kv_heads
        if heads == 0:
            return 1.0 / tp
        return max(1, heads // tp) / heads

    def allreduce_s(self, num_tokens: int) -> float:
        """The step's all-reduces for ``num_tokens`` tokens (0.0 on one GPU)."""
        tp = self.tensor_parallel_size
        if tp == 1 or num_tokens == 0:
            return 0.0
        message = num_tokens * self.allreduce_bytes_per_token
        one = self.allreduce_latency_s + 2 * (tp - 1) / tp * message / self.link_bytes_per_s
        return self.allreduces_per_step * one

    def step_s(self, shape: StepShape) -> float:
        if shape.is_empty:
            return 0.0
        tp = self.tensor_parallel_size
        pairs = shape.num_attention_pairs + shape.num_context_tokens + shape.num_decode_seqs
        flops = (self.flops_per_token * shape.num_tokens + self.attention_flops_per_pair * pairs) / tp
        kv_read = shape.num_context_tokens + shape.num_decode_seqs + shape.num_prefill_tokens
        nbytes = self.weight_bytes / tp + self.kv_bytes_per_token * self.kv_share * kv_read
        compute = max(flops / self.flops_per_s, nbytes / self.bytes_per_s)
        return self.overhead_s + compute + self.allreduce_s(shape.num_tokens)


StepCost = LinearStepCost | RooflineStepCost
_STEP_KINDS: dict[str, type[LinearStepCost] | type[RooflineStepCost]] = {
    "linear": LinearStepCost,
    "roofline": RooflineStepCost,
}


@dataclass(frozen=True)
class TransferCost:
    """One KV handoff: handshake latency + bytes / bandwidth. ``bytes_per_s``: between two workers of one
    node (NVLink on a GPU box; what a calibrated profile measured on its host); ``nic_bytes_per_s``: between
    two nodes (one GPU's share of the network), 0.0 when the profile does not say (then ``bytes_per_s``)."""

    latency_s: float
    bytes_per_s: float
    nic_bytes_per_s: float = 0.0

    def transfer_s(self, nbytes: int, between_nodes: bool = False) -> float:
        """``nbytes`` through the link of one node, or the network between two (``between_nodes``)."""
        rate = self.nic_bytes_per_s if between_nodes and self.nic_bytes_per_s > 0 else self.bytes_per_s
        return self.latency_s + nbytes / rate if nbytes > 0 else self.latency_s


@dataclass(frozen=True)
class CostProfile:
    """Everything the simulator and the router's predictions need to put a time on serving.

    ``hop_s``: one control message between the router and a worker; ``http_s``: the HTTP edge, one way
    (client to router, router to client). ``host_cpus``: CPU workers share this many cores on one host
    (a step slows down while more workers than that are busy); None when each worker has its own device.
    ``step_scale`` multiplies every step: what a step costs inside a running cluster (the worker's loop,
    the router and HTTP edge sharing the host) over what the engine sweep measured alone; the cluster
    probe of ``pdserve plan calibrate --probe`` measures it, 1.0 otherwise. ``frontend_cpu_per_token_s``:
    CPU the router and HTTP edge (and an in-process benchmark client) spend per streamed token on the
    host the CPU workers share (adds to that host's demand in the simulation).
    ``frontend_s_per_request``: the front end's work on a new request before it is routed (HTTP
    parsing, validation, the route decision); the simulation shares the front end between the requests
    it holds (processor sharing, as one event loop interleaves their handlers), so a burst of n requests
    sent at once is routed together after about n times this, while the front end counts as one busy
    core in the host's demand. ``prefill_weight``: how
    much the rest of that demand counts against a prefill step: it stretches by
    (1 + prefill_weight x (demand - 1)) / cores where other steps stretch by demand / cores (the probe
    fits it in [0.25, 4]: above 1 a prefill step beside a decode worker and the front end gets less than
    an even share of the cores, below 1 it suffers less from them than a decode step does); 1.0 treats
    every step alike. ``delivery_jitter_s``: the mean of an exponential delay the simulation
    adds to each streamed token on its way to the client (what the deterministic step and front-end
    model leaves out: the OS's time slices, event-loop turns), each stream's tokens kept in order; 0.0
    delivers without it. ``delivery_jitter_by_batch``: (tokens a step streams, mean delay) points that
    make the mean depend on the step's batch instead (measured: a step of 2 streams' tokens reaches its
    clients with less jitter than one of 8 or 32); linear in between, flat beyond the first and last.
    ``delivery_jitter_contended_s``: added to that mean for the tokens of a step that ends while another
    worker of the host is in a step too (measured: a decode stream's gaps beside another worker's prefill
    have a much longer tail than the same steps' share of the cores accounts for: the threads that carry
    its tokens wait for a core and the interpreter lock more often: 1.6-2.2 ms in the probes on the CPU
    box); 0.0 adds nothing.
    ``handoff_receive_step_s``: what receiving one KV handoff adds to a step its worker runs meanwhile:
    the transfer threads share the process, the interpreter lock and the cores with the step thread
    (measured on the 2-core CPU box: 1.5-2.7 ms a handoff, from the workers' own split of their steps,
    ``cluster.protocol.StepSplit``); 0.0 where a transfer runs beside the steps for free.
    ``handoff_send_step_s``: the same for a handoff sent while the prefill worker runs a step: its
    transfer thread's work, and the receiving side's outside its own steps, on the same cores (the
    probe fits it through the twin from bursts of prompts like batch_pressure's and stress's, where each
    prompt's handoff leaves beside the next prompts' step: 3.3-8.3 ms in five of six probes on the CPU
    box, 1.0 ms in one that put 2.2 ms on every prefill step instead; the step split alone could not see
    it, since a light load sends between steps). The probe fits them all.
    ``frontend_fifo``: the front end takes new requests one at a time, in arrival order, instead of
    sharing itself between them (a burst's requests are then routed ``frontend_s_per_request`` apart: as
    measured with a mock cluster, whose first tokens come back within a few steps).
    ``host_step_s``, ``host_decode_s``, ``host_chunk_s``, ``host_token_s``: host time a step takes
    beside ``step``'s, per step, per decode sequence, per prompt chunk (a prefill worker holds and offers
    each prompt's KV) and per prompt token: a mock engine (``load_format: mock``) waits ``step``'s time,
    and its scheduling, input prep, KV writes and sampling come on top; the mock probe of ``pdserve plan
    validate`` fits them (deploy/plan/fit_mock.py); 0.0 otherwise. ``host_transfer_s``: what a step
    takes on top while its worker's transfer thread moves KV (a mock's real KV bytes: the copies and
    digests take the cores and the interpreter lock its host work needs). ``handoff_receive_token_s``:
    on top of ``handoff_receive_step_s``, per KV position of that handoff (a mock moves the model's real
    KV bytes, and what the receiving side's work costs the step beside it grows with them).
    ``spinning_transfer_scale``: a KV handoff whose sending or receiving worker is spinning (it holds
    requests it cannot schedule, so its step loop polls without waiting) takes this many times its time:
    the loop holds the interpreter lock and a core the transfer thread needs (a mock cluster on the
    2-core box: 12 prompts of 3,072 tokens at once moved their KV at 0.56 GB/s, one at a time at 1.16);
    1.0 where a transfer runs on without it.
    ``host_link_bytes_per_s``: one GPU's copies between its memory and the host's pinned memory, one
    direction (PCIe): what the host KV tier's offloads and loads move at (``kv_offload_gib``); a mock
    engine waits it out for the blocks' whole bytes (workers/host_kv.py ``PacedHostCopies``). 0.0: the
    profile does not say (a mock's tier then copies every byte at the host's own speed).
    """

    name: str
    source: str  # how it was made: "calibrated on <host> ..." or "roofline estimate from ..."
    step: StepCost
    transfer: TransferCost
    kv_bytes_per_token: int
    hop_s: float = 0.0
    http_s: float = 0.0
    host_cpus: float | None = None
    step_scale: float = 1.0
    frontend_cpu_per_token_s: float = 0.0
    frontend_s_per_request: float = 0.0
    frontend_fifo: bool = False
    prefill_weight: float = 1.0
    delivery_jitter_s: float = 0.0
    delivery_jitter_by_batch: tuple[tuple[int, float], ...] = ()
    delivery_jitter_contended_s: float = 0.0
    handoff_receive_step_s: float = 0.0
    handoff_send_step_s: float = 0.0
    host_step_s: float = 0.0
    host_decode_s: float = 0.0
    host_chunk_s: float = 0.0
    host_token_s: float = 0.0
    host_transfer_s: float = 0.0
    handoff_receive_token_s: float = 0.0
    spinning_transfer_scale: float = 1.0
    host_link_bytes_per_s: float = 0.0

    @property
    def tensor_parallel_size(self) -> int:
        """The GPUs (ranks) of the worker whose steps ``step_s`` times."""
        return self.step.tensor_parallel_size

    def with_tensor_parallel(self, tp: int) -> CostProfile:
        """This profile for a worker of ``tp`` ranks (``EngineConfig.tensor_parallel_size``): its steps
        cost what the roofline says of that size (``RooflineStepCost``); everything else is unchanged.
        ValueError, naming the profile, when it cannot say: a measured (linear) profile knows only the
        size it was measured at, a roofline saved without link figures knows only one GPU."""
        step = self.step
        if tp == step.tensor_parallel_size:
            return self
        if isinstance(step, LinearStepCost):
            raise ValueError(
                f"cost profile {self.name!r} was measured at tensor_parallel_size "
                f"{step.tensor_parallel_size}; it cannot time a worker of {tp}: calibrate at that size "
                "or plan with a roofline estimate (--gpu)"
            )
        if tp > 1 and (step.link_bytes_per_s <= 0 or step.allreduces_per_step <= 0):
            raise ValueError(
                f"cost profile {self.name!r} has no link figures (link_bytes_per_s, allreduces_per_step): "
                f"it cannot time a worker of tensor_parallel_size {tp}; rebuild it (--gpu)"
            )
        return replace(self, step=replace(step, tensor_parallel_size=tp))

    def step_s(self, shape: StepShape) -> float:
        seconds = self.step.step_s(shape) * self.step_scale
        if shape.is_empty:
            return seconds
        return (
            seconds
            + self.host_step_s
            + self.host_decode_s * shape.num_decode_seqs
            + self.host_chunk_s * shape.num_prefill_seqs
            + self.host_token_s * shape.num_prefill_tokens
        )

    def delivery_jitter_at(self, batch: int) -> float:
        """The mean delivery delay of the tokens of a step that streams ``batch`` of them."""
        points = self.delivery_jitter_by_batch
        if not points:
            return self.delivery_jitter_s
        if batch <= points[0][0]:
            return points[0][1]
        for (b0, j0), (b1, j1) in itertools.pairwise(points):
            if batch <= b1:
                return j0 + (j1 - j0) * (batch - b0) / (b1 - b0)
        return points[-1][1]

    def host_copy_s(self, nbytes: int) -> float:
        """``nbytes`` between the GPU and host memory (the host tier's copies); ValueError when the profile
        has no ``host_link_bytes_per_s``."""
        if self.host_link_bytes_per_s <= 0:
            raise ValueError(
                f"cost profile {self.name!r} has no host_link_bytes_per_s: it cannot time host copies"
            )
        return nbytes / self.host_link_bytes_per_s

    def handoff_s(self, num_tokens: int) -> float:
        """KV transfer of ``num_tokens`` positions (those the decode side does not already hold)."""
        return self.transfer.transfer_s(num_tokens * self.kv_bytes_per_token)

    # ---- JSON -----------------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step"] = {"kind": self.step.kind, **asdict(self.step)}
        return d

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CostProfile:
        """Strict: unknown or missing keys raise ValueError naming them."""
        data = dict(data)
        step = dict(data.pop("step", None) or {})
        kind = step.pop("kind", None)
        if kind not in _STEP_KINDS:
            raise ValueError(f"cost profile step kind must be one of {sorted(_STEP_KINDS)}, got {kind!r}")
        step_cost = _build(_STEP_KINDS[kind], step)
        transfer = _build(TransferCost, dict(data.pop("transfer", None) or {}))
        points = data.pop("delivery_jitter_by_batch", None) or ()
        try:
            jitter = tuple((int(b), float(j)) for b, j in points)
        except (TypeError, ValueError):
            raise ValueError(
                f"cost profile delivery_jitter_by_batch must be [batch, seconds] pairs, got {points!r}"
            ) from None
        batches = [b for b, _ in jitter]
        if batches != sorted(set(batches)) or any(b < 1 or not j >= 0 for b, j in jitter):
            raise ValueError(
                "cost profile delivery_jitter_by_batch must have increasing batches >= 1 and seconds >= 0, "
                f"got {points!r}"
            )
        profile: CostProfile = _build(
            cls, {**data, "step": step_cost, "transfer": transfer, "delivery_jitter_by_batch": jitter}
        )
        for f in fields(cls):
            value = getattr(profile, f.name)
            if isinstance(value, float) and (math.isnan(value) or value < 0):
                raise ValueError(f"cost profile {f.name} must be a number >= 0, got {value}")
        return profile

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> CostProfile:
        return cls.from_dict(json.loads(Path(path).read_text()))


def default_profile_path() -> Path:
    """Where ``pdserve plan calibrate`` writes this machine's profile: ``$PDSERVE_PROFILE``, else
    ``~/.cache/pdserve/cpu-profile.json``."""
    return Path(os.environ.get("PDSERVE_PROFILE") or Path.home() / ".cache" / "pdserve" / "cpu-profile.json")


def _build(cls: Any, data: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - names)
    missing = sorted(
        f.name
        for f in fields(cls)
        if f.name not in data and f.default is MISSING and f.default_factory is MISSING
    )
    if unknown or missing:
        raise ValueError(f"{cls.__name__}: unknown key(s) {unknown}, missing key(s) {missing}")
    return cls(**data)
