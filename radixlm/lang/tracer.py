"""Find a program's constant prefix by running it with placeholder arguments.

The program runs synchronously on a state whose backend refuses to generate: the text it has
built when it first touches an argument (any use of a placeholder raises), reads a variable,
generates, selects or forks is the text every real run starts with. Roles render with the real
backend's chat template, so a constant system prompt is part of the prefix.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from radixlm.lang.backend.base import BaseBackend
from radixlm.lang.interpreter import StreamExecutor
from radixlm.lang.ir import DEFAULT_PARAMS, Expr
from radixlm.lang.state import ProgramState

if TYPE_CHECKING:
    from radixlm.lang.chat_template import ChatTemplate


class Traceable(Protocol):
    """What the tracer needs of a program (`radixlm.lang.program.Program`)."""

    func: Callable[..., Any]
    arg_names: Sequence[str]
    bind_arguments: dict[str, Any]


class StopTracing(Exception):
    """The program reached something that depends on its arguments or on the model."""


class Placeholder(Expr):
    """Stands for an argument while tracing. It concatenates like an expression (`"Q: " + q +
    gen(...)` is built, and its execution stops at `q`); any other use ends the trace."""

    def __init__(self, name: str) -> None:
        object.__setattr__(self, "_name", name)

    def _stop(self, *args: Any, **kwargs: Any) -> Any:
        raise StopTracing(f"argument {object.__getattribute__(self, '_name')!r} used")

    __getattr__ = __str__ = __repr__ = __format__ = __bool__ = __len__ = __iter__ = _stop
    __mul__ = __rmul__ = __mod__ = __rmod__ = __getitem__ = _stop
    __eq__ = __ne__ = __lt__ = __gt__ = __le__ = __ge__ = __contains__ = __call__ = _stop
    __int__ = __float__ = __index__ = __hash__ = _stop


class TracingBackend(BaseBackend):
    """Renders roles like `backend`; everything that would reach the model stops the trace."""

    def __init__(self, backend: BaseBackend) -> None:
        self.backend = backend

    def get_chat_template(self) -> ChatTemplate:
        return self.backend.get_chat_template()

    def _stop(self, what: str) -> Any:
        raise StopTracing(what)

    def generate(self, prompt: str, params: Any) -> Any:
        return self._stop("gen")

    def generate_stream(self, prompt: str, params: Any) -> Iterator[Any]:
        return self._stop("gen")

    def cache_prefix(self, prompt: str | Sequence[int]) -> None:
        self._stop("fork")

    def tokenize(self, text: str) -> list[int]:
        return self._stop("tokenize")

    def score(self, prompts: Any, starts: Any) -> list[list[Any]]:
        return self._stop("select")

    def select(self, prefix: str, choices: Any, temperature: float, method: Any) -> Any:
        return self._stop("select")


class _TracingExecutor(StreamExecutor):
    def get_var(self, name: str | None) -> Any:
        raise StopTracing(f"variable {name!r} read")

    def fork(self, number: int) -> list[StreamExecutor]:
        raise StopTracing("fork")


def extract_prefix(
    program: Traceable, backend: BaseBackend, arguments: dict[str, Any] | None = None
) -> str:
    """The constant text at the start of every run (given `arguments`; the others are
    placeholders)."""
    kwargs = {name: Placeholder(name) for name in program.arg_names}
    kwargs.update(program.bind_arguments)
    kwargs.update(arguments or {})
    executor = _TracingExecutor(TracingBackend(backend), kwargs, DEFAULT_PARAMS, use_thread=False)
    state = ProgramState(executor)
    try:
        program.func(state, **kwargs)
    except Exception:  # noqa: BLE001 - StopTracing, or any failure: the prefix ends here
        pass
    # NOTE: an unfinished role's prefix text is kept: it is constant too.
    return executor.text_
