"""Start JAX on the CPU alone where no accelerator is attached.

With libtpu installed (the ``tpu`` extra, which the test extras pull in), JAX's default
platform search asks libtpu to start a TPU even on a machine that has none: libtpu prints
its worker-hostname errors to stderr (into a notebook cell's output too) before JAX falls
back to the CPU. ``cpu_unless_attached()`` sets ``jax_platforms`` to ``cpu`` first when
nobody chose the platforms (``JAX_PLATFORMS``, ``jax.config``, the server's ``--platform``)
and JAX's own hardware checks see no TPU chip and no GPU. JAX would pick the CPU there
anyway; only the probe's noise goes. Compiling for TPU without a chip (``hicache_jax.tpu``,
``python -m hicache_jax.plan``) needs libtpu, not a TPU backend, and is unaffected.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def attached() -> list[str]:
    """The accelerators JAX's own checks see on this machine's PCI bus and device nodes."""
    from jax._src import hardware_utils  # what JAX consults to suggest a missing plugin

    found = []
    try:
        if hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0:
            found.append("tpu")
        if hardware_utils.has_visible_nvidia_gpu():
            found.append("cuda")
        if hardware_utils.num_available_amd_gpus(stop_at=1) > 0:
            found.append("rocm")
    except Exception as e:  # a check this JAX lacks: leave the platform search to JAX
        log.debug("accelerator check failed (%s); JAX chooses the platforms", e)
        return ["unknown"]
    return found


def cpu_unless_attached() -> bool:
    """Restrict JAX to the CPU when nothing chose its platforms, no backend has started and
    no accelerator is attached. Returns whether it did."""
    import jax
    from jax._src import xla_bridge

    if jax.config.jax_platforms or xla_bridge.backends_are_initialized() or attached():
        return False
    jax.config.update("jax_platforms", "cpu")
    return True
