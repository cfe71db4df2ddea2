"""What ``Engine.flush_cache`` did: ``success`` when the device and host caches were cleared."""

from __future__ import annotations

import dataclasses

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
