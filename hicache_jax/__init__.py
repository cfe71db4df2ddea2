"""hicache-jax: a JAX serving stack for hybrid LLMs with a three-tier KV cache."""

__version__ = "0.1.0"
