"""The engine's loop thread: the one thread that touches the scheduler, cache and model.

Callers on any thread hand it commands through an inbox (`add`, `abort`, `wake`, `stop`); it
applies every queued command, runs one step when there is ready work, and emits the outputs of
the commands (aborts) and of the step. A request waiting only for its grammar compile does not
spin the loop: the compile's completion puts a `wake` in the inbox.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch

from radixlm.runtime.batch import StepResult
from radixlm.runtime.core_factory import EngineParts
from radixlm.runtime.cpu_threads import pin_forward_threads
from radixlm.runtime.request import Request

logger = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, parts: EngineParts) -> None:
        self.parts = parts
        self.scheduler = parts.scheduler
        self.processor = parts.processor
        self.inbox: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        # Held while commands are applied and a step runs: `Engine.snapshot` and friends take
        # it to read a consistent state between steps.
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        # The exception that killed the thread (None while it lives): `submit` refuses, the
        # engine is unhealthy, and the server's /health fails and the process exits non-zero.
        self.dead: BaseException | None = None
        self.thread = threading.Thread(target=self._main, name="radixlm-engine", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def put(self, kind: str, arg: Any = None) -> None:
        self.inbox.put((kind, arg))

    def stop(self) -> None:
        self.stopped.set()
        self.inbox.put(("stop", None))
        self.thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self.dead is None and not self.stopped.is_set() and self.thread.is_alive()

    def _main(self) -> None:
        if self.parts.device.type == "cpu":
            cpus = pin_forward_threads(self.parts.num_threads)
            logger.info("forward on %d threads, pinned to CPUs %s", self.parts.num_threads, cpus)
        else:
            torch.set_num_threads(self.parts.num_threads)
        try:
            self._run()
        except BaseException as exc:  # noqa: BLE001 - recorded; the server exits non-zero
            self.dead = exc
            logger.critical("the engine thread died", exc_info=exc)
            self._fail_everything(f"the engine died: {type(exc).__name__}: {exc}")

    def _run(self) -> None:
        while not self.stopped.is_set():
            block = not self.scheduler.has_ready_work()
            try:
                cmd = self.inbox.get(timeout=0.5) if block else self.inbox.get_nowait()
            except queue.Empty:
                cmd = None
            with self.lock:
                done: list[Request] = []
                while cmd is not None:
                    done += self._apply(cmd)
                    try:
                        cmd = self.inbox.get_nowait()
                    except queue.Empty:
                        cmd = None
                if done:
                    self.processor.emit(StepResult.finished(done))
                if self.scheduler.has_ready_work() and not self.stopped.is_set():
                    self._step()
        with self.lock:
            done = []
            for req in [*self.scheduler.running, *self.scheduler.waiting]:
                done += self.scheduler.abort(req.request_id)
            self.processor.emit(StepResult.finished(done))

    def _apply(self, cmd: tuple[str, Any]) -> list[Request]:
        """Apply one command; returns the requests it finished (aborts)."""
        kind, arg = cmd
        if kind == "add":
            self.scheduler.add_request(arg)
        elif kind == "abort":
            return self.scheduler.abort(arg)
        return []

    def _step(self) -> None:
        try:
            self.parts.core.step()
        except Exception as exc:  # noqa: BLE001 - one bad step must not kill the engine
            # NOTE: the core fails a failed batch's own requests and the scheduler a request
            # that fails its own admission or page growth; what reaches here belongs to no one
            # request: nothing to attribute it to.
            logger.exception("scheduling failed; failing every request")
            message = f"internal error: {type(exc).__name__}: {exc}"
            self.processor.emit(StepResult.finished(self.scheduler.fail_all(message)))

    def _fail_everything(self, message: str) -> None:
        """Best effort after the thread died: tell every queued and running request."""
        done: list[Request] = []
        try:
            while True:
                kind, arg = self.inbox.get_nowait()
                if kind == "add":
                    self.scheduler.add_request(arg)
        except queue.Empty:
            pass
        except Exception:  # noqa: BLE001
            logger.exception("could not take the queued requests")
        try:
            done = self.scheduler.fail_all(message)
            self.processor.emit(StepResult.finished(done))
        except Exception:  # noqa: BLE001
            logger.exception("could not fail the running requests")
