"""The page codec: named numpy arrays <-> self-checking bytes, authenticated with a key.

Layout (little-endian; the payload starts and every array sits on a 64-byte
boundary so decoded arrays are aligned views of the value's bytes):

    0   magic        4s   b"HJPG"
    4   version      u16  1: no MAC; 2: a MAC follows the fixed header
    6   n_arrays     u16
    8   namespace    8s   Namespace.digest[:8] (== bytes.fromhex(Namespace.fingerprint))
    16  meta_len     u32  metadata block length, padded so the payload starts on 64 bytes
    20  payload_len  u64
    28  crc32        u32  over every byte but these four: header, MAC, metadata and payload
    32  mac          32s  version 2 only: HMAC-SHA256 (see below)
    H   metadata     key (u16 len + utf-8), then per array:
                     name (u16 len + utf-8), dtype name (u8 len + ascii), ndim u8, dims u64[ndim]
    H + meta_len     payload: the arrays in order, each C-contiguous at a 64-byte aligned offset

H is 32 for version 1, 64 for version 2.

Checksum: zlib.crc32 runs at ~2.3 GB/s here (blake2b ~0.45, sha256 ~1.2), it releases the
GIL on large buffers, and it catches what a cache must catch (torn or truncated files, flipped
bits: every burst <= 32 bits, otherwise a 2**-32 miss chance). It does not defend against a
malicious writer: anyone can recompute it.

MAC (with an `auth_key`, auth.py): HMAC-SHA256 over a domain tag, the store key and the
namespace fingerprint the READER expects, and every byte of the page but the crc and MAC
fields. A page moved to another key or namespace, re-encoded by a writer without the key, or
carrying no MAC (version 1) fails it: reason ``auth``. The crc is checked first, so a
damaged page of our own still reads as ``checksum``. Without a key the MAC is not checked
(there is nothing to check it with): the store is trusted. Writers without a key keep writing
version 1, so servers of either age share a keyless store.

Invariant: `decode_page` either returns exactly the arrays that were encoded for that
namespace (and key, when asked; and, with a key, by a holder of that key) or raises
`CorruptPage`. A caller treats `CorruptPage` as a miss.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
import zlib
from collections.abc import Mapping

import ml_dtypes
import numpy as np

MAGIC = b"HJPG"
PLAIN_VERSION = 1  # no MAC: written without a key
AUTH_VERSION = 2  # a MAC after the fixed header: written with a key
FORMAT_VERSION = AUTH_VERSION  # the newest this reader knows
ALIGN = 64
_FIXED = struct.Struct("<4sHH8sIQI")  # 32 bytes
_CRC_OFFSET = 28
_MAC_BYTES = 32
_HEADER = {PLAIN_VERSION: _FIXED.size, AUTH_VERSION: _FIXED.size + _MAC_BYTES}  # metadata starts here
_MAC_TAG = b"hicache-jax/page-mac/v2\x00"
assert _FIXED.size == 32 and _HEADER[AUTH_VERSION] % ALIGN == 0

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name).newbyteorder("<")
    for name in (
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
    )
}
_DTYPES.update(
    {
        "bfloat16": np.dtype(ml_dtypes.bfloat16),
        "float8_e4m3fn": np.dtype(ml_dtypes.float8_e4m3fn),
        "float8_e5m2": np.dtype(ml_dtypes.float8_e5m2),
    }
)


class CorruptPage(ValueError):
    """A stored value that must not be used. `reason` is one of: bad_magic, version,
    truncated, checksum, auth, namespace, key, format."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"corrupt page ({reason}): {detail}")
        self.reason = reason


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _fingerprint_bytes(fingerprint: str) -> bytes:
    raw = bytes.fromhex(fingerprint)
    if len(raw) != 8:
        raise ValueError(f"namespace fingerprint must be 16 hex chars, got {fingerprint!r}")
    return raw


def encode_page(
    arrays: Mapping[str, np.ndarray],
    namespace_fingerprint: str,
    key: str = "",
    auth_key: bytes | None = None,
) -> bytes:
    """Serialize `arrays` (in order) for one namespace and, optionally, one store key; with
    `auth_key`, as version 2 with a MAC binding it to that key and namespace."""
    if not 0 < len(arrays) < 2**16:
        raise ValueError(f"a page holds 1..65535 arrays, got {len(arrays)}")
    version = PLAIN_VERSION if auth_key is None else AUTH_VERSION
    header = _HEADER[version]
    meta = bytearray(_str16(key))
    parts: list[np.ndarray] = []
    offset = 0
    for name, value in arrays.items():
        arr = np.asarray(value)
        if arr.dtype.name not in _DTYPES:
            raise ValueError(f"array {name!r}: unsupported dtype {arr.dtype}")
        # Little-endian, C-contiguous, no copy when it already is (np.ascontiguousarray
        # would turn a 0-d array into 1-d).
        arr = np.require(arr, dtype=_DTYPES[arr.dtype.name], requirements="C")
        dtype_name = arr.dtype.name.encode("ascii")
        meta += _str16(name) + struct.pack("<BB", len(dtype_name), arr.ndim) + dtype_name
        meta += struct.pack(f"<{arr.ndim}Q", *arr.shape)
        offset = _align(offset) + arr.nbytes
        parts.append(arr)
    meta_len = _align(header + len(meta)) - header  # payload starts aligned
    payload_len = offset
    body: list[bytes | memoryview] = [bytes(meta), bytes(meta_len - len(meta))]
    pos = 0
    for arr in parts:
        pad = _align(pos) - pos
        if pad:
            body.append(bytes(pad))
        body.append(memoryview(arr.reshape(-1).view(np.uint8)))
        pos += pad + arr.nbytes
    fields = [
        MAGIC,
        version,
        len(parts),
        _fingerprint_bytes(namespace_fingerprint),
        meta_len,
        payload_len,
    ]
    # The crc field is outside the checksummed range, so checksum (and MAC) the pieces first
    # and join once: the payload is copied exactly once.
    head = _FIXED.pack(*fields, 0)[:_CRC_OFFSET]
    if auth_key is not None:
        body.insert(0, _mac(auth_key, key, namespace_fingerprint, head, body))
    crc = zlib.crc32(head)
    for chunk in body:
        crc = zlib.crc32(chunk, crc)
    return b"".join([_FIXED.pack(*fields, crc), *body])


def _mac(auth_key: bytes, key: str, namespace_fingerprint: str, head, rest) -> bytes:
    """HMAC-SHA256 of a page: the tag, the key and namespace it is for, the fixed header but
    its crc, then `rest` (metadata and payload, in order). OpenSSL's HMAC releases the GIL
    on large buffers, so prefetch threads verify pages in parallel."""
    raw_key = key.encode("utf-8")
    mac = hmac.new(auth_key, digestmod=hashlib.sha256)
    mac.update(_MAC_TAG + struct.pack("<I", len(raw_key)) + raw_key)
    mac.update(_fingerprint_bytes(namespace_fingerprint))
    mac.update(head)
    for chunk in rest:
        mac.update(chunk)
    return mac.digest()


def decode_page(
    data: bytes | memoryview,
    expected_namespace_fingerprint: str,
    expected_key: str | None = None,
    auth_key: bytes | None = None,
) -> dict[str, np.ndarray]:
    """Arrays of one page as read-only views into `data` (no copy), or raise `CorruptPage`.

    With `auth_key`, only a version-2 page whose MAC matches `expected_key` (required) and the
    expected namespace is returned; anything else is ``auth``."""
    if auth_key is not None and expected_key is None:
        raise ValueError("decode_page: an auth_key needs the expected_key the MAC is bound to")
    view = memoryview(data)
    if view.nbytes < _FIXED.size:
        raise CorruptPage("truncated", f"{view.nbytes} bytes is shorter than the header")
    magic, version, n_arrays, ns, meta_len, payload_len, crc = _FIXED.unpack_from(view)
    if magic != MAGIC:
        raise CorruptPage("bad_magic", f"magic {magic!r}")
    if version not in _HEADER:
        raise CorruptPage("version", f"format {version}, this reader knows {sorted(_HEADER)}")
    header = _HEADER[version]
    expected_len = header + meta_len + payload_len
    if view.nbytes != expected_len:
        reason = "truncated" if view.nbytes < expected_len else "format"
        raise CorruptPage(reason, f"{view.nbytes} bytes, header says {expected_len}")
    actual = zlib.crc32(view[_CRC_OFFSET + 4 :], zlib.crc32(view[:_CRC_OFFSET]))
    if actual != crc:
        raise CorruptPage("checksum", f"crc32 {actual:#010x} != stored {crc:#010x}")
    if auth_key is not None:
        if version != AUTH_VERSION:
            raise CorruptPage("auth", f"format {version} carries no MAC and a page-auth key is set")
        want = _mac(
            auth_key, expected_key, expected_namespace_fingerprint, view[:_CRC_OFFSET], [view[header:]]
        )
        if not hmac.compare_digest(want, bytes(view[_FIXED.size : header])):
            raise CorruptPage("auth", "MAC does not match this key, namespace and page key")
    if ns != _fingerprint_bytes(expected_namespace_fingerprint):
        raise CorruptPage("namespace", f"namespace {ns.hex()} != {expected_namespace_fingerprint}")
    try:
        key, arrays = _parse_meta(view, header, n_arrays, meta_len, payload_len)
    except (struct.error, UnicodeDecodeError, KeyError, ValueError) as e:
        raise CorruptPage("format", f"bad metadata: {e}") from None
    if expected_key is not None and key != expected_key:
        raise CorruptPage("key", f"page was stored for key {key!r}, read as {expected_key!r}")
    return arrays


def _str16(s: str) -> bytes:
    raw = s.encode("utf-8")
    if len(raw) >= 2**16:
        raise ValueError(f"name too long: {s[:40]!r}...")
    return struct.pack("<H", len(raw)) + raw


def _parse_meta(
    view: memoryview, header: int, n_arrays: int, meta_len: int, payload_len: int
) -> tuple[str, dict[str, np.ndarray]]:
    meta = view[header : header + meta_len]
    pos = 0

    def read_str16() -> str:
        nonlocal pos
        (n,) = struct.unpack_from("<H", meta, pos)
        s = bytes(meta[pos + 2 : pos + 2 + n]).decode("utf-8")
        pos += 2 + n
        return s

    key = read_str16()
    payload_start = header + meta_len
    offset = 0
    arrays: dict[str, np.ndarray] = {}
    for _ in range(n_arrays):
        name = read_str16()
        dlen, ndim = struct.unpack_from("<BB", meta, pos)
        dtype = _DTYPES[bytes(meta[pos + 2 : pos + 2 + dlen]).decode("ascii")]
        pos += 2 + dlen
        shape = struct.unpack_from(f"<{ndim}Q", meta, pos)
        pos += 8 * ndim
        count = int(np.prod(shape, dtype=np.int64)) if ndim else 1
        offset = _align(offset)
        if offset + count * dtype.itemsize > payload_len:
            raise ValueError(f"array {name!r} runs past the payload")
        if count:
            arr = np.frombuffer(view, dtype=dtype, count=count, offset=payload_start + offset)
        else:  # frombuffer rejects an offset at the very end of the buffer
            arr = np.empty(0, dtype=dtype)
        arrays[name] = arr.reshape(shape)
        offset += count * dtype.itemsize
    if offset != payload_len:
        raise ValueError(f"arrays cover {offset} of {payload_len} payload bytes")
    if pos > meta_len:
        raise ValueError("metadata overruns its block")
    return key, arrays
