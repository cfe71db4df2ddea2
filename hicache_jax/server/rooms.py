"""sglang-router's ``bootstrap_room``: one per prompt, checked where a body is parsed, and
carried on each engine request dict (under ``ROOM``) until ``Disaggregation.run`` takes it."""

from __future__ import annotations

from hicache_jax.sampling_params import InvalidRequest
from hicache_jax.storage.handover import check_room

ROOM = "bootstrap_room"


def rooms_for(value, prompts: int) -> list[int | None]:
    """One ``bootstrap_room`` per prompt from a body's field (an integer for one prompt, a
    list of them for a batch); InvalidRequest naming what is wrong."""
    if value is None:
        return [None] * prompts
    if isinstance(value, list):
        if len(value) != prompts:
            raise InvalidRequest(f"bootstrap_room: {len(value)} rooms for {prompts} prompt(s)")
        rooms = value
    elif prompts == 1:
        rooms = [value]
    else:
        raise InvalidRequest(f"bootstrap_room: a batch of {prompts} prompts needs a list of rooms, one each")
    for i, room in enumerate(rooms):
        try:
            check_room(room)
        except ValueError:
            where = f"bootstrap_room[{i}]" if isinstance(value, list) else "bootstrap_room"
            raise InvalidRequest(f"{where} must be an integer in [0, 2**64), got {room!r}") from None
    return list(rooms)
