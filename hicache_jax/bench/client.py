"""The benchmark's HTTP side: one streaming ``/generate`` call per request, timed, and what
the server says about itself.

Any server speaking SGLang's ``/generate`` with ``input_ids`` works: TTFT is the time to
the first streamed event that carries an output token, and cached prompt tokens are read
from ``meta_info`` (``cached_tokens``, and per tier ``cached_tokens_details``) when the
server reports them.

Chat requests (the agent workload) go to ``/v1/chat/completions``, streamed with
``stream_options.continuous_usage_stats`` so that every chunk carries the usage so far:
TTFT is the time to the first chunk whose ``completion_tokens`` is at least 1 (content
alone would not do: tool calls under ``tool_choice="required"`` arrive whole at the end,
and an ``auto`` parser holds back text that may open a call), and the prompt and cached
tokens are the usage's (``prompt_tokens_details.cached_tokens``, per tier in its
``cached_tokens_details``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Callable

import httpx

from hicache_jax.bench.theoretical import SeqRecord
from hicache_jax.cache.prefix import PrefixRules
from hicache_jax.kinds import CacheKind, Retention, cache_kinds, with_retention
from hicache_jax.tiers import TIERS


@dataclasses.dataclass
class Record:
    """One request: what was sent, what came back, and when (seconds from the phase's start)."""

    round: int
    prompt: tuple[int, ...]
    max_new_tokens: int
    sent: float
    output: tuple[int, ...] = ()
    first_token: float | None = None
    done: float | None = None
    cached: int = 0
    cached_tiers: dict = dataclasses.field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    server_timing: dict = dataclasses.field(default_factory=dict)  # meta_info "timing", seconds
    server_ttft: float | None = None  # meta_info "ttft": arrival at the engine to first token
    error: str | None = None
    # False where ``prompt`` stands in for ids the benchmark does not know (a chat request it
    # could not render as the server did): as many ids as the server counted, shared with no
    # other request's, so that token counts hold but no maximum can be computed. A chat
    # request's ``output`` is always such a stand-in (the route returns text).
    exact_ids: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None and self.first_token is not None

    @property
    def ttft(self) -> float:
        return self.first_token - self.sent

    @property
    def tpot(self) -> float | None:
        n = len(self.output)
        return (self.done - self.first_token) / (n - 1) if n > 1 else None

    def seq(self) -> SeqRecord:
        return SeqRecord(self.prompt, self.output, self.sent, self.first_token, self.done)


@dataclasses.dataclass(frozen=True)
class ServerInfo:
    """What the theoretical maximum needs to know about the server."""

    rules: PrefixRules
    chunk: int  # chunked_prefill_size (where Mamba snapshots are taken)
    vocab_size: int
    capacity_pages: int | None  # distinct pages the cache can hold; None: unbounded or unknown
    has_storage: bool
    device_tokens: int | None = None  # the device pool (max_total_tokens); None: unknown


def fetch_info(url: str, *, page_size: int = 16, vocab_size: int = 32000) -> ServerInfo:
    """From ``/get_model_info`` and ``/get_server_info`` (this project's server); for other
    servers the given page size and vocabulary, full attention, unknown capacity."""
    with httpx.Client(base_url=url, timeout=30) as c:
        model = _get_json(c, "/get_model_info")
        server = _get_json(c, "/get_server_info")
    eng = server.get("engine_config") or {}
    kinds = model.get("layer_kinds")
    vocab = int(model.get("vocab_size", vocab_size))
    if "page_size" not in model or kinds is None or not eng:
        rules = PrefixRules(page_size=page_size, kinds=(CacheKind.FULL,))
        return ServerInfo(rules, 1 << 30, vocab, None, False)
    P = int(model["page_size"])
    used = cache_kinds(kinds)
    window = model.get("sliding_window") if with_retention(used, Retention.WINDOW) else None
    rules = PrefixRules(page_size=P, kinds=used, window=window)
    # With L2 every device page is copied to the host: L1 + L2 hold the larger pool.
    capacity: int | None = eng["max_total_tokens"] // P
    l2 = eng.get("enable_hierarchical_cache")
    if eng.get("disable_radix_cache"):
        capacity = 0
    elif eng.get("hicache_storage_backend") or (l2 and eng["hicache_size_gb"]):
        capacity = None  # unbounded (L3), or a host pool sized in bytes
    elif l2:
        capacity = max(capacity, int(capacity * eng["hicache_ratio"]))
    return ServerInfo(
        rules,
        int(eng["chunked_prefill_size"]),
        vocab,
        capacity,
        bool(eng.get("hicache_storage_backend")),
        int(eng["max_total_tokens"]),
    )


def _get_json(c: httpx.Client, path: str) -> dict:
    try:
        r = c.get(path)
        return r.json() if r.status_code == 200 else {}
    except (httpx.HTTPError, json.JSONDecodeError):
        return {}


class BenchClient:
    """Sends requests for one phase; ``on_done`` is called after each (a progress bar)."""

    def __init__(self, url: str, *, timeout_s: float, on_done: Callable[[], None] | None = None):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self.http = httpx.AsyncClient(base_url=url, timeout=timeout_s, limits=limits)
        self.t0 = time.perf_counter()
        self.on_done = on_done or (lambda: None)
        self._next_stand_in = -1

    def now(self) -> float:
        return time.perf_counter() - self.t0

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    async def generate(self, prompt: list[int], max_new_tokens: int, round_idx: int) -> Record:
        rec = Record(round_idx, tuple(prompt), max_new_tokens, sent=self.now())
        sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": list(prompt), "sampling_params": sampling, "stream": True}
        try:
            async with self.http.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                else:
                    await self._read(r, rec)
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.done = self.now()
        if rec.error is None and rec.first_token is None:
            rec.error = "the stream ended without an output token"
        self.on_done()
        return rec

    async def _read(self, r: httpx.Response, rec: Record) -> None:
        async for event in _sse_events(r):
            if "error" in event:
                rec.error = str(event["error"])
                return
            if "output_ids" not in event:
                rec.error = "the server's events carry no output_ids"
                return
            if event["output_ids"] and rec.first_token is None:
                rec.first_token = self.now()
            rec.output = tuple(event["output_ids"])
            meta = event.get("meta_info") or {}
            rec.cached = int(meta.get("cached_tokens") or 0)
            details = meta.get("cached_tokens_details") or {}
            rec.cached_tiers = {t: int(details.get(t) or 0) for t in TIERS}
            rec.server_timing = dict(meta.get("timing") or {})
            if meta.get("ttft") is not None:
                rec.server_ttft = float(meta["ttft"])

    async def chat(self, body: dict, round_idx: int, prompt: list[int] | None = None) -> Record:
        """One streamed ``/v1/chat/completions`` request. ``prompt``: the ids the benchmark
        expects the server to render; kept when the server's prompt token count agrees."""
        body = dict(body, stream=True, stream_options={"include_usage": True, "continuous_usage_stats": True})
        rec = Record(round_idx, (), int(body.get("max_tokens") or 0), sent=self.now())
        usage: dict = {}
        try:
            async with self.http.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    rec.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                else:
                    async for event in _sse_events(r):
                        if "error" in event:
                            rec.error = str(event["error"])[:300]
                            break
                        if event.get("usage"):
                            usage = event["usage"]
                            if usage.get("completion_tokens") and rec.first_token is None:
                                rec.first_token = self.now()
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        rec.done = self.now()
        if rec.error is None and rec.first_token is None:
            rec.error = "no chunk reported a completion token"
        n_prompt, n_out = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
        details = usage.get("prompt_tokens_details") or {}
        rec.cached = int(details.get("cached_tokens") or 0)
        tiers = details.get("cached_tokens_details") or {}
        rec.cached_tiers = {t: int(tiers.get(t) or 0) for t in TIERS}
        rec.exact_ids = prompt is not None and len(prompt) == n_prompt
        rec.prompt = tuple(prompt) if rec.exact_ids else self._stand_in(n_prompt)
        rec.output = self._stand_in(n_out)  # the chat route returns text: output ids are never known
        self.on_done()
        return rec

    def _stand_in(self, n: int) -> tuple[int, ...]:
        """``n`` ids no other stand-in shares (negative: no vocabulary has them)."""
        out = tuple(range(self._next_stand_in, self._next_stand_in - n, -1))
        self._next_stand_in -= n
        return out

    async def post(self, path: str) -> None:
        r = await self.http.post(path)
        r.raise_for_status()

    async def aclose(self) -> None:
        await self.http.aclose()


async def _sse_events(r: httpx.Response):
    """The JSON events of a Server-Sent Events response, up to ``data: [DONE]``."""
    async for line in r.aiter_lines():
        if not line.startswith("data:"):
            continue
        data = line[5:].strip()
        if data == "[DONE]":
            return
        yield json.loads(data)
