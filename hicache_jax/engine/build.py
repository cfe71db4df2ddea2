"""Building an engine's parts from its config: the model, the device pools, the host (L2)
pools, the L3 tier, and the cache side that joins them to the scheduler."""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

from jax.sharding import Mesh

from hicache_jax.cache.host_pool import HostPool
from hicache_jax.cache.pool import IndexPool
from hicache_jax.cache.prefix import PrefixRules
from hicache_jax.cache.prefix_cache import PrefixCache
from hicache_jax.config import ConfigError, EngineConfig
from hicache_jax.hub import resolve_model_path
from hicache_jax.kinds import POOL_NAME, Retention, cache_kinds, retention, with_retention
from hicache_jax.models.causal_lm import CausalLM
from hicache_jax.models.config import ModelConfig
from hicache_jax.models.kernels.backend import KernelConfig
from hicache_jax.models.sharding import make_mesh, tp_size
from hicache_jax.models.tokenizer import Tokenizer
from hicache_jax.runtime.batch_builder import BatchBuilder
from hicache_jax.runtime.runner import ModelRunner
from hicache_jax.runtime.transfer import PageTransfer
from hicache_jax.scheduler.cache_adapter import CacheAdapter
from hicache_jax.scheduler.l3_prefetch import Prefetcher
from hicache_jax.scheduler.scheduler import Scheduler

log = logging.getLogger(__name__)


def kernel_config_of(cfg: EngineConfig) -> KernelConfig:
    """The config's kernels, without a mesh."""
    return KernelConfig(attention=cfg.attention_backend, ssd=cfg.ssd_backend, interpret=cfg.kernel_interpret)


def kernel_config(cfg: EngineConfig) -> KernelConfig:
    mesh = make_mesh(cfg.tp_size) if cfg.tp_size > 1 else None
    return dataclasses.replace(kernel_config_of(cfg), mesh=mesh)


def load_model_and_tokenizer(cfg: EngineConfig) -> tuple[CausalLM, Tokenizer]:
    kernels = kernel_config(cfg)
    kernels.check_platform()
    if cfg.model_path:
        from hicache_jax.models.loader import load_model

        path = resolve_model_path(cfg.model_path, cfg.revision)  # a Hub id: its cached snapshot
        return load_model(path, dtype=cfg.dtype, kernels=kernels), Tokenizer(path)
    from hicache_jax.models.loader import resolve_dtype
    from hicache_jax.models.presets import TOKENIZER, build_preset

    dtype = resolve_dtype("float32" if cfg.dtype == "auto" else cfg.dtype)
    return build_preset(cfg.preset, seed=cfg.random_seed, dtype=dtype, kernels=kernels), Tokenizer(TOKENIZER)


def attach_drafter(
    cfg: EngineConfig, model: CausalLM, kernels: KernelConfig | None = None, shapes_on: Mesh | None = None
) -> None:
    """Give ``model`` the drafter a model-drafting algorithm runs in every step
    (``runtime/mtp_drafts.py``), its KV one more cache layer (``mtp_cache_layers``): NEXTN,
    the model's first MTP block; EAGLE3, the draft at ``speculative_draft_model_path`` in
    the block's place, reading the residual stream at its three boundaries (``eagle3_aux``),
    its weights split over the model's mesh as a main layer's (``layers/eagle3.py``) and its
    kernels those of ``kernels`` (default: the config's) on that mesh; ``shapes_on``: its
    config only, its weights shapes (``load_eagle3``). Refuses, naming the flag, a draft
    that does not fit the model, or whose heads ``tp_size`` cannot split."""
    if cfg.speculative_algorithm.upper() != "EAGLE3":
        model.cfg = dataclasses.replace(model.cfg, mtp_cache_layers=1)
        return
    from flax import nnx

    from hicache_jax.models.hf.eagle3 import load_eagle3
    from hicache_jax.models.hf.safetensors_io import CheckpointError
    from hicache_jax.models.layers.eagle3 import cache_mismatch

    flag = f"speculative_draft_model_path={cfg.speculative_draft_model_path!r}"
    if model.cfg.dsv4 is not None:
        raise ConfigError(
            "speculative_algorithm='EAGLE3' is not supported yet for DeepSeek V4 (residual streams)"
        )
    kernels = kernels or kernel_config_of(cfg)
    kernels = dataclasses.replace(kernels, mesh=model.mesh)  # the draft runs where the model does
    path = resolve_model_path(cfg.speculative_draft_model_path)
    try:
        draft = load_eagle3(path, model.cfg, dtype=model.dtype, kernels=kernels, shapes_on=shapes_on)
    except (CheckpointError, OSError, ValueError) as e:
        raise ConfigError(f"{flag}: {e}") from e
    why = cache_mismatch(draft.cfg, model.cfg)
    if why:
        raise ConfigError(f"{flag}: its KV cannot share the model's pages: {why}")
    model.mtp = nnx.data(nnx.List([draft]))
    aux = draft.cfg.aux_boundaries(model.cfg.num_layers)
    model.cfg = dataclasses.replace(model.cfg, mtp_cache_layers=1, eagle3_aux=aux)


def set_kv_dtype(cfg: EngineConfig, model: CausalLM) -> None:
    """Give ``model`` the pages' dtype ``--kv_cache_dtype`` names (``models/kv_quant.py``);
    its cache is allocated in it, on the device, in L2 and in L3. int8 pages get per-tensor
    scales from a calibration pass (``models/kv_calibrate.py``); 8-bit floats and wide
    dtypes scale by 1."""
    from hicache_jax.models import kv_quant

    kernels = dataclasses.replace(kernel_config_of(cfg), mesh=model.mesh)
    try:
        model.kv_dtype = kv_quant.resolve(cfg.kv_cache_dtype, model.dtype)
        # Pages the Pallas kernels cannot read on this chip: refused now, naming the flag.
        kernels.check_model(model.cfg, model.dtype, kv_dtype=model.kv_dtype)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    scales = None
    if model.kv_dtype.name == "int8":
        from hicache_jax.models.kv_calibrate import calibrate

        scales = calibrate(model)
        log.info("KV pages int8: per-tensor scales calibrated (%s)", kv_quant.scheme(model.kv_dtype, scales))
    model.set_kv_scales(scales)


def verify_overhead_rows(cfg: EngineConfig, platform: str | None = None) -> float:
    """``--speculative_verify_overhead_rows`` resolved for ``platform`` (default: JAX's)."""
    import jax

    if cfg.speculative_verify_overhead_rows is not None:
        return cfg.speculative_verify_overhead_rows
    from hicache_jax.scheduler.draft_policy import ACCELERATOR_OVERHEAD_ROWS, OVERHEAD_ROWS

    return OVERHEAD_ROWS if (platform or jax.default_backend()) == "cpu" else ACCELERATOR_OVERHEAD_ROWS


def check_model_tp(cfg: EngineConfig, model: CausalLM) -> None:
    """A model built elsewhere must sit on the mesh the config asks for; over several
    processes that mesh holds every device."""
    import jax

    if jax.process_count() > 1 and cfg.tp_size != jax.device_count():
        raise ConfigError(
            f"tp_size={cfg.tp_size}: over {jax.process_count()} processes the mesh must hold "
            f"every device ({jax.device_count()})"
        )
    if tp_size(model.mesh) != cfg.tp_size:
        raise ConfigError(
            f"tp_size={cfg.tp_size}, but the model given runs on {tp_size(model.mesh)} device(s); "
            "build it with KernelConfig(mesh=make_mesh(tp_size))"
        )


def make_host_pools(
    cfg: EngineConfig, pools: dict[str, IndexPool], transfer: PageTransfer
) -> dict[str, HostPool]:
    """L2 sized as the device pools x ``hicache_ratio``, or to ``hicache_size_gb``."""
    layouts = {k: transfer.layout(k) for k in pools}
    sizes = {k: max(1, int(p.size * cfg.hicache_ratio)) for k, p in pools.items()}
    if cfg.hicache_size_gb > 0:
        page_kinds = [k for k in pools if retention(k) is not Retention.SNAPSHOT]
        per_page = sum(HostPool(k, 0, layouts[k]).bytes_per_page for k in page_kinds)
        for k in page_kinds:
            sizes[k] = max(1, int(cfg.hicache_size_gb * 1e9 / per_page))
    return {k: HostPool(k, sizes[k], layouts[k]) for k in pools}


def make_device_pools(cfg: EngineConfig, mc: ModelConfig) -> dict[str, IndexPool]:
    """L1: one pool per cache kind the model's layers use, sized by its retention rule:
    ``max_total_tokens`` of every-page kinds, ``swa_full_tokens_ratio`` of that for window
    kinds (all of it without an every-page kind), ``num_state_slots`` snapshot slots."""
    kinds = cache_kinds(mc.layer_kinds)
    full_pages = cfg.max_total_tokens // cfg.page_size
    has_every = bool(with_retention(kinds, Retention.EVERY))
    sizes = {
        Retention.EVERY: full_pages,
        Retention.WINDOW: max(1, int(full_pages * cfg.swa_full_tokens_ratio)) if has_every else full_pages,
        Retention.SNAPSHOT: cfg.num_state_slots,
    }
    return {k: IndexPool(sizes[retention(k)], POOL_NAME[k]) for k in kinds}


def context_length(cfg: EngineConfig, mc: ModelConfig) -> int:
    return min(cfg.context_length or mc.max_position_embeddings, mc.max_position_embeddings)


def page_groups(mc: ModelConfig) -> tuple[str, ...]:
    """The paged cache kinds the model's layers use (each has its page table)."""
    return tuple(k for k in cache_kinds(mc.layer_kinds) if retention(k) is not Retention.SNAPSHOT)


def make_runner(
    cfg: EngineConfig, model: CausalLM, pools: dict[str, IndexPool], abstract_on=None, check_plan=None
) -> ModelRunner:
    """The runner with a device cache the size of the pools (``abstract_on``: shapes only;
    ``check_plan``: the per-step hook over several processes; see ``ModelRunner``)."""
    return ModelRunner(
        model,
        num_pages={g: pools[g].size for g in page_groups(model.cfg)},
        page_size=cfg.page_size,
        num_state_slots=sum(p.size for k, p in pools.items() if retention(k) is Retention.SNAPSHOT),
        max_seqs=BatchBuilder.max_seqs_for(cfg.max_running_requests),
        draft_steps=cfg.spec_width - 1 if model.cfg.mtp_cache_layers else 0,
        abstract_on=abstract_on,
        check_plan=check_plan,
    )


def make_builder(cfg: EngineConfig, mc: ModelConfig, context_len: int) -> BatchBuilder:
    return BatchBuilder(
        page_size=cfg.page_size,
        groups=page_groups(mc),
        max_running=cfg.max_running_requests,
        max_prefill=cfg.chunked_prefill_size,
        max_pages=-(-context_len // cfg.page_size),
        vocab_size=mc.vocab_size,
        spec_width=cfg.spec_width,
        eos_token_ids=mc.eos_token_ids,
        draft_groups=draft_groups(mc),
    )


def draft_groups(mc: ModelConfig) -> tuple[str, ...]:
    """The page groups of the multi-token-prediction block whose KV the cache holds (none
    without one: ``ModelConfig.mtp_cache_layers``)."""
    if not mc.mtp_cache_layers:
        return ()
    return tuple(k for k in cache_kinds(mc.cache_layer_kinds[-1:]) if retention(k) is not Retention.SNAPSHOT)


def prefix_rules(cfg: EngineConfig, mc: ModelConfig) -> PrefixRules:
    kinds = cache_kinds(mc.layer_kinds)
    window = mc.sliding_window if with_retention(kinds, Retention.WINDOW) else None
    return PrefixRules(page_size=cfg.page_size, kinds=kinds, window=window)


def make_storage_tier(cfg: EngineConfig, model: CausalLM, params, prefix_cache: PrefixCache):
    """L3: a TensorStore store under a namespace that pins the weights, KV dtype, page size
    and layout (whole pages, whatever ``tp_size`` runs), and the page-auth key's id when
    ``hicache_storage_auth_key_file`` is set. The key itself is read here, once, and handed
    to the storage client only: no config holds it and nothing echoes it."""
    import jax

    from hicache_jax.cache.storage_tier import StorageTier
    from hicache_jax.models import kv_quant
    from hicache_jax.models.fingerprint import params_fingerprint
    from hicache_jax.models.loader import model_fingerprint
    from hicache_jax.storage.auth import BadAuthKey, key_id, read_auth_key
    from hicache_jax.storage.base import make_store
    from hicache_jax.storage.capacity import CapacityConfig
    from hicache_jax.storage.client import ClientConfig, StorageClient
    from hicache_jax.storage.keys import Namespace

    fp = model_fingerprint(resolve_model_path(cfg.model_path, cfg.revision)) if cfg.model_path else None
    fp = fp or params_fingerprint(params, label=model.cfg.architecture)
    if cfg.speculative_draft_model_path and cfg.model_path:  # its KV is in every page
        draft = model_fingerprint(resolve_model_path(cfg.speculative_draft_model_path))
        fp = f"{fp}+draft:{draft or params_fingerprint(params, label='draft')}"
    auth_key = None
    if cfg.hicache_storage_auth_key_file:
        path = cfg.hicache_storage_auth_key_file
        try:
            auth_key = read_auth_key(path)
        except BadAuthKey as e:  # checked by the config; the file changed since
            raise ConfigError(f"hicache_storage_auth_key_file={path!r}: {e}") from None
        if os.stat(path).st_mode & 0o077:
            log.warning("L3: the page-auth key file %s is readable by other users (chmod 600 it)", path)
    namespace = Namespace(
        model_fingerprint=fp,
        kv_dtype=str(model.kv_dtype),  # the pages' (--kv_cache_dtype)
        page_size=cfg.page_size,
        layout_version=1,
        # Pages are stored whole at every tp_size (see runtime/transfer.py): the namespace names the
        # whole-page layout, so servers at any tp_size share them.
        tp_rank=0,
        tp_size=1,
        auth_id=None if auth_key is None else key_id(auth_key),
        mtp_cache_layers=model.cfg.mtp_cache_layers,  # the drafting block's KV in every page
        kv_scales=kv_quant.scheme(model.kv_dtype, model.kv_scales),  # what quantized pages mean
    )
    spec = cfg.hicache_storage_spec or os.path.join(tempfile.gettempdir(), "hicache_jax_l3")
    store = make_store(cfg.hicache_storage_backend, spec, timeout_s=cfg.hicache_storage_timeout_s)
    log.info(
        "L3: %s store at %s (namespace %s, %s)",
        cfg.hicache_storage_backend,
        spec,
        namespace.fingerprint,
        "pages authenticated" if auth_key else "no auth key: the store is trusted",
    )
    client_cfg = ClientConfig(
        timeout_s=cfg.hicache_storage_timeout_s,
        max_queue_bytes=int(cfg.hicache_storage_write_queue_mb * 2**20),
        capacity=CapacityConfig(
            max_bytes=int(cfg.hicache_storage_max_gb * 1e9),
            min_free_bytes=int(cfg.hicache_storage_min_free_gb * 1e9),
            low_watermark=cfg.hicache_storage_evict_ratio,
            timeout_s=cfg.hicache_storage_timeout_s,
            lease_ttl_s=max(30.0, 3 * cfg.hicache_storage_timeout_s),
        ),
    )
    return StorageTier(
        StorageClient(store, namespace, client_cfg, auth_key=auth_key),
        namespace,
        prefix_cache,
        writer=(jax.process_index(), jax.process_count()),
    )


@dataclasses.dataclass(frozen=True)
class CacheSide:
    """The tiers and the scheduler over them: what ``Engine`` asks about pages and L3."""

    prefix_cache: PrefixCache
    storage: object  # StorageTier | None
    adapter: CacheAdapter
    scheduler: Scheduler


def layerwise_pages(cfg: EngineConfig, platform: str | None = None) -> int:
    """``--hicache_layerwise_pages`` resolved for ``platform`` (default: JAX's): ``-1`` is a
    chunk's worth of pages where a host-to-device copy exists to hide (TPU, GPU), none on
    CPU or over several processes."""
    import jax

    if cfg.hicache_layerwise_pages >= 0:
        return cfg.hicache_layerwise_pages
    if (platform or jax.default_backend()) == "cpu" or jax.process_count() > 1:
        return 0
    return cfg.chunked_prefill_size // cfg.page_size


def make_cache_side(cfg: EngineConfig, model: CausalLM, runner: ModelRunner, pools, rules) -> CacheSide:
    """L1 (``pools``), L2 when ``enable_hierarchical_cache``, L3 when a backend is set, the
    radix tree over them, and the scheduler with the one L3 prefetch owner."""
    import jax

    host, transfer = None, None
    if cfg.enable_hierarchical_cache:
        transfer = PageTransfer(runner, step_pages=layerwise_pages(cfg))
        host = make_host_pools(cfg, pools, transfer)
    prefix_cache = PrefixCache(
        rules,
        pools,
        enabled=not cfg.disable_radix_cache,
        host=host,
        transfer=transfer,
        write_policy=cfg.hicache_write_policy,
    )
    storage = None
    if cfg.hicache_storage_backend:
        storage = make_storage_tier(cfg, model, runner.params, prefix_cache)
    adapter = CacheAdapter(prefix_cache)
    prefetch = Prefetcher(
        None if cfg.disable_radix_cache else storage,
        prefix_cache,
        policy=cfg.hicache_storage_prefetch_policy,
        threshold=cfg.hicache_prefetch_threshold,
        host_rate_limit=cfg.hicache_host_rate_limit,
        reads=jax.process_index() == 0,  # the others get process 0's reads (multihost/replicated.py)
    )
    return CacheSide(prefix_cache, storage, adapter, Scheduler(cfg, adapter, prefetch))
