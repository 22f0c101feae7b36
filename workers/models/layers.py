"""Building blocks shared by every architecture: linear layers (fused q/k/v and gate/up), RMSNorm,
rotary embedding with scaling, the paged Attention layer, the gated MLP, and HF-name weight loading.

Parameters are created with ``torch.empty`` (no init work): a model is either filled from a checkpoint
or initialised by ``loader.build_random_model``.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable, Iterable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from workers.attention.base import AttentionSpec
from workers.forward_context import get_forward_context
from workers.models.arch import ArchConfig
from workers.models.parallel import TensorParallel, current

ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}

# HF module name -> (our fused module name, shard index).
PACKED_MODULES: dict[str, tuple[str, int]] = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class Linear(nn.Module):
    """``y = x W^T (+ b)`` with HF's parameter names; ``out_sizes`` > 1 entries fuse several HF linears.

    Under tensor parallelism (workers/models/parallel.py) ``out_sizes`` are this rank's and a checkpoint tensor
    is narrowed to this rank's part as it loads (``take``): ``rows``, one (start, length) per fused HF
    linear, for a column-parallel layer; ``cols`` (start, length) for a row-parallel one, whose partial
    outputs ``tp`` sums (the bias added once, after the sum). ``padded``: the rank's rows may run past
    the checkpoint's (the vocabulary's last shard); the rest stays zero."""

    def __init__(
        self,
        in_features: int,
        out_sizes: list[int],
        bias: bool,
        *,
        rows: list[tuple[int, int]] | None = None,
        cols: tuple[int, int] | None = None,
        tp: TensorParallel | None = None,
        padded: bool = False,
    ) -> None:
        super().__init__()
        self.out_sizes = out_sizes
        self.rows, self.cols, self.padded = rows, cols, padded
        self.reduce = tp if tp is not None and tp.is_parallel and cols is not None else None
        self.weight = nn.Parameter(torch.empty(sum(out_sizes), in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(sum(out_sizes)), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.reduce is None:
            return F.linear(x, self.weight, self.bias)
        y = self.reduce.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias

    def shard(self, param: torch.Tensor, index: int) -> torch.Tensor:
        """The rows of ``param`` that HF's ``index``-th fused linear owns."""
        start = sum(self.out_sizes[:index])
        return param.narrow(0, start, self.out_sizes[index])

    def take(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        """This rank's part of the checkpoint's ``index``-th fused tensor (weight or bias)."""
        if self.rows is not None:
            start, length = self.rows[index]
            return tensor.narrow(0, start, length)
        if self.cols is not None and tensor.dim() == 2:
            return tensor.narrow(1, *self.cols)
        return tensor


class Embedding(nn.Module):
    """Token embeddings; under tensor parallelism this rank's rows of the vocabulary (``rows``: start,
    length in the checkpoint; padded to ``num_embeddings``), looked up where an id falls in them and
    summed over the ranks (the others add zeros: exact)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        *,
        rows: tuple[int, int] | None = None,
        tp: TensorParallel | None = None,
    ) -> None:
        super().__init__()
        self.rows = rows
        self.padded = rows is not None
        self.tp = tp if tp is not None and tp.is_parallel else None
        self.weight = nn.Parameter(torch.empty(num_embeddings, embedding_dim), requires_grad=False)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None or self.rows is None:
            return F.embedding(input_ids, self.weight)
        start = self.rows[0]
        local = input_ids - start
        outside = (local < 0) | (local >= self.weight.shape[0])
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0.0)
        return self.tp.all_reduce(out)

    def take(self, tensor: torch.Tensor, index: int) -> torch.Tensor:
        return tensor if self.rows is None else tensor.narrow(0, *self.rows)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, in float32. ``gemma``: scale by ``(1 + w)`` and cast after it, as HF."""

    def __init__(self, dim: int, eps: float, gemma: bool = False) -> None:
        super().__init__()
        self.eps = eps
        self.gemma = gemma
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.gemma and x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # NOTE: one op; in float32 it equals HF's op-by-op form bit for bit (checked in tests).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.gemma:
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        # NOTE: Llama casts back to the input dtype before the weight multiply (HF does the same).
        return self.weight * normed.to(x.dtype)


@functools.cache
def triton_ops() -> ModuleType:
    """``workers.models.triton_ops``, imported on first use (triton is needed only on the fused path)."""
    return importlib.import_module("workers.models.triton_ops")


def fused_norm(
    norm: RMSNorm, x: torch.Tensor, residual: torch.Tensor | None = None, pre: RMSNorm | None = None
) -> torch.Tensor:
    """``norm(residual + pre(x))`` in one fused kernel; ``residual`` is updated in place to the sum."""
    pre_weight = None if pre is None else pre.weight
    out: torch.Tensor = triton_ops().rms_norm(x, norm.weight, norm.eps, norm.gemma, residual, pre_weight)
    return out


def rope_inv_freq(arch: ArchConfig) -> torch.Tensor:
    """Float32 inverse frequencies on the CPU, with "linear" / "llama3" scaling applied as HF does."""
    dim = arch.head_dim
    inv_freq = 1.0 / (arch.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = arch.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by factor, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < old_len / high) * ~(wavelen > old_len / low)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Computes (cos, sin) for the batch's positions once per forward; layers apply them.

    ``inv_freq`` is a non-persistent float32 buffer: after ``to_empty``/``to(dtype)`` call
    ``reset_buffers()`` to recompute it on the module's device.
    """

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", rope_inv_freq(arch), persistent=False)

    def reset_buffers(self) -> None:
        self.inv_freq = rope_inv_freq(self.arch).to(self.inv_freq.device)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [T, 1, head_dim]
        return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's non-interleaved RoPE on ``[T, heads, head_dim]``."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """q/k/v projection, optional per-head q/k norm, RoPE, then the backend over this layer's paged cache.

    The KV cache and batch metadata come from the forward context, so ``forward`` only needs the hidden
    states and this step's (cos, sin).
    """

    def __init__(self, arch: ArchConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        tp = current()
        shard = tp.sharding(arch)
        self.num_heads, self.num_kv_heads = shard.num_heads, shard.num_kv_heads
        self.head_dim = arch.head_dim
        self.q_size, self.kv_size = shard.num_heads * arch.head_dim, shard.num_kv_heads * arch.head_dim
        rows = None if not tp.is_parallel else [shard.q_rows(), shard.kv_rows(), shard.kv_rows()]
        self.qkv_proj = Linear(
            arch.hidden_size, [self.q_size, self.kv_size, self.kv_size], arch.qkv_bias, rows=rows
        )
        cols = shard.q_rows() if tp.is_parallel else None
        self.o_proj = Linear(self.q_size, [arch.hidden_size], arch.o_bias, cols=cols, tp=tp)
        self.q_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.has_qk_norm else None
        self.k_norm = RMSNorm(arch.head_dim, arch.rms_norm_eps) if arch.has_qk_norm else None
        self.spec = AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=arch.head_dim,
            scale=arch.attn_scale,
            logit_soft_cap=arch.attn_logit_softcapping,
            sliding_window=arch.layer_sliding_window(layer_idx),
        )

    def forward(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        ctx = get_forward_context()
        if ctx.fused_ops:
            q, k, _ = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(num_tokens, self.num_heads, self.head_dim)
            k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
            # NOTE: in place on the fresh qkv projection output; q/k stay views into it.
            q_w = None if self.q_norm is None else self.q_norm.weight
            k_w = None if self.k_norm is None else self.k_norm.weight
            eps = 0.0 if self.q_norm is None else self.q_norm.eps
            triton_ops().rotary_qk_(q, k, cos, sin, q_w, k_w, eps)
        else:
            q, k = self._norm_rotary_qk(qkv, cos, sin)
        v = qkv[:, self.q_size + self.kv_size :].view(num_tokens, self.num_kv_heads, self.head_dim)
        out = ctx.backend.forward(q, k, v, ctx.kv_caches[self.layer_idx], ctx.attn_metadata, self.spec)
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _norm_rotary_qk(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q/k norm and RoPE of the torch path over q and k at once: they are adjacent in ``qkv``, so
        [T, heads + kv heads, head_dim] is a view, and every op is per head (the same values as two
        passes, in half the ops)."""
        num_tokens, num_q = qkv.shape[0], self.num_heads
        qk = qkv[:, : self.q_size + self.kv_size].view(num_tokens, num_q + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            weight = torch.cat(
                (self.q_norm.weight.expand(num_q, -1), self.k_norm.weight.expand(self.num_kv_heads, -1))
            )
            qk32 = qk.float()
            normed = qk32 * torch.rsqrt(qk32.pow(2).mean(-1, keepdim=True) + self.q_norm.eps)
            qk = weight * normed.to(qk.dtype)  # HF: weight * normed, in the input dtype
        qk = apply_rotary(qk, cos, sin)
        return qk[:, :num_q], qk[:, num_q:]


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused into one matmul."""

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        if arch.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {arch.hidden_act!r}; supported: {sorted(ACTIVATIONS)}")
        self.act = ACTIVATIONS[arch.hidden_act]
        self.act_name = arch.hidden_act
        tp = current()
        shard = tp.sharding(arch)
        self.intermediate_size = size = shard.intermediate_size
        rows = [shard.mlp_rows()] * 2 if tp.is_parallel else None
        cols = shard.mlp_rows() if tp.is_parallel else None
        self.gate_up_proj = Linear(arch.hidden_size, [size, size], arch.mlp_bias, rows=rows)
        self.down_proj = Linear(size, [arch.hidden_size], arch.mlp_bias, cols=cols, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if get_forward_context().fused_ops:
            return self.down_proj(triton_ops().gated_act(gate_up, self.act_name))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(self.act(gate) * up)


def vocab_shard(arch: ArchConfig, tp: TensorParallel) -> tuple[int, tuple[int, int] | None]:
    """(rows this rank's embedding / LM head has, (start, length) of the checkpoint's rows it holds, or
    None when it holds them all)."""
    if not tp.is_parallel:
        return arch.vocab_size, None
    shard = tp.sharding(arch)
    # NOTE: a rank past the vocabulary's end (more ranks than rows to share) holds no row of it
    return shard.vocab_per_rank, (min(shard.vocab_start, arch.vocab_size), shard.vocab_rows)


def vocab_embedding(arch: ArchConfig) -> Embedding:
    """The token embeddings of ``arch``: this rank's vocabulary shard under tensor parallelism."""
    tp = current()
    rows, held = vocab_shard(arch, tp)
    return Embedding(rows, arch.hidden_size, rows=held, tp=tp)


def load_hf_weights(
    model: nn.Module, weights: Iterable[tuple[str, torch.Tensor]], skip: Callable[[str], bool]
) -> None:
    """Copies HF-named tensors into ``model`` (casting to each parameter's dtype/device), one at a time.

    Names for which ``skip(name)`` is true are ignored. Raises ValueError on an unknown name, a shape
    mismatch, or when any parameter (or fused shard) was never loaded.
    """
    params = dict(model.named_parameters())
    pending: set[tuple[str, int]] = set()
    for name in params:
        module = model.get_submodule(name.rsplit(".", 1)[0])
        shards = len(module.out_sizes) if isinstance(module, Linear) else 1
        pending.update((name, i) for i in range(shards))
    for hf_name, tensor in weights:
        if skip(hf_name) or hf_name.endswith("rotary_emb.inv_freq"):
            continue
        parts = hf_name.split(".")
        shard = 0
        if len(parts) >= 2 and parts[-2] in PACKED_MODULES:
            parts[-2], shard = PACKED_MODULES[parts[-2]]
        name = ".".join(parts)
        if name not in params:
            raise ValueError(f"checkpoint tensor {hf_name!r} has no parameter in {type(model).__name__}")
        module = model.get_submodule(name.rsplit(".", 1)[0])
        target: torch.Tensor = params[name]
        if isinstance(module, Linear) and len(module.out_sizes) > 1:
            target = module.shard(target, shard)
        padded = False
        if isinstance(module, (Linear, Embedding)):
            tensor = module.take(tensor, shard)
            padded = module.padded and tensor.dim() >= 1 and tensor.shape[0] < target.shape[0]
        if tuple(target.shape[padded:]) != tuple(tensor.shape[padded:]):
            raise ValueError(
                f"{hf_name}: checkpoint shape {tuple(tensor.shape)} != expected {tuple(target.shape)}"
            )
        with torch.no_grad():
            if padded:  # NOTE: the vocabulary's last shard: rows past the checkpoint's stay zero
                target.zero_()
                target = target.narrow(0, 0, tensor.shape[0])
            target.copy_(tensor)
        pending.discard((name, shard))
    if pending:
        missing = sorted({name for name, _ in pending})
        raise ValueError(f"checkpoint is missing weights for {missing[:8]} ({len(missing)} parameters)")


class DecoderModel(nn.Module):
    """The ``model.`` part of a causal LM: embeddings, decoder layers, final norm."""

    embed_tokens: Embedding

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class CausalLM(nn.Module):
    """What the model runner calls: ``forward`` -> hidden, ``compute_logits``, ``load_weights``.

    With tied embeddings there is no ``lm_head`` module: logits use ``model.embed_tokens.weight``.
    """

    model_class: type[DecoderModel]

    def __init__(self, arch: ArchConfig) -> None:
        super().__init__()
        self.arch = arch
        self.tp = current()
        self.model = self.model_class(arch)
        vocab = vocab_shard(arch, self.tp)
        self.lm_head = (
            None
            if arch.tie_word_embeddings
            else Linear(
                arch.hidden_size,
                [vocab[0]],
                False,
                rows=None if vocab[1] is None else [vocab[1]],
                padded=vocab[1] is not None,
            )
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``input_ids``/``positions``: [T] int64 -> hidden states [T, hidden_size]."""
        return self.model(input_ids, positions)

    def compute_logits(self, hidden: torch.Tensor, raw: bool = False, fused: bool = False) -> torch.Tensor:
        """[N, hidden_size] -> float32 logits [N, vocab_size] (final soft-cap applied when the arch has
        one). ``raw``: the head's output alone, in the model dtype (enough for an argmax: the upcast and
        the soft-cap are monotonic). ``fused``: upcast and soft-cap in one Triton kernel."""
        return self.finish_logits(self.head(hidden), raw, fused)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> the LM head's output [N, vocab_size] in the model dtype. Under tensor
        parallelism every rank computes its vocabulary shard and rank 0 gathers them (the other ranks get
        their own shard back): every rank must call it, in the same order."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.tp.gather_vocab(F.linear(hidden, weight), self.arch.vocab_size)

    def finish_logits(self, logits: torch.Tensor, raw: bool = False, fused: bool = False) -> torch.Tensor:
        """The head's output -> float32 logits, final soft-cap applied (``compute_logits``' second half)."""
        cap = self.arch.final_logit_softcapping
        if raw:
            return logits
        if fused:
            out: torch.Tensor = triton_ops().logits_to_fp32(logits, cap)
            return out
        logits = logits.float()
        if cap is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def argmax_logits(self, logits: torch.Tensor) -> torch.Tensor:
        """The head's output (``head``) -> [N] int64: each row's most likely token."""
        return logits.argmax(dim=-1)

    def argmax_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, hidden_size] -> [N] int64: each row's most likely token (the raw head's argmax)."""
        return self.compute_logits(hidden, raw=True).argmax(dim=-1)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Loads HF-named tensors one by one; ``lm_head.weight`` is ignored when embeddings are tied."""
        load_hf_weights(self, weights, skip=lambda name: self.lm_head is None and name == "lm_head.weight")
