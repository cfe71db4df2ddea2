"""Prefix rules for the three classic cache kinds, as the cache and scheduler tests build them."""

from hicache_jax.cache.prefix import PrefixRules
from hicache_jax.kinds import CacheKind


def classic_rules(page_size: int, full: bool = True, window: int | None = None, state: bool = False):
    """Rules for a model with full-attention layers (``full``), sliding-window layers (a
    ``window``) and recurrent layers (``state``)."""
    kinds = [CacheKind.FULL] * full + [CacheKind.SWA] * bool(window) + [CacheKind.STATE] * state
    return PrefixRules(page_size=page_size, kinds=tuple(kinds), window=window)
