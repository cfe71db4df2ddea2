"""Every family gives the same logits with the Pallas kernels (interpret mode) as with the
``xla`` references: a mixed ragged step (a prefill chunk beside a continuing sequence)
and a decode-only step."""

import numpy as np
import pytest

from hicache_jax.models import KernelConfig, load_hf
from tests.models.steps import build_step, jit_forward, kv_groups, logits_of, sequence

P = 16


def two_steps(model):
    """Step 1: seq A prefills 20 tokens, seq B 9. Step 2 (mixed): A continues with 12
    tokens, B decodes one. Step 3: both decode."""
    params, step = jit_forward(model)
    cache = model.allocate_cache(num_pages=8, page_size=P, num_state_slots=2, fill=np.nan)
    rng = np.random.RandomState(0)
    a = sequence(rng.randint(0, 512, 33), pages=[1, 2, 3], state_slot=0)
    b = sequence(rng.randint(0, 512, 11), pages=[5], state_slot=1)
    out = []
    for (na, ca), (nb, cb) in (((20, 0), (9, 0)), ((12, 20), (1, 9)), ((1, 32), (1, 10))):
        batch, rows = build_step(
            [(a, ca, ca + na), (b, cb, cb + nb)],
            groups=kv_groups(model),
            page_size=P,
            max_pages=3,
            all_logits=True,
        )
        cache, logits = step(params, cache, batch)
        out.append(logits_of(logits, rows))
    return out


@pytest.mark.parametrize("family", ["mistral", "gemma3", "bamba"])
def test_pallas_matches_xla(checkpoint_dir, family):
    path = checkpoint_dir(family)
    xla = two_steps(load_hf(path, kernels=KernelConfig(attention="xla", ssd="xla")))
    pallas = two_steps(load_hf(path, kernels=KernelConfig(attention="pallas", ssd="pallas", interpret=True)))
    for i, (x, p) in enumerate(zip(xla, pallas)):
        assert not np.isnan(p).any()
        np.testing.assert_allclose(p, x, rtol=0, atol=2e-5 * np.abs(x).max(), err_msg=f"step {i}")


@pytest.mark.parametrize("flag", ["attention", "ssd"])
def test_pallas_off_tpu_is_refused_at_start_up_naming_the_flag(flag):
    kernels = KernelConfig(**{flag: "pallas"})
    with pytest.raises(ValueError, match=f"--{flag}_backend=pallas needs a TPU.*--kernel_interpret"):
        kernels.check_platform("cpu")
    KernelConfig(**{flag: "pallas"}, interpret=True).check_platform("cpu")  # the tests' way
    kernels.check_platform("tpu")
    KernelConfig().check_platform("cpu")  # the platform default is xla off TPU


def test_the_server_refuses_pallas_off_tpu_before_loading(tmp_path):
    from hicache_jax.build import load_model_and_tokenizer
    from hicache_jax.config import EngineConfig

    with pytest.raises(ValueError, match="--attention_backend=pallas needs a TPU"):
        load_model_and_tokenizer(EngineConfig(preset="tiny", attention_backend="pallas"))
