"""L3 storage on TensorStore, page keys and the page codec (imported as ``hicache_jax.storage``)."""
