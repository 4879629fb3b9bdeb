"""Run the HTTP server: build the engine, the app, and a programmatic `uvicorn.Server`."""

from __future__ import annotations

import logging
from typing import Any

import uvicorn

from radixlm.server.serving import ServerConfig

logger = logging.getLogger(__name__)

# Open streams do not hold up a shutdown for longer than this.
GRACEFUL_SHUTDOWN_S = 5


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def serve(engine_kwargs: dict[str, Any], config: ServerConfig) -> None:
    """Load the engine, serve until SIGINT / SIGTERM, then shut the engine down."""
    from radixlm.runtime.engine import Engine
    from radixlm.server.app import create_app

    configure_logging(config.log_level)
    logger.info("loading engine: %s", engine_kwargs)
    engine = Engine(**engine_kwargs)
    failures: list[str] = []
    try:
        from radixlm.server.constraints import grammar_backend

        # Warm up: the grammar manager (backend import, vocabulary) is built on first use.
        logger.info("grammar backend: %s", grammar_backend(engine) or "not installed")
        app = create_app(engine, config)
        uv_config = uvicorn.Config(
            app,
            host=config.host,
            port=config.port,
            log_level=config.log_level.lower(),
            access_log=config.log_level.lower() == "debug",
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        )
        server = uvicorn.Server(uv_config)
        if getattr(engine.runner, "tp_size", 1) > 1:
            # A dead tensor-parallel rank breaks every later forward: stop serving, exit 1.
            def _stop(reason: str) -> None:
                failures.append(reason)
                server.should_exit = True

            engine.runner.on_failure = _stop
        logger.info(
            "serving %s (max_model_len %d) on http://%s:%d%s",
            engine.model_dir,
            engine.max_model_len,
            config.host,
            config.port,
            " (API key required)" if config.api_key else "",
        )
        server.run()
    finally:
        engine.shutdown()
    if failures:
        logger.error("stopped: %s", failures[0])
        raise SystemExit(1)
