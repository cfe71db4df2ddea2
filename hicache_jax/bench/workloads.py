"""Workloads: what is sent, and when. Each is a frozen config and an async function that
drives a ``BenchClient`` and returns its ``Record``s.

- Multi-turn chat: ``clients`` conversations of ``rounds`` turns under one shared system
  prompt. A client arrives after an exponential gap (Poisson arrivals at
  ``arrival_rate``); each turn appends a user message to the history, sends it, appends
  the model's actual reply, and thinks for an exponential time before the next turn.
- Shared-prefix document QA: ``documents`` long documents, ``questions`` questions on
  each, arriving as a Poisson stream in shuffled order; or, with ``zipf``, as many
  questions each on a document drawn by a Zipf law (a few documents asked again and again,
  the rest rarely). The warm-restart workload sends one set of questions, restarts the
  server, and sends another on the same documents.

Both can be sized from the server: ``pool_multiple`` picks the number of conversations
(documents) whose distinct tokens are that many times the device pool, the working set
that decides what L2 and L3 buy.
- Trace replay: a Mooncake JSONL trace (``hicache_jax.bench.traces``), each 512-token block
  scaled to ``block_tokens`` tokens, sent at its timestamp times ``time_scale``.

- Agent: ``requests`` single-turn chat requests under one long system prompt and one tool
  list (``agent_prompts.py``), each with its own short user turn, sent to
  ``/v1/chat/completions`` with ``tools`` as a Poisson stream, at most ``concurrency`` in
  flight. The system prompt and tools are the shared prefix: what an agent framework sends
  with every call.

``seed`` picks every token, so a warm-up pass with another seed runs the same shapes on
content that cannot hit the measured run.
"""

from __future__ import annotations

import asyncio
import dataclasses
import math

import numpy as np

from hicache_jax.bench import agent_prompts, traces
from hicache_jax.bench.client import BenchClient, Record

FIRST_ID = 3  # ids below are special in this project's presets (pad, bos, eos)


def _tokens(rng: np.random.Generator, n: int, vocab: int) -> list[int]:
    return rng.integers(FIRST_ID, vocab, n).tolist()


def positive(cfg, *names: str) -> None:
    """Refuse a config whose named fields are not all > 0, naming the first that is not."""
    for name in names:
        if getattr(cfg, name) <= 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be > 0, got {getattr(cfg, name)}")


def _not_negative(cfg, *names: str) -> None:
    for name in names:
        if getattr(cfg, name) < 0:
            raise ValueError(f"{type(cfg).__name__}.{name} must be >= 0, got {getattr(cfg, name)}")


@dataclasses.dataclass(frozen=True)
class ChatConfig:
    clients: int = 8
    rounds: int = 4
    system_tokens: int = 512
    user_tokens: int = 64
    output_tokens: int = 32
    arrival_rate: float = 4.0  # clients per second
    think_s: float = 0.5  # mean pause between a reply and the next turn
    pool_multiple: float = 0.0  # > 0: clients from the device pool (``sized``)

    def __post_init__(self):
        positive(self, "clients", "rounds", "system_tokens", "user_tokens", "output_tokens", "arrival_rate")
        _not_negative(self, "think_s", "pool_multiple")

    @property
    def num_requests(self) -> int:
        return self.clients * self.rounds

    def distinct_tokens(self, clients: int) -> int:
        """Tokens the conversations hold at their end: the system prompt once, then every
        client's turns and replies."""
        return self.system_tokens + clients * self.rounds * (self.user_tokens + self.output_tokens)

    def sized(self, device_tokens: int | None) -> ChatConfig:
        """With ``pool_multiple``: as many clients (at least 2) as make ``distinct_tokens``
        about ``pool_multiple`` x the device pool."""
        if not self.pool_multiple:
            return self
        if not device_tokens:
            raise ValueError("chat pool_multiple needs the server's device pool size (max_total_tokens)")
        per_client = self.rounds * (self.user_tokens + self.output_tokens)
        want = self.pool_multiple * device_tokens - self.system_tokens
        return dataclasses.replace(self, clients=max(2, math.ceil(want / per_client)), pool_multiple=0.0)


async def multi_turn(client: BenchClient, cfg: ChatConfig, vocab: int, seed: int) -> list[Record]:
    rng = np.random.default_rng(seed)
    system = _tokens(rng, cfg.system_tokens, vocab)
    starts = np.cumsum(rng.exponential(1 / cfg.arrival_rate, cfg.clients))
    turns = [[_tokens(rng, cfg.user_tokens, vocab) for _ in range(cfg.rounds)] for _ in range(cfg.clients)]
    thinks = rng.exponential(cfg.think_s, (cfg.clients, cfg.rounds)) if cfg.think_s else None

    async def conversation(c: int) -> list[Record]:
        await client.sleep_until(float(starts[c]))
        history, out = list(system), []
        for r in range(cfg.rounds):
            history += turns[c][r]
            rec = await client.generate(history, cfg.output_tokens, r)
            out.append(rec)
            if not rec.ok:
                break  # the conversation cannot go on without the reply
            history += rec.output
            if thinks is not None:
                await asyncio.sleep(float(thinks[c, r]))
        return out

    per_client = await asyncio.gather(*(conversation(c) for c in range(cfg.clients)))
    return [rec for recs in per_client for rec in recs]


@dataclasses.dataclass(frozen=True)
class DocQAConfig:
    documents: int = 4
    questions: int = 8  # per document (per phase in the warm-restart workload); with zipf, on average
    doc_tokens: int = 1024
    question_tokens: int = 32
    output_tokens: int = 16
    rate: float = 4.0  # requests per second
    zipf: float = 0.0  # > 0: each question's document drawn with probability ~ 1 / rank ** zipf
    pool_multiple: float = 0.0  # > 0: documents from the device pool (``sized``)

    def __post_init__(self):
        positive(self, "documents", "questions", "doc_tokens", "question_tokens", "output_tokens", "rate")
        _not_negative(self, "zipf", "pool_multiple")

    @property
    def num_requests(self) -> int:
        return self.documents * self.questions

    def sized(self, device_tokens: int | None) -> DocQAConfig:
        """With ``pool_multiple``: as many documents (at least 2) as hold about
        ``pool_multiple`` x the device pool."""
        if not self.pool_multiple:
            return self
        if not device_tokens:
            raise ValueError("qa pool_multiple needs the server's device pool size (max_total_tokens)")
        documents = max(2, math.ceil(self.pool_multiple * device_tokens / self.doc_tokens))
        return dataclasses.replace(self, documents=documents, pool_multiple=0.0)

    def asked(self, rng: np.random.Generator) -> np.ndarray:
        """The document of each question, in the order asked."""
        n = self.documents * self.questions
        if not self.zipf:
            return rng.permutation(np.repeat(np.arange(self.documents), self.questions))
        weights = 1.0 / np.arange(1, self.documents + 1) ** self.zipf
        ranks = rng.permutation(self.documents)  # which document is how popular
        return ranks[rng.choice(self.documents, size=n, p=weights / weights.sum())]


async def doc_qa(
    client: BenchClient, cfg: DocQAConfig, vocab: int, seed: int, question_seed: int | None = None
) -> list[Record]:
    """Questions on shared documents; ``question_seed`` (default ``seed``) picks the
    questions and their order, ``seed`` the documents. A record's round counts the questions
    asked on its document before it."""
    docs_rng = np.random.default_rng(seed)
    docs = [_tokens(docs_rng, cfg.doc_tokens, vocab) for _ in range(cfg.documents)]
    rng = np.random.default_rng([seed, seed if question_seed is None else question_seed, 1])
    order = cfg.asked(rng)  # documents asked
    arrivals = np.cumsum(rng.exponential(1 / cfg.rate, len(order)))
    questions = [_tokens(rng, cfg.question_tokens, vocab) for _ in order]
    asked, count = [], [0] * cfg.documents  # questions on the same document before this one
    for d in order:
        asked.append(count[d])
        count[d] += 1

    async def ask(k: int) -> Record:
        await client.sleep_until(float(arrivals[k]))
        return await client.generate(docs[order[k]] + questions[k], cfg.output_tokens, asked[k])

    return list(await asyncio.gather(*(ask(k) for k in range(len(order)))))


@dataclasses.dataclass(frozen=True)
class TraceConfig:
    path: str
    block_tokens: int = 16  # tokens per trace block when replayed
    time_scale: float = 1.0  # multiplies the trace's timestamps
    max_requests: int | None = None
    trace_block_tokens: int = traces.MOONCAKE_BLOCK_TOKENS  # tokens per block in the trace
    rounds: int = 8  # the replay is cut into this many equal parts for per-round counts

    def __post_init__(self):
        positive(self, "block_tokens", "trace_block_tokens", "rounds")
        if self.time_scale < 0:
            raise ValueError(f"TraceConfig.time_scale must be >= 0, got {self.time_scale}")

    def requests(self) -> list[traces.TraceRequest]:
        return traces.read_trace(self.path, self.max_requests, block_size=self.trace_block_tokens)


async def trace_replay(client: BenchClient, cfg: TraceConfig, vocab: int, seed: int) -> list[Record]:
    reqs = cfg.requests()
    if not reqs:
        raise ValueError(f"{cfg.path}: the trace has no requests")
    t_first = min(r.timestamp_ms for r in reqs)
    offset = seed << 40  # another seed: other blocks, the same sharing structure
    per_round = math.ceil(len(reqs) / cfg.rounds)

    async def send(i: int, req: traces.TraceRequest) -> Record:
        req = dataclasses.replace(req, hash_ids=tuple(h + offset for h in req.hash_ids))
        ids = traces.prompt_ids(
            req,
            tokens_per_block=cfg.block_tokens,
            vocab=(FIRST_ID, vocab),
            block_tokens_in_trace=cfg.trace_block_tokens,
        )
        out = traces.scaled_output_length(
            req, tokens_per_block=cfg.block_tokens, block_tokens_in_trace=cfg.trace_block_tokens
        )
        await client.sleep_until((req.timestamp_ms - t_first) / 1000 * cfg.time_scale)
        return await client.generate(ids, out, i // per_round)

    return list(await asyncio.gather(*(send(i, r) for i, r in enumerate(reqs))))


AGENT_ROUNDS = 4  # the agent run is cut into this many parts, in arrival order, for per-round counts
TOOL_CHOICES = ("auto", "required", "none")


@dataclasses.dataclass(frozen=True)
class AgentConfig:
    """Every text is made of words (``agent_prompts.WORDS``); how many tokens a word takes is
    the tokenizer's affair (about 3 on the tiny preset's, 1.3 on a production one): the
    report gives the prompt tokens per request."""

    requests: int = 32
    concurrency: int = 8  # requests in flight at most; an arrival waits for a free slot
    rate: float = 4.0  # arrivals per second (Poisson)
    tools: int = 16
    system_words: int = 150
    user_words: int = 12
    output_tokens: int = 8
    tool_choice: str = "auto"  # "required": held by the tools' JSON-schema grammar

    def __post_init__(self):
        positive(self, "requests", "concurrency", "rate", "system_words", "user_words", "output_tokens")
        _not_negative(self, "tools")
        if self.tool_choice not in TOOL_CHOICES:
            raise ValueError(
                f"AgentConfig.tool_choice must be one of {TOOL_CHOICES}, got {self.tool_choice!r}"
            )
        if self.tool_choice == "required" and not self.tools:
            raise ValueError("AgentConfig.tool_choice='required' needs tools > 0")

    @property
    def num_requests(self) -> int:
        return self.requests


def agent_texts(cfg: AgentConfig, seed: int) -> tuple[str, list[dict], list[str], np.ndarray]:
    """The system prompt, the tools, the user turns and the arrival times that ``seed`` picks."""
    rng = np.random.default_rng([seed, 3])
    system = agent_prompts.system_prompt(rng, cfg.system_words)
    tools = agent_prompts.tool_list(rng, cfg.tools)
    users = [agent_prompts.user_turn(rng, cfg.user_words) for _ in range(cfg.requests)]
    arrivals = np.cumsum(rng.exponential(1 / cfg.rate, cfg.requests))
    return system, tools, users, arrivals


async def agent(
    client: BenchClient, cfg: AgentConfig, model: str, seed: int, local: agent_prompts.LocalChat | None = None
) -> list[Record]:
    """Function-calling requests under one shared system prompt and tool list.

    ``seed`` picks everything, the shared prefix included: the warm-up pass (another seed)
    runs on *another* system prompt and tool list, as the other workloads' warm-ups run on
    other tokens. It compiles the programs of these shapes, and leaves nothing the measured
    pass can use: its first request is a genuine miss in every configuration (the runner
    flushes every tier after this warm-up, L3 included: all prompts open with the chat
    template's header, whatever their text), and every later hit on the shared prefix is
    one this pass made. Sharing the tools with the warm-up would change one thing more:
    with ``tool_choice="required"`` the server compiles a grammar per tool list (and keeps
    it), so the measured pass's first request would skip that compilation. With other
    tools it pays it, as a deployment's first call with a new tool list does.

    ``local``: the server's rendering on this machine, for each prompt's ids (the
    theoretical maximum); without it the report has hit rates but no maximum. A request's
    TTFT runs from its send, after the wait for a slot (``concurrency``).
    """
    system, tools, users, arrivals = agent_texts(cfg, seed)
    messages = [[{"role": "system", "content": system}, {"role": "user", "content": u}] for u in users]
    prompts = [local.encode(m, tools or None) if local is not None else None for m in messages]
    slots = asyncio.Semaphore(cfg.concurrency)

    async def ask(k: int) -> Record:
        body = {
            "model": model,
            "messages": messages[k],
            "max_tokens": cfg.output_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if tools:
            body |= {"tools": tools, "tool_choice": cfg.tool_choice}
        await client.sleep_until(float(arrivals[k]))
        async with slots:
            return await client.chat(body, k * AGENT_ROUNDS // cfg.requests, prompts[k])

    return list(await asyncio.gather(*(ask(k) for k in range(cfg.requests))))
