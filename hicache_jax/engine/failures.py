"""What the engine raises when a step cannot go on. The first two leave the engine usable;
``EngineLost`` does not."""

from __future__ import annotations


class EngineStalled(RuntimeError):
    """Work is queued, nothing is in flight (no L3 prefetch), and for a bounded number of
    steps nothing could be scheduled: a scheduling bug, reported instead of spun on."""


class StepFailed(RuntimeError):
    """A step raised. The device cache it was given is gone, so the engine failed every
    running request (``failed`` rids), rebuilt its device state, and serves on."""

    def __init__(self, failed: list[str], message: str):
        super().__init__(message)
        self.failed = failed
        self.message = message


class EngineLost(RuntimeError):
    """This process's engine cannot go on: the processes serving one model together planned
    different steps, or one of them is gone. Serving on would hang in a collective or give
    wrong answers, so the server fails what is in flight and stops."""
