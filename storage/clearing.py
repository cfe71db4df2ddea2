"""Clearing a store: only the keys this project wrote, of one namespace or of all of them.

    scope "<model>/<fields>"   every page of that namespace, for every cache_salt tenant
    scope ""                   every page of the layout (every model, config and tenant),
                               the recency journal, the index checkpoint, the usage record
                               and the prefill -> decode handover markers

A key is ours only if its name is one this project writes: a page path `parse_page_path`
accepts (under the scope's prefix), a journal object named as `RecencyLog` names them, a
handover marker named as `handover.room_key` names them, or ``meta/index`` /
``meta/usage.json``. Anything else under the store's path survives: a user's files at the
root, under ``pages/``, inside a namespace directory or under ``meta/``, and layout-1 flat
pages (``gc --drop_legacy`` drops those, explicitly). Kept on purpose:

  * the marker (``hicache-l3.json``): the store keeps its layout, so the next start need not
    list it again for flat pages;
  * the evictor's lease (``meta/lease``): a live evictor on another server holds it, and
    deleting it would let a second evictor start beside the first.

A foreign file named exactly like a page of the layout, in a page's place, cannot be told
from one and is deleted with it.
"""

from __future__ import annotations

import time

from hicache_jax.storage.capacity import RECORDS
from hicache_jax.storage.handover import room_of
from hicache_jax.storage.journal import is_journal_key
from hicache_jax.storage.keys import Namespace
from hicache_jax.storage.layout import META, PAGES, namespace_dir, namespace_prefix, parse_page_path

DELETE_BATCH = 256  # keys per delete call: each call ends within the store's deadline


def own_scope(ns: Namespace) -> str:
    """A server's own clear scope: its namespace dir without the salt level, so every tenant
    (cache_salt) of the model and config it serves, and no other config (dtype, page size,
    auth key) that other servers serve."""
    return namespace_dir(ns).rsplit("/", 1)[0]


def owned_keys(store, scope: str = "") -> list[str]:
    """The keys a clear of `scope` deletes (see the module docstring); one listing per area."""
    scope = scope.strip("/")
    if scope:
        prefix = namespace_prefix(scope)
        return [k for k in store.list_keys(prefix) if parse_page_path(k) is not None]
    pages = [k for k in store.list_keys(PAGES) if parse_page_path(k) is not None]
    meta = [k for k in store.list_keys(META) if k in RECORDS or is_journal_key(k) or room_of(k) is not None]
    return pages + meta


def clear(store, scope: str = "", deadline: float | None = None, batch: int = DELETE_BATCH) -> int:
    """Delete `owned_keys(store, scope)` in batches; returns how many. Past `deadline`
    (monotonic) it stops between batches and raises TimeoutError saying how far it got:
    what was deleted stays deleted, and clearing again finishes the job."""
    keys = owned_keys(store, scope)  # pages first, then the records that index them
    for i in range(0, len(keys), batch):
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(
                f"L3 clear stopped at its deadline after {i} of {len(keys)} keys; clear again to finish"
            )
        store.delete(keys[i : i + batch])
    return len(keys)
