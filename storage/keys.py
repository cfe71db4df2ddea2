"""Content-addressed L3 page keys: a namespace, chained SHA-256 page hashes, key strings.

A page key names the KV of one FULL page of tokens *given everything before it*:

    h_0 = H(namespace.digest || u32le(tokens[0:P]))
    h_i = H(h_{i-1}          || u32le(tokens[iP:(i+1)P]))

so two prompts share a key exactly when they share the whole prefix up to and
including that page, and two namespaces (models, dtypes, page sizes, layouts,
TP shards, tenants) never share a key. A trailing partial page has no key.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
from collections.abc import Sequence

import numpy as np

from hicache_jax.kinds import L3_SUFFIX

HASH_BYTES = 32  # SHA-256 digest size
KINDS = tuple(L3_SUFFIX.values())  # object suffixes: full-attention KV, sliding KV, state snapshot
_U32_LIMIT = 2**32
_HEX_ID = re.compile(r"^[0-9a-f]{16}$")
# Namespace fields added after stores existed: left out of the digest while None.
LATER_FIELDS = ("auth_id", "mtp_cache_layers", "kv_scales")
# A scale scheme's name: shown in the namespace's directory (``layout._SAFE``).
_SCHEME = re.compile(r"^[A-Za-z0-9._+-]{1,40}$")


@dataclasses.dataclass(frozen=True)
class Namespace:
    """Everything that must match for a stored page to be reusable.

    Invariant: any change to any field changes `digest`, hence every page key.
    `cache_salt=None` (no salt) and `cache_salt=""` are different namespaces. A field added
    later (`LATER_FIELDS`) is left out of `canonical_bytes` while None, so a namespace
    without it keeps the digest it had before the field existed (existing stores still hit).
    """

    model_fingerprint: str  # identity of the weights (e.g. a hash of the checkpoint)
    kv_dtype: str  # e.g. "bfloat16"
    page_size: int  # tokens per page
    layout_version: int  # bump when the stored array layout changes
    # The shard of each page the namespace stores: 0/1 is the whole page (what the engine
    # writes at every tp_size); a per-shard layout would key each shard by its own rank.
    tp_rank: int = 0
    tp_size: int = 1
    cache_salt: str | None = None  # per-tenant / per-request isolation
    # The page-auth key's one-way id (`auth.key_id`; never the key): servers with different
    # keys, or with and without one, never share a page key. None: pages carry no MAC.
    auth_id: str | None = None
    # Cache layers each page holds past the model's main layers (a drafting block's KV,
    # ``ModelConfig.mtp_cache_layers``): its pages are larger, so servers with and without
    # it never share a key. 0 is stored as None: the digest and directory of a server
    # without it are those of a store from before the field.
    mtp_cache_layers: int | None = None
    # What quantized pages' numbers mean beyond their dtype (``models/kv_quant.scheme``:
    # "tensor-1" for unit per-tensor scales, "tensor-<digest>" for calibrated ones), so
    # servers with other scales never share a page. None for unquantized pages: the digest
    # and directory of a store from before the field.
    kv_scales: str | None = None

    def __post_init__(self) -> None:
        if not self.model_fingerprint:
            raise ValueError("Namespace.model_fingerprint must be non-empty")
        if not self.kv_dtype:
            raise ValueError("Namespace.kv_dtype must be non-empty")
        if self.page_size <= 0:
            raise ValueError(f"Namespace.page_size must be > 0, got {self.page_size}")
        if self.layout_version < 0:
            raise ValueError(f"Namespace.layout_version must be >= 0, got {self.layout_version}")
        if self.tp_size <= 0 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"need 0 <= tp_rank < tp_size, got {self.tp_rank}/{self.tp_size}")
        if self.auth_id is not None and not _HEX_ID.match(self.auth_id):
            raise ValueError(f"Namespace.auth_id must be 16 lowercase hex chars, got {self.auth_id!r}")
        extra = self.mtp_cache_layers
        if extra is not None and (type(extra) is not int or extra < 0):
            raise ValueError(f"Namespace.mtp_cache_layers must be an int >= 0 or None, got {extra!r}")
        if extra == 0:
            object.__setattr__(self, "mtp_cache_layers", None)
        if self.kv_scales is not None and not (
            isinstance(self.kv_scales, str) and _SCHEME.match(self.kv_scales)
        ):
            raise ValueError(
                "Namespace.kv_scales must be None or 1-40 characters of [A-Za-z0-9._+-], "
                f"got {self.kv_scales!r}"
            )

    def canonical_bytes(self) -> bytes:
        """A stable, unambiguous encoding of all fields (sorted-key JSON, ASCII only)."""
        fields = dataclasses.asdict(self)
        for name in LATER_FIELDS:
            if fields[name] is None:
                del fields[name]  # unset: the digest (every page key) of a store from before it
        body = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=True)
        return b"hicache-jax/namespace/v1\x00" + body.encode("ascii")

    @functools.cached_property
    def digest(self) -> bytes:
        """SHA-256 of `canonical_bytes()`; the seed of every page hash chain."""
        return hashlib.sha256(self.canonical_bytes()).digest()

    @property
    def fingerprint(self) -> str:
        """A short hex id (first 8 bytes of `digest`) written into page headers."""
        return self.digest[:8].hex()

    def with_salt(self, cache_salt: str | None) -> Namespace:
        """The same namespace for another tenant (or none)."""
        return dataclasses.replace(self, cache_salt=cache_salt)


def token_bytes(token_ids: Sequence[int] | np.ndarray) -> bytes:
    """Token ids as little-endian uint32 bytes; raises ValueError outside [0, 2**32)."""
    arr = np.asarray(token_ids)
    if arr.ndim != 1:
        raise ValueError(f"token ids must be 1-D, got shape {arr.shape}")
    if arr.size == 0:
        return b""
    if arr.dtype.kind == "O":  # Python ints too large for int64, or non-ints
        bad = [t for t in arr.tolist() if not isinstance(t, int) or not 0 <= t < _U32_LIMIT]
        raise ValueError(f"token ids must be integers in [0, 2**32); got e.g. {bad[:3]}")
    if arr.dtype.kind not in "iu":
        raise ValueError(f"token ids must be integers, got dtype {arr.dtype}")
    lo, hi = int(arr.min()), int(arr.max())
    if lo < 0 or hi >= _U32_LIMIT:
        raise ValueError(f"token ids must be in [0, 2**32); got min {lo}, max {hi}")
    return arr.astype("<u4", copy=False).tobytes()


def page_hashes(
    token_ids: Sequence[int] | np.ndarray,
    page_size: int,
    namespace: Namespace,
    start_hash: bytes | None = None,
) -> list[bytes]:
    """Chained SHA-256 digests, one per FULL page of `token_ids`.

    `start_hash` continues a chain: pass the hash of the page just before
    `token_ids[0]` (which must then sit on a page boundary). Without it the chain
    starts at `namespace.digest`. Hence, for any split at a page boundary k*P:
    `page_hashes(t) == h[:k] + page_hashes(t[k*P:], start_hash=h[k-1])`.
    """
    if page_size != namespace.page_size:
        raise ValueError(f"page_size {page_size} != namespace.page_size {namespace.page_size}")
    if start_hash is not None and len(start_hash) != HASH_BYTES:
        raise ValueError(f"start_hash must be {HASH_BYTES} bytes, got {len(start_hash)}")
    data = token_bytes(token_ids)
    page_bytes = 4 * page_size
    prev = namespace.digest if start_hash is None else bytes(start_hash)
    out = []
    for begin in range(0, len(data) - page_bytes + 1, page_bytes):
        prev = hashlib.sha256(prev + data[begin : begin + page_bytes]).digest()
        out.append(prev)
    return out


def page_key(h: bytes, kind: str) -> str:
    """The store key of one page: ``<64 hex chars>.<kind>``."""
    if kind not in KINDS:
        raise ValueError(f"unknown page kind {kind!r}; expected one of {KINDS}")
    if len(h) != HASH_BYTES:
        raise ValueError(f"page hash must be {HASH_BYTES} bytes, got {len(h)}")
    return f"{h.hex()}.{kind}"


def page_keys(hashes: Sequence[bytes], kind: str) -> list[str]:
    """`page_key` over a chain."""
    return [page_key(h, kind) for h in hashes]


def parse_key(key: str) -> tuple[bytes, str]:
    """Inverse of `page_key`: ``(hash, kind)``; raises ValueError on a malformed key."""
    hex_part, dot, kind = key.partition(".")
    if not dot or kind not in KINDS or len(hex_part) != 2 * HASH_BYTES:
        raise ValueError(f"malformed page key {key!r}")
    try:
        return bytes.fromhex(hex_part), kind
    except ValueError:
        raise ValueError(f"malformed page key {key!r}") from None
