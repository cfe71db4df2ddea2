"""The attention layer's query blocks (``q_block``): one row in a decode step, the width in a
speculative verify step, 16 once sequences bring prompt chunks; and a verify step's ragged
drafts attended in those blocks equal the naive oracle (every poisoned page and slot of the
kernel tests included)."""

from __future__ import annotations

import types

import numpy as np
import pytest

from hicache_jax.models.kernels.ragged_paged_attention import reference
from hicache_jax.models.layers.attention import PREFILL_Q_BLOCK, q_block
from tests.models.kernels import test_ragged_paged_attention as rpa


def batch(seqs: int, decode_only: bool = False):
    return types.SimpleNamespace(decode_only=decode_only, kv_lens=np.zeros(seqs, np.int32))


@pytest.mark.parametrize("seqs", [1, 4, 64])
def test_blocks_follow_the_rows_a_sequence_brings(seqs: int):
    assert q_block("xla", batch(seqs, decode_only=True), seqs) == 1
    for width, block in {2: 2, 3: 4, 4: 4, 8: 8}.items():  # a verify step: ``width`` rows each
        assert q_block("xla", batch(seqs), seqs * width) == block
    assert q_block("xla", batch(seqs), seqs * 16) == PREFILL_Q_BLOCK["xla"]
    assert q_block("xla", batch(seqs), seqs * 16 + 512) == PREFILL_Q_BLOCK["xla"]  # a chunk beside
    assert q_block("pallas", batch(seqs), seqs * 4) is None  # the kernel plans its own


# Drafts of 3, 0, 2 and 3 tokens after each sequence's last (rows 4, 1, 3, 4), a new
# sequence's first verify (kv 4) and one resuming mid-page; 6 sequence slots x width 4 rows.
VERIFY = [(4, 50), (1, 17), (3, 150), (4, 4), (2, 33)]
WIDTH = 4


@pytest.mark.parametrize(
    "cfg",
    [rpa.Config(16, None, 3, "float32"), rpa.Config(16, 17, 1, "float32"), rpa.Config(64, 64, 4, "bfloat16")],
    ids=str,
)
def test_verify_blocks_match_naive(cfg, monkeypatch):
    monkeypatch.setitem(rpa.BATCHES, "verify", VERIFY)
    monkeypatch.setattr(rpa, "NUM_TOKENS", rpa.SEQ_SLOTS * WIDTH)
    case = rpa.make_case(cfg, "verify")
    block = q_block("xla", batch(rpa.SEQ_SLOTS), rpa.NUM_TOKENS)
    assert block == WIDTH
    static = rpa.static_args(cfg) | {"q_block": block}
    out = reference.ragged_paged_attention(**case, **static)
    rpa.check(out, rpa.naive_attention(case, cfg), case, cfg)
