"""Where things live in an L3 store: a fan-out tree of pages per namespace, and a `meta/` area.

    hicache-l3.json                                    marker: {"layout": 2, ...}
    pages/<model>/<fields>/<salt>/ab/cd/<hash>.<kind>  one object per page
    meta/lease                                         the evictor's lease (lease.py)
    meta/journal/<ms>-<server>-<seq>                   batched recency records (journal.py)
    meta/index                                         the folded recency index (lru_index.py)
    meta/usage.json                                    the store's size, as the evictor saw it
    meta/handover/<room>                               prefill -> decode markers (handover.py)

Only these names are this project's: clear and gc delete nothing else (clearing.py), so
another program's files under the same path survive.

`<model>` is the namespace's model fingerprint, `<fields>` every other namespace field but the
salt (``kv_dtype=bfloat16,page_size=16,...``, so a field added to `Namespace` shows up here
without a change; a field that is None is left out, so ``auth_id=<key id>`` appears only with
a page-auth key and keyless paths are those of a store from before keys), `<salt>` is
``nosalt`` or a hash of the tenant's salt (user text never reaches a path). ``ab/cd`` are the
first two bytes of the page hash: 65,536 leaf directories, so 10 million pages put ~150
entries in each and no directory ever grows past a few thousand.
A whole model's (or tenant's) pages sit under one prefix, to list or drop together.

Layout 1 put every page flat at the root (``<hash>.<kind>``). A store without the marker
that holds such keys is refused (`LegacyLayout`): their namespace is not recoverable from
them, so they cannot be moved; drop them with ``python -m hicache_jax.storage.gc
--spec=... --drop_legacy``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re

from hicache_jax.storage.keys import HASH_BYTES, KINDS, Namespace, page_key

LAYOUT_VERSION = 2
MARKER = "hicache-l3.json"
PAGES = "pages/"
META = "meta/"
_SAFE = re.compile(r"^[A-Za-z0-9._=,+-]{1,96}$")
_SALT = re.compile(r"^(nosalt|salt-[0-9a-f]{24})$")
_LEGACY = re.compile(r"^[0-9a-f]{64}\.(" + "|".join(KINDS) + r")$")
# Layout-1 keys are 64 hex chars at the root; every layout-2 key starts with h, m or p.
LEGACY_RANGE = ("0", "g")


class LegacyLayout(RuntimeError):
    """The store holds pages in the old flat layout; the message says what to do."""


def _safe(text: str) -> str:
    """`text` if it is a short, path-safe token, else a hash of it."""
    return text if _SAFE.match(text) else "h-" + hashlib.sha256(text.encode()).hexdigest()[:24]


@functools.lru_cache(maxsize=1024)
def namespace_dir(ns: Namespace) -> str:
    """``<model>/<fields>/<salt>``: the directory of one namespace's pages (no slashes at the ends)."""
    fields = [
        f"{f.name}={getattr(ns, f.name)}"
        for f in dataclasses.fields(ns)
        if f.name not in ("model_fingerprint", "cache_salt") and getattr(ns, f.name) is not None
    ]
    salt = "nosalt"
    if ns.cache_salt is not None:
        salt = "salt-" + hashlib.sha256(ns.cache_salt.encode()).hexdigest()[:24]
    return f"{_safe(ns.model_fingerprint)}/{_safe(','.join(fields))}/{salt}"


def page_path(ns: Namespace, h: bytes, kind: str) -> str:
    """The store key of one page of namespace `ns`."""
    return f"{PAGES}{namespace_dir(ns)}/{h[:1].hex()}/{h[1:2].hex()}/{page_key(h, kind)}"


@dataclasses.dataclass(frozen=True)
class PagePath:
    ns_dir: str
    hash: bytes
    kind: str

    @property
    def path(self) -> str:
        h = self.hash
        return f"{PAGES}{self.ns_dir}/{h[:1].hex()}/{h[1:2].hex()}/{page_key(h, self.kind)}"


def parse_page_path(key: str) -> PagePath | None:
    """Inverse of `page_path`; None for a key that `page_path` cannot produce (clear and gc
    delete only keys this returns a path for: another program's files are never touched)."""
    if not key.startswith(PAGES):
        return None
    parts = key[len(PAGES) :].split("/")
    if len(parts) != 6:
        return None
    *ns, a, b, leaf = parts
    if not (_SAFE.match(ns[0]) and _SAFE.match(ns[1]) and _SALT.match(ns[2])):
        return None
    hex_part, _, kind = leaf.partition(".")
    if kind not in KINDS or len(hex_part) != 2 * HASH_BYTES or hex_part[:2] != a or hex_part[2:4] != b:
        return None
    try:
        h = bytes.fromhex(hex_part)
    except ValueError:
        return None
    return PagePath("/".join(ns), h, kind)


def namespace_prefix(ns_dir: str) -> str:
    """The key prefix of every page of one namespace dir (or of a model: its first part)."""
    return f"{PAGES}{ns_dir.strip('/')}/"


def is_legacy_key(key: str) -> bool:
    return bool(_LEGACY.match(key))


def marker_bytes() -> bytes:
    body = {"format": "hicache-jax-l3", "layout": LAYOUT_VERSION, "fanout": "ab/cd"}
    return json.dumps(body, sort_keys=True).encode()


def check_marker(value: bytes) -> None:
    """Raise `LegacyLayout` unless `value` is a marker of this layout."""
    try:
        layout = json.loads(value)["layout"]
    except (ValueError, KeyError, TypeError):
        raise LegacyLayout(f"unreadable L3 layout marker {MARKER}: {value[:80]!r}") from None
    if layout != LAYOUT_VERSION:
        raise LegacyLayout(f"L3 store has layout {layout}; this server writes layout {LAYOUT_VERSION}")


def legacy_message(where: str, count: int) -> str:
    return (
        f"L3 store {where} holds {count}+ pages in the old flat layout (<hash>.<kind> at the root). "
        "Their namespace cannot be recovered from them, so they are not migrated: drop them with "
        f"`python -m hicache_jax.storage.gc --spec={where} --drop_legacy` (or point "
        "--hicache_storage_spec at a new location)."
    )


def check_layout(store) -> None:
    """Refuse a store in the old flat layout; mark an unmarked store as this layout.

    One read when the marker is there (every start but the first); otherwise one listing
    of the range where flat keys would sit (empty on a new store).
    """
    value, generation = store.read_generation(MARKER)
    if value is not None:
        check_marker(value)
        return
    legacy = [k for k in store.list_keys(*LEGACY_RANGE) if is_legacy_key(k)]
    if legacy:
        raise LegacyLayout(legacy_message(getattr(store, "url", repr(store)), len(legacy)))
    store.write_if(MARKER, marker_bytes(), generation)
