"""The small pieces of constrained decoding: SamplingParams.constraint, config and CLI flags, the
per-step mask (suppression folding), raw logprobs under a mask."""

from __future__ import annotations

import argparse

import pytest
import torch

from radixlm.cli import add_engine_args, engine_kwargs
from radixlm.config import EngineConfig
from radixlm.runtime.grammar.bitmask import allocate_bitmask, is_token_allowed
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.sampler import Sampler
from radixlm.runtime.sampling_batch import SamplingBatchInfo
from radixlm.runtime.sampling_params import SamplingParams


def test_sampling_params_constraint_from_mapping_or_object():
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    p = SamplingParams(constraint={"json_schema": schema, "best_effort": True})
    assert isinstance(p.constraint, Constraint) and p.constraint.kind == "json_schema"
    assert p.constraint.best_effort
    q = SamplingParams(constraint=Constraint.from_params(json_schema=schema, best_effort=True))
    assert p == q and hash(p) == hash(q)
    assert SamplingParams().constraint is None
    assert SamplingParams(constraint={"regex": "a+"}).constraint.spec == "a+"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ({"regex": "a", "ebnf": 'root ::= "a"'}, "at most one constraint"),
        ({"regex": ""}, "regex must be a non-empty string"),
        ({"json_schema": "{nope"}, "not valid JSON"),
        ({"choices": []}, "choices must be a non-empty list"),
        ({"grammar": "x"}, "unexpected keyword"),
        ("a+", "constraint must be a Constraint"),
    ],
)
def test_sampling_params_constraint_errors_name_the_field(value, message):
    with pytest.raises(ValueError, match=message) as exc:
        SamplingParams(constraint=value)
    assert str(exc.value).startswith("constraint")


def test_engine_config_and_cli_flags():
    cfg = EngineConfig()
    assert cfg.grammar_backend == "auto" and cfg.enable_jump_forward
    assert cfg.grammar_timeout_s == 30.0
    with pytest.raises(ValueError, match="grammar_timeout_s"):
        EngineConfig(grammar_timeout_s=0)
    assert cfg.grammar_max_rollbacks == 32
    with pytest.raises(ValueError, match="grammar_max_rollbacks"):
        EngineConfig(grammar_max_rollbacks=-1)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    kw = engine_kwargs(parser.parse_args([]))
    assert kw["grammar_backend"] == "auto" and kw["enable_jump_forward"] is True
    args = ["--grammar-backend", "outlines", "--disable-jump-forward", "--grammar-timeout-s", "5"]
    kw = engine_kwargs(parser.parse_args(args))
    assert kw["grammar_backend"] == "outlines" and kw["enable_jump_forward"] is False
    assert kw["grammar_timeout_s"] == 5.0
    kw = engine_kwargs(parser.parse_args(["--grammar-max-rollbacks", "4"]))
    assert kw["grammar_max_rollbacks"] == 4
    assert (
        engine_kwargs(parser.parse_args(["--enable-jump-forward", "false"]))["enable_jump_forward"]
        is False
    )
    assert "--disable-jump-forward" in parser.format_help()


class _OnlyTokens:
    """A matcher stand-in whose row allows exactly ``allowed``."""

    def __init__(self, allowed: list[int]) -> None:
        self.allowed = allowed

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        from radixlm.runtime.grammar.bitmask import fill_bitmask_tokens

        fill_bitmask_tokens(bitmask, row, self.allowed)

    def fill_bitmask_loose(self, bitmask: torch.Tensor, row: int) -> bool:
        self.fill_bitmask(bitmask, row)
        return False


def test_mask_folds_suppression_but_never_empties_a_row():
    from radixlm.runtime.constrained import GrammarStep

    class _Mgr:
        def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
            return allocate_bitmask(rows, 64)

    step = GrammarStep(_Mgr(), torch.device("cpu"))  # type: ignore[arg-type]
    matchers = [_OnlyTokens([2, 7]), None, _OnlyTokens([2])]
    logits = torch.zeros(3, 64)
    left = step.mask(matchers, logits, [[2], [2], [2]])  # type: ignore[arg-type]
    assert left == [[], [2], []]  # constrained rows: in the mask; the other: for the sampler
    assert torch.isfinite(logits[0]).tolist() == [t == 7 for t in range(64)]  # EOS 2 held back
    assert bool(torch.isfinite(logits[1]).all())  # unconstrained row untouched
    assert torch.isfinite(logits[2]).tolist() == [t == 2 for t in range(64)]  # only EOS: kept
    mask = step._bitmask
    assert is_token_allowed(mask, 2, 2) and not is_token_allowed(mask, 0, 2)


class _SlowTokens(_OnlyTokens):
    """Fills its row slowly, recording the thread it filled on."""

    threads: list[str] = []

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import threading
        import time

        time.sleep(0.01)
        self.threads.append(threading.current_thread().name)
        super().fill_bitmask(bitmask, row)


def test_prefetched_rows_are_filled_on_the_worker_and_masked_the_same():
    """``prefetch`` fills the rows on the worker thread (overlapped time); ``mask`` with the
    same matchers only applies them; with other matchers it fills again on the caller."""
    from radixlm.runtime.constrained import GrammarStep

    class _Mgr:
        def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
            return allocate_bitmask(rows, 64)

    step = GrammarStep(_Mgr(), torch.device("cpu"))  # type: ignore[arg-type]
    matchers = [_SlowTokens([3, 9]), None]
    step.prefetch(matchers)  # type: ignore[arg-type]
    logits = torch.zeros(2, 64)
    step.mask(matchers, logits, [[], []])  # type: ignore[arg-type]
    assert torch.isfinite(logits[0]).tolist() == [t in (3, 9) for t in range(64)]
    assert bool(torch.isfinite(logits[1]).all())
    assert _SlowTokens.threads == ["radixlm-grammar-mask_0"]
    assert step.overlapped_seconds >= 0.01
    other = [_SlowTokens([4]), None]
    step.prefetch(matchers)  # type: ignore[arg-type]
    logits = torch.zeros(2, 64)
    step.mask(other, logits, [[], []])  # type: ignore[arg-type]
    assert torch.isfinite(logits[0]).tolist() == [t == 4 for t in range(64)]
    assert _SlowTokens.threads[-1] == "MainThread"
    step.close()


class _FailsOnWorker(_OnlyTokens):
    """Its fill raises on the worker thread (a backend error there), works on the caller's."""

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        import threading

        if threading.current_thread().name.startswith("radixlm-grammar-mask"):
            raise RuntimeError("fill failed")
        super().fill_bitmask(bitmask, row)


def test_a_fill_that_fails_on_the_worker_is_done_again_by_mask():
    """The worker's error is not the step's: ``fused_mask`` hands nothing over and ``mask``
    fills on the caller's thread; the worker keeps serving the next prefetch; ``close`` ends
    it."""
    from radixlm.runtime.constrained import GrammarStep

    class _Mgr:
        def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
            return allocate_bitmask(rows, 64)

    step = GrammarStep(_Mgr(), torch.device("cpu"))  # type: ignore[arg-type]
    bad = [_FailsOnWorker([6]), None]
    step.prefetch(bad)  # type: ignore[arg-type]
    masks = step.fused_mask()
    assert masks is not None and masks(2) is None
    logits = torch.zeros(2, 64)
    step.mask(bad, logits, [[], []])  # type: ignore[arg-type]
    assert torch.isfinite(logits[0]).tolist() == [t == 6 for t in range(64)]
    good = [_OnlyTokens([8]), None]
    step.prefetch(good)  # type: ignore[arg-type]
    logits = torch.zeros(2, 64)
    step.mask(good, logits, [[], []])  # type: ignore[arg-type]
    assert torch.isfinite(logits[0]).tolist() == [t == 8 for t in range(64)]
    worker = step._worker
    assert worker is not None
    step.close()
    assert not worker._thread.is_alive() and step._worker is None


def test_masks_the_lm_head_took_are_not_applied_again():
    """``fused_mask``: the forward's LM head gets the prefetched bitmask for the constrained
    rows (after the fill), and the next ``mask`` of the same matchers only adds what changed
    (a suppression); a row count that is not the prefetch's, or other matchers, take the usual
    fill and apply; off the CPU, or with no prefetch, there is nothing to hand over."""
    from radixlm.runtime.constrained import GrammarStep
    from radixlm.runtime.grammar.bitmask import apply_token_bitmask

    class _Mgr:
        def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
            return allocate_bitmask(rows, 64)

    step = GrammarStep(_Mgr(), torch.device("cpu"))  # type: ignore[arg-type]
    assert step.fused_mask() is None  # no prefetch in flight
    matchers = [_SlowTokens([2, 3, 9]), None, _SlowTokens([5])]
    step.prefetch(matchers)  # type: ignore[arg-type]
    masks = step.fused_mask()
    assert masks is not None
    bitmask, rows = masks(3)  # type: ignore[misc]
    assert rows == [0, 2] and _SlowTokens.threads[-1] == "radixlm-grammar-mask_0"
    logits = torch.zeros(3, 64)
    apply_token_bitmask(logits, bitmask, rows)  # what the LM head writes
    calls: list[list[int]] = []
    import radixlm.runtime.constrained as constrained

    real = constrained.apply_token_bitmask

    def counted(lg, bm, rws):  # noqa: ANN001, ANN202
        calls.append(list(rws))
        real(lg, bm, rws)

    constrained.apply_token_bitmask = counted
    try:
        left = step.mask(matchers, logits, [[2], [], []])  # type: ignore[arg-type]
        assert calls == [[0]]  # only the row a suppression changed
        assert left == [[], [], []]
        assert torch.isfinite(logits[0]).tolist() == [t in (3, 9) for t in range(64)]
        assert bool(torch.isfinite(logits[1]).all())
        assert torch.isfinite(logits[2]).tolist() == [t == 5 for t in range(64)]
        # the wrong row count: nothing handed over, ``mask`` fills and applies as usual
        step.prefetch(matchers)  # type: ignore[arg-type]
        masks = step.fused_mask()
        assert masks is not None and masks(4) is None
        logits = torch.zeros(3, 64)
        step.mask(matchers, logits, [[], [], []])  # type: ignore[arg-type]
        assert calls[-1] == [0, 2]
        assert torch.isfinite(logits[0]).tolist() == [t in (2, 3, 9) for t in range(64)]
        # handed over for these matchers, then masked for others: filled and applied again
        step.prefetch(matchers)  # type: ignore[arg-type]
        masks = step.fused_mask()
        assert masks is not None and masks(3) is not None
        other = [_OnlyTokens([4]), None, None]
        logits = torch.zeros(3, 64)
        step.mask(other, logits, [[], [], []])  # type: ignore[arg-type]
        assert calls[-1] == [0]
        assert torch.isfinite(logits[0]).tolist() == [t == 4 for t in range(64)]
    finally:
        constrained.apply_token_bitmask = real
        step.close()
    gpu = GrammarStep(_Mgr(), torch.device("meta"))  # type: ignore[arg-type]
    gpu.prefetch(matchers)  # type: ignore[arg-type]
    assert gpu.fused_mask() is None  # only the CPU LM head takes masks
    gpu.close()


@pytest.mark.parametrize("impl", ["xgrammar", "torch"])
def test_mask_works_on_inference_tensors(monkeypatch, impl):
    """The runner returns logits made under inference_mode; both apply paths mask them."""
    from radixlm.runtime import constrained
    from radixlm.runtime.grammar.bitmask import apply_token_bitmask_torch

    if impl == "torch":  # the fallback when xgrammar is not installed
        monkeypatch.setattr(constrained, "apply_token_bitmask", apply_token_bitmask_torch)

    class _Mgr:
        def allocate_bitmask(self, rows: int, pin_memory: bool = False) -> torch.Tensor:
            return allocate_bitmask(rows, 64)

    step = constrained.GrammarStep(_Mgr(), torch.device("cpu"))  # type: ignore[arg-type]
    with torch.inference_mode():
        logits = torch.zeros(2, 64)
    step.mask([_OnlyTokens([5]), None], logits, [[], []])  # type: ignore[list-item]
    assert torch.isfinite(logits[0]).tolist() == [t == 5 for t in range(64)]
    assert bool(torch.isfinite(logits[1]).all())


def test_sampler_logprobs_come_from_the_raw_logits():
    raw = torch.tensor([[0.0, 1.0, 2.0, 3.0]])
    masked = raw.clone()
    masked[0, 3] = -torch.inf
    info = SamplingBatchInfo.build(
        [SamplingParams(temperature=0, logprobs=True, top_logprobs=2)], [None], [()], [()], 4
    )
    out = Sampler()(masked, info, raw_logits=raw)
    assert out.next_token_ids == [2]
    expected = torch.log_softmax(raw, dim=-1)[0]
    assert out.logprobs[0] == pytest.approx(float(expected[2]))
    assert out.top_logprobs[0][0][0] == 3  # the raw distribution's favourite, masked or not


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_verify_scans_the_likeliest_tokens_after_a_few_redraws(dtype: torch.dtype):
    """A string that must start with "z" (a lookaround: the verifier's), the model preferring
    19 other letters and then, below "z", 72 more refused characters: ``_MAX_REDRAWS``
    refused redraws, then one scan of the likeliest ``_FIRST_SCAN`` masks the refused among
    them and finds "z", which the next draw takes; the unlikely ones are never checked (still
    allowed in the row). float32 logits are masked through a NumPy view, others by torch."""
    from radixlm.runtime.constrained import _FIRST_SCAN, _MAX_REDRAWS, GrammarStep
    from radixlm.runtime.grammar.base import get_backend
    from radixlm.runtime.grammar.manager import GrammarManager
    from radixlm.runtime.grammar.vocab import TokenVocab

    eos = 256
    vocab = TokenVocab(
        tuple(bytes([b]) for b in range(256)) + (None,), (eos,), encode=lambda s: list(s.encode())
    )
    mgr = GrammarManager(None, 257, [eos], get_backend("xgrammar")(vocab))
    schema = {"type": "string", "pattern": "^(?![a-y])[a-z]+$"}
    m = mgr.submit(Constraint.from_params(json_schema=schema)).result(timeout=30).new_matcher()
    assert m.accept_token(ord('"'))
    step = GrammarStep(mgr, torch.device("cpu"))
    logits = torch.full((1, 257), float("-inf"), dtype=dtype)
    order = b"abcdefghijklmnopqrs" + b"z" + b"tuvwxy0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZ"
    order += b"!#$%&'()*+,-./:;<=>?@[]^_{|}~"
    for k, c in enumerate(order):
        logits[0, c] = 100.0 - k

    gone = set(torch.nonzero(torch.isneginf(logits[0])).flatten().tolist())

    def redraw(i: int, removed: list[int]) -> tuple[int, None]:
        # told exactly the tokens masked since the last redraw (``Sampler.redraw`` relies on it)
        now = set(torch.nonzero(torch.isneginf(logits[i])).flatten().tolist())
        assert set(removed) == now - gone and len(removed) == len(set(removed))
        gone.update(removed)
        return int(logits[i].argmax()), None

    tokens = [ord("a")]
    assert step.verify([m], logits, tokens, [None], redraw) == {}
    assert tokens == [ord("z")]
    stats = step.verifier_stats["pattern"]
    drawn = _MAX_REDRAWS + 1
    assert drawn + _FIRST_SCAN < order.index(b"z") + 62  # "z" is among the scanned
    assert (stats.masked, stats.resampled) == (drawn, drawn)
    # "z" and the least likely, below the ones drawn and the ones scanned, are left unmasked.
    assert int(torch.isfinite(logits[0]).sum()) == len(order) - drawn - _FIRST_SCAN + 1
