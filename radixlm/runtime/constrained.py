"""Grammar-constrained decoding, the per-step part: mask the logits, advance the matchers, jump
forward. Compilation and admission are elsewhere (``GrammarManager``, ``Scheduler``).

One step, for the rows of the batch whose request has a grammar (``req.grammar``):

1. ``mask``: each matcher fills its row of one persistent CPU bitmask; the ``min_new_tokens``
   suppressions of those rows are folded into the mask; one batched ``apply_token_bitmask``
   sets the forbidden logits to ``-inf`` on the logits' device. The executor calls
   ``prefetch`` with the rows' matchers before the forward: the rows are then filled on a
   worker thread while the model runs (the backends' fills run native code), and ``mask``
   only waits for them. On CPU, where each logits row is one of those rows, the executor also
   hands the forward ``fused_mask``: an LM head that can (radixlm's packed bf16 / fp32 or int8
   kernel) writes the filled masks into the logits as it makes them (no pass over 8 fp32 rows
   of 49k read back from memory afterwards), and ``mask`` then only adds the
   ``min_new_tokens`` suppressions.
2. The sampler samples (logprobs stay the raw model's: the caller keeps an unmasked copy).
3. ``verify`` (schemas with a verifier, ``grammar.verified``): a sampled token that the exact
   schema refuses is masked and its row resampled, until one stands or none is left (a dead
   end: the scheduler rolls the request back, ``TokenAppender.roll_back``, or fails it).
4. ``advance``: the matcher accepts the sampled token, then jump-forward appends the text the
   grammar forces, possibly replacing the sampled token (``num_rollback``); ``must_stop`` says
   the grammar allows nothing but EOS now, so the request finishes with "stop".

Invariants:

- While a prefetch is in flight only its worker reads those matchers and writes the bitmask:
  every other entry (``mask``, ``verify``, ``advance``, the forward's ``fused_mask``) first
  waits for it (``_settle``).
- ``mask`` skips the bitmask of rows that ``fused_mask`` put into the logits only when they
  are the same matchers (and loose masks are wanted where they were loose); otherwise it
  fills and applies as usual (masking again only removes more: an exact mask is a subset of
  the loose one).
- A constrained row is never left without an allowed token: a suppression that would empty it
  is dropped (EOS / stop ids are then allowed although fewer than ``min_new_tokens`` exist).
- ``advance`` returns the tokens to append; the matcher has accepted exactly them (after the
  request's earlier output). Jump-forward rolls back only the just-sampled token: its KV was
  never computed, so replacing it costs nothing; the scheduler computes all appended tokens in
  the next step's extend. (A dead end's rollback is the scheduler's: ``TokenAppender``.)
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

from radixlm.config import EngineConfig
from radixlm.runtime.batch import SampleError
from radixlm.runtime.grammar.base import GrammarMatcher
from radixlm.runtime.grammar.bitmask import apply_token_bitmask, set_bitmask_bits
from radixlm.runtime.grammar.manager import GrammarManager
from radixlm.runtime.grammar.verified import VerifiedMatcher
from radixlm.runtime.request import Request

logger = logging.getLogger(__name__)

# Redraws of one row before the likeliest allowed tokens are checked at once, _FIRST_SCAN of
# them, twice as many each time after (all of them, at worst: a dead end). A redraw from the
# kept distribution (``Sampler.redraw``, ~10-25 us on CPU) costs about one check (~10-25 us; a
# string prefix check more), so a row scans only once the model keeps drawing refused tokens
# (a lookaround pattern it wants to break), where the mass left to draw from is small.
_MAX_REDRAWS = 8
_FIRST_SCAN = 32
_NONE_PASSED: frozenset[int] = frozenset()  # ``verify``'s rows before their first scan
DEAD_END = "grammar_dead_end"  # error code: the exact schema refuses every continuation


@dataclass
class KeywordStats:
    """Per relaxed keyword: sampled tokens the verifier refused (each masked; a token banned
    after a rollback counts under the keyword of its dead end), redraws after them, rows left
    with no allowed token (dead ends), and the dead ends left by a rollback (the others end
    their request with ``DEAD_END``)."""

    masked: int = 0
    resampled: int = 0
    dead_ends: int = 0
    rollbacks: int = 0


# A fresh (token, logprob) for row i of the step's masked logits, or None when the row allows
# no token any more (a dead end); the list: the tokens of row i set to -inf since its last
# redraw (all of them after the first: ``Sampler.redraw`` then sums only their blocks).
Redraw = Callable[[int, list[int]], tuple[int, Any] | None]


@dataclass(frozen=True)
class Advance:
    """What to append after sampling ``token_id`` for a constrained request."""

    token_ids: tuple[int, ...]  # the sampled token (unless rolled back), then forced tokens
    sampled_kept: bool  # token_ids[0] is the sampled token (it was not rolled back)
    must_stop: bool  # the grammar now allows only EOS: finish with "stop"


class GrammarStep:
    """The grammar work of one decoding step; used by the executor (``mask``) and the
    scheduler's ``TokenAppender`` (``advance``), on the step thread."""

    def __init__(
        self,
        manager: GrammarManager,
        device: torch.device,
        max_rollbacks: int = EngineConfig.grammar_max_rollbacks,
    ) -> None:
        self.manager = manager
        self.device = device
        self._pin = device.type == "cuda"
        self._bitmask = manager.allocate_bitmask(8, pin_memory=self._pin)  # [rows, W] int32
        self._views: dict[int, torch.Tensor] = {}  # rows -> self._bitmask[:rows]
        # Tokens appended beyond one per sample (a re-tokenized sampled token counts as sampled).
        self.num_jump_forward_tokens = 0
        self.num_jump_forward_rollbacks = 0  # sampled tokens replaced by a re-tokenization
        # Time the grammar holds up the step thread (mask, checks, accept, jump-forward): the
        # grammar's share of the steps. Mask fills done during the forward are not in it.
        self.seconds = 0.0
        self.overlapped_seconds = 0.0  # mask fills run on the worker while the model ran
        self._worker: _FillWorker | None = None
        # the matchers of the fill in flight on the worker
        self._prefetched: list[GrammarMatcher | None] | None = None
        # Rows of the last ``mask`` filled loose (a superset: ``verify`` checks their samples).
        self._loose: list[bool] = []
        # Set by the forward's ``fused_mask``: the matchers whose masks are in the logits, and
        # which of them were loose; read (and cleared) by the next ``mask``.
        self._premasked: tuple[list[GrammarMatcher | None], list[bool]] | None = None
        self.verifier_stats: dict[str, KeywordStats] = {}
        self.verifier_seconds = 0.0  # time spent checking sampled tokens (included above)
        self.max_rollbacks = max_rollbacks  # per request (``GrammarMatcher.backtrack``)

    def _buffer(self, rows: int) -> torch.Tensor:
        """The bitmask's first ``rows`` rows ``[rows, W]`` (views kept: a fresh slice costs
        ~30 us on the step thread right after a forward)."""
        view = self._views.get(rows)
        if view is None:
            if self._bitmask.shape[0] < rows:
                size = max(rows, 2 * self._bitmask.shape[0])
                self._bitmask = self.manager.allocate_bitmask(size, pin_memory=self._pin)
                self._views.clear()
            view = self._views[rows] = self._bitmask[:rows]
        return view

    def prefetch(self, matchers: list[GrammarMatcher | None]) -> None:
        """Start filling the bitmask rows of ``matchers`` (as ``mask`` will be called with
        them) on the worker thread; the caller runs the forward meanwhile and must not change
        these matchers before ``mask``."""
        self._settle()
        self._premasked = None
        if not any(m is not None for m in matchers):
            return
        start = time.perf_counter()
        bitmask = self._buffer(len(matchers))
        if self._worker is None:
            self._worker = _FillWorker("radixlm-grammar-mask_0")
        self._prefetched = list(matchers)
        self._worker.start(self._prefetched, bitmask)
        self.seconds += time.perf_counter() - start

    def fused_mask(self) -> Callable[[int], tuple[torch.Tensor, list[int]] | None] | None:
        """For the forward that the in-flight ``prefetch`` overlaps, when row i of its logits
        is the sample of that prefetch's ``matchers[i]`` (the caller's promise; no row wants
        the raw logits): ``Model.forward``'s ``logits_mask``, which waits for the fill and
        hands the LM head the bitmask and the constrained rows. None off the CPU or with no
        prefetch in flight. The next ``mask`` of those matchers then skips their bitmask."""
        if self._prefetched is None or self.device.type != "cpu":
            return None
        matchers = self._prefetched

        def masks(num_rows: int) -> tuple[torch.Tensor, list[int]] | None:
            start = time.perf_counter()
            loose = self._settle()  # the fill, done on the worker during the forward
            self.seconds += time.perf_counter() - start
            if loose is None or num_rows != len(matchers):
                return None  # ``mask`` fills and applies as usual
            self._premasked = (matchers, loose)
            return self._buffer(len(matchers)), [i for i, m in enumerate(matchers) if m is not None]

        return masks

    def _settle(self) -> list[bool] | None:
        """Wait for an in-flight prefetch (its fill time counts as overlapped); its rows' loose
        flags when it filled without error, else None."""
        if self._prefetched is None:
            return None
        self._prefetched = None
        assert self._worker is not None
        done = self._worker.wait()
        if done is None:
            return None  # the fill failed: ``mask`` fills again on the step thread
        seconds, loose = done
        self.overlapped_seconds += seconds
        return loose

    def close(self) -> None:
        """Stop the worker thread (after any in-flight prefetch)."""
        self._settle()
        if self._worker is not None:
            self._worker.stop()
            self._worker = None

    def mask(
        self,
        matchers: list[GrammarMatcher | None],
        logits: torch.Tensor,
        suppress: list[list[int]],
        loose: bool = False,
    ) -> list[list[int]]:
        """In place: ``logits[i, t] = -inf`` for every token ``t`` that ``matchers[i]`` forbids
        (constrained rows only; ``logits`` is ``[len(matchers), V]``; a row's matcher is its
        request's, or a fork advanced through a speculative draft's prefix).
        ``suppress[i]`` (min_new_tokens) of constrained rows go into the mask; returns the
        suppress lists left for the sampler (empty for those rows). ``loose``: a row may get a
        superset (``GrammarMatcher.fill_bitmask_loose``) when its samples then go through
        ``verify``."""
        self._loose = []
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return suppress
        start = time.perf_counter()
        premasked, self._premasked = self._premasked, None
        applied = premasked is not None and _same(premasked[0], matchers)
        applied = applied and (loose or not any(premasked[1]))  # type: ignore[index]
        same = self._prefetched is not None and _same(self._prefetched, matchers)
        prefetched = self._settle()
        bitmask = self._buffer(len(matchers))
        if applied:
            self._loose = premasked[1]  # type: ignore[index]
        elif prefetched is not None and same and (loose or not any(prefetched)):
            self._loose = prefetched
        else:
            self._loose = _fill_rows(matchers, bitmask, loose=loose)
        out = list(suppress)
        changed = []  # rows whose bitmask the suppressions changed after ``fused_mask``
        for i in rows:
            if out[i]:
                self._suppress(bitmask, i, out[i])
                out[i] = []
                changed.append(i)
        if not applied or changed:
            with torch.inference_mode():  # the runner's logits are inference tensors
                apply_token_bitmask(logits, bitmask, changed if applied else rows)
        self.seconds += time.perf_counter() - start
        return out

    def verifies(self, matchers: list[GrammarMatcher | None]) -> bool:
        """Some row of ``matchers`` has a verifier, or a loose mask from the last ``mask``
        (``verify`` may resample it)."""
        return any(self._loose) or any(isinstance(m, VerifiedMatcher) for m in matchers)

    def verify(
        self,
        matchers: list[GrammarMatcher | None],
        logits: torch.Tensor,
        tokens: list[int],
        logprobs: list[Any],
        redraw: Redraw,
    ) -> dict[int, SampleError]:
        """Sample, check, mask, resample: for each row whose matcher has a verifier, while
        the exact schema refuses ``tokens[i]``, set ``logits[i, tokens[i]] = -inf`` and take
        ``redraw(i, removed)`` (a fresh (token, logprob) from the masked row, None when none is
        left; ``removed``: the tokens masked since the row's last redraw).
        ``tokens`` / ``logprobs`` are updated in place; returns the rows left with no token
        (their requests fail with code ``DEAD_END``). ``logits`` is the step's private masked
        copy."""
        self._settle()
        errors: dict[int, SampleError] = {}
        start = time.perf_counter()
        refuse = _refuser(logits)
        loose = self._loose if len(self._loose) == len(matchers) else []
        for i, m in enumerate(matchers):
            if m is None or not (isinstance(m, VerifiedMatcher) or (loose and loose[i])):
                continue
            redraws, scan = 0, _FIRST_SCAN
            passed = _NONE_PASSED  # tokens a scan found the verifier admits (a set once one ran)
            while tokens[i] not in passed and (keyword := m.check_token(tokens[i])) is not None:
                stats = self.verifier_stats.get(keyword)
                if stats is None:
                    stats = self.verifier_stats[keyword] = KeywordStats()
                stats.masked += 1
                removed = [tokens[i]]
                refuse(i, tokens[i])
                if redraws >= _MAX_REDRAWS:
                    if passed is _NONE_PASSED:
                        passed = set()
                    with torch.inference_mode():  # the runner's logits are inference tensors
                        removed += self._mask_refused(m, logits[i], scan, passed)
                    scan *= 2
                drawn = redraw(i, removed)
                if drawn is None:
                    stats.dead_ends += 1
                    errors[i] = SampleError(
                        f"the JSON schema's {keyword!r} refuses every continuation the grammar "
                        "allows here; the output so far is a prefix of no valid instance",
                        DEAD_END,
                        keyword,
                    )
                    break
                tokens[i], logprobs[i] = drawn
                stats.resampled += 1
                redraws += 1
        elapsed = time.perf_counter() - start
        self.verifier_seconds += elapsed
        self.seconds += elapsed
        return errors

    def record_rollback(self, keyword: str) -> None:
        """A dead end refused by ``keyword`` was left by a rollback (the scheduler's)."""
        self.verifier_stats.setdefault(keyword, KeywordStats()).rollbacks += 1

    def verifier_events(self) -> dict[str, dict[str, int]]:
        """``verifier_stats`` as plain counts per keyword (a snapshot)."""
        return {k: asdict(v) for k, v in list(self.verifier_stats.items())}

    @staticmethod
    def _mask_refused(
        matcher: GrammarMatcher, row: torch.Tensor, most: int, passed: set[int]
    ) -> list[int]:
        """``row[t] = -inf`` for each of the ``most`` likeliest still-allowed tokens that the
        verifier refuses (returned); those it admits join ``passed`` (not checked again). Not
        all of them: inside a string with a prefix check each is a scan (those whose first
        character the check refuses are known without one: ``quick_refusals``). The redraw
        that follows is still exact: masking refused tokens leaves the others' odds as they
        were."""
        allowed = int(torch.isfinite(row).sum())
        if allowed == 0:
            return []
        top = torch.topk(row, min(most, allowed)).indices.tolist()
        refused = []
        quick = matcher.quick_refusals(top)  # inside a checked string: by first character
        for t in top:
            if t in quick:
                refused.append(t)
            elif t not in passed:
                if matcher.check_token(t) is None:
                    passed.add(t)
                else:
                    refused.append(t)
        if refused:
            row[torch.tensor(refused, device=row.device)] = float("-inf")
        return refused

    @staticmethod
    def _suppress(bitmask: torch.Tensor, row: int, token_ids: list[int]) -> None:
        """Forbid ``token_ids`` in ``row`` unless nothing else is allowed there."""
        before = bitmask[row].clone()  # [W]
        set_bitmask_bits(bitmask, row, token_ids, allowed=False)
        if not bool(bitmask[row].any()):
            bitmask[row] = before

    def advance(self, req: Request, token_id: int, max_growth: int) -> Advance | None:
        """Accept the sampled ``token_id`` and jump forward; None when the grammar rejects it
        (cannot happen for a token sampled under this step's mask). ``max_growth``: how many
        tokens the request may still grow by after ``token_id``."""
        self._settle()
        matcher = req.grammar
        assert matcher is not None
        start = time.perf_counter()
        try:
            if not matcher.accept_token(token_id):
                return None
            jf = self.manager.jump_forward(matcher, [token_id], max_tokens=max(0, max_growth))
        finally:
            self.seconds += time.perf_counter() - start
        kept = jf.num_rollback == 0
        tokens = ((token_id,) if kept else ()) + jf.token_ids
        self.num_jump_forward_tokens += len(jf.token_ids) - jf.num_rollback
        self.num_jump_forward_rollbacks += jf.num_rollback
        return Advance(tokens, kept, jf.must_stop or matcher.is_terminated())


class _FillWorker:
    """One daemon thread that fills the bitmask rows of a ``prefetch`` (``_fill_rows``, loose)
    while the step thread runs the forward. One fill at a time, handed over through two locks:
    ``start`` releases ``_go``, the thread releases ``_done`` when the fill ends, ``wait``
    takes it. (An executor's ``submit`` cost ~40 us of the step thread here, this a lock
    release.) Invariant: between ``start`` and ``wait`` only the thread touches the job."""

    def __init__(self, name: str) -> None:
        self._go = threading.Lock()
        self._go.acquire()
        self._done = threading.Lock()
        self._done.acquire()
        self._job: tuple[list[GrammarMatcher | None], torch.Tensor] | None = None
        self._result: tuple[float, list[bool]] | None = None
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            self._go.acquire()
            job = self._job
            if job is None:  # ``stop``
                self._done.release()
                return
            self._result = None
            try:
                start = time.perf_counter()
                loose = _fill_rows(job[0], job[1], loose=True)
                self._result = (time.perf_counter() - start, loose)
            except Exception:  # noqa: BLE001 - ``wait`` says None: the step thread fills again
                logger.debug("grammar mask fill failed on the worker", exc_info=True)
            self._done.release()

    def start(self, matchers: list[GrammarMatcher | None], bitmask: torch.Tensor) -> None:
        self._job = (matchers, bitmask)
        self._go.release()

    def wait(self) -> tuple[float, list[bool]] | None:
        """The fill's (seconds, loose rows) once it ended, None when it failed."""
        self._done.acquire()
        self._job = None
        return self._result

    def stop(self) -> None:
        """End the thread (no fill in flight)."""
        self._job = None
        self._go.release()
        self._done.acquire()
        self._thread.join()


def _same(a: list[GrammarMatcher | None], b: list[GrammarMatcher | None]) -> bool:
    """The same matcher objects, row for row."""
    return len(a) == len(b) and all(x is y for x, y in zip(a, b))


def _refuser(logits: torch.Tensor) -> Callable[[int, int], None]:
    """A setter of ``logits[i, t] = -inf`` (``[B, V]``): through a NumPy view of CPU float32
    logits (~0.4 us against ~11 us for a torch item write, more right after a forward), made
    at the first refusal (most steps have none)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        views: list[Any] = []

        def refuse(i: int, t: int) -> None:
            if not views:
                with torch.inference_mode():  # the runner's logits are inference tensors
                    views.append(logits.numpy())  # [B, V], shares the memory
            views[0][i, t] = -math.inf

        return refuse

    def refuse_torch(i: int, t: int) -> None:
        with torch.inference_mode():
            logits[i, t] = float("-inf")

    return refuse_torch


def _fill_rows(
    matchers: list[GrammarMatcher | None], bitmask: torch.Tensor, loose: bool = False
) -> list[bool]:
    """Row i of ``bitmask`` from ``matchers[i]`` (constrained rows), with ``loose`` where the
    matcher gives one (``fill_bitmask_loose``); which rows are loose."""
    out = [False] * len(matchers)
    for i, m in enumerate(matchers):
        if m is None:
            continue
        if loose:
            out[i] = m.fill_bitmask_loose(bitmask, i)
        else:
            m.fill_bitmask(bitmask, i)
    return out
