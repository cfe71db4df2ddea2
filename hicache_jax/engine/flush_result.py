"""``Engine.flush_cache`` and ``close``: the tiers emptied or stopped, and what the flush
did (``success`` when the device and host caches were cleared)."""

from __future__ import annotations

import dataclasses
import logging
import time

from hicache_jax.cache.storage_tier import StorageDrain


@dataclasses.dataclass(frozen=True)
class FlushResult:
    """A flush succeeds once L1 and L2 are cleared, even if L3 did not drain in time: `storage`
    then says how many prefetches were abandoned and how many page writes were left queued.
    """

    success: bool
    message: str
    seconds: float = 0.0
    storage: StorageDrain | None = None  # None: refused, or no L3 configured
    failed: bool = False  # it raised (not merely refused while requests run)

    def to_dict(self) -> dict:
        out = {"success": self.success, "message": self.message, "seconds": round(self.seconds, 3)}
        if self.storage is not None:
            d = self.storage
            out["l3"] = {
                "complete": d.complete,
                "writes_drained": d.writes_drained,
                "writes_pending": d.writes_pending,
                "prefetches_abandoned": d.prefetches_abandoned,
                "seconds": round(d.seconds, 3),
            }
        return out

    @staticmethod
    def done(seconds: float, storage: StorageDrain | None) -> FlushResult:
        if storage is None:
            msg = "device and host caches flushed"
        elif storage.complete:
            msg = f"device and host caches flushed (L3 kept; {storage.writes_drained} page writes drained)"
        else:
            msg = (
                f"device and host caches flushed; L3 did not drain within its deadline: "
                f"{storage.writes_pending} page writes left queued, "
                f"{storage.prefetches_abandoned} prefetches abandoned"
            )
        return FlushResult(True, msg, seconds, storage)


log = logging.getLogger(__name__)


def flush_tiers(side, write_back: bool, check_integrity) -> FlushResult:
    """Clear L1 and L2 after draining pending L3 writes (for at most
    ``hicache_storage_timeout_s``); L3 is kept. Refused (``success`` False) while requests
    are in flight. ``side``: the engine's ``CacheSide`` (``engine/build.py``)."""
    if side.scheduler.has_work():
        return FlushResult(False, "requests are still in flight")
    t0 = time.monotonic()
    if side.prefix_cache.host:
        # write_back keeps data only on the device until eviction: a flush writes it back.
        side.prefix_cache.backup_pending(everything=write_back)
    drained = None
    if side.storage is not None:  # in-flight prefetches are dropped, queued L3 writes drained
        drained = side.storage.drain(side.scheduler.abandon_prefetches)
    side.prefix_cache.flush()
    # Idle and flushed: every page must be free. Cheap now, and a leak found here is
    # reported by /flush_cache instead of surfacing later as a stall.
    check_integrity()
    for name, used in side.prefix_cache.pages_in_use().items():
        if used:
            raise AssertionError(f"{name}: {used} pages still in use after flush_cache")
    return FlushResult.done(time.monotonic() - t0, drained)


def close_tiers(side) -> None:
    """Stop L3 work: queued writes get up to ``hicache_storage_timeout_s``, then are dropped."""
    if side.storage is None:
        return
    side.scheduler.close()  # no prefetch outlives the storage tier
    side.storage.close()
    done = side.storage.client.stats()
    log.info(
        "L3 at close: %d page writes, %d page reads, %d write errors",
        done["writes"],
        done["reads"],
        side.storage.counters["l3_write_errors"],
    )
