"""Appending sampled tokens to sequences: the scheduler's half of `update`.

A sampled token grows `req.token_ids`; a constrained request's matcher accepts it and may jump
forward (several tokens, possibly replacing the sampled one); each appended token goes through
the stop checks in order: stop token / EOS, stop string (the incremental detokenizer finds it),
the grammar's end, `max_new_tokens` / the context length. The first stop finishes the sequence.

A stop ends the sequence and frees its pages, so deciding it is sequence work, as in SGLang's
scheduler (`check_finished`); the output processor only formats and emits what this returns.
The detokenizer therefore belongs to the sequence: it is attached here and advanced only here.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from radixlm.runtime.batch import SeqUpdate
from radixlm.runtime.constrained import GrammarStep
from radixlm.runtime.detokenizer import IncrementalDetokenizer, stop_token_hit
from radixlm.runtime.request import Request, RequestStatus, TokenLogprob


class GrammarRejectedError(RuntimeError):
    """A constrained request's matcher refused the token sampled under its own mask."""


class TokenAppender:
    def __init__(
        self, tokenizer: Any | None, eos_token_ids: Sequence[int], max_model_len: int
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_ids = tuple(eos_token_ids)
        self.max_model_len = max_model_len
        self.grammar: GrammarStep | None = None  # set (once) when the first grammar is needed
        self.num_output_tokens = 0  # tokens appended to outputs: sampled and forced

    def set_grammar(self, step: GrammarStep) -> None:
        self.grammar = step

    def init_request(self, req: Request) -> None:
        """Attach the incremental detokenizer (before the request is queued)."""
        if self.tokenizer is not None:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, req.prompt_token_ids, req.params
            )

    def append(
        self,
        req: Request,
        tok: int,
        lp: TokenLogprob | None,
        now: float,
        drafted: Iterable[tuple[int, TokenLogprob | None]] = (),
    ) -> SeqUpdate:
        """Append the sampled `tok` (and, constrained, what the grammar forces after it) until
        the first stop; `lp` is its logprob when the request asks for logprobs. `drafted`:
        accepted speculative draft tokens (with their logprobs) that precede `tok`; a stop
        among them cuts the run there."""
        if req.grammar is None:
            upd = SeqUpdate(req)
            text = []
            for t, t_lp in (*drafted, (tok, lp)):
                if t_lp is not None:
                    upd.logprobs.append(t_lp)
                text.append(self._push(req, t, now))
                if req.is_finished:
                    break
            upd.text = "".join(text)
            return upd
        return self._append_constrained(req, tok, lp, now)

    def _append_constrained(
        self, req: Request, tok: int, lp: TokenLogprob | None, now: float
    ) -> SeqUpdate:
        assert self.grammar is not None
        growth = min(
            req.params.max_new_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens
        )
        adv = self.grammar.advance(req, tok, growth - 1)
        if adv is None:
            raise GrammarRejectedError(f"the grammar rejected sampled token {tok}")
        upd = SeqUpdate(req)
        text = []
        for k, t in enumerate(adv.token_ids):
            if req.params.logprobs:
                sampled = lp if k == 0 and adv.sampled_kept else None
                upd.logprobs.append(sampled or TokenLogprob(t, 0.0))  # forced tokens: 0.0
            last = k == len(adv.token_ids) - 1
            text.append(self._push(req, t, now, grammar_stop=last and adv.must_stop))
            if req.is_finished:
                break
        upd.text = "".join(text)
        return upd

    def _push(self, req: Request, tok: int, now: float, grammar_stop: bool = False) -> str:
        """Append one token and run the stop checks; returns the new text. `grammar_stop`: the
        grammar is complete after this token (finish "stop", before any length limit)."""
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
            delta += finish_sequence(req, reason, now)
        return delta


def finish_sequence(
    req: Request,
    reason: str,
    now: float | None = None,
    error: str | None = None,
    code: str | None = None,
) -> str:
    """Mark `req` finished (once): reason, time, and for "error" the message and its code
    (`req.error_code` if already set, else "internal"); returns the detokenizer's tail text."""
    if req.status is RequestStatus.FINISHED:
        return ""
    req.status = RequestStatus.FINISHED
    req.finish_reason = reason
    req.finish_time = time.monotonic() if now is None else now
    if reason == "error":
        req.error = error
        req.error_code = code or req.error_code or "internal"
    if req.detokenizer is not None and reason in ("stop", "length"):
        return req.detokenizer.finish()
    return ""
