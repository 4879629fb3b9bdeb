"""``GrammarManager``: compile constraints off the step loop, cache them, make matchers.

Threading: ``submit`` never blocks on compilation. Compiles run in a small thread pool; each
has a deadline of ``timeout_s`` from the moment it is submitted: time queued behind other
compiles counts, so two slow constraints cannot stall every later constrained request for
longer than that. A compile that misses it fails its future with ``GrammarTimeoutError``; a
compile still queued then is skipped; a running one cannot be killed and keeps its thread, and
if it does finish, its result replaces the cached timeout so later requests get it.

Cache: an LRU of ``cache_size`` entries keyed by (backend, constraint), holding futures, so
concurrent submits of one constraint share one compile. Failures are cached too (they are
deterministic, and re-submitting a pathological grammar must not occupy another worker).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Any

import torch

from radixlm.runtime.grammar.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarMatcher,
    get_backend,
)
from radixlm.runtime.grammar.bitmask import allocate_bitmask
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError, GrammarTimeoutError
from radixlm.runtime.grammar.jump_forward import JumpForward, jump_forward
from radixlm.runtime.grammar.vocab import TokenVocab

_Key = tuple[str, Constraint]


def _resolve(fut: Future[Any], result: Any = None, exc: BaseException | None = None) -> bool:
    """Complete ``fut`` unless it already is; True if this call completed it."""
    try:
        if exc is not None:
            fut.set_exception(exc)
        else:
            fut.set_result(result)
    except InvalidStateError:
        return False
    return True


def _shut_down(fut: Future[Any]) -> None:
    _resolve(fut, exc=GrammarError("the grammar manager is shut down"))


def _copy_into(dst: Future[CompiledGrammar], src: Future[CompiledGrammar]) -> None:
    if dst.done():  # cancelled by its caller
        return
    exc = src.exception()
    _resolve(dst, None if exc is not None else src.result(), exc)


class GrammarManager:
    """Compiles, caches and instantiates grammars for one model vocabulary.

    ``backend``: a registered name (``"auto"``, ``"llguidance"``, ``"xgrammar"``, ``"outlines"``)
    or a ready backend instance.
    ``vocab_size``: the model's logits width (bitmasks cover it; ids the tokenizer lacks are
    never allowed). ``jump_forward_enabled=False`` makes ``jump_forward`` a no-op.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        eos_token_ids: Sequence[int],
        backend: str | GrammarBackend = "auto",
        *,
        max_workers: int = 2,
        cache_size: int = 256,
        timeout_s: float = 30.0,
        jump_forward_enabled: bool = True,
    ) -> None:
        if cache_size < 1 or max_workers < 1 or timeout_s <= 0:
            raise ValueError("cache_size and max_workers must be >= 1, timeout_s > 0")
        if isinstance(backend, GrammarBackend):
            self.backend = backend
            self.vocab = backend.vocab
        else:
            self.vocab = TokenVocab.from_tokenizer(tokenizer, vocab_size, eos_token_ids)
            self.backend = get_backend(backend)(self.vocab)
        self.cache_size = cache_size
        self.timeout_s = timeout_s
        self.jump_forward_enabled = jump_forward_enabled
        self._pool = ThreadPoolExecutor(max_workers, thread_name_prefix="radixlm-grammar")
        self._cache: OrderedDict[_Key, Future[CompiledGrammar]] = OrderedDict()
        self._validated: OrderedDict[Constraint, None] = OrderedDict()  # LRU of passes
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def backend_name(self) -> str:
        return self.backend.name

    @property
    def vocab_size(self) -> int:
        return self.vocab.vocab_size

    # ---- compile -------------------------------------------------------------------------------

    def validate(self, constraint: Constraint) -> None:
        """Checks before compiling: raises ``GrammarError`` naming the problem: an
        unsupported kind, an invalid schema, unsupported schema keywords (listed), bad regex /
        EBNF syntax where parsing is cheap. ``compile_sync`` catches everything. A pass is
        remembered (per constraint, as many as the compile cache holds): the checks are
        deterministic, and requests that share a schema would otherwise each repeat them."""
        with self._lock:
            if constraint in self._validated:
                self._validated.move_to_end(constraint)
                return
        self.backend.validate(constraint)
        with self._lock:
            self._validated[constraint] = None
            while len(self._validated) > self.cache_size:
                self._validated.popitem(last=False)

    def submit(self, constraint: Constraint) -> Future[CompiledGrammar]:
        """A future of the compiled grammar; never blocks. A cached constraint returns an
        already-completed future holding the cached object. The future fails with
        ``GrammarError`` (``GrammarTimeoutError`` on timeout). Cancelling it affects nobody else.
        """
        key = (self.backend_name, constraint)
        with self._lock:
            shared = self._cache.get(key)
            if shared is not None:
                self._cache.move_to_end(key)
                self.hits += 1
            else:
                self.misses += 1
                shared = Future()
                self._cache[key] = shared
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
                timer = threading.Timer(self.timeout_s, self._expire, (shared, constraint))
                timer.daemon = True
                timer.start()
                shared.add_done_callback(lambda _, t=timer: t.cancel())
                task = self._pool.submit(self._compile, key, shared)
                task.add_done_callback(lambda t, f=shared: t.cancelled() and _shut_down(f))
        view: Future[CompiledGrammar] = Future()
        shared.add_done_callback(lambda src: _copy_into(view, src))
        return view

    def compile_sync(self, constraint: Constraint) -> CompiledGrammar:
        """Compile (or fetch from the cache) and wait; raises ``GrammarError``. For the server,
        to answer a bad constraint with a 400 before queueing the request."""
        return self.submit(constraint).result()

    def _compile(self, key: _Key, shared: Future[CompiledGrammar]) -> None:
        constraint = key[1]
        if shared.done():
            # Timed out while queued: skip the compile; a later submit compiles it afresh.
            with self._lock:
                if self._cache.get(key) is shared:
                    del self._cache[key]
            return
        try:
            result = self.backend.compile(constraint)
        except GrammarError as exc:
            _resolve(shared, exc=exc)
        except Exception as exc:  # a backend bug must fail one request, not the engine
            _resolve(shared, exc=GrammarError(f"{constraint.kind} compilation failed: {exc!r}"))
        else:
            if not _resolve(shared, result):
                self._store_late(key, shared, result)

    def _expire(self, shared: Future[CompiledGrammar], constraint: Constraint) -> None:
        _resolve(
            shared,
            exc=GrammarTimeoutError(
                f"{constraint.kind} compilation took longer than {self.timeout_s:g} s "
                "(queue + compile, --grammar-timeout-s); simplify the constraint or retry"
            ),
        )

    def _store_late(self, key: _Key, shared: Future[CompiledGrammar], result: Any) -> None:
        """A compile that finished after its timeout: cache its result for later requests."""
        done: Future[CompiledGrammar] = Future()
        done.set_result(result)
        with self._lock:
            if self._cache.get(key) is shared:
                self._cache[key] = done

    def cache_info(self) -> dict[str, int]:
        with self._lock:
            return {"hits": self.hits, "misses": self.misses, "size": len(self._cache)}

    # ---- per sequence --------------------------------------------------------------------------

    def new_matcher(self, compiled: CompiledGrammar, tokens: Sequence[int] = ()) -> GrammarMatcher:
        """A matcher at the start of ``compiled``, advanced through ``tokens`` (to rebuild a
        sequence's state from its generated tokens). Raises ``GrammarError`` on a rejection."""
        return compiled.new_matcher(tokens)

    def allocate_bitmask(self, batch_size: int, *, pin_memory: bool = False) -> torch.Tensor:
        """CPU int32 ``[batch_size, ceil(vocab_size / 32)]``, all allowed."""
        return allocate_bitmask(batch_size, self.vocab_size, pin_memory=pin_memory)

    def jump_forward(
        self,
        matcher: GrammarMatcher,
        recent_tokens: Sequence[int] = (),
        *,
        max_tokens: int | None = None,
    ) -> JumpForward:
        """``jump_forward.jump_forward`` with this manager's vocabulary (a no-op when disabled,
        except that ``must_stop`` is still reported)."""
        if not self.jump_forward_enabled:
            return JumpForward(must_stop=matcher.only_eos_allowed())
        return jump_forward(matcher, self.vocab, recent_tokens, max_tokens=max_tokens)

    def shutdown(self, wait: bool = False) -> None:
        """Stop compiling: queued compiles fail with ``GrammarError``; running ones finish."""
        self._pool.shutdown(wait=wait, cancel_futures=True)

    def __enter__(self) -> GrammarManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
