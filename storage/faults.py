"""Fault injection for L3: a store wrapper whose calls hang, lag, fail or return damaged
values, and functions that damage stored page bytes the way real faults do.

    store = FaultyStore(TensorStoreL3(path))
    store.hang("get")                     # get() blocks until release() / heal()
    store.slow(0.5, "get", "exists")      # injected latency
    store.fail(lambda: OSError(errno.ENOSPC, "No space left on device"), "put")
    store.damage(key, truncate)           # get(key) returns truncated bytes
    store.vanish_after_probe(key)         # exists() says yes, then the page is deleted
    store.heal()                          # back to the inner store's behaviour

`inject(client)` puts one under a running `StorageClient`. For tests and drills; nothing
in the serving path imports this module.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Sequence

import numpy as np

from hicache_jax.storage.base import L3Store
from hicache_jax.storage.client import StorageClient
from hicache_jax.storage.codec import decode_page, encode_page

OPS = ("exists", "get", "put", "delete", "clear")


# -- damaged values (bytes -> bytes) ---------------------------------------------------
def truncate(value: bytes, keep: float = 0.5) -> bytes:
    """The first `keep` share of a value: a torn or partly written page."""
    return value[: int(len(value) * keep)]


def flip_bit(value: bytes, bit: int | None = None) -> bytes:
    """`value` with one bit flipped (index taken modulo the value's size). By default a
    high exponent bit of a float32 near the middle of the payload: served, it would change
    the KV a lot, not by a rounding error."""
    out = bytearray(value)
    if bit is None:
        bit = 8 * (len(out) // 2 // 4 * 4 + 3) + 6
    bit %= 8 * len(out)
    out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def restamp(value: bytes, fingerprint: str, new_fingerprint: str, key: str) -> bytes:
    """The same arrays written by another namespace (e.g. another model) under `key`: a
    page with a valid checksum that this namespace must not use."""
    return encode_page(decode_page(value, fingerprint, key), new_fingerprint, key)


def forge(
    value: bytes, fingerprint: str, key: str, *, read_key: bytes | None = None, write_key: bytes | None = None
) -> bytes:
    """The page at `key` with every array zeroed, re-encoded by a writer holding `write_key`
    (None: no key): what someone who can write the store, but lacks the servers' key, can
    craft. Its checksum is valid; only a MAC can refuse it."""
    arrays = decode_page(value, fingerprint, key, auth_key=read_key)
    zeroed = {name: np.zeros_like(arr) for name, arr in arrays.items()}
    return encode_page(zeroed, fingerprint, key, auth_key=write_key)


class FaultyStore(L3Store):
    """Wraps `inner`; every knob is thread-safe and may change while calls run.
    `calls[op]` counts calls made; `blocked` is the number of calls hanging now."""

    def __init__(self, inner: L3Store):
        self.inner = inner
        self._lock = threading.Lock()
        self._hang: dict[str, threading.Event] = {}  # op -> gate that releases it
        self._latency: dict[str, float] = {}
        self._errors: dict[str, Callable[[], BaseException]] = {}
        self._damage: dict[str, Callable[[bytes], bytes | None]] = {}
        self._vanish: set[str] = set()
        self.calls: collections.Counter[str] = collections.Counter()
        self.blocked = 0

    # -- knobs -------------------------------------------------------------------------
    def hang(self, *ops: str) -> None:
        """Calls of `ops` (default: all) block until `release` or `heal`."""
        gate = threading.Event()
        with self._lock:
            for op in _ops(ops):
                self._hang[op] = gate

    def release(self) -> None:
        """Unblock every hanging call; later calls no longer hang."""
        with self._lock:
            gates, self._hang = list(self._hang.values()), {}
        for gate in gates:
            gate.set()

    def slow(self, seconds: float, *ops: str) -> None:
        with self._lock:
            for op in _ops(ops):
                self._latency[op] = seconds

    def fail(self, error: Callable[[], BaseException], *ops: str) -> None:
        """Calls of `ops` (default: all) raise ``error()`` without reaching the store."""
        with self._lock:
            for op in _ops(ops):
                self._errors[op] = error

    def damage(self, key: str, fn: Callable[[bytes], bytes | None]) -> None:
        """`get` returns ``fn(stored value)`` for `key` (None: as if missing)."""
        with self._lock:
            self._damage[key] = fn

    def vanish_after_probe(self, *keys: str) -> None:
        """The next `exists` that reports one of `keys` deletes it right after: a page
        evicted (by another server) between a probe and the read."""
        with self._lock:
            self._vanish.update(keys)

    def heal(self) -> None:
        """Drop every fault and release hanging calls."""
        with self._lock:
            self._latency.clear()
            self._errors.clear()
            self._damage.clear()
            self._vanish.clear()
        self.release()

    # -- the store ---------------------------------------------------------------------
    def _enter(self, op: str) -> None:
        with self._lock:
            self.calls[op] += 1
            gate = self._hang.get(op)
            latency = self._latency.get(op, 0.0)
            error = self._errors.get(op)
        if gate is not None:
            with self._lock:
                self.blocked += 1
            try:
                gate.wait()
            finally:
                with self._lock:
                    self.blocked -= 1
        if latency:
            time.sleep(latency)
        if error is not None:
            raise error()

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._enter("exists")
        present = self.inner.exists(keys)
        with self._lock:
            gone = [k for k, p in zip(keys, present, strict=True) if p and k in self._vanish]
            self._vanish.difference_update(gone)
        if gone:
            self.inner.delete(gone)
        return present

    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        self._enter("get")
        values = self.inner.get(keys)
        with self._lock:
            damage = dict(self._damage)
        return [
            damage[k](v) if v is not None and k in damage else v for k, v in zip(keys, values, strict=True)
        ]

    def put(self, items: Sequence[tuple[str, bytes]], *, force: bool = False) -> int:
        self._enter("put")
        return self.inner.put(items, force=force)

    def delete(self, keys: Sequence[str]) -> None:
        self._enter("delete")
        self.inner.delete(keys)

    def clear(self, scope: str = "", deadline: float | None = None) -> int:
        self._enter("clear")
        return super().clear(scope, deadline)  # through this wrapper's list and delete

    def list_keys(self, prefix: str = "", end: str | None = None) -> list[str]:
        return self.inner.list_keys(prefix, end)

    def read_generation(self, key: str) -> tuple[bytes | None, bytes]:
        return self.inner.read_generation(key)

    def write_if(self, key: str, value: bytes | None, generation: bytes | None) -> bool:
        return self.inner.write_if(key, value, generation)

    def free_bytes(self) -> int | None:
        return self.inner.free_bytes()

    def close(self) -> None:
        self.release()  # a closed store must not keep threads parked forever
        self.inner.close()

    def stats(self) -> dict[str, int]:
        return self.inner.stats()


def inject(client: StorageClient) -> FaultyStore:
    """Wrap `client`'s store in a `FaultyStore` in place (idempotent); returns it."""
    if not isinstance(client.store, FaultyStore):
        client.store = FaultyStore(client.store)
    return client.store


def _ops(ops: Sequence[str]) -> tuple[str, ...]:
    for op in ops:
        if op not in OPS:
            raise ValueError(f"unknown store operation {op!r}; expected one of {OPS}")
    return tuple(ops) or OPS
