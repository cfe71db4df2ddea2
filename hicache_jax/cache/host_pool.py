"""L2: host-memory pools in numpy, page-first.

One row per page (or snapshot) holds every layer's data for it, so a page is one
contiguous block: copied to and from the device in one transfer, written to L3 as one
value::

    paged kinds: <row>       [num_pages, layers, fields, rows, *per_row]
                 as the layers declare them (``models/cache.py``, ``paged_specs``): full
                 and sliding-window attention store ``kv``, [.., 2 (k, v), page_size,
                 kv_heads, head_dim]
    state:       <kind>.conv [num_slots, layers of that kind, conv_kernel - 1, conv_dim]
                 <kind>.ssm  [num_slots, layers of that kind, *that kind's state shape]
                 for each recurrent layer kind the model has ("mamba", "gdn"; shapes from
                 ``ModelConfig.state_shapes``)
"""

from __future__ import annotations

import numpy as np

from hicache_jax.cache.pool import IndexPool


class HostPool:
    def __init__(self, kind: str, size: int, layout: dict[str, tuple[tuple[int, ...], np.dtype]]):
        self.kind = kind
        self.index = IndexPool(size, f"host {kind} pages")
        self.layout = layout
        self.arrays = {name: np.zeros((size,) + shape, dtype) for name, (shape, dtype) in layout.items()}

    @property
    def size(self) -> int:
        return self.index.size

    @property
    def bytes_per_page(self) -> int:
        return sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.layout.values())

    def write(self, rows: list[int], data: dict[str, np.ndarray]) -> None:
        for name, arr in self.arrays.items():
            if data[name].shape[1:] != arr.shape[1:] or data[name].shape[0] != len(rows):
                raise ValueError(
                    f"host {self.kind}: {name} rows of shape {data[name].shape[1:]} "
                    f"(x{data[name].shape[0]}) do not fit {arr.shape[1:]} (x{len(rows)})"
                )
            arr[rows] = data[name]

    def read(self, rows: list[int]) -> dict[str, np.ndarray]:
        """Copies (never views): a reader may keep them while the rows are reused."""
        return {name: arr[rows] for name, arr in self.arrays.items()}

    def page(self, row: int) -> dict[str, np.ndarray]:
        return {name: arr[row].copy() for name, arr in self.arrays.items()}
