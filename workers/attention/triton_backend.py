"""Triton attention backend: paged KV write, split-K decode, ragged prefill/extend in one forward call.

Runs on CUDA; on CPU the kernels run under the Triton interpreter (``TRITON_INTERPRET=1``, set by
``triton_kernels`` when CUDA is absent), which is how the tests check them against the torch oracle.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from workers.attention import triton_kernels as kernels
from workers.attention.base import AttentionBackend, AttentionMetadata, AttentionSpec


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


@dataclass(frozen=True)
class TritonLaunchConfig:
    """Every tile size, warp count and split-K knob of the backend (the one place to tune them).

    prefill_block_m counts Q-tile rows, i.e. (query, head-in-group) pairs; it is raised to the GQA group
    size when smaller. Decode splits the visible keys of each sequence into
    ``min(cdiv(max_kv_len, min_kv_per_split), cdiv(target_programs, num_decodes * num_kv_heads),
    max_splits)`` parts, rounded down to a power of two; 1 means no reduce kernel.
    """

    prefill_block_m: int = 128
    prefill_block_n: int = 64
    prefill_num_warps: int = 8
    prefill_num_stages: int = 2
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    min_kv_per_split: int = 256
    max_splits: int = 32
    target_programs: int = 264

    def num_decode_splits(self, num_decodes: int, num_kv_heads: int, max_kv_len: int) -> int:
        by_len = -(-max_kv_len // self.min_kv_per_split)
        by_occupancy = -(-self.target_programs // max(1, num_decodes * num_kv_heads))
        wanted = max(1, min(by_len, by_occupancy, self.max_splits))
        return 1 << (wanted.bit_length() - 1)


def launch_config_for(head_dim: int, num_sms: int) -> TritonLaunchConfig:
    """Tiles by head size; split-K occupancy target = 2 programs per SM."""
    if head_dim > 128:
        return TritonLaunchConfig(
            prefill_block_m=64, prefill_block_n=32, decode_block_n=32, target_programs=2 * num_sms
        )
    if head_dim <= 64:
        return TritonLaunchConfig(prefill_num_warps=4, target_programs=2 * num_sms)
    return TritonLaunchConfig(target_programs=2 * num_sms)


@functools.lru_cache(maxsize=16)
def default_launch_config(head_dim: int, device: torch.device) -> TritonLaunchConfig:
    """``launch_config_for`` the device's SM count (1 "SM" on CPU)."""
    num_sms = 1
    if device.type == "cuda":
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
    return launch_config_for(head_dim, num_sms)


class TritonAttentionBackend(AttentionBackend):
    """Writes new K/V into the paged cache, then decodes sequences ``[0, num_decodes)`` with the split-K
    decode kernel and the rest with the prefill/extend kernel, all without a host sync (sizes come from
    the ``*_cpu`` fields and host ints of the metadata).

    ``launch_config`` overrides the per-head-size defaults (tests use tiny tiles to exercise the loops).
    """

    name = "triton"

    def __init__(self, launch_config: TritonLaunchConfig | None = None) -> None:
        self.launch_config = launch_config

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
    ) -> torch.Tensor:
        num_tokens, num_heads, head_dim = q.shape
        if num_heads != spec.num_heads or head_dim != spec.head_dim or num_heads % spec.num_kv_heads:
            raise ValueError(f"q shape {tuple(q.shape)} does not match {spec}")
        if kv_cache.shape[2] != meta.block_size or kv_cache.stride(-1) != 1:
            raise ValueError(f"kv_cache {tuple(kv_cache.shape)} does not match block_size {meta.block_size}")
        q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
        cfg = self.launch_config or default_launch_config(head_dim, q.device)
        self._write_kv(k, v, kv_cache, meta)

        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        num_real = int(meta.query_start_loc_cpu[-1])
        if num_real < num_tokens:
            out[num_real:].zero_()  # CUDA-graph padding rows belong to no sequence
        if meta.num_decodes > 0:
            self._decode(q, kv_cache, meta, spec, cfg, out)
        if meta.num_seqs > meta.num_decodes:
            self._prefill(q, kv_cache, meta, spec, cfg, out)
        return out

    @staticmethod
    def _write_kv(k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata) -> None:
        num_kv_heads, head_dim = k.shape[1], k.shape[2]
        if meta.num_tokens == 0:
            return
        kernels.kv_write_kernel[(meta.num_tokens,)](
            k, v, kv_cache, meta.slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            *_cache_strides(kv_cache),
            NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HEADS_PAD=_next_pow2(num_kv_heads),
            DIM_PAD=_next_pow2(head_dim), BLOCK_SIZE=meta.block_size,
        )  # fmt: skip

    @staticmethod
    def _decode(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        cfg: TritonLaunchConfig,
        out: torch.Tensor,
    ) -> None:
        num_decodes, num_heads, head_dim = meta.num_decodes, spec.num_heads, spec.head_dim
        group = num_heads // spec.num_kv_heads
        max_kv_len = meta.max_seq_len
        if spec.sliding_window is not None:
            max_kv_len = min(max_kv_len, spec.sliding_window)
        num_splits = cfg.num_decode_splits(num_decodes, spec.num_kv_heads, max_kv_len)
        is_split = num_splits > 1
        # NOTE: scratch only when splitting; each split program overwrites its whole slice, so no zeroing.
        part_shape = (num_decodes, num_heads, num_splits) if is_split else (1, 1, 1)
        part_out = torch.empty((*part_shape, head_dim), dtype=torch.float32, device=q.device)
        part_lse = torch.empty(part_shape, dtype=torch.float32, device=q.device)
        po_strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2))
        pl_strides = (part_lse.stride(0), part_lse.stride(1))
        kernels.decode_kernel[(num_decodes, spec.num_kv_heads, num_splits)](
            q, kv_cache, meta.block_tables, meta.seq_lens, out, part_out, part_lse,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *_cache_strides(kv_cache), meta.block_tables.stride(0),
            *po_strides, *pl_strides,
            spec.scale, spec.logit_soft_cap or 0.0, spec.sliding_window or 0, num_splits,
            GROUP=group, GROUP_PAD=max(16, _next_pow2(group)), HEAD_DIM=head_dim,
            DIM_PAD=max(16, _next_pow2(head_dim)), BLOCK_N=cfg.decode_block_n, BLOCK_SIZE=meta.block_size,
            USE_SOFT_CAP=spec.logit_soft_cap is not None, USE_WINDOW=spec.sliding_window is not None,
            IS_SPLIT=is_split, DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype),
            num_warps=cfg.decode_num_warps, num_stages=cfg.decode_num_stages,
        )  # fmt: skip
        if is_split:
            kernels.decode_reduce_kernel[(num_decodes, num_heads)](
                part_out, part_lse, out, *po_strides, *pl_strides, out.stride(0), out.stride(1), num_splits,
                HEAD_DIM=head_dim, DIM_PAD=_next_pow2(head_dim),
            )  # fmt: skip

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        spec: AttentionSpec,
        cfg: TritonLaunchConfig,
        out: torch.Tensor,
    ) -> None:
        group = spec.num_heads // spec.num_kv_heads
        block_m = max(cfg.prefill_block_m, _next_pow2(group))
        block_q = block_m // group
        num_prefills = meta.num_seqs - meta.num_decodes
        grid = (num_prefills, -(-meta.max_query_len // block_q), spec.num_kv_heads)
        kernels.prefill_kernel[grid](
            q, kv_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc, out,
            q.stride(0), q.stride(1), out.stride(0), out.stride(1),
            *_cache_strides(kv_cache), meta.block_tables.stride(0),
            spec.scale, spec.logit_soft_cap or 0.0, spec.sliding_window or 0, meta.num_decodes,
            GROUP=group, BLOCK_M=block_m, BLOCK_Q=block_q, HEAD_DIM=spec.head_dim,
            DIM_PAD=max(16, _next_pow2(spec.head_dim)), BLOCK_N=cfg.prefill_block_n,
            BLOCK_SIZE=meta.block_size, USE_SOFT_CAP=spec.logit_soft_cap is not None,
            USE_WINDOW=spec.sliding_window is not None, DOT_PRECISION=_dot_precision(q.dtype), UPCAST_DOT=_upcast_dot(q.dtype),
            num_warps=cfg.prefill_num_warps, num_stages=cfg.prefill_num_stages,
        )  # fmt: skip


def _cache_strides(kv_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """(block, k/v, slot-in-block, kv-head) strides of ``[num_blocks, 2, block_size, num_kv_heads, D]``."""
    return kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3)


def _dot_precision(dtype: torch.dtype) -> str:
    # NOTE: fp32 models must match the fp32 oracle; TF32 (the default) keeps only 10 mantissa bits.
    return "ieee" if dtype == torch.float32 else "tf32"


def _upcast_dot(dtype: torch.dtype) -> bool:
    return kernels.IS_INTERPRETED and dtype == torch.bfloat16
