"""The offline API: ``LLM(...).generate(...)`` returns SGLang-style dicts.

    from hicache_jax import LLM
    llm = LLM()                                   # the tiny preset, random weights
    llm.generate(prompts=["Hello"], sampling_params={"max_new_tokens": 8})

Keyword arguments are EngineConfig fields: the same names as the server's flags.
"""

from __future__ import annotations

import time

from hicache_jax import accelerators
from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from hicache_jax.engine.flush_result import FlushResult
from hicache_jax.sampling_params import QueueFull, SamplingParams


class LLM:
    def __init__(self, model_path: str | None = None, **kwargs):
        accelerators.cpu_unless_attached()  # no libtpu probe (and its stderr) without a TPU
        self.engine = Engine(EngineConfig(model_path=model_path, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | dict | list | None = None,
        *,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        logprob_start_len: int = -1,
        top_logprobs_num: int = 0,
        cache_salt: str | None = None,
    ) -> list[dict]:
        """One result dict per prompt, in order. All prompts are queued together and run
        with continuous batching."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts or input_ids")
        if prompts is not None:
            items = [{"text": p} for p in ([prompts] if isinstance(prompts, str) else prompts)]
        else:
            ids = [input_ids] if input_ids and isinstance(input_ids[0], int) else input_ids
            items = [{"input_ids": list(x)} for x in ids]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(items)
        if len(params) != len(items):
            raise ValueError(f"{len(params)} sampling_params for {len(items)} prompts")
        rids = []
        for item, sp in zip(items, params):
            while True:
                try:
                    rids.append(
                        self.engine.add_request(
                            **item,
                            sampling_params=sp,
                            return_logprob=return_logprob,
                            logprob_start_len=logprob_start_len,
                            top_logprobs_num=top_logprobs_num,
                            cache_salt=cache_salt,
                        )
                    )
                    break
                except QueueFull:  # a batch larger than the queue: run some, then add more
                    self._step()
        while self.engine.has_unfinished():
            self._step()
        return [self.engine.pop_output(r) for r in rids]

    def _step(self) -> None:
        self.engine.step()
        if not self.engine.scheduler.running:
            time.sleep(0.001)  # only requests waiting on L3 prefetches: don't spin

    def flush_cache(self) -> FlushResult:
        """Clear L1 and L2 (L3 is kept); check ``.success``: False while requests run."""
        return self.engine.flush_cache()

    def close(self) -> None:
        """Drain queued L3 writes and stop background threads."""
        self.engine.close()
