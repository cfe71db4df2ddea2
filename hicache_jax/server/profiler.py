"""``/start_profile`` and ``/stop_profile``: a ``jax.profiler`` trace of the engine's steps.

Owned by the engine thread (the HTTP layer reaches it through ``StartProfile``/``StopProfile``
messages), so a trace starts and stops between steps, never inside one. The trace lands in
``<output_dir>/plugins/profile/<timestamp>/``: ``*.xplane.pb`` for TensorBoard's profile
plugin (``tensorboard --logdir=<output_dir>``) and ``perfetto_trace.json.gz`` for
https://ui.perfetto.dev. ``num_steps`` stops it by itself after that many engine steps.

The client names the directory, and the server writes there with its own rights, so
``confine`` keeps it under ``--profile_dir`` (a name of at most ``MAX_NAME_CHARS`` characters
and ``MAX_NAME_PARTS`` parts), and ``check_quota`` refuses a new trace once the directory holds
``--profile_max_traces`` traces or ``--profile_max_mb`` MB: each trace is tens of MB.
"""

from __future__ import annotations

import glob
import logging
import os
import time

log = logging.getLogger(__name__)

MAX_NAME_CHARS = 255
MAX_NAME_PARTS = 16


class ProfileError(RuntimeError):
    """A profile cannot start or stop now (one already runs / none runs)."""


def confine(root: str, name: str | None) -> str:
    """The directory a client's ``output_dir`` names: ``root`` itself for none, else ``name``
    resolved (symlinks too) inside ``root``; a ProfileError for anything that leaves it."""
    base = os.path.realpath(root)
    if not name:
        return base
    if len(name) > MAX_NAME_CHARS or len(name.split(os.sep)) > MAX_NAME_PARTS:
        raise ProfileError(
            f"output_dir: at most {MAX_NAME_CHARS} characters and {MAX_NAME_PARTS} path parts, "
            f"got {len(name)} and {len(name.split(os.sep))}"
        )
    try:
        path = os.path.realpath(os.path.join(base, name))  # an absolute name replaces base
    except (ValueError, OSError) as e:  # a NUL byte, say
        raise ProfileError(f"output_dir {name!r} is not a usable path: {e}") from None
    if os.path.commonpath([base, path]) != base:
        raise ProfileError(
            f"output_dir {name!r} is outside --profile_dir ({base}): give a relative name inside it"
        )
    return path


def traces(root: str) -> list[str]:
    """The trace runs under ``root``: ``<dir>/plugins/profile/<timestamp>`` directories."""
    runs = []
    for path, dirs, _ in os.walk(root):
        if os.path.basename(path) == "profile" and os.path.basename(os.path.dirname(path)) == "plugins":
            runs += [os.path.join(path, d) for d in dirs]
            dirs.clear()
    return runs


def used_bytes(root: str) -> int:
    total = 0
    for path, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(path, f)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def check_quota(root: str, max_traces: int, max_bytes: int) -> None:
    """ProfileError when ``root`` already holds ``max_traces`` traces or ``max_bytes``."""
    count, size = len(traces(root)), used_bytes(root)
    if count >= max_traces or size >= max_bytes:
        raise ProfileError(
            f"the profile directory {root} holds {count} traces ({size / 2**20:.0f} MB); the quota is "
            f"{max_traces} traces and {max_bytes / 2**20:.0f} MB (--profile_max_traces, --profile_max_mb): "
            "delete old traces first"
        )


class Profiler:
    def __init__(self) -> None:
        self.output_dir: str | None = None  # the running trace's directory; None: none runs
        self.steps_left: int | None = None
        self._started = 0.0

    @property
    def running(self) -> bool:
        return self.output_dir is not None

    def start(self, output_dir: str, num_steps: int | None = None) -> None:
        import jax

        if self.running:
            raise ProfileError(f"a profile is already running (into {self.output_dir}); stop it first")
        if num_steps is not None and num_steps < 1:
            raise ProfileError(f"num_steps={num_steps}: must be >= 1")
        os.makedirs(output_dir, exist_ok=True)
        jax.profiler.start_trace(output_dir, create_perfetto_trace=True)
        self.output_dir, self.steps_left, self._started = output_dir, num_steps, time.perf_counter()
        log.info("profile started into %s%s", output_dir, f" for {num_steps} steps" if num_steps else "")

    def stop(self) -> dict:
        """Stop the trace; returns where it went and the files it wrote."""
        import jax

        if not self.running:
            raise ProfileError("no profile is running (POST /start_profile first)")
        out, seconds = self.output_dir, time.perf_counter() - self._started
        self.output_dir = self.steps_left = None
        jax.profiler.stop_trace()
        runs = sorted(glob.glob(os.path.join(out, "plugins", "profile", "*")))  # timestamped names
        files = sorted(glob.glob(os.path.join(runs[-1], "*"))) if runs else []
        log.info("profile of %.1fs written to %s", seconds, out)
        return {"output_dir": out, "seconds": seconds, "files": files}

    def stepped(self) -> dict | None:
        """After each engine step: stops a ``num_steps`` profile once they are done."""
        if self.steps_left is None:
            return None
        self.steps_left -= 1
        return self.stop() if self.steps_left <= 0 else None
