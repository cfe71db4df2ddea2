"""Runs every workload on every cache configuration, each configuration on a fresh server.

One server per configuration runs the workloads one after another; before each, its
caches are emptied (``/flush_cache`` clears L1 and L2, ``/clear_storage`` L3), so every
workload starts cold. The warm-restart workload restarts the server *process* on the same
L3 directory between its two phases; a configuration without L3 keeps nothing across a
restart, so there it only flushes (the same empty cache, without a second start-up).

With ``warmup_pass`` each measured phase is preceded by the same workload on other tokens
(another seed), then a flush (of L1 and L2; for the agent workload L3 too): programs are
compiled, or loaded from JAX's persistent compilation cache, before anything is timed.

The agent workload sends chat requests (text): it needs a server with a tokenizer, so it is
not among the default workloads (``DEFAULT_WORKLOADS``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import time

import httpx

from hicache_jax.bench import report
from hicache_jax.bench.agent_prompts import LocalChat
from hicache_jax.bench.client import BenchClient, Record, ServerInfo, fetch_info
from hicache_jax.bench.server_process import ServerProcess
from hicache_jax.bench.workloads import (
    AgentConfig,
    ChatConfig,
    DocQAConfig,
    TraceConfig,
    agent,
    doc_qa,
    multi_turn,
    trace_replay,
)

WORKLOADS = ("multi_turn", "doc_qa", "trace", "warm_restart", "agent")
DEFAULT_WORKLOADS = WORKLOADS[:4]  # the agent workload needs a tokenizer (chat takes text)
WARMUP_SEED = 7919  # added to the seed: other tokens, same shapes


@dataclasses.dataclass(frozen=True)
class CacheConfig:
    name: str
    label: str
    flags: tuple[str, ...]
    storage: bool = False


CACHE_CONFIGS = {
    c.name: c
    for c in (
        CacheConfig("none", "no prefix cache", ("--disable_radix_cache",)),
        CacheConfig("l1", "L1", ()),
        CacheConfig("l1l2", "L1+L2", ("--enable_hierarchical_cache",)),
        CacheConfig(
            "l1l2l3",
            "L1+L2+L3",
            ("--enable_hierarchical_cache", "--hicache_storage_backend=tensorstore"),
            storage=True,
        ),
    )
}


@dataclasses.dataclass(frozen=True)
class BenchConfig:
    out_dir: str
    configs: tuple[str, ...] = tuple(CACHE_CONFIGS)
    workloads: tuple[str, ...] = DEFAULT_WORKLOADS
    chat: ChatConfig = ChatConfig()
    qa: DocQAConfig = DocQAConfig()
    restart: DocQAConfig = DocQAConfig(questions=2)
    trace: TraceConfig | None = None
    agent: AgentConfig = AgentConfig()
    server_flags: tuple[str, ...] = ()
    server_env: tuple[tuple[str, str], ...] = ()
    url: str | None = None  # drive this server instead of starting them
    page_size: int = 16  # for a server that does not report one (url)
    seed: int = 0
    warmup_pass: bool = True
    request_timeout_s: float = 1800.0
    startup_timeout_s: float = 1800.0

    def __post_init__(self):
        bad = [w for w in self.workloads if w not in WORKLOADS]
        if bad or not self.workloads:
            raise ValueError(f"workloads must be some of {WORKLOADS}, got {list(self.workloads)}")
        if "trace" in self.workloads and self.trace is None:
            raise ValueError("the trace workload needs a trace file")
        if self.url is None:
            bad = [c for c in self.configs if c not in CACHE_CONFIGS]
            if bad or not self.configs:
                raise ValueError(f"configs must be some of {list(CACHE_CONFIGS)}, got {list(self.configs)}")

    def requests_per_pass(self, workload: str) -> int:
        if workload == "multi_turn":
            return self.chat.num_requests
        if workload == "doc_qa":
            return self.qa.num_requests
        if workload == "warm_restart":
            return 2 * self.restart.num_requests
        if workload == "agent":
            return self.agent.num_requests
        return len(self.trace.requests())

    def total_requests(self) -> int:
        per_config = sum(self.requests_per_pass(w) for w in self.workloads)
        return per_config * (2 if self.warmup_pass else 1) * (1 if self.url else len(self.configs))


class Runner:
    def __init__(self, cfg: BenchConfig, progress=None):
        self.cfg = cfg
        self.progress = progress
        self.starts = 0
        self.startup_s: dict[str, list[float]] = {}  # per configuration, each server start
        self._chat: tuple[str, LocalChat | None] | None = None  # the server's model name and rendering

    def run(self) -> dict:
        """``{config: {"label", "server", workload: [phase summaries]}}``."""
        if self.cfg.url:
            return {"url": self._workloads(None, CacheConfig("url", self.cfg.url, ()), self.cfg.url)}
        out = {}
        for name in self.cfg.configs:
            cc = CACHE_CONFIGS[name]
            l3 = os.path.join(self.cfg.out_dir, "l3", name)
            shutil.rmtree(l3, ignore_errors=True)
            server = self._start(cc, l3)
            try:
                out[name] = self._workloads(server, cc, l3)
            finally:
                server[0].close()
            out[name]["startup_s"] = self.startup_s[name]
        return out

    # ---- servers -------------------------------------------------------------------------
    def _start(self, cc: CacheConfig, l3: str) -> list[ServerProcess]:
        """A one-element list, so that a restart can swap the process in place."""
        flags = list(self.cfg.server_flags) + list(cc.flags)
        flags += [f"--hicache_storage_spec={l3}"] if cc.storage else []
        os.makedirs(os.path.join(self.cfg.out_dir, "logs"), exist_ok=True)
        self.starts += 1
        log = os.path.join(self.cfg.out_dir, "logs", f"{cc.name}-{self.starts}.log")
        env = dict(os.environ) | dict(self.cfg.server_env)
        self._desc(f"{cc.name}: starting server")
        t0 = time.perf_counter()
        server = ServerProcess(flags, log_path=log, env=env, startup_timeout=self.cfg.startup_timeout_s)
        self.startup_s.setdefault(cc.name, []).append(time.perf_counter() - t0)
        return [server]

    def _restart(self, server: list[ServerProcess], cc: CacheConfig, l3: str) -> None:
        server[0].close()
        server[0] = self._start(cc, l3)[0]

    def _desc(self, text: str) -> None:
        if self.progress is not None:
            self.progress.set_description(text)

    # ---- workloads -----------------------------------------------------------------------
    def _workloads(self, server: list[ServerProcess] | None, cc: CacheConfig, l3: str) -> dict:
        url = self.cfg.url or server[0].url
        info = fetch_info(url, page_size=self.cfg.page_size)
        self._size(info)
        if "agent" in self.cfg.workloads:
            self._chat = self._chat_target(url)
        out = {"label": cc.label, "server": dataclasses.asdict(info), "sizes": self._sizes()}
        for k, w in enumerate(self.cfg.workloads):
            if k:
                self._empty(url, info, storage_too=True)
            if w != "warm_restart":
                records, secs = self._measured(url, w, info, cc.name)
                out[w] = [report.summarize("run", records, secs, info)]
                continue
            cold, cold_s = self._measured(url, w, info, cc.name, phase="cold")
            seen = [r.seq() for r in cold if r.ok]
            if server is not None and info.has_storage:
                self._empty(url, info, storage_too=False)  # drains L3 writes before the restart
                self._desc(f"{cc.name}: restarting the server")
                self._restart(server, cc, l3)
                url, restart = server[0].url, "process"
            else:
                self._empty(url, info, storage_too=False)
                restart = "flush"
            warm, warm_s = self._measured(url, w, info, cc.name, phase="warm")
            out[w] = [
                report.summarize("cold", cold, cold_s, info),
                report.summarize(
                    "warm", warm, warm_s, info, seen=seen, seen_capacity=seen if info.has_storage else ()
                ),
            ]
            out[w][1]["restart"] = restart
        return out

    def _size(self, info: ServerInfo) -> None:
        """Workloads sized from the server's device pool (``pool_multiple``) get their sizes;
        the progress bar's total follows."""
        before = sum(self.cfg.requests_per_pass(w) for w in self.cfg.workloads)
        self.cfg = dataclasses.replace(
            self.cfg, chat=self.cfg.chat.sized(info.device_tokens), qa=self.cfg.qa.sized(info.device_tokens)
        )
        after = sum(self.cfg.requests_per_pass(w) for w in self.cfg.workloads)
        if self.progress is not None and after != before:
            configs = 1 if self.cfg.url else len(self.cfg.configs)
            self.progress.total += (after - before) * (2 if self.cfg.warmup_pass else 1) * configs
            self.progress.refresh()

    def _chat_target(self, url: str) -> tuple[str, LocalChat | None]:
        """The served model's name, and its prompt rendering on this machine (None: unknown)."""
        with httpx.Client(base_url=url, timeout=30) as c:
            r = c.get("/get_model_info")
            model = r.json() if r.status_code == 200 else {}
            if not model.get("served_model_name"):
                r = c.get("/v1/models")
                data = r.json().get("data") if r.status_code == 200 else None
                if not data:
                    raise RuntimeError(f"{url}: neither /get_model_info nor /v1/models names the model")
                model["served_model_name"] = data[0]["id"]
        return model["served_model_name"], LocalChat.find(model, self.cfg.server_flags)

    def _sizes(self) -> dict:
        """The sizes each workload ran at."""
        out = {}
        if "multi_turn" in self.cfg.workloads:
            out["multi_turn"] = dataclasses.asdict(self.cfg.chat)
        if "doc_qa" in self.cfg.workloads:
            out["doc_qa"] = dataclasses.asdict(self.cfg.qa)
        if "agent" in self.cfg.workloads:
            out["agent"] = dataclasses.asdict(self.cfg.agent)
        return out

    def _measured(self, url: str, w: str, info: ServerInfo, name: str, phase: str = "run"):
        if self.cfg.warmup_pass:
            self._desc(f"{name}: {w} (warm-up pass)")
            self._pass(url, w, info, self.cfg.seed + WARMUP_SEED, phase)
            # L3 too after the agent's warm-up: its prompts open with the chat template's
            # header (one page on the tiny preset's tokenizer), the same whatever the text,
            # which L3 would serve to the measured pass's first request.
            self._empty(url, info, storage_too=w == "agent")
        self._desc(f"{name}: {w}" + ("" if phase == "run" else f" ({phase})"))
        return self._pass(url, w, info, self.cfg.seed, phase)

    def _pass(self, url: str, w: str, info: ServerInfo, seed: int, phase: str) -> tuple[list[Record], float]:
        cfg, vocab = self.cfg, info.vocab_size

        async def drive():
            client = BenchClient(url, timeout_s=cfg.request_timeout_s, on_done=self._tick)
            try:
                if w == "multi_turn":
                    recs = await multi_turn(client, cfg.chat, vocab, seed)
                elif w == "doc_qa":
                    recs = await doc_qa(client, cfg.qa, vocab, seed)
                elif w == "trace":
                    recs = await trace_replay(client, cfg.trace, vocab, seed)
                elif w == "agent":
                    model, local = self._chat
                    recs = await agent(client, cfg.agent, model, seed, local)
                else:  # warm restart: the same documents, other questions after the restart
                    q = seed + (1 if phase == "warm" else 0)
                    recs = await doc_qa(client, cfg.restart, vocab, seed, question_seed=q)
                return recs, client.now()
            finally:
                await client.aclose()

        return asyncio.run(drive())

    def _tick(self) -> None:
        if self.progress is not None:
            self.progress.update(1)

    def _empty(self, url: str, info: ServerInfo, storage_too: bool) -> None:
        """Flush L1 + L2 (after draining L3 writes); with ``storage_too`` clear L3 as well."""
        with httpx.Client(base_url=url, timeout=self.cfg.request_timeout_s) as c:
            r = c.post("/flush_cache")
            if r.status_code != 200:
                raise RuntimeError(f"/flush_cache: HTTP {r.status_code}: {r.text[:300]}")
            if storage_too and info.has_storage:
                r = c.post("/clear_storage")
                if r.status_code != 200:
                    raise RuntimeError(f"/clear_storage: HTTP {r.status_code}: {r.text[:300]}")
