"""`@function` programs: `run`, `run_batch` (threads, progress bar, prefix precaching), `bind`.

`run` returns the program's `ProgramState` once the program has finished (or at once with
`stream=True`, the program then runs on a thread). Whatever goes wrong (the program raises, a
backend call fails, the server is unreachable) is on `state.error()`: `run` and `run_batch`
return states, they do not raise for a program's failure.

`run_batch` first traces the program with placeholder arguments to find its constant prefix
(the text every call starts with) and sends that once, so that all the programs of the batch
find it in the radix cache instead of racing to compute it.
"""

from __future__ import annotations

import inspect
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.ir import DEFAULT_PARAMS, GenParams
from radixlm.lang.state import ProgramState
from radixlm.lang.tracer import extract_prefix

if TYPE_CHECKING:
    from radixlm.lang.backend.base import BaseBackend

logger = logging.getLogger(__name__)

MIN_PRECACHE_CHARS = 64  # shorter constant prefixes are not worth an extra request
_default_backend: BaseBackend | None = None


def set_default_backend(backend: BaseBackend | None) -> None:
    global _default_backend
    _default_backend = backend


def get_default_backend() -> BaseBackend | None:
    return _default_backend


def _backend(backend: BaseBackend | None) -> BaseBackend:
    backend = backend or _default_backend
    if backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...)")
    return backend


class Program:
    """A frontend program: a function whose first parameter is the state `s`."""

    def __init__(self, func: Callable[..., Any], bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"@function {func.__name__}: the first parameter must be the state s")
        self.func = func
        self.arg_names = params[1:]
        self.bind_arguments = dict(bind_arguments or {})
        self.__name__ = getattr(func, "__name__", "program")
        self.__doc__ = func.__doc__

    def bind(self, **kwargs: Any) -> Program:
        """A copy with some arguments fixed."""
        unknown = [k for k in kwargs if k not in self.arg_names]
        if unknown:
            raise TypeError(f"{self.__name__}.bind: unknown argument(s) {unknown}")
        return Program(self.func, {**self.bind_arguments, **kwargs})

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        stop: str | Sequence[str] | None = None,
        stop_token_ids: Sequence[int] | None = None,
        stop_regex: str | Sequence[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        backend: BaseBackend | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        defaults = GenParams(
            max_new_tokens=max_new_tokens, stop=stop or (), stop_token_ids=stop_token_ids or (),
            stop_regex=stop_regex or (), temperature=temperature, top_p=top_p, top_k=top_k,
            min_p=min_p, frequency_penalty=frequency_penalty, presence_penalty=presence_penalty,
            ignore_eos=ignore_eos, return_logprob=return_logprob,
            top_logprobs_num=top_logprobs_num,
        ).merged(DEFAULT_PARAMS)  # fmt: skip
        return run_program(self, _backend(backend), args, kwargs, defaults, stream)

    def run_batch(
        self,
        batch_kwargs: Sequence[dict[str, Any]],
        *,
        backend: BaseBackend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, `num_threads` at a time; states in order."""
        if not isinstance(batch_kwargs, (list, tuple)):
            raise TypeError("run_batch: batch_kwargs must be a list of dicts")
        if not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch: each item of batch_kwargs must be a dict")
        if not batch_kwargs:
            return []
        backend = _backend(backend)
        if len(batch_kwargs) > 1:
            precache_prefix(self, backend)
        if num_threads == "auto":
            num_threads = max(96, (os.cpu_count() or 1) * 16)
        if not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be 'auto' or an int >= 1, got {num_threads!r}")
        bar = _progress_bar(len(batch_kwargs)) if progress_bar else None
        lock = threading.Lock()

        def one(kwargs: dict[str, Any]) -> ProgramState:
            try:
                return self.run(backend=backend, **sampling, **kwargs)
            finally:
                if bar is not None:
                    with lock:
                        bar.update(1)

        try:
            with ThreadPoolExecutor(min(num_threads, len(batch_kwargs))) as pool:
                return list(pool.map(one, batch_kwargs))
        finally:
            if bar is not None:
                bar.close()

    def trace_prefix(self, backend: BaseBackend | None = None, **kwargs: Any) -> str:
        """The constant text every run of this program starts with."""
        return extract_prefix(self, _backend(backend), kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)


def run_program(
    program: Program,
    backend: BaseBackend,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    defaults: GenParams,
    stream: bool,
) -> ProgramState:
    kwargs = {**program.bind_arguments, **kwargs}
    state = ProgramState(StreamExecutor(backend, kwargs, defaults, stream))
    if stream:
        thread = threading.Thread(
            target=_run, args=(state, program, args, kwargs), name="radixlm-program", daemon=True
        )
        state.stream_executor.program_thread = thread
        thread.start()
    else:
        _run(state, program, args, kwargs)
        state.sync()
    return state


def _run(state: ProgramState, program: Program, args: Sequence[Any], kwargs: dict) -> None:
    try:
        state.ret_value = program.func(state, *args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - reported on the state
        logger.debug("program %s raised", program.__name__, exc_info=True)
        state.stream_executor.set_error(exc)
    finally:
        state.stream_executor.end()


def precache_prefix(program: Program, backend: BaseBackend) -> str:
    """Send the program's constant prefix to the backend once; returns it ('' when none)."""
    try:
        prefix = program.trace_prefix(backend)
        if len(prefix) >= MIN_PRECACHE_CHARS:
            backend.cache_prefix(prefix)
            return prefix
    except Exception as exc:  # noqa: BLE001 - an optimization: the programs still run
        logger.warning("could not precache the prefix of %s: %r", program.__name__, exc)
    return ""


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="programs", unit="prog")


def function(func: Callable[..., Any] | None = None, **_: Any) -> Any:
    """`@function` (or `@function()`): make a frontend program of `func(s, ...)`."""
    if func is not None:
        return Program(func)
    return Program
