"""Per-token bookkeeping after sampling: append, stop checks, detokenize, emit deltas.

Runs on the engine's step thread (called by `Scheduler.update`). Outputs are queued during a step
and handed to the requests' sinks by `drain()` at the end of the step, after the scheduler has
released finished pages. Sampling itself is the executor's (`radixlm.runtime.executor`).

Constrained requests (`req.grammar`): the executor masked the logits before sampling; here the
sampled token advances the matcher, and one sample may append several tokens (jump-forward);
they go through the same per-token stop
checks (stop strings, `max_new_tokens`), the first finish wins, and the step emits one delta per
request. Logprobs are the raw model's (before the grammar mask); forced tokens report 0.0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch

from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.detokenizer import IncrementalDetokenizer, stop_token_hit
from radixlm.runtime.request import Request, RequestOutput, RequestStatus, TokenLogprob
from radixlm.runtime.sampler import make_generator


class OutputProcessor:
    def __init__(
        self,
        tokenizer: Any | None,
        eos_token_ids: Sequence[int],
        vocab_size: int,
        max_model_len: int,
        device: torch.device,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.device = device
        self._pending: list[tuple[Request, RequestOutput]] = []
        # Per-request cursor: how many output tokens / logprobs were already emitted.
        self._emitted: dict[int, int] = {}
        self.grammar: GrammarStep | None = None  # set (once) when the first grammar is needed
        self.num_output_tokens = 0  # tokens appended to outputs: sampled and forced

    def set_grammar(self, step: GrammarStep) -> None:
        self.grammar = step

    # ---- request setup -------------------------------------------------------------------------

    def init_request(self, req: Request) -> None:
        """Attach the detokenizer and (for seeded requests) the generator."""
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params
            )
        if req.params.seed is not None:
            req.generator = make_generator((req.params.seed + req.index) % (1 << 64), self.device)

    def make_branch(self, parent: Request, index: int) -> Request:
        child = Request(
            request_id=parent.request_id,
            prompt_token_ids=parent.prompt_token_ids,
            params=parent.params,
            sink=parent.sink,
            namespace=parent.namespace,
            index=index,
            arrival_time=parent.arrival_time,
        )
        self.init_request(child)
        if parent.grammar is not None:
            # NOTE: branches fork before the parent's first sample: the states are equal.
            assert parent.grammar.num_accepted == 0, "forking a matcher that accepted tokens"
            child.grammar = parent.grammar.fork()
        child.grammar_future = parent.grammar_future
        return child

    # ---- per step ------------------------------------------------------------------------------

    def append(
        self, reqs: Sequence[Request], token_ids: Sequence[int], logprobs: Sequence[Any]
    ) -> list[Request]:
        """Append each request's sampled token (constrained ones: accept it in the grammar and
        jump forward), run the stop checks, detokenize, queue one delta per request; return the
        finished ones. `logprobs[i]` is a `TokenLogprob` or None."""
        finished = []
        now = time.monotonic()
        for req, tok, lp in zip(reqs, token_ids, logprobs):
            if req.grammar is None:
                done = self._append_sampled(req, tok, lp, now)
            else:
                done = self._append_constrained(req, tok, lp, now)
            if done:
                finished.append(req)
        return finished

    def _append_sampled(self, req: Request, tok: int, lp: TokenLogprob | None, now: float) -> bool:
        if lp is not None:
            req.output_logprobs.append(lp)
        done, delta = self._push(req, tok, now)
        self._queue(req, delta)
        return done

    def _append_constrained(
        self, req: Request, tok: int, lp: TokenLogprob | None, now: float
    ) -> bool:
        """Accept `tok` in the request's grammar, jump forward, and append the result token by
        token until the first finish."""
        assert self.grammar is not None
        growth = min(
            req.params.max_new_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens
        )
        adv = self.grammar.advance(req, tok, growth - 1)
        if adv is None:
            self.fail(req, f"internal error: the grammar rejected sampled token {tok}")
            return True
        text = []
        done = False
        for k, t in enumerate(adv.token_ids):
            if req.params.logprobs:
                sampled = lp if k == 0 and adv.sampled_kept else None
                req.output_logprobs.append(sampled or TokenLogprob(t, 0.0))
            last = k == len(adv.token_ids) - 1
            done, delta = self._push(req, t, now, grammar_stop=last and adv.must_stop)
            text.append(delta)
            if done:
                break
        self._queue(req, "".join(text))
        return done

    def _push(
        self, req: Request, tok: int, now: float, grammar_stop: bool = False
    ) -> tuple[bool, str]:
        """Append one token and run the stop checks; returns (finished, new text).
        `grammar_stop`: the grammar is complete after this token (finish "stop", before any
        length limit)."""
        req.token_ids.append(tok)
        req.output_counts[tok] += 1
        self.num_output_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = now
        n_out = req.num_output_tokens
        delta = ""
        reason = None
        stop_tok = stop_token_hit(tok, req.params, self.eos_token_ids, n_out)
        if stop_tok is not None:
            reason = "stop"
            req.stop_reason = tok if tok in req.params.stop_token_ids else None
        elif req.detokenizer is not None:
            delta = req.detokenizer.append(tok)
            if req.detokenizer.stopped:
                reason = "stop"
                req.stop_reason = req.detokenizer.stop_reason
        if reason is None and grammar_stop:
            reason = "stop"
        if reason is None and (
            n_out >= req.params.max_new_tokens or req.num_tokens >= self.max_model_len
        ):
            reason = "length"
        if reason is not None:
            req.finish_reason = reason
            req.status = RequestStatus.FINISHED
            req.finish_time = now
            if req.detokenizer is not None:
                delta += req.detokenizer.finish()
        return reason is not None, delta

    def finish(self, req: Request, reason: str) -> None:
        """End a request from outside sampling (abort)."""
        if req.status is RequestStatus.FINISHED:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.finish_time = time.monotonic()
        self._queue(req, "")
        # n > 1 branches not forked yet end with their parent (every branch finishes exactly once).
        for k in range(req.pending_forks):
            branch = self.make_branch(req, index=k + 1)
            branch.num_cached_tokens = req.num_cached_tokens
            branch.error = req.error
            branch.status = RequestStatus.FINISHED
            branch.finish_reason = reason
            branch.finish_time = req.finish_time
            self._queue(branch, "")
        req.pending_forks = 0

    def fail(self, req: Request, message: str) -> None:
        req.error = message
        self.finish(req, "error")

    def _queue(self, req: Request, text: str) -> None:
        key = id(req)
        start = self._emitted.get(key, 0)
        new_tokens = req.token_ids[req.num_prompt_tokens + start :]  # only the new ones
        new_lps = req.output_logprobs[start:] if req.params.logprobs else []
        finished = req.status is RequestStatus.FINISHED
        if finished:
            self._emitted.pop(key, None)
        else:
            self._emitted[key] = start + len(new_tokens)
        self._pending.append(
            (
                req,
                RequestOutput(
                    request_id=req.request_id,
                    index=req.index,
                    text=text,
                    token_ids=new_tokens,
                    logprobs=list(new_lps),
                    finished=finished,
                    finish_reason=req.finish_reason if finished else None,
                    stop_reason=req.stop_reason if finished else None,
                    error=req.error,
                    prompt_tokens=req.num_prompt_tokens,
                    cached_tokens=req.num_cached_tokens,
                    completion_tokens=req.num_output_tokens,
                    prompt_logprobs=req.prompt_logprobs if finished else None,
                ),
            )
        )

    def drain(self) -> list[RequestOutput]:
        """Hand this step's outputs to their sinks; return them."""
        pending, self._pending = self._pending, []
        for req, out in pending:
            if req.sink is not None:
                req.sink(out)
        return [out for _, out in pending]
