"""One evictor at a time across every server on a store: a lease object with an expiry.

``meta/lease`` holds ``{"owner": server id, "expires": Unix time}``. A server takes it when
it is missing, expired or its own, with a conditional write on the generation it just read
(compare-and-swap: TensorStore's ``if_equal``; the file driver and SeaweedFS's S3 honour it),
so of two servers racing for a free lease exactly one wins. The holder renews it every tick
and checks it before each batch of deletes; it is released on close. A holder that dies
stops renewing, and another server takes over once `ttl_s` has passed.

Clocks: expiry compares the writer's wall clock with the reader's; hosts sharing a store
must keep their clocks within a fraction of `ttl_s` (NTP does).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

from hicache_jax.storage.layout import META

LEASE = META + "lease"


class Lease:
    def __init__(
        self,
        read: Callable[[str], tuple[bytes | None, bytes]],
        write_if: Callable[[str, bytes | None, bytes], bool],
        owner: str,
        ttl_s: float,
        clock: Callable[[], float] = time.time,
    ):
        """`read(key)` -> (value or None, generation); `write_if(key, value, generation)` ->
        whether it was written (the generation still matched)."""
        self._read, self._write_if = read, write_if
        self.owner = owner
        self.ttl_s = ttl_s
        self._clock = clock
        self._expires = 0.0  # our own lease's expiry, as we wrote it

    def held(self, margin: float = 0.0) -> bool:
        """Whether we hold it for at least `margin` more seconds (local view)."""
        return self._clock() + margin < self._expires

    def acquire(self) -> bool:
        """Take or renew the lease; False if another live server holds it."""
        value, gen = self._read(LEASE)
        now = self._clock()
        if value is not None:
            try:
                cur = json.loads(value)
                owner, expires = cur["owner"], float(cur["expires"])
            except (ValueError, KeyError, TypeError):
                owner, expires = "", 0.0  # unreadable: treated as free
            if owner != self.owner and expires > now:
                self._expires = 0.0
                return False
        expires = now + self.ttl_s
        body = json.dumps({"owner": self.owner, "expires": expires}).encode()
        if not self._write_if(LEASE, body, gen):
            self._expires = 0.0
            return False
        self._expires = expires
        return True

    def release(self) -> None:
        """Give the lease up if we hold it (another server may take it at once)."""
        if not self.held():
            return
        self._expires = 0.0
        value, gen = self._read(LEASE)
        if value is not None and json.loads(value).get("owner") == self.owner:
            self._write_if(LEASE, None, gen)
