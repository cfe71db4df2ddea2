"""Choosing a kernel backend: Pallas off TPU needs interpret mode, refused at start-up
otherwise. That every family gives the same logits with the Pallas kernels (interpret mode)
as with the ``xla`` references, at every ``tp_size``, is
``tests/models/test_tensor_parallel.py``."""

import pytest

from hicache_jax.models import KernelConfig


@pytest.mark.parametrize("flag", ["attention", "ssd"])
def test_pallas_off_tpu_is_refused_at_start_up_naming_the_flag(flag):
    kernels = KernelConfig(**{flag: "pallas"})
    with pytest.raises(ValueError, match=f"--{flag}_backend=pallas needs a TPU.*--kernel_interpret"):
        kernels.check_platform("cpu")
    KernelConfig(**{flag: "pallas"}, interpret=True).check_platform("cpu")  # the tests' way
    kernels.check_platform("tpu")
    KernelConfig().check_platform("cpu")  # the platform default is xla off TPU


def test_the_server_refuses_pallas_off_tpu_before_loading(tmp_path):
    from hicache_jax.config import EngineConfig
    from hicache_jax.engine.build import load_model_and_tokenizer

    with pytest.raises(ValueError, match="--attention_backend=pallas needs a TPU"):
        load_model_and_tokenizer(EngineConfig(preset="tiny", attention_backend="pallas"))
