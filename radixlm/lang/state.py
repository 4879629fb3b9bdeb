"""`ProgramState` (the `s` of a program) and `ProgramStateGroup` (the branches of `s.fork(n)`)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from typing import Any

from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.ir import (
    Expr,
    ExprList,
    RoleBegin,
    RoleEnd,
    VarScopeBegin,
    VarScopeEnd,
    as_expr,
)
from radixlm.tool_calls import ParsedToolCall, parse_tool_calls

_POLL_S = 0.5  # async iterators re-check at least this often


class ProgramState:
    """The state of a running program: `s += ...`, `s["var"]`, `s.text()`, roles, `fork`."""

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor
        self.ret_value: Any = None

    # ---- building -----------------------------------------------------------------------------

    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Any = None) -> Any:
        if expr is not None:
            self.stream_executor.submit(ExprList([RoleBegin(role), as_expr(expr), RoleEnd(role)]))
            return None
        return self._role_scope(role)

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.stream_executor.submit(RoleBegin(role))
        yield
        self.stream_executor.submit(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        """`s.system("...")` adds a system message; `with s.system():` wraps what is added."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """`with s.var_scope("x"):` makes `s["x"]` the text added inside the block."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def fork(self, number: int = 1) -> ProgramStateGroup:
        """`number` branches that start from this state's text. The text so far is sent to the
        backend once first (for `number > 1`), so the branches find it in the radix cache."""
        if isinstance(number, bool) or not isinstance(number, int) or number < 1:
            raise ValueError(f"fork: number must be an int >= 1, got {number!r}")
        children = self.stream_executor.fork(number)
        return ProgramStateGroup([ProgramState(c) for c in children], self)

    @contextmanager
    def copy(self) -> Iterator[ProgramState]:
        """`with s.copy() as c:` a branch whose new variables are gathered back on exit."""
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- reading ------------------------------------------------------------------------------

    def text(self) -> str:
        self.stream_executor.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, str]]:
        self.stream_executor.sync()
        return list(self.stream_executor.messages_)

    def sync(self) -> None:
        self.stream_executor.sync()

    def error(self) -> BaseException | None:
        """The first error of this program (None when it ran cleanly); waits for it to end."""
        self.stream_executor.sync()
        return self.stream_executor.error_

    def get_var(self, name: str) -> Any:
        return self.stream_executor.get_var(name)

    def set_var(self, name: str, value: Any) -> None:
        self.stream_executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        return self.stream_executor.get_meta_info(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def tool_calls(self, name: str) -> list[ParsedToolCall]:
        """The tool calls in variable `name` (a `gen(name, tools=...)`), in order; `.name`,
        `.arguments` (the JSON text) and `.args` (parsed)."""
        return list(parse_tool_calls(self.get_var(name)).calls)

    def __contains__(self, name: str) -> bool:
        self.stream_executor.sync()
        return name in self.stream_executor.variables

    # ---- streaming ----------------------------------------------------------------------------

    def _next_chunk(self, var: str | None, seen: int, timeout: float | None) -> tuple[str, bool]:
        """(new text after `seen` chars of the state's text or of `var`, finished?)."""
        ex = self.stream_executor

        def current() -> str:
            value = ex.text_ if var is None else ex.variables.get(var, "")
            return value if isinstance(value, str) else str(value)

        def done() -> bool:
            if var is None:
                return ex.finished or ex.error_ is not None
            return ex.is_done(var)

        with ex.cond:
            ex.cond.wait_for(lambda: len(current()) > seen or done(), timeout)
            return current()[seen:], done()

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is generated: the whole state's (None) or one variable's. Without
        `stream=True` it yields the final value once."""
        if not self.stream_executor.stream:
            yield self.text() if var_name is None else str(self.get_var(var_name))
            return
        seen = 0
        while True:
            chunk, done = self._next_chunk(var_name, seen, None)
            seen += len(chunk)
            if chunk:
                yield chunk
            if done:
                self._check_defined(var_name)
                return

    async def text_async_iter(self, var_name: str | None = None) -> AsyncIterator[str]:
        """`async for chunk in s.text_async_iter("answer")`: `text_iter` for asyncio."""
        loop = asyncio.get_running_loop()
        if not self.stream_executor.stream:
            final = await loop.run_in_executor(None, lambda: list(self.text_iter(var_name)))
            for chunk in final:
                yield chunk
            return
        seen = 0
        while True:
            chunk, done = await loop.run_in_executor(
                None, self._next_chunk, var_name, seen, _POLL_S
            )
            seen += len(chunk)
            if chunk:
                yield chunk
            if done:
                self._check_defined(var_name)
                return

    def _check_defined(self, var: str | None) -> None:
        ex = self.stream_executor
        if var is not None and var not in ex.variables and ex.error_ is None:
            raise KeyError(ex._missing(var))

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"

    def __del__(self) -> None:
        ex = getattr(self, "stream_executor", None)
        if ex is not None:
            ex.end()


class ProgramStateGroup:
    """The branches of a fork: `group += lambda i: ...`, `group[i]`, `group.join()`."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState) -> None:
        self.states = states
        self.src_state = src_state

    def __len__(self) -> int:
        return len(self.states)

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # NOTE: `group[i] += x` assigns the (same) state back after `__iadd__`.
        if value is not self.states[i]:
            raise TypeError("a fork's branches cannot be replaced")

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Expr):
            for i, s in enumerate(self.states):
                s += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"got {len(other)} items for {len(self.states)} branches")
            for s, item in zip(self.states, other):
                s += item
        else:
            for s in self.states:
                s += other
        return self

    def join(self) -> None:
        """Wait for every branch; each variable a branch defined (and the parent did not have)
        becomes a list on the parent, one item per branch. A branch's error becomes the
        parent's."""
        parent = self.src_state.stream_executor
        before = set(parent.variables)
        gathered: dict[Any, list[Any]] = {}
        for s in self.states:
            ex = s.stream_executor
            ex.sync()
            if ex.error_ is not None:
                parent.set_error(ex.error_)
            for k, v in ex.variables.items():
                if k not in before:
                    gathered.setdefault(k, []).append(v)
            ex.end()
        with parent.cond:
            parent.variables.update(gathered)
            parent.cond.notify_all()
