"""Run the HTTP server: build the engine, the app, and a programmatic `uvicorn.Server`.

Stopping: the first SIGTERM / SIGINT starts a graceful stop: new requests (and `/health`) get
503, running requests have `--shutdown-timeout` seconds to finish, the rest are failed with a
503 "the server is shutting down" (an error event on a stream), then the server exits 0. A
second SIGINT forces the exit. If the engine's step thread dies, `/health` fails at once, the
server stops and the process exits 1 with the cause logged.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType
from typing import Any

import uvicorn

from radixlm.server.client import EngineClient
from radixlm.server.server_config import ServerConfig

logger = logging.getLogger(__name__)

# After the drain, open connections get this long to deliver their last bytes.
GRACEFUL_SHUTDOWN_S = 5
WATCHDOG_INTERVAL_S = 0.25


class GracefulServer(uvicorn.Server):
    """`uvicorn.Server` with a drain phase on the first signal and an engine watchdog."""

    def __init__(self, config: uvicorn.Config, client: EngineClient, shutdown_timeout_s: float):
        super().__init__(config)
        self.client = client
        self.shutdown_timeout_s = shutdown_timeout_s
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        self._spawn(self._watchdog())
        await super().serve(sockets)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: the signal is not recorded for uvicorn to re-raise: a graceful stop exits 0.
        if self.client.draining or self._loop is None:
            if sig == signal.SIGINT:
                self.force_exit = True
            self.should_exit = True
            return
        self.client.draining = True
        logger.warning(
            "%s: stopping; running requests have %g s to finish",
            signal.Signals(sig).name,
            self.shutdown_timeout_s,
        )
        self._loop.call_soon_threadsafe(lambda: self._spawn(self._drain()))

    async def _drain(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout_s
        while self.client.active and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        failed = self.client.fail_all_active("the server is shutting down", "shutting_down")
        if failed:
            logger.warning("aborted %d unfinished requests at shutdown", failed)
            await asyncio.sleep(0.2)  # let their handlers write the error
        self.should_exit = True

    async def _watchdog(self) -> None:
        engine = self.client.engine
        while not self.should_exit:
            if not engine.healthy and not self.client.draining:
                logger.critical("stopping the server: %s", engine._dead_message())
                self.exit_code = 1
                self.client.fail_all_active(engine._dead_message(), "engine_unavailable")
                await asyncio.sleep(0.2)
                self.should_exit = True
                return
            await asyncio.sleep(WATCHDOG_INTERVAL_S)


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


def serve(engine_kwargs: dict[str, Any], config: ServerConfig) -> int:
    """Load the engine, serve until SIGINT / SIGTERM (0) or the engine dies (1), then shut the
    engine down; returns the exit code."""
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
        server = GracefulServer(uv_config, app.state.client, config.shutdown_timeout_s)
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
        if failures:
            logger.error("stopped: %s", failures[0])
            return 1
        if server.exit_code:
            logger.critical("exiting with status %d: %s", server.exit_code, engine._dead_message())
        return server.exit_code
    finally:
        engine.shutdown()
