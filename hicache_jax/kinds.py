"""The one vocabulary of layer kinds and cache kinds (JAX-free; every layer shares it).

A model is a stack of layers of a ``LayerKind``. What the prefix cache keeps for a page of
a prefix is one entry per ``CacheKind``, each in a pool of its own::

    LayerKind   ATTENTION  SLIDING  MAMBA   GDN     MLA     DSA
    CacheKind   FULL       SWA      STATE   STATE   LATENT  LATENT + INDEX
    kept        every      pages    one snapshot of every   every page
                page       in the   recurrent layer's state,
                           window   taken at the end of the page (only the last page
                                    of a match needs one)

    LayerKind   SWA_MQA    CSA                              HCA
    CacheKind   SWA        SWA + CSA + INDEX + CSA_STATE    SWA + HCA + HCA_STATE
    kept        window     window, every, every, window     window, every, window
    (DeepSeek V4: a compressed kind holds a row per ``rate`` tokens, a state kind one row
    per page: the compressor's running softmax after the page's last token)

Every recurrent kind (``RECURRENT``) shares the ``STATE`` cache kind: a state slot holds
one state per recurrent layer, whatever its kind, with the shapes the model declares
(``models/cache.py``, ``state_shapes``). Slots, snapshots, the rule for the usable prefix
(``cache/prefix.py``), L2 copies and L3 keys handle ``STATE`` alone and never ask which
recurrent kind produced it. A third recurrent kind is a new ``LayerKind`` mapped to
``STATE`` here, its layer, and its entry in ``state_shapes``; nothing in ``cache/`` or
``scheduler/`` changes.

What the cache keeps of each cache kind follows its ``Retention`` rule (``RETENTION``), and
nothing in ``cache/`` or ``scheduler/`` names a cache kind: they read the rule. A new paged
kind is a ``CacheKind`` with its rule, its L3 suffix, and the layers that use it
(``docs/architecture.md``, "Adding a cache kind").

``StrEnum`` members compare and hash as their strings, so config files, metric names and
JSON keep the plain names.
"""

from __future__ import annotations

import enum


class LayerKind(enum.StrEnum):
    ATTENTION = "attention"  # full causal attention over the whole prefix
    SLIDING = "sliding"  # causal attention over the last sliding_window tokens
    MAMBA = "mamba"  # Mamba2 (SSD) mixer: conv state + SSM state
    GDN = "gdn"  # Gated DeltaNet linear attention: conv state + delta-rule state
    MLA = "mla"  # multi-head latent attention (DeepSeek): one latent row per token, every head
    DSA = "dsa"  # MLA over the positions a lightning indexer picks (its keys paged too)
    DSA_SHARED = "dsa_shared"  # MLA over the positions the previous DSA layer's indexer picked
    # DeepSeek V4's attention: one K=V head over a sliding window, and (CSA, HCA) over
    # compressed entries of the whole prefix, one per ``compress_rate`` tokens.
    SWA_MQA = "swa_mqa"  # the sliding window alone
    CSA = "csa"  # + compressed entries (rate 4, overlapping windows) a lightning indexer picks
    HCA = "hca"  # + every compressed entry (rate 128)


class CacheKind(enum.StrEnum):
    FULL = "full"  # full-attention KV, every page
    SWA = "swa"  # sliding-window KV, the pages a window needs
    STATE = "state"  # a recurrent-state snapshot (every recurrent layer) at a page's end
    LATENT = "latent"  # MLA's compressed KV and rope key, every page
    INDEX = "index"  # a sparse-attention indexer's keys, every page
    CSA = "csa"  # compressed sparse attention's entries, one per compress_rate tokens
    HCA = "hca"  # heavily compressed attention's entries, one per compress_rate tokens
    # A compressor's unfinished window at a page's end (float32 running softmax sums), one
    # row per page; the page the window behind a prefix's end covers is the one it needs.
    CSA_STATE = "csa_state"
    HCA_STATE = "hca_state"


class Retention(enum.StrEnum):
    """What a prefix ending at token ``e`` needs of a cache kind (``cache/prefix.py``)."""

    EVERY = "every"  # every page before e; a page whose only copy goes takes its subtree along
    WINDOW = "window"  # the pages a window ending at e covers; older ones may be tombstoned
    SNAPSHOT = "snapshot"  # one entry taken exactly at e, in slots rather than pages


RETENTION: dict[CacheKind, Retention] = {
    CacheKind.FULL: Retention.EVERY,
    CacheKind.SWA: Retention.WINDOW,
    CacheKind.STATE: Retention.SNAPSHOT,
    CacheKind.LATENT: Retention.EVERY,
    CacheKind.INDEX: Retention.EVERY,
    CacheKind.CSA: Retention.EVERY,
    CacheKind.HCA: Retention.EVERY,
    CacheKind.CSA_STATE: Retention.WINDOW,
    CacheKind.HCA_STATE: Retention.WINDOW,
}

# The cache kinds each layer kind keeps (a layer may keep several: its entries are
# allocated, loaded and stored per kind).
LAYER_CACHE: dict[LayerKind, tuple[CacheKind, ...]] = {
    LayerKind.ATTENTION: (CacheKind.FULL,),
    LayerKind.SLIDING: (CacheKind.SWA,),
    LayerKind.MAMBA: (CacheKind.STATE,),
    LayerKind.GDN: (CacheKind.STATE,),
    LayerKind.MLA: (CacheKind.LATENT,),
    LayerKind.DSA: (CacheKind.LATENT, CacheKind.INDEX),
    LayerKind.DSA_SHARED: (CacheKind.LATENT,),
    LayerKind.SWA_MQA: (CacheKind.SWA,),
    LayerKind.CSA: (CacheKind.SWA, CacheKind.INDEX, CacheKind.CSA, CacheKind.CSA_STATE),
    LayerKind.HCA: (CacheKind.SWA, CacheKind.HCA, CacheKind.HCA_STATE),
}
RECURRENT = frozenset(k for k, c in LAYER_CACHE.items() if c == (CacheKind.STATE,))
# Paged kinds whose one row per page is a running state after the last token written in
# the page, rewritten every step (DeepSeek V4's compressors): a verify step writes the
# state after each fed token but the last to a scratch page (``CacheAdapter.trail_slots``).
PAGE_STATE = frozenset({CacheKind.CSA_STATE, CacheKind.HCA_STATE})
# Cache kinds that hold one page per page of tokens (the rest hold snapshots in slots).
PAGED = tuple(k for k in CacheKind if RETENTION[k] is not Retention.SNAPSHOT)

# What a device pool of the kind holds, in messages (``IndexPool`` names).
POOL_NAME: dict[CacheKind, str] = {
    CacheKind.FULL: "full-attention pages",
    CacheKind.SWA: "sliding-window pages",
    CacheKind.STATE: "recurrent state slots",
    CacheKind.LATENT: "latent-attention pages",
    CacheKind.INDEX: "indexer key pages",
    CacheKind.CSA: "compressed sparse attention pages",
    CacheKind.HCA: "heavily compressed attention pages",
    CacheKind.CSA_STATE: "compressed sparse attention state pages",
    CacheKind.HCA_STATE: "heavily compressed attention state pages",
}

# The L3 object name suffix of each cache kind (``storage/layout.py`` joins it to the
# page's hash). Renaming one orphans what servers already stored under the old name.
L3_SUFFIX: dict[CacheKind, str] = {
    CacheKind.FULL: "kv",
    CacheKind.SWA: "swa",
    CacheKind.STATE: "state",
    CacheKind.LATENT: "mla",
    CacheKind.INDEX: "idx",
    CacheKind.CSA: "csa",
    CacheKind.HCA: "hca",
    CacheKind.CSA_STATE: "csast",
    CacheKind.HCA_STATE: "hcast",
}


def retention(kind: str) -> Retention:
    """A cache kind's retention rule."""
    return RETENTION[CacheKind(kind)]


def with_retention(kinds, rule: Retention) -> tuple[CacheKind, ...]:
    """Those of ``kinds`` kept by ``rule``, in the order given."""
    return tuple(k for k in kinds if RETENTION[CacheKind(k)] is rule)


def layer_cache(layer: str) -> tuple[CacheKind, ...]:
    """The cache kinds a layer kind's entries live in."""
    return LAYER_CACHE[LayerKind(layer)]


def cache_kinds(layer_kinds) -> tuple[CacheKind, ...]:
    """The cache kinds a stack of layers uses, in ``CacheKind`` order."""
    used = {c for k in layer_kinds for c in layer_cache(k)}
    return tuple(k for k in CacheKind if k in used)
