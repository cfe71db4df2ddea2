"""hicache-jax: a JAX serving stack for hybrid LLMs with a three-tier KV cache."""

__version__ = "0.1.0"

__all__ = ["LLM", "SamplingParams", "EngineConfig"]


def __getattr__(name):  # lazy: importing the package must not start JAX
    if name == "LLM":
        from hicache_jax.llm import LLM

        return LLM
    if name == "SamplingParams":
        from hicache_jax.sampling_params import SamplingParams

        return SamplingParams
    if name == "EngineConfig":
        from hicache_jax.config import EngineConfig

        return EngineConfig
    raise AttributeError(name)
