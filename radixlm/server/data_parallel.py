"""`radixlm serve --dp-size N`: N engine replicas behind an existing cache-aware router.

Each replica is an ordinary `radixlm serve` process (its own engine, KV pool and radix cache) on
a loopback port; the router is `smg` (Shepherd Model Gateway, SGLang's Rust router lineage) on
the public host and port, with the `cache_aware` policy by default: it keeps an approximate
radix tree of the text each worker has seen and sends a request to the worker with the longest
match, falling back to the shortest queue when the load is imbalanced (it polls each replica's
`/v1/loads`, see `router_api`).

Supervision: the replicas start first; the router starts once every replica answers `/health`.
If any child exits (a replica or the router), the others are stopped (SIGTERM, then SIGKILL)
and the launcher exits with status 1, naming the child. SIGTERM / SIGINT stop everything and
exit 0. Every child gets PR_SET_PDEATHSIG, so a killed launcher leaves no orphan.

The API key (if any) reaches the replicas through `RADIXLM_API_KEY`, not argv, and the router
uses it for its own probes of the workers (`--api-key`); the router forwards the client's
`Authorization` header, so the replicas still authenticate every client request.
"""

from __future__ import annotations

import ctypes
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from radixlm.server.server_config import ServerConfig

logger = logging.getLogger(__name__)

ROUTER_POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "least_load")
STARTUP_TIMEOUT_S = 600.0
STOP_TIMEOUT_S = 20.0
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class DataParallelConfig:
    """`dp_size` replicas on loopback ports (`replica_ports`, default: free ones) and the
    router with `policy` on the server's host and port."""

    dp_size: int
    policy: str = "cache_aware"
    replica_ports: tuple[int, ...] = ()
    router_args: tuple[str, ...] = ()  # extra `smg launch` flags, passed through verbatim

    def __post_init__(self) -> None:
        if self.dp_size < 1:
            raise ValueError(f"dp_size must be >= 1, got {self.dp_size}")
        if self.policy not in ROUTER_POLICIES:
            raise ValueError(f"router policy must be one of {ROUTER_POLICIES}, got {self.policy}")
        if self.replica_ports and len(self.replica_ports) != self.dp_size:
            raise ValueError(f"need {self.dp_size} replica ports, got {len(self.replica_ports)}")


@dataclass
class Child:
    name: str
    argv: list[str]
    process: subprocess.Popen[bytes] = field(repr=False)


class ChildExited(RuntimeError):
    def __init__(self, child: Child) -> None:
        super().__init__(f"{child.name} exited with status {child.process.returncode}")
        self.child = child


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def router_command() -> list[str]:
    """`smg` from the running interpreter's environment (its console script or `-m smg`)."""
    exe = shutil.which("smg", path=os.path.dirname(sys.executable))
    if exe:
        return [exe]
    try:
        import smg  # noqa: F401
    except ImportError:
        raise RuntimeError(
            "--dp-size needs the router: pip install 'smg==1.13.0' (or radixlm[router])"
        ) from None
    return [sys.executable, "-m", "smg"]


def engine_flags(engine_kwargs: dict[str, Any]) -> list[str]:
    """`engine_kwargs` (as `radixlm.cli.engine_kwargs` builds them) back into CLI flags."""
    argv: list[str] = []
    for name, value in engine_kwargs.items():
        if name == "chunked_prefill_size" and value is None:
            value = 0  # the CLI's spelling of "no chunking"
        if value is None:
            continue
        if isinstance(value, bool):
            value = "true" if value else "false"
        argv += ["--" + name.replace("_", "-"), str(value)]
    return argv


def replica_engine_kwargs(engine_kwargs: dict[str, Any], k: int) -> dict[str, Any]:
    """Replica `k`'s engine arguments: a second KV tier in files gets its own subdirectory
    (`<dir>/dp<k>`: each store bounds and indexes only its own files, and a restarted replica k
    finds its own pages)."""
    tier_dir = engine_kwargs.get("hicache_storage_dir")
    if tier_dir is None:
        return engine_kwargs
    return {**engine_kwargs, "hicache_storage_dir": os.path.join(tier_dir, f"dp{k}")}


def replica_argv(engine_kwargs: dict[str, Any], config: ServerConfig, port: int) -> list[str]:
    argv = [sys.executable, "-m", "radixlm.cli", "serve", "--host", "127.0.0.1"]
    argv += ["--port", str(port), "--max-n", str(config.max_n)]
    argv += ["--max-batch-prompts", str(config.max_batch_prompts)]
    argv += ["--log-level", config.log_level]
    if config.served_model_name:
        argv += ["--served-model-name", config.served_model_name]
    if config.dashboard_show_text:
        argv.append("--dashboard-show-text")
    return argv + engine_flags(engine_kwargs)


def router_argv(
    config: ServerConfig, dp: DataParallelConfig, worker_urls: Sequence[str]
) -> list[str]:
    log_level = {"warning": "warn", "critical": "error"}.get(config.log_level, config.log_level)
    argv = [*router_command(), "launch", "--host", config.host, "--port", str(config.port)]
    argv += ["--worker-urls", *worker_urls, "--policy", dp.policy]
    # The router's own metrics on a free port (its default, 29000, would clash between routers).
    argv += ["--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port())]
    # HTTP routing needs no tokenizer, and a router must not reach for a model hub.
    argv += ["--disable-tokenizer-autoload", "--log-level", log_level]
    if config.api_key:
        argv += ["--api-key", config.api_key]
    return argv + list(dp.router_args)


def _die_with_parent() -> None:
    """preexec_fn: SIGTERM this child when the launcher dies (Linux)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:  # noqa: S310 (loopback)
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


class DataParallelServer:
    """Starts, watches and stops the replicas and the router."""

    def __init__(
        self, engine_kwargs: dict[str, Any], config: ServerConfig, dp: DataParallelConfig
    ) -> None:
        self.engine_kwargs = engine_kwargs
        self.config = config
        self.dp = dp
        ports = dp.replica_ports or tuple(free_port() for _ in range(dp.dp_size))
        self.worker_urls = [f"http://127.0.0.1:{p}" for p in ports]
        self.children: list[Child] = []
        self._env = dict(os.environ)
        # Each replica's tensor-parallel group (if any) needs its own rendezvous port.
        self._env.pop("MASTER_PORT", None)
        if config.api_key:
            self._env["RADIXLM_API_KEY"] = config.api_key

    def _spawn(self, name: str, argv: list[str]) -> Child:
        logger.info("starting %s: %s", name, " ".join(a for a in argv if a != self.config.api_key))
        proc = subprocess.Popen(argv, env=self._env, preexec_fn=_die_with_parent)  # noqa: PLW1509
        child = Child(name, argv, proc)
        self.children.append(child)
        return child

    def check_children(self) -> None:
        """Raise ChildExited for the first child that is no longer running."""
        for child in self.children:
            if child.process.poll() is not None:
                raise ChildExited(child)

    def _wait_until(self, what: str, ready: Callable[[], bool], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not ready():
            self.check_children()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{what} not ready after {timeout:.0f} s")
            time.sleep(0.25)

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> None:
        for k, url in enumerate(self.worker_urls):
            port = int(url.rsplit(":", 1)[1])
            kwargs = replica_engine_kwargs(self.engine_kwargs, k)
            self._spawn(f"replica {k} ({url})", replica_argv(kwargs, self.config, port))
        self._wait_until("replicas", lambda: all(_healthy(u) for u in self.worker_urls), timeout)
        self._spawn("router", router_argv(self.config, self.dp, self.worker_urls))
        router_url = f"http://{_connect_host(self.config.host)}:{self.config.port}"
        self._wait_until("router", lambda: self._router_ready(router_url), timeout)
        logger.info(
            "serving %d replicas behind the %s router on http://%s:%d",
            self.dp.dp_size,
            self.dp.policy,
            self.config.host,
            self.config.port,
        )

    def _router_ready(self, url: str) -> bool:
        """Ready once the router lists every replica as a healthy worker."""
        import json

        req = urllib.request.Request(f"{url}/workers")
        if self.config.api_key:
            req.add_header("Authorization", f"Bearer {self.config.api_key}")
        try:
            with urllib.request.urlopen(req, timeout=2) as r:  # noqa: S310 (loopback)
                body = json.loads(r.read())
        except (urllib.error.URLError, OSError, ValueError):
            return False
        workers = body.get("workers", []) if isinstance(body, dict) else []
        healthy = {w.get("url") for w in workers if w.get("is_healthy", True)}
        return all(u in healthy for u in self.worker_urls)

    def wait(self) -> None:
        """Block until a child exits (raises ChildExited)."""
        while True:
            self.check_children()
            time.sleep(0.5)

    def stop(self) -> None:
        """SIGTERM the router first (no new requests), then the replicas; SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.process.poll() is None:
                child.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for child in reversed(self.children):
            try:
                child.process.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in %.0f s: killing it", child.name, STOP_TIMEOUT_S)
                child.process.kill()
                child.process.wait()


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def serve_data_parallel(
    engine_kwargs: dict[str, Any], config: ServerConfig, dp: DataParallelConfig
) -> int:
    """Run until a signal (exit 0) or until a child dies (exit 1)."""
    from radixlm.server.launch import configure_logging

    configure_logging(config.log_level)
    server = DataParallelServer(engine_kwargs, config, dp)

    def _on_signal(signum: int, _: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, _on_signal)
    status = 0
    try:
        server.start()
        server.wait()
    except KeyboardInterrupt:
        logger.info("stopping the replicas and the router")
    except ChildExited as exc:
        logger.error("%s: stopping the other processes", exc)
        status = 1
    except (TimeoutError, RuntimeError) as exc:
        logger.error("data-parallel start failed: %s", exc)
        status = 1
    finally:
        server.stop()
    return status
