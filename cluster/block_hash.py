"""Chained content hashes of full KV blocks, shared by the router (prefix affinity) and the workers
(prefix cache, decode-side hits).

A full block's hash covers its tokens and, through the parent hash, every token before it, so equal
hashes mean equal prefixes. The digest is blake2b-128 over bytes, identical in every process. This
module imports nothing of the project (a leaf the control plane owns).
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes
ROOT_HASH: BlockHash = b""


def hash_block(parent: BlockHash, token_ids: Sequence[int]) -> BlockHash:
    return hashlib.blake2b(parent + array("q", token_ids).tobytes(), digest_size=16).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, start_block: int = 0, parent: BlockHash = ROOT_HASH
) -> list[BlockHash]:
    """Chained hashes of the full blocks ``start_block, start_block + 1, ...`` of ``token_ids``.

    ``parent`` is the hash of block ``start_block - 1`` (ROOT_HASH for block 0).
    """
    hashes: list[BlockHash] = []
    for b in range(start_block, len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[b * block_size : (b + 1) * block_size])
        hashes.append(parent)
    return hashes
