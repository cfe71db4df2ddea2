"""The L3 store interface and its backend registry.

An L3 store maps string keys to immutable byte values. It knows nothing of
tokens, pages or models: keys come from `hicache_jax.storage.keys` and values
from `hicache_jax.storage.codec`. One exception: `clear` asks `clearing.py` which keys
are this project's, so that it deletes nothing else.
"""

from __future__ import annotations

import abc
import importlib
from collections.abc import Sequence
from typing import Any

# Backends, imported only when asked for, so that e.g. a cloud SDK is never loaded on a
# machine that does not use it. name -> "module:attribute".
_BACKENDS: dict[str, str] = {
    "tensorstore": "hicache_jax.storage.tensorstore_store:TensorStoreL3",
}


class L3Store(abc.ABC):
    """A shared, content-addressed key -> bytes store.

    Semantics every backend must give:
      * Batched calls take lists and return results aligned with the input order.
      * Atomic visibility: a reader sees a key's whole value or nothing, never a torn
        or partly written value (the codec's checksum is the second line of defence).
      * Idempotent put: values are content-addressed, so writing a key that exists is
        a no-op by default; two writers racing on one key both succeed.
      * Many processes (and many hosts, for a shared backend) may use one store at
        once; no call takes a lock that spans processes for longer than one key.
      * `delete` of a missing key and `clear` of an empty store are no-ops; `clear` deletes
        only this project's keys (see `clear`).
      * Every method is safe to call from several threads of one process.
      * A call may be abandoned by its caller at a deadline (`StoreGuard`) and keep running
        on its own thread: it must not leave the store inconsistent when it later finishes.
    """

    @abc.abstractmethod
    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is stored."""

    @abc.abstractmethod
    def get(self, keys: Sequence[str]) -> list[bytes | None]:
        """The value of each key, or None where it is missing."""

    @abc.abstractmethod
    def put(self, items: Sequence[tuple[str, bytes]], *, force: bool = False) -> int:
        """Store values; keys already stored are skipped unless `force`.

        Returns the number of values written. When it returns, every written value
        is visible to every reader of the store.
        """

    @abc.abstractmethod
    def delete(self, keys: Sequence[str]) -> None:
        """Remove keys (missing keys are ignored)."""

    def clear(self, scope: str = "", deadline: float | None = None) -> int:
        """Delete the keys this project wrote under this store's path, and nothing else.

        `scope` "<model>/<fields>": that namespace's pages, every cache_salt tenant;
        "" (the default): every namespace's pages, and the meta records the evictor rebuilds
        (journal, index, usage), not the lease or the layout marker. A key is deleted only if
        its name is one this project writes (`clearing.owned_keys`): another program's files
        beside the pages survive, wherever they sit. It lists, then deletes in batches, each
        call within the store's own deadline; past `deadline` (monotonic) it stops between
        batches and raises TimeoutError (what was deleted stays deleted). Returns the keys
        deleted. Needs `list_keys`. Never a range delete of the whole path.
        """
        from hicache_jax.storage.clearing import clear

        return clear(self, scope, deadline)

    @abc.abstractmethod
    def close(self) -> None:
        """Release resources; no call may follow. Closing twice is allowed."""

    @abc.abstractmethod
    def stats(self) -> dict[str, int]:
        """Counters: pages/bytes read and written, skipped puts, misses."""

    # Optional: the fleet features (layout check, lease, journal, eviction, gc) need these;
    # a store without them serves pages but cannot be capped.
    def list_keys(self, prefix: str = "", end: str | None = None) -> list[str]:
        """Keys starting with `prefix` (or, with `end`, in [prefix, end)), sorted."""
        raise NotImplementedError

    def read_generation(self, key: str) -> tuple[bytes | None, bytes]:
        """(value or None, an opaque generation for `write_if`)."""
        raise NotImplementedError

    def write_if(self, key: str, value: bytes | None, generation: bytes | None) -> bool:
        """Write (or delete, value None) `key` if its generation still equals `generation`
        (None: unconditionally); whether it was written."""
        raise NotImplementedError

    def free_bytes(self) -> int | None:
        """Free space under a local store (None: not a local file system)."""
        return None

    def __enter__(self) -> L3Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def register_store(name: str, target: str) -> None:
    """Register a backend as ``"package.module:ClassName"`` (imported on first use)."""
    _BACKENDS[name] = target


def make_store(backend: str, spec: Any, **options: Any) -> L3Store:
    """Open the store `spec` with the named backend (e.g. ``"tensorstore"``)."""
    if backend not in _BACKENDS:
        raise ValueError(f"unknown L3 backend {backend!r}; known: {sorted(_BACKENDS)}")
    module_name, _, attr = _BACKENDS[backend].partition(":")
    cls = getattr(importlib.import_module(module_name), attr)
    return cls(spec, **options)
