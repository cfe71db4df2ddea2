"""A TPU slice to compile for: its devices (from libtpu's topology, no chip needed), the
chip's figures (VMEM, HBM, bandwidth, peak flops) and a tracing context in which Pallas's
Mosaic lowering sees that chip rather than the host's CPU.

libtpu (``pip install "hicache-jax[tpu]"``) compiles for any topology it knows, on any
machine; ``missing_reason()`` says why it cannot, for tests to skip with."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os

import jax
import numpy as np
from jax.sharding import Mesh

from hicache_jax.models.sharding import AXIS

INSTALL = 'pip install "jax[tpu]"  (or the package extra: pip install -e ".[tpu]")'
TOPOLOGIES = ("v5e:2x2", "v6e:2x4", "v5p:2x2x1")  # the slices the tests compile for


@dataclasses.dataclass(frozen=True)
class ChipInfo:
    """One chip's figures, per chip (a megacore chip's cores added up)."""

    name: str  # "v5e", "v6e", "v5p"
    vmem_bytes: int  # per TensorCore
    hbm_bytes: int
    hbm_bytes_per_s: float
    bf16_flops_per_s: float


@dataclasses.dataclass(frozen=True)
class TpuTarget:
    topology: str  # "v6e:2x4"
    devices: tuple
    chip: ChipInfo

    @property
    def num_chips(self) -> int:
        return len(self.devices)

    def mesh(self, tp_size: int) -> Mesh:
        """The first ``tp_size`` chips on the tensor-parallel axis (``models/sharding.py``)."""
        if tp_size > self.num_chips:
            raise ValueError(f"tp_size={tp_size} needs {tp_size} chips; {self.topology} has {self.num_chips}")
        return Mesh(np.array(self.devices[:tp_size]), (AXIS,))


def missing_reason() -> str | None:
    """None when libtpu can compile here; else why not, naming the install command."""
    try:
        import libtpu  # noqa: F401
    except ImportError:
        return f"libtpu is not installed: {INSTALL}"
    return None


@functools.cache
def target(topology: str) -> TpuTarget:
    """The slice ``topology`` (e.g. ``"v5e:2x2"``), as libtpu describes it."""
    reason = missing_reason()
    if reason:
        raise RuntimeError(f"cannot compile for TPU: {reason}")
    # Several processes (pytest-xdist workers, a planner beside a server) may each load libtpu.
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
    from jax.experimental import topologies

    try:
        topo = topologies.get_topology_desc(topology_name=topology, platform="tpu")
    except Exception as e:
        raise ValueError(f"topology {topology!r}: {e} (examples: {', '.join(TOPOLOGIES)})") from e
    return TpuTarget(topology, tuple(topo.devices), chip_info(topo.devices[0]))


def chip_info(device) -> ChipInfo:
    from jax._src.pallas.mosaic import tpu_info
    from jax.experimental.pallas import tpu as pltpu

    version = tpu_info.chip_version_from_device_kind(device.device_kind)
    # A JAX device on v4 / v5p is a megacore chip (its two TensorCores as one device);
    # tpu_info's figures are per core.
    cores = getattr(version, "num_physical_tensor_cores_per_chip", 1)
    info = pltpu.get_tpu_info_for_chip(version, 1)
    return ChipInfo(
        name=str(version).split(".")[-1],
        vmem_bytes=info.vmem_capacity_bytes,
        hbm_bytes=info.hbm_capacity_bytes * cores,
        hbm_bytes_per_s=float(info.mem_bw_bytes_per_second) * cores,
        bf16_flops_per_s=float(info.bf16_ops_per_second) * cores,
    )


@contextlib.contextmanager
def tracing_for(mesh: Mesh):
    """Trace inside this so Pallas kernels lower for the mesh's chips (Mosaic asks the
    abstract mesh, not the default device, which is the host's CPU here)."""
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):
        yield


def compile_for(mesh: Mesh, fn, *args, **jit_kwargs) -> jax.stages.Compiled:
    """``jax.jit(fn).trace(*args).lower().compile()`` for ``mesh``'s chips; ``args`` are
    ``jax.ShapeDtypeStruct``s (with shardings on ``mesh``) or arrays."""
    with tracing_for(mesh):
        return jax.jit(fn, **jit_kwargs).trace(*args).lower().compile()


def abstract(mesh: Mesh, shape: tuple, dtype, spec: jax.sharding.PartitionSpec | None = None):
    """A ``jax.ShapeDtypeStruct`` on ``mesh``, replicated unless ``spec`` splits it."""
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    return jax.ShapeDtypeStruct(tuple(shape), dtype, sharding=NamedSharding(mesh, spec or P()))
