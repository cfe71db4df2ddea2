"""The server binary.

    python -m hicache_jax.serve --flagfile=configs/cpu.flags [--port=30000] [--api_key=KEY]
    hicache-jax-serve --flagfile=configs/tpu.flags --flagfile=configs/gemma3.flags

Parses flags (``hicache_jax/flags.py``), builds the engine (loading weights, compiling if
``--warmup``), then serves HTTP until interrupted. With ``--dist_num_processes`` > 1 every
process runs this binary with its ``--dist_process_id``; process 0 serves HTTP and the
others replay its engine calls (``hicache_jax/multihost/replicated.py``). A bad flag or an
unloadable model stops it here with one line naming the problem and a non-zero exit code.
"""

from __future__ import annotations

import logging
import os
import sys
import time

from absl import app, flags
from absl import logging as absl_logging
from absl.logging import converter

from hicache_jax import accelerators
from hicache_jax import flags as server_flags

FLAGS = flags.FLAGS
log = logging.getLogger("hicache_jax.serve")


def _die(message: str, code: int) -> None:
    print(f"hicache-jax-serve: error: {message}", file=sys.stderr)
    sys.exit(code)


def _lost(error: BaseException) -> None:
    """Exit at once after ``EngineLost``: exiting normally would wait, in JAX's exit
    hooks, for processes that are gone or stopping too."""
    print(f"hicache-jax-serve: error: {type(error).__name__}: {error}", file=sys.stderr, flush=True)
    logging.shutdown()
    os._exit(3)


def python_log_level(fv: flags.FlagValues, log_level: str) -> int:
    """absl's ``-v``/``--verbosity`` when the command line gives it (``-v=1``: debug), as
    absl users expect; else ``--log_level``."""
    if "verbosity" in fv and fv["verbosity"].present:
        return converter.absl_to_standard(fv["verbosity"].value)
    return getattr(logging, log_level.upper())


def main(argv: list[str]) -> None:
    if len(argv) > 1:
        _die(f"unexpected arguments {argv[1:]} (flags are --name=value)", 2)
    try:
        engine_cfg, server_cfg = server_flags.configs_from_flags(FLAGS)
    except server_flags.FlagError as e:
        _die(str(e), 2)
    level = python_log_level(FLAGS, server_cfg.log_level)
    absl_logging.set_verbosity(converter.standard_to_absl(level))
    logging.getLogger().setLevel(level)
    if server_cfg.platform != "auto":
        os.environ["JAX_PLATFORMS"] = server_cfg.platform  # before JAX starts a backend
    else:
        accelerators.cpu_unless_attached()  # no libtpu probe on a machine without a TPU
    check_plan = None  # one process: no other to agree with
    if engine_cfg.dist_num_processes > 1:
        from hicache_jax.multihost import distributed

        check_plan = distributed.check_plan  # every process must launch the same steps
        distributed.initialize(engine_cfg)  # before JAX starts a backend
        try:
            distributed.check_same_config(engine_cfg)
        except ValueError as e:  # config.ConfigError: the flags differ between processes
            # Every process sees the difference and stops; a normal exit would wait in
            # jax.distributed's shutdown barrier for peers that may already be gone (and
            # for the coordinator process 0 hosts), which under load outlived the test's
            # two minutes.
            print(f"hicache-jax-serve: error: {e}", file=sys.stderr, flush=True)
            logging.shutdown()
            sys.stdout.flush()
            os._exit(2)

    t0 = time.perf_counter()
    what = engine_cfg.model_path or f"preset {engine_cfg.preset!r}"
    log.info("loading %s (dtype %s)%s", what, engine_cfg.dtype, "; warm-up on" if engine_cfg.warmup else "")
    try:
        import jax

        from hicache_jax.engine.engine import Engine

        log.info("JAX %s on %s", jax.__version__, ", ".join(str(d) for d in jax.devices()))
        engine = Engine(engine_cfg, check_plan=check_plan)
    except (ValueError, OSError, RuntimeError) as e:  # config, checkpoint, storage and backend errors
        _die(f"cannot start the engine: {e}", 1)
    log.info("engine ready in %.1fs", time.perf_counter() - t0)

    from hicache_jax.engine.failures import EngineLost
    from hicache_jax.multihost.replicated import LeaderEngine, follow

    if engine_cfg.dist_process_id > 0:  # only process 0 serves HTTP; the others replay it
        log.info(
            "process %d of %d: following process 0", engine_cfg.dist_process_id, engine_cfg.dist_num_processes
        )
        try:
            follow(engine)
        except EngineLost as e:
            _lost(e)
        log.info("process 0 closed the engine; stopping")
        return
    if engine_cfg.dist_num_processes > 1:
        engine = LeaderEngine(engine)

    from hicache_jax.server.launch import run_server

    lost = run_server(engine, server_cfg)
    if lost is not None:
        _lost(lost)


def run() -> None:
    server_flags.define_flags(FLAGS)
    app.run(main)


if __name__ == "__main__":
    run()
