"""Block hashes: the chain key of a full KV block, with a choice of hash function. No torch.

A block's hash covers its parent's hash, its own tokens and its extra keys, so equal hashes mean
equal prefixes (and equal salts/partitions)::

    tokens   [t0 ........ t15] [t16 ....... t31] [t32 ....... t47]
    hash     h0 = H(root, b0, k0)   h1 = H(h0, b1, None)   h2 = H(h1, b2, None)

    root: the first block's parent      k0: the first block's extra keys (salt, partition)

Algorithms (``HASH_ALGOS``, vLLM's ``--prefix-caching-hash-algo`` names where they exist):

* ``builtin``: Python's ``hash((parent, *tokens))`` (an int; a tuple of ints hashes the same in
  every process, whatever PYTHONHASHSEED), the chain every cache tier keys by (kv/keys.py). Its
  first block's parent is ``fold_keys(extra_keys)``: 0 without salt or partition, else an int64
  from a SHA-256 of them. Fast, not collision-resistant: the tiers compare a block's tokens on a hit.
* ``sha256_cbor``: vLLM's ``hash_block_tokens`` with ``sha256_cbor``: SHA-256 of the canonical
  CBOR of ``(parent, tuple(tokens), extra_keys)`` (32 bytes), root ``NONE_HASH``:
  ``sha256_cbor(PYTHONHASHSEED)``, or 32 random bytes when it is unset (as vLLM: a consumer that
  hashes request tokens itself needs the same PYTHONHASHSEED as the engine).
* ``sha256``: the same with vLLM's pickle encoding (its default; only Python can reproduce it).

Extra keys are vLLM's ``generate_block_hash_extra_keys`` for a text request without LoRA: the
first block carries ``(cache_salt,)``, later blocks None, so a salted hash equals vLLM's for the
same salt. A server-side partition goes first, tagged so no salt can spell it:
``(("partition", p), cache_salt)``.

The published form (``BlockHasher.external``, what KV events carry) is vLLM's
``maybe_convert_block_hash``: by default (vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1``) the
hash's low 64 bits as an unsigned int (a digest read big-endian: its last 8 bytes); with
``int_external=False`` the digest itself (a builtin hash: its low 64 bits as 8 big-endian bytes).
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
from dataclasses import dataclass
from typing import Any, Callable, Sequence, Union

logger = logging.getLogger(__name__)

HASH_ALGOS = ("builtin", "sha256", "sha256_cbor")
BlockHash = Union[int, bytes]  # builtin: int; sha256, sha256_cbor: 32-byte digest
ExtraKeys = Union[tuple, None]
U64 = (1 << 64) - 1


def block_hash(prev_hash: int, tokens: Sequence[int]) -> int:
    """The chain hash of a block: of the one before it and its own tokens, so equal hashes mean
    equal prefixes (up to collisions, which the host tier checks against the block's tokens).
    Python's hash of a tuple of ints is the same in every process."""
    return hash((prev_hash, *tokens))


def sha256(obj: Any) -> bytes:
    """vLLM's ``sha256``: SHA-256 of the pickled object (highest protocol)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: SHA-256 of the object's canonical CBOR (RFC 8949 deterministic)."""
    import cbor2

    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def none_hash(hash_fn: Callable[[Any], bytes], seed: str | None) -> bytes:
    """vLLM's ``init_none_hash``, returned instead of kept in a global: the parent of a chain's
    first block, ``hash_fn(seed)`` for PYTHONHASHSEED's string, 32 random bytes without one."""
    return os.urandom(32) if seed is None else hash_fn(seed)


def first_block_keys(cache_salt: str | None = None, partition: str | None = None) -> ExtraKeys:
    """The extra keys of a chain's first block (later blocks have None). With a salt alone they are
    vLLM's, ``(cache_salt,)``; vLLM, like this, ignores an empty salt."""
    keys: list[Any] = []
    if partition:
        keys.append(("partition", partition))
    if cache_salt:
        keys.append(cache_salt)
    return tuple(keys) if keys else None


def fold_keys(extra_keys: ExtraKeys) -> int:
    """builtin: a first block's extra keys as the int64 its chain starts from (0: none), the same
    in every process (Python salts str hashes per process; the router, and the disk tier after a
    restart, must agree)."""
    if extra_keys is None:
        return 0
    return int.from_bytes(hashlib.sha256(repr(extra_keys).encode()).digest()[:8], "big", signed=True)


@dataclass(frozen=True)
class BlockHasher:
    """One chain hash function with its root; build with ``create``."""

    algo: str
    root: BlockHash  # the parent of a chain's first block
    int_external: bool = True  # publish the low 64 bits as an int, else the digest (``external``)

    @classmethod
    def create(cls, algo: str, hash_seed: str | None, int_external: bool = True) -> "BlockHasher":
        """``hash_seed``: PYTHONHASHSEED's value (``os.environ.get("PYTHONHASHSEED")``), as vLLM
        reads it; unused by ``builtin``."""
        if algo not in HASH_ALGOS:
            raise ValueError(f"prefix_caching_hash_algo: must be one of {HASH_ALGOS}, got {algo!r}")
        if algo == "builtin":
            return cls(algo, 0, int_external)
        if hash_seed is None:
            logger.warning("PYTHONHASHSEED is not set: the %s block hashes start from a random seed, so a "
                           "consumer cannot reproduce them (set it to the same value on both sides)", algo)
        return cls(algo, none_hash(sha256_cbor if algo == "sha256_cbor" else sha256, hash_seed), int_external)

    def hash_block(self, parent: BlockHash | None, tokens: Sequence[int], extra_keys: ExtraKeys = None) -> BlockHash:
        """The hash of a full block after ``parent`` (None: the chain's first block)."""
        if self.algo == "builtin":  # the chain the caches key by (kv/keys.py): the keys fold into its root
            return block_hash(parent or fold_keys(extra_keys), tokens)
        if not parent:  # vLLM: a falsy parent is the root
            parent = self.root
        fn = sha256_cbor if self.algo == "sha256_cbor" else sha256
        return fn((parent, tuple(map(int, tokens)), extra_keys))

    def extend(self, block_hashes: list[BlockHash], token_ids: Sequence[int], block_size: int,
               first_keys: ExtraKeys = None) -> list[BlockHash]:
        """Append to ``block_hashes`` (a request's chain so far) the hashes of the full blocks of
        ``token_ids`` past it, as vLLM's request block hasher; returns the new ones."""
        new: list[BlockHash] = []
        parent = block_hashes[-1] if block_hashes else None
        for i in range(len(block_hashes), len(token_ids) // block_size):
            parent = self.hash_block(parent, token_ids[i * block_size:(i + 1) * block_size],
                                     first_keys if i == 0 else None)
            new.append(parent)
        block_hashes.extend(new)
        return new

    def external(self, h: BlockHash) -> int | bytes:
        """The published form: the low 64 bits as an unsigned int (vLLM's default), or the digest."""
        if not self.int_external:
            return h if isinstance(h, bytes) else (h & U64).to_bytes(8, "big")
        return (int.from_bytes(h, "big") if isinstance(h, bytes) else h) & U64
