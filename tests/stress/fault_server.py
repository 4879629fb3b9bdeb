"""`radixlm serve` with fault-injection hooks, for tests/stress (never imported by radixlm).

Each hook fires for requests marked by their sampling `seed` (or a constraint), so one bad
request can be mixed into a batch of good ones:

- seed 7001: the sampler raises while building this request's sampling state;
- seed 7002: the grammar step raises while advancing this request's matcher;
- seed 7003: the detokenizer raises on this request's first token;
- seed 7004: the engine's step thread dies (a BaseException escapes the step loop);
- seed 7005: every sampling step this request is part of sleeps 50 ms (a request that stays in
  flight for seconds however fast the machine, for tests that act on it while it runs);
- prompt token ids FORWARD (three rare ids in a row) anywhere in a batch: the model forward
  raises (a batch-level fault caused by one request);
- prompt token ids SCHEDULE (three other rare ids): the prefix cache's lookup raises while the
  scheduler admits that request (a fault inside scheduling);
- a regex starting with `SLOW`: the grammar backend's compile sleeps 5 s (a compile timeout).

Usage: python tests/stress/fault_server.py serve <radixlm serve flags>
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

SAMPLE, GRAMMAR, DETOK, DIE, SLOW = 7001, 7002, 7003, 7004, 7005
FORWARD = [49100, 49101, 49102]
SCHEDULE = [49103, 49104, 49105]


class InjectedThreadDeath(BaseException):
    """Not an Exception: escapes the engine's per-step handler, like a fatal interpreter
    error would."""


def install() -> None:
    from radixlm.radix import RadixCache
    from radixlm.runtime import constrained, detokenizer, model_runner, sampling_batch, scheduler
    from radixlm.runtime.grammar import auto_backend

    build = sampling_batch.SamplingBatchInfo.build.__func__

    def faulty_build(cls, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(p.seed == SAMPLE for p in params):
            raise RuntimeError("injected sampling fault")
        if any(p.seed == SLOW for p in params):
            time.sleep(0.05)
        return build(cls, params, *args, **kwargs)

    sampling_batch.SamplingBatchInfo.build = classmethod(faulty_build)  # type: ignore[method-assign]

    advance = constrained.GrammarStep.advance

    def faulty_advance(self, req, token_id, max_growth):  # type: ignore[no-untyped-def]
        if req.params.seed == GRAMMAR:
            raise RuntimeError("injected grammar fault")
        return advance(self, req, token_id, max_growth)

    constrained.GrammarStep.advance = faulty_advance  # type: ignore[method-assign]

    detok_init = detokenizer.IncrementalDetokenizer.__init__
    detok_append = detokenizer.IncrementalDetokenizer.append

    def init(self, tokenizer, prompt_ids, params, *args, **kwargs):  # type: ignore[no-untyped-def]
        detok_init(self, tokenizer, prompt_ids, params, *args, **kwargs)
        self._injected_fault = params.seed == DETOK

    def append(self, token_id):  # type: ignore[no-untyped-def]
        if getattr(self, "_injected_fault", False):
            raise RuntimeError("injected detokenizer fault")
        return detok_append(self, token_id)

    detokenizer.IncrementalDetokenizer.__init__ = init  # type: ignore[method-assign]
    detokenizer.IncrementalDetokenizer.append = append  # type: ignore[method-assign]

    schedule = scheduler.Scheduler.schedule

    def faulty_schedule(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if any(r.params.seed == DIE for r in [*self.waiting, *self.running]):
            raise InjectedThreadDeath("injected engine-thread death")
        return schedule(self, *args, **kwargs)

    scheduler.Scheduler.schedule = faulty_schedule  # type: ignore[method-assign]

    forward = model_runner.ModelRunner.forward

    def faulty_forward(self, batch, *args, **kwargs):  # type: ignore[no-untyped-def]
        ids = batch.input_ids.tolist()
        if any(ids[i : i + 3] == FORWARD for i in range(len(ids) - 2)):
            raise RuntimeError("injected forward fault")
        return forward(self, batch, *args, **kwargs)

    model_runner.ModelRunner.forward = faulty_forward  # type: ignore[method-assign]

    match_prefix = RadixCache.match_prefix

    def faulty_match(self, tokens, *args, **kwargs):  # type: ignore[no-untyped-def]
        ids = list(tokens)
        if any(ids[i : i + 3] == SCHEDULE for i in range(len(ids) - 2)):
            raise RuntimeError("injected scheduling fault")
        return match_prefix(self, tokens, *args, **kwargs)

    RadixCache.match_prefix = faulty_match  # type: ignore[method-assign]

    compile_ = auto_backend.AutoBackend.compile  # the default backend

    def slow_compile(self, constraint):  # type: ignore[no-untyped-def]
        if constraint.kind == "regex" and constraint.spec.startswith("SLOW"):
            time.sleep(5.0)
        return compile_(self, constraint)

    auto_backend.AutoBackend.compile = slow_compile  # type: ignore[method-assign]


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    install()
    from radixlm.cli import main

    raise SystemExit(main(sys.argv[1:]))
