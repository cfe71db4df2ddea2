"""The server binary, as a process other than 0 runs it, with one fault injected: a request
whose first prompt token is ``DIVERGE_TOKEN`` draws its sampling seed from another
generator on this process only. Process 0 cannot know; the per-step plan digest must catch
it (``tests/server/test_multihost.py``).

Usage: python -m tests._diverging_follower --flag=value ... (the flags of hicache_jax.serve)
"""

import random

from hicache_jax import serve
from hicache_jax.engine.engine import Engine

DIVERGE_TOKEN = 511

_add_request = Engine.add_request


def add_request(self, input_ids=None, *args, **kwargs):
    if input_ids and input_ids[0] == DIVERGE_TOKEN:
        self._rng = random.Random(1234)  # process 0 keeps its own: the seeds now differ
    return _add_request(self, input_ids, *args, **kwargs)


if __name__ == "__main__":
    Engine.add_request = add_request
    serve.run()
