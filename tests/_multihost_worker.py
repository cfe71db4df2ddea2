"""One of two processes (4 emulated CPU devices each) serving one model at tp_size 8.

Usage: python -m tests._multihost_worker PORT PROCESS_ID OUT_DIR
Generates greedily for the prompts of ``tests/test_distributed.py`` (both processes run
the same engine on their half of the mesh), saves the output ids, then plans a step that
only process 1 changes and reports the PlanDivergence both must raise.
"""

import os
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
    from tests.test_distributed import PROMPTS, generate, make_engine

    engine = make_engine(tp_size=8)
    outs = generate(engine, PROMPTS)
    with open(os.path.join(out_dir, f"out{pid}.json"), "w") as f:
        json.dump({"outputs": outs, "retractions": engine.scheduler.num_retractions}, f)
    prompt = PROMPTS[0] + ([7] if pid == 1 else [])  # process 1 alone plans another step
    try:
        generate(engine, [prompt])
    except StepFailed as e:  # the engine reports a failed step with its cause
        assert isinstance(e.__cause__, distributed.PlanDivergence), e
        print(f"PlanDivergence: {e.__cause__}", flush=True)
        os._exit(3)  # the other process may still sit in a collective: do not wait on it
    print("no divergence detected", flush=True)
    os._exit(0)


if __name__ == "__main__":
    main()
