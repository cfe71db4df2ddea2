"""Soak: many concurrent HTTP clients against one server, round after round.

Each round sends ``requests_per_round`` requests from ``clients`` concurrent clients:
random prompt lengths over a few shared prefixes, SGLang ``/generate`` (streaming or not)
and OpenAI ``/v1/completions``; some clients give up mid-request (the connection closes:
an abort) and some streaming clients hang up after a few events (a disconnect). After
each round the server is flushed and its resident memory read. At the end every request
that completed is sent again alone, one at a time, and must give the same output (greedy
and seeded sampling are deterministic), and the flushed server must hold no page.

The check is ``SoakReport.problems()``: empty when all of that holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import random
import time

import httpx
import numpy as np

from hicache_jax.bench.workloads import positive

VOCAB = (3, 500)  # tiny presets: ids below 3 are special


@dataclasses.dataclass(frozen=True)
class SoakConfig:
    """Rounds of ``requests_per_round`` requests from ``clients`` concurrent clients; the
    shares are of the requests (streaming, OpenAI route, aborted, disconnected)."""

    clients: int = 16
    rounds: int = 4
    requests_per_round: int = 100
    max_prompt: int = 400
    max_new_tokens: int = 24
    num_prefixes: int = 4
    stream_share: float = 0.4
    openai_share: float = 0.15
    abort_share: float = 0.1  # the client gives up after a random delay
    disconnect_share: float = 0.1  # a streaming client hangs up after a few events
    request_timeout_s: float = 300.0
    seed: int = 0

    def __post_init__(self):
        positive(self, "clients", "rounds", "requests_per_round", "max_new_tokens", "num_prefixes")
        positive(self, "request_timeout_s")
        if self.max_prompt < 2:
            raise ValueError(f"SoakConfig.max_prompt must be >= 2, got {self.max_prompt}")
        shares = (self.stream_share, self.openai_share, self.abort_share, self.disconnect_share)
        if any(not 0 <= s <= 1 for s in shares):
            raise ValueError(f"SoakConfig shares must be in [0, 1], got {shares}")


@dataclasses.dataclass(frozen=True)
class SoakRequest:
    key: str
    round_idx: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    temperature: float
    seed: int
    route: str  # generate | generate_stream | completions
    action: str  # complete | abort | disconnect
    give_up_after_s: float = 0.0

    def sampling(self) -> dict:
        sp = {"max_new_tokens": self.max_new_tokens, "temperature": self.temperature, "ignore_eos": True}
        return sp | ({"seed": self.seed, "top_k": 40} if self.temperature else {})

    @property
    def solo_key(self) -> tuple:
        return (self.prompt, self.max_new_tokens, self.temperature, self.seed if self.temperature else 0)


@dataclasses.dataclass
class Outcome:
    req: SoakRequest
    status: str  # ok | gave_up | error
    output: list[int] | str | None = None  # output ids (generate) or text (completions)
    latency_s: float = 0.0
    detail: str = ""


def make_requests(cfg: SoakConfig, round_idx: int) -> list[SoakRequest]:
    rng = random.Random(cfg.seed * 1000 + round_idx)
    prefix_rng = np.random.default_rng(cfg.seed)
    prefixes = [prefix_rng.integers(*VOCAB, cfg.max_prompt).tolist() for _ in range(cfg.num_prefixes)]
    out = []
    for i in range(cfg.requests_per_round):
        base = rng.choice(prefixes)[: rng.randint(0, cfg.max_prompt - 1)]
        n = rng.randint(1, cfg.max_prompt - len(base))
        prompt = tuple(base + [rng.randint(*VOCAB) for _ in range(n)])
        u = rng.random()
        if u < cfg.openai_share:
            route = "completions"
        elif u < cfg.openai_share + cfg.stream_share:
            route = "generate_stream"
        else:
            route = "generate"
        v = rng.random()
        action = "complete"
        if v < cfg.abort_share:
            action = "abort"
        elif v < cfg.abort_share + cfg.disconnect_share and route == "generate_stream":
            action = "disconnect"
        out.append(
            SoakRequest(
                key=f"r{round_idx}-{i}",
                round_idx=round_idx,
                prompt=prompt,
                max_new_tokens=rng.randint(1, cfg.max_new_tokens),
                temperature=0.0 if route == "completions" or rng.random() < 0.6 else 0.8,
                seed=rng.randint(0, 10_000),
                route=route,
                action=action,
                give_up_after_s=rng.uniform(0.05, 1.5),
            )
        )
    return out


# ---- one request ---------------------------------------------------------------------------
async def _generate(client: httpx.AsyncClient, req: SoakRequest, model: str) -> Outcome:
    body = {"input_ids": list(req.prompt), "sampling_params": req.sampling()}
    r = await client.post("/generate", json=body)
    if r.status_code != 200:
        return Outcome(req, "error", detail=f"HTTP {r.status_code}: {r.text[:300]}")
    return Outcome(req, "ok", output=r.json()["output_ids"])


async def _generate_stream(client: httpx.AsyncClient, req: SoakRequest, model: str) -> Outcome:
    body = {"input_ids": list(req.prompt), "sampling_params": req.sampling(), "stream": True}
    last, events = None, 0
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            return Outcome(req, "error", detail=f"HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: ") :]
            if data == "[DONE]":
                break
            payload = json.loads(data)
            if "error" in payload:
                return Outcome(req, "error", detail=str(payload["error"]))
            last, events = payload, events + 1
            if req.action == "disconnect" and events >= 2:
                return Outcome(req, "gave_up", detail=f"hung up after {events} events")
    if last is None:
        return Outcome(req, "error", detail="stream ended without an event")
    return Outcome(req, "ok", output=last["output_ids"])


async def _completions(client: httpx.AsyncClient, req: SoakRequest, model: str) -> Outcome:
    body = {"model": model, "prompt": list(req.prompt), "max_tokens": req.max_new_tokens, "temperature": 0}
    body["ignore_eos"] = True
    r = await client.post("/v1/completions", json=body)
    if r.status_code != 200:
        return Outcome(req, "error", detail=f"HTTP {r.status_code}: {r.text[:300]}")
    return Outcome(req, "ok", output=r.json()["choices"][0]["text"])


ROUTES = {"generate": _generate, "generate_stream": _generate_stream, "completions": _completions}


async def send(client: httpx.AsyncClient, req: SoakRequest, model: str) -> Outcome:
    t0 = time.perf_counter()
    call = ROUTES[req.route](client, req, model)
    try:
        if req.action == "abort":
            out = await asyncio.wait_for(call, req.give_up_after_s)
        else:
            out = await call
    except TimeoutError:
        out = Outcome(req, "gave_up", detail=f"gave up after {req.give_up_after_s:.2f}s")
    except httpx.HTTPError as e:
        out = Outcome(req, "error", detail=f"{type(e).__name__}: {e}")
    out.latency_s = time.perf_counter() - t0
    return out


async def run_round(
    url: str, reqs: list[SoakRequest], clients: int, timeout: float, model: str
) -> list[Outcome]:
    """``clients`` workers share the queue; each keeps one request in flight."""
    queue: asyncio.Queue[SoakRequest] = asyncio.Queue()
    for r in reqs:
        queue.put_nowait(r)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=clients * 2)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits) as client:

        async def worker():
            while not queue.empty():
                outcomes.append(await send(client, queue.get_nowait(), model))

        await asyncio.gather(*(worker() for _ in range(clients)))
    return outcomes


# ---- the whole soak ---------------------------------------------------------------------------
def server_flags(preset: str, l3_dir: str, pool_tokens: int, max_running: int = 8) -> list[str]:
    """A CPU server with every tier on and a small device pool (eviction and retraction)."""
    from hicache_jax.bench.server_process import REPO_CONFIGS

    return [
        f"--flagfile={os.path.join(REPO_CONFIGS, 'hicache_l3_cpu.flags')}",
        f"--preset={preset}",
        f"--max_total_tokens={pool_tokens}",
        "--chunked_prefill_size=64",
        f"--max_running_requests={max_running}",
        "--hicache_ratio=1.0",
        "--hicache_storage_prefetch_policy=timeout",
        "--hicache_prefetch_threshold=64",
        f"--hicache_storage_spec={l3_dir}",
        "--log_level=warning",
    ]


@dataclasses.dataclass
class SoakReport:
    outcomes: list[Outcome]
    rounds_s: list[float]
    rss_mb: list[float]  # after each round (flushed)
    mismatches: list[str]
    leaks: list[str]
    flush_failures: list[str]

    @property
    def completed(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.status == "ok"]

    def latency_ms(self, q: float, first_round: int = 0) -> float:
        lat = [
            o.latency_s
            for o in self.completed
            if o.req.action == "complete" and o.req.round_idx >= first_round
        ]
        return 1000 * float(np.quantile(lat, q)) if lat else float("nan")

    def requests_per_s(self, first_round: int = 0) -> float:
        n = sum(o.req.round_idx >= first_round for o in self.outcomes)
        return n / sum(self.rounds_s[first_round:])

    def problems(self, rss_growth_mb: float | None = None) -> list[str]:
        """Everything that went wrong: errors, a request meant to complete that did not,
        outputs that differ from solo runs, leaked pages, failed flushes, and RSS growth
        after the first round beyond ``rss_growth_mb`` (when given)."""
        out = [f"{o.req.key} ({o.req.route}): {o.detail}" for o in self.outcomes if o.status == "error"]
        out += [
            f"{o.req.key}: {o.status} although it was meant to complete"
            for o in self.outcomes
            if o.req.action == "complete" and o.status != "ok"
        ]
        out += self.mismatches + self.leaks + self.flush_failures
        if rss_growth_mb is not None and len(self.rss_mb) > 1:
            growth = max(self.rss_mb[1:]) - self.rss_mb[0]
            if growth > rss_growth_mb:
                out.append(f"RSS grew {growth:.0f} MB after the first round (bound {rss_growth_mb:.0f} MB)")
        return out

    def summary(self) -> str:
        n = len(self.outcomes)
        gave_up = sum(o.status == "gave_up" for o in self.outcomes)
        return (
            f"{n} requests ({len(self.completed)} completed, {gave_up} gave up) "
            f"in {sum(self.rounds_s):.1f}s: "
            f"{self.requests_per_s():.2f} req/s; latency p50 {self.latency_ms(0.5):.0f} ms, "
            f"p99 {self.latency_ms(0.99):.0f} ms"
            + (
                f"; after the first round (compiles): {self.requests_per_s(1):.2f} req/s, "
                f"p50 {self.latency_ms(0.5, 1):.0f} ms, p99 {self.latency_ms(0.99, 1):.0f} ms"
                if len(self.rounds_s) > 1
                else ""
            )
            + "; RSS after each round (MB): "
            + ", ".join(f"{x:.0f}" for x in self.rss_mb)
        )


def _flush(url: str) -> str | None:
    r = httpx.post(url + "/flush_cache", timeout=120)
    return None if r.status_code == 200 else f"flush_cache: HTTP {r.status_code}: {r.text[:300]}"


def leaked_pages(url: str) -> list[str]:
    """After a flush every device and host page must be free (``/metrics`` pool gauges)."""
    from hicache_jax.bench.server_process import metrics

    m = metrics(url)
    return [f"{k} = {v:.0f} after flush_cache" for k, v in m.items() if k.endswith("_used") and v != 0]


def solo_mismatches(url: str, outcomes: list[Outcome], timeout: float) -> list[str]:
    """Send every completed request again, alone, and compare."""
    out = []
    seen: dict[tuple, list[int] | str] = {}
    with httpx.Client(base_url=url, timeout=timeout) as client:
        for o in outcomes:
            if o.status != "ok":
                continue
            key = (o.req.solo_key, o.req.route == "completions")
            if key not in seen:
                body = {"input_ids": list(o.req.prompt), "sampling_params": o.req.sampling()}
                r = client.post("/generate", json=body)
                r.raise_for_status()
                seen[key] = r.json()["text" if o.req.route == "completions" else "output_ids"]
            if seen[key] != o.output:
                out.append(f"{o.req.key} ({o.req.route}): {o.output!r} under load, {seen[key]!r} alone")
    return out


def run_soak(url: str, cfg: SoakConfig, rss: callable | None = None, log=print) -> SoakReport:
    """Drive the server at ``url``; ``rss()`` returns its resident bytes (if known)."""
    outcomes, rounds_s, rss_mb, flush_failures = [], [], [], []
    model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
    for k in range(cfg.rounds):
        reqs = make_requests(cfg, k)
        t0 = time.perf_counter()
        got = asyncio.run(run_round(url, reqs, cfg.clients, cfg.request_timeout_s, model))
        rounds_s.append(time.perf_counter() - t0)
        outcomes += got
        failure = _flush(url)
        if failure:
            flush_failures.append(f"round {k}: {failure}")
        if rss is not None:
            rss_mb.append(rss() / 2**20)
        log(
            f"round {k}: {len(got)} requests in {rounds_s[-1]:.1f}s, "
            f"{sum(o.status == 'ok' for o in got)} completed"
            + (f", RSS {rss_mb[-1]:.0f} MB" if rss_mb else "")
        )
    mismatches = solo_mismatches(url, outcomes, cfg.request_timeout_s)
    failure = _flush(url)
    if failure:
        flush_failures.append(f"final: {failure}")
    return SoakReport(outcomes, rounds_s, rss_mb, mismatches, leaked_pages(url), flush_failures)
