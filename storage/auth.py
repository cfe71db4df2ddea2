"""The page-auth key: read from a file, named in paths by a one-way id, never stored elsewhere.

With a key (``--hicache_storage_auth_key_file``) every page carries an HMAC-SHA256 over its
store key, its namespace and all of its bytes (codec.py, format version 2), and the key's id
joins the `Namespace` (``auth_id``), so servers with different keys, or with a key and without
one, use disjoint page keys and never read each other's pages.

What it protects: a page forged or swapped by anyone who can write the store but lacks the key
is a miss (counted as ``corrupt_auth``), never served. What it does not: anyone holding the
key; deletion of pages (availability); reading them (no encryption). Without a key the store
is trusted: a CRC-valid page under the right key is served.

The key file's surrounding whitespace (a trailing newline from ``echo``) is stripped, so two
hosts whose files differ only by it share pages; what is left must be at least
`MIN_KEY_BYTES` long (``openssl rand -hex 32 > key`` makes a good one).
"""

from __future__ import annotations

import hashlib
import hmac

MIN_KEY_BYTES = 16
MAX_KEY_BYTES = 4096  # a larger "key file" is a mistake (or /dev/zero): refused, not read whole
_ID_LABEL = b"hicache-jax key id"
ID_HEX = 16  # 64 bits: tells keys apart; the MAC, not the id, is what protects a page


class BadAuthKey(ValueError):
    """The key file cannot be used; the message says why (never what the key is)."""


def read_auth_key(path: str) -> bytes:
    """The key in `path`, stripped of surrounding whitespace; raises `BadAuthKey`."""
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_KEY_BYTES + 1)
    except OSError as e:
        raise BadAuthKey(f"cannot read it: {e.strerror or e}") from None
    if len(raw) > MAX_KEY_BYTES:
        raise BadAuthKey(f"must hold at most {MAX_KEY_BYTES} bytes")
    key = raw.strip()
    if len(key) < MIN_KEY_BYTES:
        raise BadAuthKey(
            f"must hold a key of at least {MIN_KEY_BYTES} bytes (surrounding whitespace ignored), "
            f"got {len(key)}; e.g. openssl rand -hex 32"
        )
    return key


def key_id(key: bytes) -> str:
    """A one-way id of `key` (hex): equal keys give equal ids; the id does not give the key."""
    return hmac.new(key, _ID_LABEL, hashlib.sha256).hexdigest()[:ID_HEX]
