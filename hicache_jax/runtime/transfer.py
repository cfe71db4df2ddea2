"""Page copies between the device cache and host (L2) pools, in the host pools' layout.

A call moves its pages in chunks of at most ``max_pages(kind)`` (a power of two, chosen
so one chunk holds at most ``CHUNK_BYTES`` of page data); each chunk is padded to a power
of two >= ``MIN_PAGES``. So a few programs per kind serve every transfer, and warm-up
can compile all of them (``lowerings``). Padding reads page 0 and writes nowhere.

Under tensor parallelism host pages hold *whole* pages: every KV head once, in the layout
of ``tp_size=1``. A read gathers each page's head shards from the devices (dropping the
copies of replicated KV heads); a write splits the page back over them. The other choice,
each host keeping only its own devices' heads, was not taken; per token, with ``L``
layers, ``Hkv`` KV heads, ``D`` head dim, ``b`` bytes per value and ``h`` hosts:

    whole pages (this)   device->host 2*L*Hkv*D*b per token, in all (each head once);
                         on several hosts, each host also gathers the (h-1)/h it lacks
                         over the network. L2 and L3 pages are the same at every
                         tp_size: a restart at another tp_size reuses all of L3.
    per-host shards      2*L*Hkv*D*b/h per host, no cross-host traffic, but a page is h
                         separate values keyed by shard layout, so a restart at another
                         tp_size (or another host count) can reuse none of L3, and a
                         prefetch is all or nothing across h stores.

One host serves every tp_size this stack runs on CPU and most single-host TPU slices;
there whole pages cost nothing beyond the copy itself. Over several processes a read
gathers each page onto every device (``replicate``), so every process gets the whole page
from its own devices, and a write gives every process the same whole pages.

What a row of a cache kind holds comes from the layers' declaration (``models/cache.py``,
``paged_specs``): every layer that pages the kind, each with its entry's fields stacked
(``[layers, fields, rows, *per_row]``: K and V of full attention, an MLA latent), or
for the state kind each recurrent layer kind's states.

Layer by layer (``step_pages > 0``): a write of attention pages only queues them. The next
step that runs a prefill takes up to ``step_pages`` pages of each page group as arrays in
host memory (``step_loads``), and the step writes each layer's pages just before that
layer runs, so the copies overlap the forward (``models/page_loads.py``). What the step
cannot take, and whatever is queued when anything else touches the device cache (a read,
``flush``), is written at once by the scatter program.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
import numpy as np

from hicache_jax.kinds import PAGED, RECURRENT, layer_cache
from hicache_jax.models import sharding
from hicache_jax.models.cache import RecurrentState, layer_specs
from hicache_jax.models.page_loads import PageLoads

MIN_PAGES = 8
CHUNK_BYTES = 64 << 20  # most page data one program call moves (bounds its device buffer)


def _bucket(n: int) -> int:
    return max(MIN_PAGES, 1 << (n - 1).bit_length())


class PageTransfer:
    def __init__(self, runner, chunk_bytes: int = CHUNK_BYTES, step_pages: int = 0):
        self.runner = runner
        self.chunk_bytes = chunk_bytes
        self.step_pages = step_pages  # pages per group a step takes layer by layer (0: none)
        self._pending: dict[str, list[tuple[list[int], dict]]] = {}  # kind -> queued writes
        self.layerwise_pages = 0  # pages the last ``step_loads`` took
        kinds = runner.cfg.cache_layer_kinds  # a drafting block's entry pages as a main layer's
        self.shardings = runner.model.cache_shardings()
        mesh = runner.model.mesh
        # Over several processes a host reads only its own devices: gather pages onto all.
        self.replicate = sharding.replicated(mesh) if jax.process_count() > 1 and mesh is not None else None
        specs = layer_specs(runner.cfg)
        # Per paged kind: the layers that page it, and where in each layer's entry it is.
        declared = {s.kind: s for layer in specs for s in layer}
        self.spec = {k: declared[k] for k in PAGED if k in declared}
        self.parts = {
            c: tuple(
                (i, n if len(layer) > 1 else None)
                for i, layer in enumerate(specs)
                for n, s in enumerate(layer)
                if s.kind == c
            )
            for c in self.spec
        }
        self.layers = {c: [i for i, _ in p] for c, p in self.parts.items()}
        # The snapshot kind recurrent layers keep their state in (one row: every such layer).
        self.state_kind = next((c for k in kinds if k in RECURRENT for c in layer_cache(k)), None)
        if self.state_kind is not None:
            self.layers[self.state_kind] = [i for i, k in enumerate(kinds) if k in RECURRENT]
        # A state row holds each recurrent layer kind's states stacked over its layers
        # (their shapes differ between kinds): name prefix -> layers.
        self.state_groups = {k: [i for i, x in enumerate(kinds) if x == k] for k in sorted(RECURRENT)}
        self.state_groups = {k: v for k, v in self.state_groups.items() if v}

    def kinds(self) -> list[str]:
        return [k for k, layers in self.layers.items() if layers]

    def layout(self, kind: str) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """Shapes of one host row of ``kind`` (see host_pool.py)."""
        if kind == self.state_kind:
            out = {}
            for prefix, group in self.state_groups.items():
                entry = self.runner.cache[group[0]]
                for field, a in zip(RecurrentState._fields, entry):
                    out[f"{prefix}.{field}"] = ((len(group),) + a.shape[1:], a.dtype)
            return out
        spec, first = self.spec[kind], self._first(kind)
        fields = len(spec.entry._fields)
        return {spec.row: ((len(self.layers[kind]), fields, first.shape[1], *spec.per_row), first.dtype)}

    def _first(self, kind: str):
        """The first device array of ``kind`` (its pages or slots lead)."""
        if kind == self.state_kind:
            return self.runner.cache[self.layers[kind][0]][0]
        i, n = self.parts[kind][0]
        entry = self.runner.cache[i]
        return (entry if n is None else entry[n])[0]

    def _kv_repeat(self, kind: str) -> int:
        """Device copies of each KV head (> 1 when tensor parallelism replicates them)."""
        if kind == self.state_kind or not self.spec[kind].heads:
            return 1
        return self._first(kind).shape[2] // self.spec[kind].per_row[0]

    def max_pages(self, kind: str) -> int:
        """Pages per chunk: no more than the device holds, nor than ``chunk_bytes``."""
        on_device = self._first(kind).shape[0]
        row = sum(int(np.prod(s)) * np.dtype(d).itemsize for s, d in self.layout(kind).values())
        by_bytes = 1 << (max(1, self.chunk_bytes // row).bit_length() - 1)  # largest power of two
        return max(MIN_PAGES, min(_bucket(max(1, on_device)), by_bytes))

    def buckets(self, kind: str) -> list[int]:
        """Every padded chunk size a transfer of ``kind`` can use."""
        out, b = [], MIN_PAGES
        while b <= self.max_pages(kind):
            out.append(b)
            b *= 2
        return out

    def read(self, kind: str, idx: list[int]) -> dict[str, np.ndarray]:
        self.flush()
        m = self.max_pages(kind)
        parts = [self._read(kind, idx[i : i + m]) for i in range(0, max(1, len(idx)), m)]
        if len(parts) == 1:
            return parts[0]
        return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def write(self, kind: str, idx: list[int], data: dict[str, np.ndarray]) -> None:
        if self.step_pages and kind in PAGED and idx:
            self._pending.setdefault(kind, []).append((list(idx), data))
            return
        self._write_now(kind, idx, data)

    def _write_now(self, kind: str, idx: list[int], data: dict[str, np.ndarray]) -> None:
        m = self.max_pages(kind)
        for i in range(0, len(idx), m):
            self._write(kind, idx[i : i + m], {k: v[i : i + m] for k, v in data.items()})

    # ---- layer by layer -----------------------------------------------------------------
    def pending(self) -> bool:
        return bool(self._pending)

    def flush(self) -> None:
        """Write every queued page now (before anything else reads the device cache)."""
        pending, self._pending = self._pending, {}
        for kind, writes in pending.items():
            for idx, data in writes:
                self._write_now(kind, idx, data)

    def discard(self) -> None:
        """Forget queued pages (the device cache they were for is gone)."""
        self._pending = {}

    def step_loads(self) -> PageLoads | None:
        """Up to ``step_pages`` queued pages of each group, as the step's ``PageLoads``; the
        rest are written now. None when nothing is queued."""
        if not self._pending:
            return None
        taken: dict[str, tuple[list[int], np.ndarray]] = {}
        for kind, writes in self._pending.items():
            row = self.spec[kind].row
            idx = [i for w, _ in writes for i in w]
            kv = np.concatenate([d[row] for _, d in writes]) if len(writes) > 1 else writes[0][1][row]
            last = {i: n for n, i in enumerate(idx)}  # a page queued twice: its later data
            if len(last) < len(idx):
                keep = sorted(last.values())
                idx, kv = [idx[n] for n in keep], kv[keep]
            c = self.step_pages
            taken[kind] = (idx[:c], kv[:c])
            if len(idx) > c:
                self._write_now(kind, idx[c:], {row: kv[c:]})
        self._pending = {}
        self.layerwise_pages = sum(len(i) for i, _ in taken.values())
        return self._loads(taken)

    def _loads(self, taken: dict[str, tuple[list[int], np.ndarray]], abstract: bool = False) -> PageLoads:
        """``taken`` (kind -> page indices and their host rows) padded to ``step_pages``
        and placed in host memory; ``abstract``: only their shapes."""
        c = self.step_pages
        idx, pages = {}, [None] * len(self.runner.cache)
        for kind, spec in self.spec.items():  # the host pools' kinds are the page groups' names
            got, kv = taken.get(kind, ([], None))
            ((shape, dtype),) = self.layout(kind).values()  # (layers, fields, rows, *per_row)
            r = self._kv_repeat(kind)
            per_layer = (c, shape[2], shape[3] * r, *shape[4:])
            fields = range(shape[1])
            if abstract:
                idx[kind] = jax.ShapeDtypeStruct((c,), np.int32)
                for i, n in self.parts[kind]:
                    a = jax.ShapeDtypeStruct(per_layer, dtype, sharding=self._host_sharding(i, n))
                    pages[i] = (pages[i] or {}) | {kind: spec.entry(*(a for _ in fields))}
                continue
            padded = np.full(c, np.iinfo(np.int32).max, np.int32)  # past the pool: dropped
            padded[: len(got)] = got
            idx[kind] = padded
            full = np.zeros((c,) + shape, dtype)
            if kv is not None:
                full[: len(got)] = kv
            for j, (i, n) in enumerate(self.parts[kind]):
                on = self._host_sharding(i, n)
                arrays = (jax.device_put(np.repeat(full[:, j, f], r, axis=2), on) for f in fields)
                pages[i] = (pages[i] or {}) | {kind: spec.entry(*arrays)}
        return PageLoads(idx=idx, pages=tuple(pages))

    def _host_sharding(self, layer: int, part: int | None):
        """Where layer ``layer``'s loaded pages wait: host memory (``pinned_host``, which a
        TPU or GPU copies from by DMA), split as its cache is. On CPU, whose "device" memory
        is host memory already, in device memory: the step's copy is then a no-op."""
        entry = self.runner.cache[layer]
        sharding = (entry if part is None else entry[part])[0].sharding
        if next(iter(sharding.device_set)).platform == "cpu":
            return sharding
        return sharding.with_memory_kind("pinned_host")

    def empty_step_loads(self) -> PageLoads:
        """``PageLoads`` with no page, for warm-up and TPU compiles to lower the steps that take
        them (only shapes, when the runner's cache is only shapes)."""
        shapes_only = isinstance(jax.tree_util.tree_leaves(self.runner.cache)[0], jax.ShapeDtypeStruct)
        return self._loads({}, abstract=shapes_only)

    def _read(self, kind: str, idx: list[int]) -> dict[str, np.ndarray]:
        n = len(idx)
        padded = np.zeros(_bucket(n), np.int32)
        padded[:n] = idx
        out = _gather_jit(self.runner.cache, padded, **self._static(kind), replicate=self.replicate)
        return {k: np.asarray(v)[:n] for k, v in out.items()}

    def _write(self, kind: str, idx: list[int], data: dict[str, np.ndarray]) -> None:
        n, b = len(idx), _bucket(len(idx))
        padded = np.full(b, np.iinfo(np.int32).max, np.int32)  # out of range: dropped
        padded[:n] = idx
        full = {k: np.concatenate([v, np.zeros((b - n,) + v.shape[1:], v.dtype)]) for k, v in data.items()}
        self.runner.cache = _scatter_jit(
            self.runner.cache, padded, full, **self._static(kind), shardings=self.shardings
        )

    def _static(self, kind: str) -> dict:
        if kind == self.state_kind:
            groups = tuple(
                (prefix, tuple((i, None) for i in layers)) for prefix, layers in self.state_groups.items()
            )
        else:
            groups = ((self.spec[kind].row, self.parts[kind]),)
        recurrent = kind == self.state_kind
        return {"groups": groups, "recurrent": recurrent, "kv_repeat": self._kv_repeat(kind)}

    def lowerings(self) -> Iterator[tuple[str, Callable[[], jax.stages.Lowered]]]:
        """(name, a function that lowers it) for every gather and scatter."""
        for kind in self.kinds():
            layout = self.layout(kind)
            static = self._static(kind)
            for b in self.buckets(kind):
                idx = jax.ShapeDtypeStruct((b,), np.int32)
                data = {k: jax.ShapeDtypeStruct((b,) + s, d) for k, (s, d) in layout.items()}
                read = functools.partial(
                    _gather_jit.lower, self.runner.cache, idx, **static, replicate=self.replicate
                )
                write = functools.partial(
                    _scatter_jit.lower, self.runner.cache, idx, data, **static, shardings=self.shardings
                )
                yield f"read {kind} x{b}", read
                yield f"write {kind} x{b}", write


@jax.named_scope("transfer_gather")
def _gather(cache, idx, *, groups, recurrent, kv_repeat, replicate):
    out = {}
    for prefix, layers in groups:
        if recurrent:  # "mamba.conv", "mamba.ssm", "gdn.conv", ...: [n, layers, ...]
            for f, field in enumerate(RecurrentState._fields):
                out[f"{prefix}.{field}"] = jnp.stack([cache[i][f][idx] for i, _ in layers], axis=1)
        else:
            r = kv_repeat  # keep one copy of each replicated KV head
            rows = [jnp.stack([a[idx][:, :, ::r] for a in _part(cache[i], n)], axis=1) for i, n in layers]
            out[prefix] = jnp.stack(rows, axis=1)  # [n, layers, fields, rows, *per_row]
    return sharding.constrain(out, replicate)


def _part(entry, n: int | None):
    """The entry of one cache kind, in a layer's entry (``models/cache.py``, ``parts``)."""
    return entry if n is None else entry[n]


@jax.named_scope("transfer_scatter")
def _scatter(cache, idx, data, *, groups, recurrent, kv_repeat, shardings):
    cache = list(cache)
    for prefix, layers in groups:
        for j, (i, n) in enumerate(layers):
            e = cache[i]
            if recurrent:
                cache[i] = RecurrentState(
                    *(
                        a.at[idx].set(data[f"{prefix}.{field}"][:, j].astype(a.dtype), mode="drop")
                        for field, a in zip(RecurrentState._fields, e)
                    )
                )
                continue
            rows = data[prefix][:, j]  # [n, fields, rows, *per_row]
            if kv_repeat > 1:
                rows = jnp.repeat(rows, kv_repeat, axis=3)
            part = _part(e, n)
            part = type(part)(
                *(a.at[idx].set(rows[:, f].astype(a.dtype), mode="drop") for f, a in enumerate(part))
            )
            if n is None:
                cache[i] = part
            else:
                cache[i] = tuple(part if m == n else x for m, x in enumerate(e))
    return sharding.constrain(tuple(cache), shardings)


# Module-level jits: engines in one process share compiled transfers.
_gather_jit = jax.jit(_gather, static_argnames=("groups", "recurrent", "kv_repeat", "replicate"))
_scatter_jit = jax.jit(
    _scatter, static_argnames=("groups", "recurrent", "kv_repeat", "shardings"), donate_argnums=(0,)
)
