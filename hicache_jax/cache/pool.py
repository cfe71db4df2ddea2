"""A pool of interchangeable indices: KV pages of one page group, or recurrent state slots."""

from __future__ import annotations


class IndexPool:
    """Hands out indices ``0 .. size-1``. ``alloc`` is all or nothing; freeing an index
    that is not allocated is a bug and raises at once (a double free would hand the same
    page to two owners later)."""

    def __init__(self, size: int, name: str):
        if size < 0:
            raise ValueError(f"{name}: pool size must be >= 0, got {size}")
        self.size = size
        self.name = name
        self._free = list(range(size - 1, -1, -1))  # pop() hands out low indices first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self._free):
            return None
        out = [self._free.pop() for _ in range(n)]
        self._used.update(out)
        return out

    def free(self, indices) -> None:
        for i in indices:
            if i not in self._used:
                raise RuntimeError(f"{self.name}: freeing index {i} that is not allocated")
            self._used.remove(i)
            self._free.append(i)

    def is_used(self, i: int) -> bool:
        return i in self._used

    def used(self) -> set[int]:
        return set(self._used)

    def reset(self) -> None:
        self.__init__(self.size, self.name)

    def check_integrity(self) -> None:
        free = set(self._free)
        if len(free) != len(self._free):
            raise AssertionError(f"{self.name}: duplicate entries in the free list")
        if free & self._used:
            raise AssertionError(f"{self.name}: indices both free and used: {sorted(free & self._used)[:8]}")
        if len(free) + len(self._used) != self.size or any(not 0 <= i < self.size for i in free | self._used):
            raise AssertionError(
                f"{self.name}: free {len(free)} + used {len(self._used)} != size {self.size}"
            )
