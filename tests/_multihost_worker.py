"""One of two processes (4 emulated CPU devices each) serving one model at tp_size 8.

Usage: python -m tests._multihost_worker PORT PROCESS_ID OUT_DIR
Process 0 generates greedily for the prompts of ``tests/test_distributed.py`` through a
``LeaderEngine`` and saves the outputs; process 1 replays its calls (``follow``). Then
process 1 alone draws another sampling seed for the next request: both must stop with
PlanDivergence at that request's first step.
"""

import os
import random
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")

from hicache_jax import distributed  # noqa: E402
from hicache_jax.config import EngineConfig  # noqa: E402


def main() -> None:
    port, pid, out_dir = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    distributed.initialize(
        EngineConfig(dist_coordinator=f"127.0.0.1:{port}", dist_num_processes=2, dist_process_id=pid)
    )
    import json

    from hicache_jax.failures import StepFailed
    from hicache_jax.replicated import LeaderEngine, follow
    from tests.test_distributed import PROMPTS, generate, make_engine

    engine = make_engine(tp_size=8)
    try:
        if pid == 0:
            leader = LeaderEngine(engine)
            outs = generate(leader, PROMPTS)
            with open(os.path.join(out_dir, "out0.json"), "w") as f:
                json.dump({"outputs": outs, "retractions": engine.scheduler.num_retractions}, f)
            generate(leader, [PROMPTS[0]])
        else:
            add, added = engine.add_request, []

            def add_request(*args, **kwargs):  # the request after the first batch diverges
                added.append(1)
                if len(added) == len(PROMPTS) + 1:
                    engine._rng = random.Random(1234)
                return add(*args, **kwargs)

            engine.add_request = add_request
            follow(engine)
    except (StepFailed, distributed.PlanDivergence) as e:
        cause = e if isinstance(e, distributed.PlanDivergence) else e.__cause__
        assert isinstance(cause, distributed.PlanDivergence), e
        print(f"PlanDivergence: {cause}", flush=True)
        os._exit(3)  # the other process may still sit in a collective: do not wait on it
    print("no divergence detected", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
