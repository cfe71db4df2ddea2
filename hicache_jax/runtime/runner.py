"""The model runner: device cache arrays and one jitted function per step shape.

A step is ``restore snapshots -> forward -> take snapshots -> sample -> count``, all inside
one jit, so logits never leave the device, recurrent state copies need no extra dispatch, and
the penalty counts (``penalties.py``) take each sampled token on the device.

``launch`` only dispatches (JAX runs it asynchronously) and ``fetch`` reads the results,
so the engine can schedule the next step while this one runs. A step may take input tokens
that the previous step sampled and nobody has read yet (``ForwardBatch.feed_rows``): every
step returns its sampled ids padded to ``max_seqs`` and takes the previous step's, on device.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from hicache_jax.kinds import CacheKind, cache_kinds
from hicache_jax.models import sharding
from hicache_jax.models.cache import RecurrentState
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.runtime import compiles, penalties
from hicache_jax.runtime.mtp_drafts import mtp_drafts
from hicache_jax.runtime.sampler import SamplingInputs, SamplingOutputs, sample
from hicache_jax.runtime.step_inputs import StepInputs

log = logging.getLogger(__name__)


def step_name(shape: tuple, top_logprobs: int) -> str:
    """A step program's name for a ``StepShape`` (T, S, R, decode_only[, N]): warm-up's
    progress and the log line of a step that waited on its compile."""
    T, S, R, decode_only, *N = shape
    if N and N[0] not in (0, S):
        return f"verify step T={T} S={S} top={top_logprobs}"
    return f"{'decode' if decode_only else 'prefill'} step T={T} S={S} R={R} top={top_logprobs}"


def copy_states(cache: tuple, src: jax.Array, dst: jax.Array) -> tuple:
    """Copy recurrent state slot ``src[i]`` to ``dst[i]`` in every recurrent layer, for the
    leading entries that are not -1 (the batch builder packs them first).

    One slot at a time, in a loop that runs once per copy: a step reads and writes only the
    slots it copies, in place. (A gather of all K entries then a scatter moved K whole slots
    per layer twice a step, copies or not: 64 MiB a layer at 64 slots of Bamba-9B at tp 4.)
    Within one call no copy reads a slot another writes (restores write working slots from
    snapshots; snapshots copy working slots to fresh ones), so the order does not matter."""
    recurrent = [i for i, entry in enumerate(cache) if isinstance(entry, RecurrentState)]
    if not recurrent:
        return cache
    count = jnp.sum((src >= 0) & (dst >= 0))

    def one(i, states):
        def move(x):
            row = jax.lax.dynamic_slice_in_dim(x, src[i], 1)
            return jax.lax.dynamic_update_slice_in_dim(x, row, dst[i], 0)

        return tuple(RecurrentState(*(move(a) for a in st)) for st in states)

    moved = jax.lax.fori_loop(0, count, one, tuple(cache[i] for i in recurrent))
    out = list(cache)
    for i, st in zip(recurrent, moved):
        out[i] = st
    return tuple(out)


class _Structure:
    """The model's graph and parameter tree as one static jit argument. Interned, so it
    hashes by identity: hashing a Flax graphdef on every call costs milliseconds.

    Under tensor parallelism it also holds where the step's outputs live: the cache as it
    came in (``cache_shardings``), the sampled ids on every device (``replicated``)."""

    _interned: dict = {}

    def __init__(self, graphdef, treedef, cache_shardings, replicated):
        self.graphdef, self.treedef = graphdef, treedef
        self.cache_shardings, self.replicated = cache_shardings, replicated

    @classmethod
    def of(cls, graphdef, treedef, cache_shardings=None, replicated=None) -> _Structure:
        key = (graphdef, treedef, cache_shardings, replicated)
        return cls._interned.setdefault(key, cls(*key))


class ModelRunner:
    def __init__(
        self,
        model: CausalLM,
        *,
        num_pages: dict[str, int],
        page_size: int,
        num_state_slots: int,
        max_seqs: int = 1,
        draft_steps: int = 0,
        abstract_on: jax.sharding.Mesh | None = None,
        check_plan: Callable[[int, object], None] | None = None,
    ):
        """``abstract_on``: allocate nothing. The model's weights are ``ShapeDtypeStruct``s
        (``hicache_jax/tpu/abstract.py``) and the cache and ids become ones too, placed on
        the model's mesh or, without one, on this one-device mesh: the step can then be
        lowered and compiled for devices this process cannot run (a TPU slice, from here).

        ``check_plan(n, plan)`` runs before the ``n``-th launch with the step's host-side
        inputs and raises to stop it. Over several processes it is the check that every
        process launches the same step (``multihost/distributed.py``), passed in from
        there so that the runtime needs nothing above it.

        ``draft_steps``: draft tokens each step proposes per sequence with the model's first
        multi-token-prediction block (``mtp_drafts.py``; 0: none), returned as
        ``SamplingOutputs.drafts``."""
        self.model = model
        self.draft_steps = draft_steps
        self.cfg = model.cfg
        self.page_size = page_size
        self.has_state = CacheKind.STATE in cache_kinds(self.cfg.layer_kinds)
        self.graphdef, self.params = nnx.split(model)
        # Flat leaves: flattening an nnx.State on every call costs milliseconds per step.
        self._leaves, treedef = jax.tree_util.tree_flatten(self.params)
        self.mesh = model.mesh
        self._structure = _Structure.of(
            self.graphdef, treedef, model.cache_shardings(), sharding.replicated(self.mesh)
        )
        self._cache_shape = dict(num_pages=num_pages, page_size=page_size, num_state_slots=num_state_slots)
        # Penalty counts (``penalties.py``): one row per slot, split by vocabulary as logits are.
        self.num_penalty_slots = max_seqs
        self._counts_sharding = sharding.vocab_rows(sharding.replicated(self.mesh), self.cfg.vocab_size)
        self._abstract_on = None if abstract_on is None else sharding.replicated(self.mesh or abstract_on)
        self._all_allowed: dict[tuple[int, int], jax.Array] = {}  # grammar bitmasks, by shape
        if abstract_on is None:
            self.cache = self._new_cache()
            self._no_ids = jax.device_put(jnp.zeros((max_seqs,), jnp.int32), self._placed())
            self.counts = self._new_counts()
        else:
            self.cache = model.cache_shapes(placement=abstract_on, **self._cache_shape)
            on = self._abstract_on
            self._no_ids = jax.ShapeDtypeStruct((max_seqs,), jnp.int32, sharding=on)
            vocab_on = self._counts_sharding or on
            self.counts = jax.ShapeDtypeStruct((max_seqs, self.cfg.vocab_size), jnp.int32, sharding=vocab_on)
        self._compiled_before = compiles.total(STEP_PROGRAM)
        self._multiprocess = jax.process_count() > 1
        self._check_plan = check_plan
        self._launched = 0

    def launch(
        self, inputs: StepInputs, prev_ids: jax.Array | None = None
    ) -> tuple[SamplingOutputs, jax.Array]:
        """Dispatch a step; returns its outputs and its sampled ids padded to ``max_seqs``
        (the next step's ``prev_ids``), both still on the device."""
        args = self._step_args(inputs, prev_ids)
        top_logprobs = inputs.top_logprobs
        if self._check_plan is not None:
            self._launched += 1
            plan = ((args[2], args[3], args[4]), args[6], top_logprobs)  # host arrays
            self._check_plan(self._launched, plan)
        before, t0 = compiles.total(STEP_PROGRAM), time.perf_counter()
        self.cache, out, ids, self.counts = _step_jit(*args, **self._static(top_logprobs))
        if compiles.total(STEP_PROGRAM) != before:  # this shape's first use: the step waited
            log.warning(
                "a step waited %.1f s for its program to compile (%s; warm-up, --warmup or "
                "LLM(warmup=True), compiles every step shape before serving)",
                time.perf_counter() - t0,
                step_name(inputs.shape, top_logprobs),
            )
        return out, ids

    def lower_penalty_row(self) -> jax.stages.Lowered:
        """The program ``write_penalty_row`` runs, lowered (for warm-up)."""
        row = np.zeros(self.cfg.vocab_size, np.int32)
        return penalties.lower_write_row(self.counts, row, self._counts_sharding)

    def write_penalty_row(self, slot: int, row: np.ndarray) -> None:
        """Set penalty slot ``slot``'s counts (``penalties.seed_row``), in device order after
        the step in flight (which may still add to the slot's former holder)."""
        self.counts = penalties.write_row(self.counts, slot, row, self._counts_sharding)

    @staticmethod
    def fetch(out: SamplingOutputs) -> SamplingOutputs:
        """Wait for a launched step and bring its outputs to the host (outputs are
        replicated, so on several processes each reads its own copy)."""
        return jax.tree_util.tree_map(_to_host, out)

    def step(self, inputs: StepInputs) -> SamplingOutputs:
        """Launch and wait."""
        return self.fetch(self.launch(inputs)[0])

    def lower_step(self, inputs: StepInputs) -> jax.stages.Lowered:
        """The program ``step`` runs for inputs of these shapes, lowered: warm-up compiles
        it, and the jit's call path then finds it compiled."""
        return _step_jit.lower(*self._step_args(inputs), **self._static(inputs.top_logprobs))

    def _step_args(self, inputs: StepInputs, prev_ids=None) -> tuple:
        batch, sampling, penalty = inputs.batch, inputs.sampling, inputs.penalty
        if batch.feed_rows is None:
            batch = dataclasses.replace(batch, feed_rows=np.full(batch.input_ids.shape, -1, np.int32))
        prev_ids = self._no_ids if prev_ids is None else prev_ids
        if sampling.allowed is not None:
            sampling = dataclasses.replace(sampling, allowed=self._placed_mask(sampling))
        args = (self._leaves, self.cache, batch, sampling, inputs.copies, prev_ids, penalty, self.counts)
        return (*args, inputs.draft)

    def _static(self, top_logprobs: int) -> dict:
        return {"structure": self._structure, "top_logprobs": top_logprobs, "draft_steps": self.draft_steps}

    def _placed_mask(self, sampling: SamplingInputs):
        """The step's grammar bitmask where the step's state lives. Without a constrained row
        it is a device array kept per shape (all tokens allowed), so an unconstrained step
        moves no mask; with one, the host's masks are copied over. Either way the program
        sees the same placement, so it is one program."""
        shape = sampling.allowed.shape
        if self._abstract_on is not None:
            return jax.ShapeDtypeStruct(shape, jnp.int32, sharding=self._abstract_on)
        if self._multiprocess:  # host arrays, as every other input there
            return sampling.allowed
        if np.any(sampling.constrained):
            return jax.device_put(sampling.allowed, self._placed())
        if shape not in self._all_allowed:
            self._all_allowed[shape] = jax.device_put(np.full(shape, -1, np.int32), self._placed())
        return self._all_allowed[shape]

    def reset_cache(self) -> None:
        """Fresh device cache arrays and penalty counts (after a failed step consumed the
        donated ones)."""
        self.cache = self._new_cache()
        self.counts = self._new_counts()

    def _placed(self):
        """Where the step's state lives: replicated on the mesh, or on the one device. Placed
        explicitly even on one device: a step whose L2 pages wait in host memory
        (``models/page_loads.py``) takes placed inputs and so returns placed outputs, and
        programs compiled for unplaced ones would compile again."""
        return sharding.replicated(self.mesh) or jax.sharding.SingleDeviceSharding(jax.devices()[0])

    def _new_cache(self) -> tuple:
        cache = self.model.allocate_cache(**self._cache_shape)
        return cache if self.mesh is not None else jax.device_put(cache, self._placed())

    def _new_counts(self) -> jax.Array:
        zeros = jnp.zeros((self.num_penalty_slots, self.cfg.vocab_size), jnp.int32)
        return jax.device_put(zeros, self._counts_sharding or self._placed())

    def num_compiled(self) -> int:
        """Step programs compiled since this runner was made (``benchmarks/decode.py`` checks
        that its timed steps compile nothing). The jit is shared by every runner of the
        process, so engines of the same model structure and shapes reuse each other's
        programs, and a compile in another engine counts here too."""
        return compiles.total(STEP_PROGRAM) - self._compiled_before

    def kv_bytes_per_token(self) -> int:
        """Device bytes one token takes in every paged layer (shape arithmetic: indexing
        would compile), KV heads as the device holds them: a page's bytes over its tokens
        (a compressed kind holds a row per several tokens, a state kind one per page)."""
        b = 0
        for entry in self.cache:
            if not isinstance(entry, RecurrentState):
                b += sum(
                    int(np.prod(a.shape[1:])) * a.dtype.itemsize for a in jax.tree_util.tree_leaves(entry)
                )
        return round(b / self.page_size)


def _to_host(x: jax.Array) -> np.ndarray:
    return np.asarray(x if x.is_fully_addressable else x.addressable_data(0))


def _step(
    leaves,
    cache,
    batch,
    sampling,
    copies,
    prev_ids,
    penalty,
    counts,
    draft,
    *,
    structure,
    top_logprobs,
    draft_steps,
):
    fed = prev_ids[jnp.maximum(batch.feed_rows, 0)]
    ids = jnp.where(batch.feed_rows >= 0, fed, batch.input_ids)
    batch = dataclasses.replace(batch, input_ids=ids, feed_rows=None)
    params = jax.tree_util.tree_unflatten(structure.treedef, leaves)
    # Each stage hands the cache on where it lives: left free, XLA may split the replicated
    # conv-state pool across the copy loop and all-gather it whole afterwards, every step.
    cache = copy_states(cache, copies.before_src, copies.before_dst)
    cache = sharding.constrain(cache, structure.cache_shardings)
    model = nnx.merge(structure.graphdef, params)
    if draft_steps:
        cache, logits, hidden = model(cache, batch, hidden=True)
    else:
        cache, logits = model(cache, batch)
    cache = sharding.constrain(cache, structure.cache_shardings)
    cache = copy_states(cache, copies.after_src, copies.after_dst)
    rows = sharding.vocab_rows(structure.replicated, logits.shape[-1])
    out = sample(logits, sampling, top_logprobs, rows, structure.replicated, (penalty, counts))
    counts = sharding.constrain(penalties.counted(counts, penalty, out.next_ids), rows)
    if draft_steps:
        cache, drafts = mtp_drafts(model, cache, hidden, batch, out.next_ids, draft, draft_steps)
        out = dataclasses.replace(out, drafts=drafts)
    n = min(out.next_ids.shape[0], prev_ids.shape[0])
    ids = jnp.zeros_like(prev_ids).at[:n].set(out.next_ids[:n])
    cache = sharding.constrain(cache, structure.cache_shardings)
    out = sharding.constrain(out, structure.replicated)
    return cache, out, sharding.constrain(ids, structure.replicated), counts


STEP_PROGRAM = "jit(_step)"  # the name compile events carry


def step_jit(compiler_options: dict | None = None):
    """The jitted ``_step`` (``compiler_options``: XLA options for its compiles)."""
    return jax.jit(
        _step,
        static_argnames=("structure", "top_logprobs", "draft_steps"),
        donate_argnums=(1, 7),
        compiler_options=compiler_options,
    )


_step_jit = step_jit()
