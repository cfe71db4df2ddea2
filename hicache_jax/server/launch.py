"""Engine -> engine thread -> app -> uvicorn."""

from __future__ import annotations

import logging

from hicache_jax.server.config import ServerConfig

log = logging.getLogger(__name__)


def run_server(engine, server_cfg: ServerConfig) -> BaseException | None:
    """Serve until SIGINT/SIGTERM, or until the engine is lost (several processes that
    disagree, or one gone: ``failures.EngineLost``, which is returned). uvicorn runs the
    asyncio side in this thread; the engine gets a thread of its own (started and stopped by
    the app's lifespan)."""
    import uvicorn

    from hicache_jax.server.app import create_app
    from hicache_jax.server.engine_loop import EngineLoop
    from hicache_jax.server.state import ServerState

    loop = EngineLoop(engine, flush_wait_s=server_cfg.flush_cache_wait_s)
    state = ServerState.from_engine(engine, loop, server_cfg)
    app = create_app(state)
    if server_cfg.host not in ("127.0.0.1", "localhost", "::1") and not server_cfg.api_key:
        log.warning("listening on %s without --api_key: anyone who can reach it can use it", server_cfg.host)
    log.info("serving %r on http://%s:%d", state.served_model_name, server_cfg.host, server_cfg.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=server_cfg.host,
            port=server_cfg.port,
            log_level=server_cfg.log_level,
            timeout_graceful_shutdown=5,
        )
    )

    def stop() -> None:
        server.should_exit = True  # read by uvicorn's main loop (set from the engine thread)

    loop.on_fatal = stop
    server.run()
    return loop.fatal
