"""Two processes x 4 emulated CPU devices serve one checkpoint at tp_size 8 with the server
binary, every tier on (jax.distributed over gloo on 127.0.0.1; HTTP on process 0 only):

* concurrent requests on a pool small enough to retract give the greedy outputs of one
  process at tp_size 1 (a plain ``Engine`` over the same checkpoint, in this process);
* after ``/flush_cache`` the same prompts are served from L3, prefetched by process 0 and
  sent to process 1 with its steps (``hicache_jax/multihost/replicated.py``), with the same outputs;
  the two processes wrote disjoint shares of the pages (``StorageTier.writer``): the
  writes they log at exit add up to the page files in the store;
* a sampling seed drawn differently on process 1 (``tests/_diverging_follower.py``) stops
  both with ``PlanDivergence`` within seconds: the request gets an error naming it, and
  both exit with status 3, instead of hanging in a collective;
* the pair stops cleanly: SIGTERM to process 0 closes the engine on process 1 too, and both
  leave ``jax.distributed`` together;
* processes started with different settings refuse to start, naming the flag.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from hicache_jax.bench.server_process import ServerError, ServerProcess, free_port
from hicache_jax.config import EngineConfig
from hicache_jax.engine.engine import Engine
from tests import hf_checkpoints
from tests._diverging_follower import DIVERGE_TOKEN
from tests.server.conftest import ROOT, server_env
from tests.waits import wait
from tests.xla_env import with_device_count

TINY_TOKENIZER = os.path.join(ROOT, "hicache_jax", "assets", "tiny_tokenizer.json")

# Four prompts of 3-5 pages with 8 new tokens each, on 8 pages of KV: retraction is forced.
PROMPTS = [[(11 * i + 5 * j) % 500 + 3 for j in range(40 + 9 * i)] for i in range(4)]
SAMPLING = {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True}
# The last prompt's output is held by a grammar: each process compiles it and fills its masks.
SAMPLINGS = [SAMPLING] * (len(PROMPTS) - 1) + [dict(SAMPLING, regex="[a-e]{3,12}")]
ENGINE = dict(
    dtype="float32",
    page_size=16,
    chunked_prefill_size=32,
    max_running_requests=4,
    max_total_tokens=128,
    context_length=256,
)
FLAGS = [
    "--platform=cpu",
    "--attention_backend=xla",
    "--log_level=info",
    *(f"--{k}={v}" for k, v in ENGINE.items()),
    "--tp_size=8",
    "--enable_hierarchical_cache",
    "--hicache_ratio=4",
    "--hicache_write_policy=write_through",
    "--hicache_storage_backend=tensorstore",
    "--hicache_storage_prefetch_policy=wait_complete",
    "--hicache_prefetch_threshold=16",
    "--hicache_host_rate_limit=1.0",
    "--dist_num_processes=2",
]


def env4() -> dict:
    """A server process's environment with 4 emulated devices (one host of the pair)."""
    env = server_env()
    env["XLA_FLAGS"] = with_device_count(env["XLA_FLAGS"], 4)
    return env


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    """gemma3 (sliding and full attention) with 8 query heads, so tp_size 8 splits them."""
    out = str(tmp_path_factory.mktemp("heads8"))
    path = hf_checkpoints.make("gemma3", out, overrides={"num_attention_heads": 8, "head_dim": 8})
    shutil.copy(TINY_TOKENIZER, os.path.join(path, "tokenizer.json"))  # 512 tokens: grammars need text
    return path


class Pair:
    """Process 1 (the follower, started first: process 0 waits for it to join) and process
    0 (the HTTP server), each with 4 emulated devices."""

    def __init__(self, tmp: Path, checkpoint: str, extra: tuple[str, ...] = ()):
        tmp.mkdir()
        self.l3 = tmp / "l3"
        flags = [
            *FLAGS,
            *extra,
            f"--model_path={checkpoint}",
            f"--hicache_storage_spec={self.l3}",
            f"--dist_coordinator=127.0.0.1:{free_port()}",
        ]
        env = env4()
        self.log1 = tmp / "process1.log"
        with open(self.log1, "w") as log:
            self.follower = subprocess.Popen(
                [sys.executable, "-m", "tests._diverging_follower", *flags, "--dist_process_id=1"],
                cwd=ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        try:
            self.leader = ServerProcess(
                [*flags, "--dist_process_id=0"],
                log_path=str(tmp / "process0.log"),
                startup_timeout=wait(400),
                env=env,
                cwd=ROOT,
            )
        except ServerError as e:
            self.follower.kill()
            pytest.fail(f"{e}\nprocess 1:\n{self.follower_log()[-3000:]}")
        self.client = httpx.Client(base_url=self.leader.url, timeout=wait(300))

    def follower_log(self) -> str:
        return self.log1.read_text()

    def generate(self, prompts: list[list[int]]) -> list[httpx.Response]:
        def post(prompt, sp):
            return self.client.post("/generate", json={"input_ids": prompt, "sampling_params": sp})

        with ThreadPoolExecutor(len(prompts)) as pool:
            return list(pool.map(post, prompts, SAMPLINGS))

    def wait_exit(self, timeout: float) -> tuple[int, int]:
        deadline = time.monotonic() + timeout
        codes = []
        for proc in (self.leader.proc, self.follower):
            try:
                codes.append(proc.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return tuple(codes)

    def close(self) -> None:
        self.client.close()
        for proc in (self.leader.proc, self.follower):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        self.leader.close()


def reference(checkpoint: str) -> list[list[int]]:
    """One process, tp_size 1, no L2/L3: the same prompts at once, on the same small pool."""
    engine = Engine(EngineConfig(model_path=checkpoint, **ENGINE))
    rids = [engine.add_request(input_ids=p, sampling_params=sp) for p, sp in zip(PROMPTS, SAMPLINGS)]
    while engine.has_unfinished():
        engine.step()
    assert engine.scheduler.num_retractions > 0
    return [engine.pop_output(r)["output_ids"] for r in rids]


def l3_page_files(root: Path) -> int:
    return sum(1 for p in (root / "pages").rglob("*") if p.is_file())


def logged_l3_writes(log: str) -> int:
    found = re.findall(r"L3 at close: (\d+) page writes", log)
    assert len(found) == 1, log[-3000:]
    return int(found[0])


def test_two_processes_serve_tp8_over_http_like_one_process(tmp_path, checkpoint):
    want = reference(checkpoint)  # (without speculation)
    # With n-gram speculative decoding: every process drafts the same tokens from the same
    # request states, so the replayed verify steps agree (the plan digest checks each).
    spec = ("--speculative_algorithm=NGRAM", "--speculative_ngram_min_match_window_size=1")
    pair = Pair(tmp_path / "a", checkpoint, extra=spec)
    try:
        first = pair.generate(PROMPTS)
        assert [r.status_code for r in first] == [200] * len(PROMPTS), [r.text for r in first]
        assert [r.json()["output_ids"] for r in first] == want
        assert re.fullmatch(SAMPLINGS[-1]["regex"], first[-1].json()["text"]), first[-1].json()
        metrics = pair.client.get("/get_server_info").json()["metrics"]
        assert metrics["num_retractions"] > 0, metrics
        assert metrics["spec_draft_tokens"] > 0, metrics

        # L3: flushed from L1 and L2, served from the store through process 0's prefetch.
        assert pair.client.post("/flush_cache").status_code == 200
        second = pair.generate(PROMPTS)
        assert [r.json()["output_ids"] for r in second] == want
        from_l3 = [r.json()["meta_info"]["cached_tokens_details"]["storage"] for r in second]
        assert all(n >= 16 for n in from_l3), [r.json()["meta_info"]["cached_tokens_details"] for r in second]

        # A clean stop: process 0's SIGTERM closes process 1's engine as well.
        pair.leader.proc.send_signal(signal.SIGTERM)
        leader, follower = pair.wait_exit(60)
        # uvicorn shuts down gracefully, then re-raises the signal it caught.
        assert leader in (0, -signal.SIGTERM), (leader, pair.leader.log_tail())
        assert follower == 0, (follower, pair.follower_log()[-3000:])
        log0, log1 = pair.leader.log_tail(400), pair.follower_log()
        writes = [logged_l3_writes(log0), logged_l3_writes(log1)]
        assert all(writes) and sum(writes) == l3_page_files(pair.l3), (writes, l3_page_files(pair.l3))
    finally:
        pair.close()


def test_a_plan_divergence_stops_both_processes_within_seconds(tmp_path, checkpoint):
    pair = Pair(tmp_path / "b", checkpoint)
    try:
        assert pair.generate(PROMPTS[:1])[0].status_code == 200  # in step until the fault
        t0 = time.monotonic()
        (r,) = pair.generate([[DIVERGE_TOKEN, *PROMPTS[0][1:]]])
        assert r.status_code >= 500 and "PlanDivergence" in r.text, r.text
        codes = pair.wait_exit(30)
        took = time.monotonic() - t0
        assert codes == (3, 3), (codes, pair.follower_log()[-3000:])
        assert took < 30
        for log in (pair.leader.log_tail(60), pair.follower_log()):
            assert "PlanDivergence: step" in log, log[-3000:]
    finally:
        pair.close()


def test_processes_started_with_different_settings_refuse_to_start(tmp_path, checkpoint):
    flags = [*FLAGS, f"--model_path={checkpoint}", f"--dist_coordinator=127.0.0.1:{free_port()}"]
    serve = [sys.executable, "-m", "hicache_jax.serve", *flags]
    procs = [
        subprocess.Popen(
            [*serve, f"--dist_process_id={i}", f"--random_seed={i}"],
            cwd=ROOT,
            env=env4(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in (0, 1)
    ]
    outs = [p.communicate(timeout=wait(300))[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 2, out[-3000:]
        assert "different settings for random_seed; every process must get the same flags" in out, out[-3000:]
