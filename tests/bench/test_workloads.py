"""Workload sizing from the server's pool and the Zipf order of document questions."""

import numpy as np
import pytest

from hicache_jax.bench.workloads import ChatConfig, DocQAConfig


@pytest.mark.parametrize("pool", [256, 1000, 16384])
@pytest.mark.parametrize("multiple", [1.0, 4.0, 8.0])
def test_chat_clients_make_the_asked_multiple_of_the_pool(pool, multiple):
    cfg = ChatConfig(rounds=3, system_tokens=64, user_tokens=40, output_tokens=8, pool_multiple=multiple)
    sized = cfg.sized(pool)
    want = multiple * pool
    assert sized.pool_multiple == 0 and sized.clients >= 2
    # The fewest clients that reach the multiple (or two).
    assert sized.distinct_tokens(sized.clients) >= want or sized.clients == 2
    assert sized.clients == 2 or sized.distinct_tokens(sized.clients - 1) < want


def test_documents_hold_the_asked_multiple_of_the_pool():
    sized = DocQAConfig(doc_tokens=1000, pool_multiple=8).sized(4096)
    assert sized.documents == 33 and sized.documents * 1000 >= 8 * 4096 > 32 * 1000
    assert DocQAConfig(documents=5).sized(None).documents == 5  # no multiple: as given
    with pytest.raises(ValueError, match="pool_multiple"):
        DocQAConfig(pool_multiple=2).sized(None)


def test_zipf_questions_favour_few_documents_and_uniform_ones_do_not():
    rng = np.random.default_rng(0)
    zipf = DocQAConfig(documents=50, questions=40, zipf=1.2).asked(rng)
    counts = np.sort(np.bincount(zipf, minlength=50))[::-1]
    assert len(zipf) == 2000
    # Rank 1 against rank 10 under 1/rank**1.2 is ~15.8x; the sample is close.
    assert 10 < counts[0] / counts[9] < 25
    assert counts[:5].sum() > 0.5 * len(zipf)
    flat = DocQAConfig(documents=50, questions=40).asked(rng)
    assert (np.bincount(flat, minlength=50) == 40).all()


def test_negative_sizes_are_refused_by_name():
    with pytest.raises(ValueError, match="zipf"):
        DocQAConfig(zipf=-1)
    with pytest.raises(ValueError, match="pool_multiple"):
        ChatConfig(pool_multiple=-0.5)
