"""Two processes x 4 emulated CPU devices (jax.distributed over gloo on 127.0.0.1) serve one
model at tp_size 8, process 0 driving and process 1 replaying its calls
(``hicache_jax/replicated.py``): the greedy outputs of one process at tp_size 1, under
retraction; a sampling seed drawn differently on one process stops both with
PlanDivergence instead of hanging."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from flax import nnx

from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.engine import Engine
from hicache_jax.models import CausalLM, KernelConfig
from hicache_jax.models.sharding import make_mesh, shard_model
from tests.models.test_tensor_parallel import HEADS8

REPO = Path(__file__).resolve().parents[1]
# Three requests at once in a pool of 6 pages: the last ones to grow are retracted.
PROMPTS = [[(7 * i + j) % 500 + 3 for j in range(20 + 5 * i)] for i in range(3)]
SAMPLING = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def make_engine(tp_size: int) -> Engine:
    mesh = make_mesh(tp_size) if tp_size > 1 else None
    model = CausalLM(HEADS8, rngs=nnx.Rngs(3), kernels=KernelConfig(attention="xla", mesh=mesh))
    shard_model(model)
    cfg = EngineConfig(
        tp_size=tp_size, page_size=16, chunked_prefill_size=32, max_running_requests=4, max_total_tokens=96
    )
    return Engine(cfg, model=model)


def generate(engine, prompts: list[list[int]]) -> list[list[int]]:
    rids = [engine.add_request(input_ids=p, sampling_params=SAMPLING) for p in prompts]
    while engine.has_unfinished():
        engine.step()
    return [engine.pop_output(r)["output_ids"] for r in rids]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_processes_serve_tp8_like_one_process_tp1(tmp_path):
    port = _free_port()
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS="")
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "tests._multihost_worker", str(port), str(i), str(tmp_path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    logs = [p.communicate(timeout=300)[0] for p in procs]
    engine = make_engine(1)
    want = generate(engine, PROMPTS)
    assert engine.scheduler.num_retractions > 0
    assert (tmp_path / "out0.json").exists(), logs[0][-3000:]
    got = json.loads((tmp_path / "out0.json").read_text())
    assert got["outputs"] == want and got["retractions"] > 0, got
    for p, log in zip(procs, logs):  # a hang would have timed out above
        assert p.returncode == 3 and "PlanDivergence: step" in log, log[-3000:]


def test_dist_flags_are_checked():
    with pytest.raises(ConfigError, match="dist_coordinator=None: must be set"):
        EngineConfig(dist_num_processes=2)
    with pytest.raises(ConfigError, match=r"dist_process_id=2: must be in \[0, dist_num_processes=2\)"):
        EngineConfig(dist_coordinator="127.0.0.1:1", dist_num_processes=2, dist_process_id=2)
