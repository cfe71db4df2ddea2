"""L3: the two-pass test for every family, the prefetch-end regression, two processes."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from hicache_jax.cache import storage_tier
from tests.cache.l3_helpers import P, hicache_llm, prompt, run, two_pass
from tests.waits import wait

CHUNK = 64


@pytest.mark.parametrize("family", ["mistral", "gemma3", "bamba", "llama"])
def test_two_pass_hits_storage(checkpoint_dir, tmp_path, family):
    llm = hicache_llm(tmp_path / "l3", model_path=checkpoint_dir(family), dtype="float32")
    ids = prompt()
    _, second = two_pass(llm, ids)
    meta = second["meta_info"]
    floor = len(ids) - (CHUNK if family == "bamba" else P)
    assert meta["cached_tokens"] >= floor, meta
    assert meta["cached_tokens_details"]["storage"] > 0, meta
    stats = llm.engine.metrics()
    assert stats["prefetch_completed"] >= 1 and stats["l3_checksum_failures"] == 0


def _buggy_end(rules, input_len, lsl, held):
    """SGLang's old prefetch range: every full page of the prompt (``full_ids[matched:]``),
    not capped at input_len - 1 like the match."""
    return min(input_len // rules.page_size, len(held["swa"])) * rules.page_size


@pytest.mark.parametrize("buggy", [False, True])
def test_prefetch_must_end_at_usable_prefix_end(tmp_path, monkeypatch, buggy):
    """With the prefetch ending where the match ends, a sliding-window model hits N - P.
    Let it end at N (a multiple of the page size) and it fetches the window before N, not
    before N - P, where the match must stop: the storage hit falls to 0."""
    if buggy:
        monkeypatch.setattr(storage_tier, "usable_prefix_end", _buggy_end)
    llm = hicache_llm(tmp_path / "l3", preset="tiny-swa")
    ids = prompt()
    _, second = two_pass(llm, ids)
    want = 0 if buggy else len(ids) - P
    assert second["meta_info"]["cached_tokens"] == want


def test_two_processes_share_one_l3(tmp_path):
    """A second engine in another process gets storage hits for prefixes the first computed."""
    spec = tmp_path / "shared_l3"
    ids = prompt(seed=5)
    code = textwrap.dedent(
        f"""
        import json
        from tests.cache.l3_helpers import hicache_llm, run
        llm = hicache_llm({str(spec)!r}, preset="tiny")
        out = run(llm, {ids!r})
        llm.engine.close()  # drains queued L3 writes
        print(json.dumps(out["output_ids"]))
        """
    )
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    root = os.path.dirname(os.path.dirname(os.path.dirname(__file__)))
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=wait(300)
    )
    assert done.returncode == 0, done.stderr[-2000:]
    theirs = json.loads(done.stdout.strip().splitlines()[-1])
    llm = hicache_llm(spec, preset="tiny")
    mine = run(llm, ids)
    assert mine["meta_info"]["cached_tokens_details"]["storage"] >= len(ids) - P
    assert mine["output_ids"] == theirs
