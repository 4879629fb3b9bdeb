"""The stream executor: runs one program state's expressions, in order, on a worker thread.

The program's own code runs on the caller's thread and only submits expressions (`s += ...`),
so a program can fork branches that generate concurrently (the engine batches them). Reading a
variable (`s["x"]`) waits for the expression that defines it.

Errors never hang and never escape a thread: the first exception (a backend error, bad
parameters, an unreachable server) is stored on the state (`s.error()`); the expressions still
queued are skipped, and everyone waiting on a variable wakes up (and gets a `KeyError` that
names the error).
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from typing import TYPE_CHECKING, Any

from radixlm.lang.ir import (
    DEFAULT_PARAMS,
    CommitLazy,
    Constant,
    Expr,
    ExprList,
    Gen,
    GenParams,
    RoleBegin,
    RoleEnd,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
    defined_names,
)

if TYPE_CHECKING:
    from radixlm.lang.backend.base import BaseBackend
    from radixlm.lang.chat_template import ChatTemplate

logger = logging.getLogger(__name__)


class StreamExecutor:
    """Executes expressions against a backend; holds the text, messages and variables."""

    def __init__(
        self,
        backend: BaseBackend,
        arguments: dict[str, Any] | None = None,
        defaults: GenParams = DEFAULT_PARAMS,
        stream: bool = False,
        use_thread: bool = True,
    ) -> None:
        self.sid = uuid.uuid4().hex
        self.backend = backend
        self.arguments = dict(arguments or {})
        self.defaults = defaults
        self.stream = stream
        self.text_ = ""
        self.messages_: list[dict[str, str]] = []
        self.variables: dict[str | None, Any] = {}
        self.meta_info: dict[str | None, Any] = {}
        self.error_: BaseException | None = None
        self.fork_start_text_pos: int | None = None
        self.cur_role: str | None = None
        self._role_begin_pos = 0
        self._role_suffix = ""
        self._scope_start: dict[str, int] = {}
        self._pending: dict[str | None, int] = {}  # name -> number of queued definitions
        self._chat_template: ChatTemplate | None = None
        self.cond = threading.Condition()
        self.finished = False  # the worker has run everything and stopped
        self._ended = False
        # The thread running a streaming program (`run(stream=True)`), None otherwise.
        self.program_thread: threading.Thread | None = None
        self.use_thread = use_thread
        if use_thread:
            self._queue: queue.Queue[Expr | None] = queue.Queue()
            self._worker = threading.Thread(
                target=self._worker_loop, name=f"radixlm-lang-{self.sid[:8]}", daemon=True
            )
            self._worker.start()

    # ---- called by the program's thread -------------------------------------------------------

    def submit(self, value: Any) -> None:
        expr = as_expr(value)
        if self._ended:
            raise RuntimeError("the program has ended; nothing more can be added to its state")
        with self.cond:
            for name in defined_names(expr):
                self._pending[name] = self._pending.get(name, 0) + 1
        if self.use_thread:
            self._queue.put(expr)
        else:
            self._run(expr)

    def sync(self) -> None:
        if self.use_thread:
            self._queue.join()

    def end(self) -> None:
        """No more expressions: the worker stops once the queue is drained."""
        if self._ended:
            return
        with self.cond:
            self._ended = True
            self.cond.notify_all()
        if self.use_thread:
            self._queue.put(None)
        else:
            self._mark_finished()

    def set_error(self, exc: BaseException) -> None:
        with self.cond:
            if self.error_ is None:
                self.error_ = exc
            self.cond.notify_all()

    def get_var(self, name: str | None) -> Any:
        """The value of `name`, once final. A reader on another thread than a streaming
        program's also waits for the program to define it (or end)."""
        me = threading.current_thread()

        def ready() -> bool:
            if self.error_ is not None:
                return True
            if self._pending.get(name):
                return False
            elsewhere = self.program_thread not in (None, me) and not self._ended
            return name in self.variables or not elsewhere

        with self.cond:
            self.cond.wait_for(ready)
            if name in self.variables and not self._pending.get(name):
                return self.variables[name]
        raise KeyError(self._missing(name))

    def get_meta_info(self, name: str | None) -> Any:
        self.get_var(name)
        return self.meta_info.get(name)

    def set_var(self, name: str, value: Any) -> None:
        with self.cond:
            self.variables[name] = value
            self.cond.notify_all()

    def is_done(self, name: str | None) -> bool:
        """True when `name` is defined and final, or can no longer be (error, program ended)."""
        if self.error_ is not None or self.finished:
            return True
        return name in self.variables and not self._pending.get(name)

    def _missing(self, name: str | None) -> str:
        if self.error_ is not None:
            return f"variable {name!r} is not set: the program failed: {self.error_!r}"
        known = sorted(
            {str(k) for k in self.variables} | {str(k) for k, n in self._pending.items() if n}
        )
        return f"variable {name!r} is not defined (defined: {known})"

    @property
    def chat_template(self) -> ChatTemplate:
        if self._chat_template is None:
            self._chat_template = self.backend.get_chat_template()
        return self._chat_template

    def fork(self, number: int) -> list[StreamExecutor]:
        if number > 1:
            self.submit(CommitLazy())
        self.sync()
        children = []
        for _ in range(number):
            child = StreamExecutor(self.backend, self.arguments, self.defaults, self.stream)
            child.variables = dict(self.variables)
            child.meta_info = dict(self.meta_info)
            child.text_ = self.text_
            child.messages_ = list(self.messages_)
            child.cur_role = self.cur_role
            child._role_begin_pos, child._role_suffix = self._role_begin_pos, self._role_suffix
            child._chat_template = self._chat_template
            child.fork_start_text_pos = len(self.text_)
            child.error_ = self.error_
            children.append(child)
        return children

    # ---- the worker ---------------------------------------------------------------------------

    def _worker_loop(self) -> None:
        while True:
            expr = self._queue.get()
            try:
                if expr is None:
                    self._mark_finished()
                    return
                self._run(expr)
            finally:
                self._queue.task_done()

    def _mark_finished(self) -> None:
        with self.cond:
            self.finished = True
            self.cond.notify_all()

    def _run(self, expr: Expr) -> None:
        try:
            if self.error_ is None:
                self._execute(expr)
        except Exception as exc:  # noqa: BLE001 - stored on the state, never lost in a thread
            if not self.use_thread:
                raise
            logger.debug("program expression failed", exc_info=True)
            self.set_error(exc)
        finally:
            with self.cond:
                for name in defined_names(expr):
                    self._pending[name] -= 1
                self.cond.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Constant):
            self._fill(str(expr.value))
        elif isinstance(expr, ExprList):
            for e in expr.exprs:
                self._execute(e)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            self._select(expr)
        elif isinstance(expr, RoleBegin):
            self._role_begin(expr.role)
        elif isinstance(expr, RoleEnd):
            self._role_end(expr.role)
        elif isinstance(expr, VarScopeBegin):
            self._scope_start[expr.name] = len(self.text_)
        elif isinstance(expr, VarScopeEnd):
            if expr.name not in self._scope_start:
                raise KeyError(f"var_scope {expr.name!r} ended before it began")
            self._define(expr.name, self.text_[self._scope_start.pop(expr.name) :], None)
        elif isinstance(expr, CommitLazy):
            if self.text_:
                self.backend.cache_prefix(self.text_)
        else:
            raise TypeError(f"cannot execute {type(expr).__name__}")

    def _fill(self, text: str) -> None:
        with self.cond:
            self.text_ += text
            self.cond.notify_all()

    def _define(self, name: str | None, value: Any, meta: Any, text: str = "") -> None:
        with self.cond:
            self.text_ += text
            self.variables[name] = value
            self.meta_info[name] = meta
            self.cond.notify_all()

    def _gen(self, expr: Gen) -> None:
        params = expr.params.merged(self.defaults)
        if not self.stream:
            comp, meta = self.backend.generate(self.text_, params)
            text = comp[0] if isinstance(comp, list) else comp
            self._define(expr.name, comp, meta, text)
            return
        self._define(expr.name, "", None)
        try:
            for delta, meta in self.backend.generate_stream(self.text_, params):
                with self.cond:
                    self.text_ += delta
                    self.variables[expr.name] += delta
                    self.meta_info[expr.name] = meta
                    self.cond.notify_all()
        except Exception:
            with self.cond:
                del self.variables[expr.name]  # a failed gen defines nothing
            raise

    def _select(self, expr: Select) -> None:
        decision = self.backend.select(
            self.text_, expr.choices, expr.temperature, expr.choices_method
        )
        self._define(expr.name, decision.decision, decision.meta_info, decision.decision)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"role {role!r} begins inside role {self.cur_role!r}: no nesting")
        prefix, self._role_suffix = self.chat_template.prefix_and_suffix(role, self.messages_)
        self._fill(prefix)
        self.cur_role = role
        self._role_begin_pos = len(self.text_)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the current role is {self.cur_role!r}")
        content = self.text_[self._role_begin_pos :].lstrip()
        self._fill(self._role_suffix)
        with self.cond:
            self.messages_.append({"role": role, "content": content})
        self.cur_role = None
