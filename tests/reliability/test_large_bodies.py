"""Issue 39, finding 3: a 60 MB chat message stalled the whole process, ``/health`` included,
for 80 s (tokenizers' ``encode`` holds the GIL), and 10,000 tools for half a minute. Now what
cannot fit is refused before any work, and the largest bodies the server does take (texts at
the context's byte bound, a batch of token ids at the body bound, OpenAI's 128 tools, a
grammar at its size limit) are tokenized and compiled while ``/health`` keeps answering
within a second."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from tests.server.conftest import CONTEXT
from tests.waits import wait

HEALTH_S = 1.0


def body_limit(server) -> int:
    return server.client.get("/server_info").json()["max_request_body_bytes"]


def text_at_the_bound(server) -> str:
    """A text of exactly the most bytes a prompt may have (context x the longest token)."""
    word = "hierarchical cache "
    limit = server.client.get("/server_info").json()["max_prompt_text_bytes"]
    return (word * (limit // len(word) + 1))[:limit]


def largest_bodies(server) -> dict[str, tuple[str, bytes]]:
    limit = body_limit(server)
    text = text_at_the_bound(server)
    n_texts = limit // (len(text) + 8)
    ids = [[(7 * i + j) % 500 for j in range(CONTEXT - 8)] for i in range(limit // (CONTEXT * 5))]
    params = {
        "type": "object",
        "properties": {
            f"arg_{k}": {"type": "string", "enum": [f"v{k}_{m}" for m in range(12)]} for k in range(8)
        },
    }
    tools = [
        {"type": "function", "function": {"name": f"tool_{i}", "parameters": params}} for i in range(128)
    ]
    enum = [f"choice number {i} of a long enumeration" for i in range(11_500)]
    schema = json.dumps({"type": "string", "enum": enum})
    assert len(schema) < 512 << 10
    chat = {"model": "tiny", "max_tokens": 1}
    bodies = {
        # refused at once: 15x the body bound
        "a 60 MB chat message": (
            "/v1/chat/completions",
            json.dumps({**chat, "messages": [{"role": "user", "content": "a" * 60_000_000}]}).encode(),
        ),
        # taken, tokenized, then refused by the engine (prompt + max_new_tokens > context)
        "texts at the byte bound, to the body bound": (
            "/generate",
            json.dumps({"text": [text] * n_texts, "sampling_params": {"max_new_tokens": CONTEXT}}).encode(),
        ),
        "token ids to the body bound": (
            "/generate",
            json.dumps({"input_ids": ids, "sampling_params": {"max_new_tokens": CONTEXT}}).encode(),
        ),
        "a chat message at the byte bound": (
            "/v1/chat/completions",
            json.dumps({**chat, "messages": [{"role": "user", "content": text}]}).encode(),
        ),
        "128 tools, required": (
            "/v1/chat/completions",
            json.dumps(
                {
                    **chat,
                    "messages": [{"role": "user", "content": "hi"}],
                    "tools": tools,
                    "tool_choice": "required",
                }
            ).encode(),
        ),  # fmt: skip
        "a schema near its size limit": (
            "/generate",
            json.dumps(
                {"text": "pick", "sampling_params": {"max_new_tokens": 2, "json_schema": schema}}
            ).encode(),
        ),
    }
    for name, (_, raw) in bodies.items():
        if name != "a 60 MB chat message":
            assert len(raw) <= limit, (name, len(raw), limit)
    return bodies


@pytest.mark.parametrize("which", range(6))
def test_health_answers_while_the_largest_bodies_are_processed(server, which):
    name, (route, raw) = list(largest_bodies(server).items())[which]
    result: dict = {}

    def send():
        t0 = time.monotonic()
        r = httpx.post(
            server.url + route, content=raw, headers={"Content-Type": "application/json"}, timeout=wait(300)
        )
        result.update(status=r.status_code, text=r.text[:300], seconds=time.monotonic() - t0)

    t = threading.Thread(target=send)
    t.start()
    worst, probes = 0.0, 0
    with httpx.Client(base_url=server.url, timeout=30) as probe:
        while t.is_alive() or probes < 3:
            t0 = time.monotonic()
            assert probe.get("/health").status_code == 200
            worst = max(worst, time.monotonic() - t0)
            probes += 1
            time.sleep(0.05)
    t.join()
    assert result["status"] < 500, (name, result)
    assert worst < HEALTH_S, (name, worst, result)
    if name == "a 60 MB chat message":
        assert result["status"] == 413 and result["seconds"] < 5, result
