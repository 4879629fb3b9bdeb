"""The output processor: `emit(StepResult) -> list[RequestOutput]`, the last line of a step.

It turns what the scheduler did to each request (`SeqUpdate`: tokens appended, their text and
logprobs; prompt logprobs) into one `RequestOutput` delta per request and hands each to its
request's sink. It owns the output state of a request: `output_logprobs`, `prompt_logprobs`,
`prompt_top_logprobs` (written only here), and its emission cursor (kept here, by request).
It decides nothing about the sequence: stops, finishes and pages are the scheduler's.
"""

from __future__ import annotations

from radixlm.runtime.batch import PromptLogprobs, StepResult
from radixlm.runtime.request import Request, RequestOutput


class OutputProcessor:
    def __init__(self) -> None:
        # Per unfinished request: how many output tokens were already emitted.
        self._emitted: dict[int, int] = {}

    def emit(self, result: StepResult) -> list[RequestOutput]:
        """Record the step's logprobs, build one delta per update (in order), hand each to its
        request's sink; return them."""
        for plp in result.prompt_logprobs:
            self._record_prompt_logprobs(plp)
        outs: list[tuple[Request, RequestOutput]] = []
        for upd in result.updates:
            req = upd.req
            if req.params.logprobs:
                req.output_logprobs.extend(upd.logprobs)
            outs.append((req, self._delta(req, upd.text)))
        for req, out in outs:
            if req.sink is not None:
                req.sink(out)
        return [out for _, out in outs]

    @staticmethod
    def _record_prompt_logprobs(plp: PromptLogprobs) -> None:
        """Entry `p + 1 - start` of `req.prompt_logprobs` is log p(prompt[p + 1])."""
        req = plp.req
        k = req.prompt_logprob_start
        assert k is not None
        if req.prompt_logprobs is None:
            req.prompt_logprobs = [None] * (req.num_prompt_tokens - k)
        for p, v in zip(plp.positions, plp.values):
            req.prompt_logprobs[p + 1 - k] = v
        if plp.top is not None and req.prompt_top_logprobs is not None:
            k0 = plp.positions.start + 1 - k
            req.prompt_top_logprobs[k0 : k0 + len(plp.top)] = plp.top

    def _delta(self, req: Request, text: str) -> RequestOutput:
        key = id(req)
        start = self._emitted.get(key, 0)
        # Only the new ones, and not those held back (``req.held``: they may be rolled back).
        new_tokens = req.token_ids[req.num_prompt_tokens + start : req.num_final_tokens]
        new_lps = req.output_logprobs[start:] if req.params.logprobs else []
        finished = req.is_finished
        if finished:
            self._emitted.pop(key, None)
        else:
            self._emitted[key] = start + len(new_tokens)
        return RequestOutput(
            request_id=req.request_id,
            index=req.index,
            text=text,
            token_ids=new_tokens,
            logprobs=list(new_lps),
            finished=finished,
            finish_reason=req.finish_reason if finished else None,
            stop_reason=req.stop_reason if finished else None,
            error=req.error,
            error_code=req.error_code,
            prompt_tokens=req.num_prompt_tokens,
            cached_tokens=req.num_cached_tokens,
            completion_tokens=req.num_output_tokens,
            prompt_logprobs=req.prompt_logprobs if finished else None,
            prompt_top_logprobs=req.prompt_top_logprobs if finished else None,
        )
