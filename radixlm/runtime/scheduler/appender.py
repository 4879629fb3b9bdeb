"""Appending sampled tokens to sequences: the scheduler's half of `update`.

A sampled token grows `req.token_ids`; a constrained request's matcher accepts it and may jump
forward (several tokens, possibly replacing the sampled one); each appended token goes through
the stop checks in order: stop token / EOS, stop string (the incremental detokenizer finds it),
the grammar's end, `max_new_tokens` / the context length. The first stop finishes the sequence.

A stop ends the sequence and frees its pages, so deciding it is sequence work, as in SGLang's
scheduler (`check_finished`); the output processor only formats and emits what this returns.
The detokenizer therefore belongs to the sequence: it is attached here and advanced only here.

A verified request (its matcher can `backtrack`) holds back the tokens of the outermost open
value the exact schema may refuse by its own keywords (`req.held`, from `matcher.num_settled()`):
they are not released to the client until that value is settled or the sequence finishes. On a
dead end `roll_back` takes back the last held token (the matcher bans it there), trims the
sequence and replays the detokenizer; the scheduler then frees the pages past the shorter
sequence, as after a rejected speculative draft. Released tokens are never rolled back.
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
            req.detokenizer = self._detokenizer(req)

    def _detokenizer(self, req: Request) -> IncrementalDetokenizer:
        return IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, req.params)

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
        pushed: list[tuple[str, TokenLogprob | None]] = []
        for t, t_lp in drafted:  # accepted draft tokens: the matcher accepted them on a fork
            if not req.grammar.accept_token(t):
                raise GrammarRejectedError(f"the grammar rejected accepted draft token {t}")
            t_lp = (t_lp or TokenLogprob(t, 0.0)) if req.params.logprobs else None
            # As after a sampled token: a grammar that allows only EOS now ends the sequence.
            grammar_stop = req.grammar.only_eos_allowed()
            pushed.append((self._push(req, t, now, grammar_stop=grammar_stop), t_lp))
            if req.is_finished:
                return self._release(req, pushed)
        self._append_constrained(req, tok, lp, now, pushed)
        return self._release(req, pushed)

    def _append_constrained(
        self,
        req: Request,
        tok: int,
        lp: TokenLogprob | None,
        now: float,
        pushed: list[tuple[str, TokenLogprob | None]],
    ) -> None:
        assert self.grammar is not None
        growth = min(
            req.params.max_new_tokens - req.num_output_tokens, self.max_model_len - req.num_tokens
        )
        adv = self.grammar.advance(req, tok, growth - 1)
        if adv is None:
            raise GrammarRejectedError(f"the grammar rejected sampled token {tok}")
        for k, t in enumerate(adv.token_ids):
            t_lp = None
            if req.params.logprobs:
                sampled = lp if k == 0 and adv.sampled_kept else None
                t_lp = sampled or TokenLogprob(t, 0.0)  # forced tokens: 0.0
            last = k == len(adv.token_ids) - 1
            pushed.append((self._push(req, t, now, grammar_stop=last and adv.must_stop), t_lp))
            if req.is_finished:
                break

    @staticmethod
    def _release(req: Request, pushed: list[tuple[str, TokenLogprob | None]]) -> SeqUpdate:
        """Hold back the pushed tokens after the matcher's settled ones (all are released once
        the sequence finished); the update carries the text and logprobs of the released."""
        assert req.grammar is not None
        req.held.extend(pushed)
        keep = 0 if req.is_finished else req.num_output_tokens - req.grammar.num_settled()
        n = max(0, len(req.held) - keep)
        released = req.held[:n]
        del req.held[:n]
        upd = SeqUpdate(req, "".join(text for text, _ in released))
        upd.logprobs = [t_lp for _, t_lp in released if t_lp is not None]
        return upd

    def roll_back(self, req: Request, keyword: str) -> bool:
        """Leave a dead end of a verified request (nothing could be sampled after its output):
        the matcher takes back the last held token and bans it at its position
        (`GrammarMatcher.backtrack`); the sequence drops it, the last token left is to be
        computed again (its logits are needed) and the detokenizer is replayed. False (nothing
        changed) when no held token is left or the rollback budget is spent. The caller frees
        the pages past the shorter sequence (`PageManager.trim`)."""
        assert req.grammar is not None and self.grammar is not None
        floor = req.num_final_tokens - req.num_prompt_tokens
        n = req.grammar.backtrack(floor, keyword, self.grammar.max_rollbacks)
        if n == 0:
            return False
        for t in req.token_ids[-n:]:
            req.output_counts[t] -= 1
            if not req.output_counts[t]:
                del req.output_counts[t]
        del req.token_ids[-n:]
        del req.held[-n:]
        req.num_computed_tokens = min(req.num_computed_tokens, req.num_tokens - 1)
        if req.detokenizer is not None:
            # Every delta depends only on the tokens before it: the held texts stand as they are.
            req.detokenizer = self._detokenizer(req)
            for t in req.output_token_ids:
                req.detokenizer.append(t)
        self.grammar.record_rollback(keyword)
        return True

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
