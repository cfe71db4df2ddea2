"""Tests of hicache_jax.storage: page keys, page codec, L3 stores and the storage client."""
