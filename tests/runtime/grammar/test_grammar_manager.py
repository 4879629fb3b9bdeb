"""GrammarManager: thread-pool compile, LRU cache, timeout, per-request error isolation."""

from __future__ import annotations

import threading
import time
from concurrent.futures import CancelledError
from typing import Any

import pytest
from grammar_helpers import EOS, VOCAB_SIZE, walk

from radixlm.runtime.grammar.base import CompiledGrammar, GrammarBackend
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError, GrammarTimeoutError
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.vocab import TokenVocab


class SlowBackend(GrammarBackend):
    """Delegates to a real backend after waiting on ``gate`` (or sleeping ``delay_s``)."""

    name = "slow"

    def __init__(self, inner: GrammarBackend, delay_s: float = 0.0) -> None:
        super().__init__(inner.vocab)
        self.inner = inner
        self.kinds = inner.kinds  # type: ignore[misc]
        self.schema_support = inner.schema_support  # type: ignore[misc]
        self.delay_s = delay_s
        self.gate = threading.Event()
        self.calls = 0
        self.threads: set[str] = set()

    def compile(self, constraint: Constraint) -> CompiledGrammar:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.delay_s:
            time.sleep(self.delay_s)
        else:
            self.gate.wait(timeout=10)
        return self.inner.compile(constraint)


def _c(**kwargs: Any) -> Constraint:
    c = Constraint.from_params(**kwargs)
    assert c is not None
    return c


@pytest.fixture
def slow(backends: dict[str, GrammarBackend]) -> SlowBackend:
    return SlowBackend(backends["xgrammar"])


def test_builds_its_vocab_and_backend_by_name(tokenizer: Any) -> None:
    with GrammarManager(tokenizer, VOCAB_SIZE, [EOS], backend="outlines") as mgr:
        assert mgr.backend_name == "outlines" and mgr.vocab_size == VOCAB_SIZE
        assert isinstance(mgr.vocab, TokenVocab)
        assert mgr.allocate_bitmask(4).shape == (4, VOCAB_SIZE // 32)
    with pytest.raises(ValueError, match="unknown grammar backend 'nope'"):
        GrammarManager(tokenizer, VOCAB_SIZE, [EOS], backend="nope")


def test_submit_runs_in_the_pool_and_caches(slow: SlowBackend) -> None:
    with GrammarManager(None, 0, (), slow) as mgr:
        c = _c(regex="[a-z]+")
        f1 = mgr.submit(c)
        f2 = mgr.submit(c)  # in flight: shares the same compile
        assert not f1.done() and not f2.done()  # submit never waits for compilation
        slow.gate.set()
        compiled = f1.result(timeout=10)
        assert f2.result(timeout=10) is compiled
        assert slow.calls == 1 and all(t.startswith("radixlm-grammar") for t in slow.threads)
        f3 = mgr.submit(c)
        assert f3.done() and f3.result() is compiled  # cached: completed immediately
        assert mgr.compile_sync(_c(regex="[a-z]+")) is compiled
        assert mgr.cache_info() == {"hits": 3, "misses": 1, "size": 1}
        assert slow.calls == 1


def test_lru_eviction(backends: dict[str, GrammarBackend]) -> None:
    with GrammarManager(None, 0, (), backends["xgrammar"], cache_size=2) as mgr:
        a, b, c = (_c(choices=[x]) for x in "abc")
        ga = mgr.compile_sync(a)
        mgr.compile_sync(b)
        assert mgr.compile_sync(a) is ga  # refresh a
        mgr.compile_sync(c)  # evicts b, the least recently used
        assert mgr.compile_sync(a) is ga
        assert mgr.cache_info()["size"] == 2
        misses = mgr.cache_info()["misses"]
        mgr.compile_sync(b)
        assert mgr.cache_info()["misses"] == misses + 1


def test_timeout_fails_that_request_and_a_late_result_is_kept(
    backends: dict[str, GrammarBackend],
) -> None:
    slow = SlowBackend(backends["xgrammar"])  # compiles only once the gate opens
    with GrammarManager(None, 0, (), slow, timeout_s=0.1) as mgr:
        c = _c(regex="[0-9]+")
        with pytest.raises(GrammarTimeoutError, match="longer than 0.1 s"):
            mgr.submit(c).result(timeout=5)  # fails while the worker is still blocked
        slow.gate.set()  # the worker finishes anyway; its result replaces the timeout
        deadline = time.monotonic() + 10
        while True:
            try:
                assert isinstance(mgr.submit(c).result(timeout=5), CompiledGrammar)
                break
            except GrammarTimeoutError:
                assert time.monotonic() < deadline, "the late result never replaced the timeout"
                time.sleep(0.05)
        assert slow.calls == 1


def test_errors_stay_with_their_request(backends: dict[str, GrammarBackend]) -> None:
    with GrammarManager(None, 0, (), backends["outlines"], max_workers=2) as mgr:
        bad = mgr.submit(_c(regex="a(b"))
        names = {"type": "object", "patternProperties": {"^a": {"type": "integer"}}}
        unsupported = mgr.submit(_c(json_schema=names))
        good = mgr.submit(_c(regex="[a-z]{2}"))
        assert isinstance(good.result(timeout=10), CompiledGrammar)
        with pytest.raises(GrammarError, match="invalid regex"):
            bad.result(timeout=10)
        with pytest.raises(GrammarError, match="patternProperties"):
            unsupported.result(timeout=10)
        with pytest.raises(GrammarError, match="invalid regex"):
            mgr.compile_sync(_c(regex="a(b"))  # cached failure: same error, no new compile
        with pytest.raises(GrammarError, match="ebnf"):
            mgr.validate(_c(ebnf='root ::= "a"'))


def test_cancelling_one_view_leaves_the_others(slow: SlowBackend) -> None:
    with GrammarManager(None, 0, (), slow) as mgr:
        c = _c(choices=["x", "y"])
        f1, f2 = mgr.submit(c), mgr.submit(c)
        assert f1.cancel()
        slow.gate.set()
        assert isinstance(f2.result(timeout=10), CompiledGrammar)
        with pytest.raises(CancelledError):
            f1.result()


def test_shutdown_fails_pending_futures(slow: SlowBackend) -> None:
    mgr = GrammarManager(None, 0, (), slow, max_workers=1)
    first = mgr.submit(_c(regex="a"))
    queued = mgr.submit(_c(regex="b"))
    deadline = time.monotonic() + 30
    while slow.calls < 1:  # the worker has taken `first` (queued work is cancelled)
        assert time.monotonic() < deadline, "the worker never started the first compile"
        time.sleep(0.01)
    mgr.shutdown()
    slow.gate.set()
    with pytest.raises(GrammarError, match="shut down"):
        queued.result(timeout=10)
    first.result(timeout=10)  # the running compile completes


def test_new_matcher_rebuilds_from_tokens(
    tokenizer: Any, backends: dict[str, GrammarBackend]
) -> None:
    with GrammarManager(None, 0, (), backends["xgrammar"]) as mgr:
        compiled = mgr.compile_sync(_c(json_schema={"type": "array", "items": {"type": "integer"}}))
        ids = tokenizer.encode("[1,2,3]")
        m = mgr.new_matcher(compiled, ids)
        assert m.num_accepted == len(ids) and m.is_completed()


class CountingBackend(SlowBackend):
    """Counts ``validate`` calls; compiles without waiting."""

    def __init__(self, inner: GrammarBackend) -> None:
        super().__init__(inner, delay_s=0.001)
        self.validations = 0

    def validate(self, constraint: Constraint) -> None:
        self.validations += 1
        self.inner.validate(constraint)


def test_a_passed_validation_is_remembered_a_failed_one_is_not(
    backends: dict[str, GrammarBackend],
) -> None:
    counting = CountingBackend(backends["llguidance"])
    with GrammarManager(None, 0, (), counting, cache_size=2) as mgr:
        schema = _c(json_schema={"type": "object", "properties": {"a": {"type": "integer"}}})
        for _ in range(3):
            mgr.validate(schema)
        assert counting.validations == 1
        bad = _c(regex="a(b")
        for _ in range(2):
            with pytest.raises(GrammarError, match="regex"):
                mgr.validate(bad)
        assert counting.validations == 3  # a refusal is checked again (and refused again)
        for x in "xy":  # two others push the schema out of the 2-entry memory
            mgr.validate(_c(choices=[x]))
        mgr.validate(schema)
        assert counting.validations == 6


def test_llguidance_builds_the_matcher_once_for_validate_then_compile(
    backends: dict[str, GrammarBackend], tokenizer: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = backends["llguidance"]
    built: list[Constraint] = []
    real = type(backend)._build

    def counted(self: Any, c: Constraint) -> Any:
        built.append(c)
        return real(self, c)

    monkeypatch.setattr(type(backend), "_build", counted)
    c = _c(json_schema={"type": "array", "items": {"enum": ["p", "q"]}, "maxItems": 2})
    backend.validate(c)
    compiled = backend.compile(c)
    assert built == [c]
    walk(compiled.new_matcher(), tokenizer.encode('["p","q"]', add_special_tokens=False))
    assert backend.compile(c) is not compiled and built == [c, c]  # taken: built afresh
