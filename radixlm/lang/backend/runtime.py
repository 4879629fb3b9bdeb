"""`Runtime`: an in-process `Engine` as a frontend backend (no HTTP, no subprocess).

`Runtime(model_path=..., **engine_args)` takes SGLang's constructor name for the model and a few
of SGLang's server-argument names (`mem_fraction_static`, `disable_radix_cache`, `random_seed`,
`context_length`, `tp_size=1`, `log_level`); every other keyword goes to `Engine`.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

from radixlm.lang.backend.base import BaseBackend, Meta, check_scores
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import GenParams
from radixlm.runtime.engine import Engine
from radixlm.runtime.outputs import GenerateResult, sglang_finish_reason
from radixlm.runtime.sampling_params import SamplingParams

_IGNORED = ("log_level", "tokenizer_path", "trust_remote_code", "skip_tokenizer_init")


def engine_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    """Engine keyword arguments from SGLang-style `Runtime(...)` ones."""
    out = {k: v for k, v in kwargs.items() if k not in _IGNORED}
    if out.pop("tp_size", 1) != 1:
        raise ValueError("tp_size: radixlm runs on one device")
    if "mem_fraction_static" in out:
        out["kv_memory_fraction"] = out.pop("mem_fraction_static")
    if "disable_radix_cache" in out:
        out["enable_prefix_caching"] = not out.pop("disable_radix_cache")
    if "random_seed" in out:
        out["seed"] = out.pop("random_seed")
    if "context_length" in out:
        out["max_model_len"] = out.pop("context_length")
    if out.get("chunked_prefill_size") == -1:
        out["chunked_prefill_size"] = None
    if out.get("dtype") == "auto":
        out.pop("dtype")
    return out


def sampling_params(p: GenParams, **override: Any) -> SamplingParams:
    """The engine's `SamplingParams` for resolved frontend params."""
    kw: dict[str, Any] = dict(
        max_new_tokens=p.max_new_tokens,
        min_new_tokens=p.min_new_tokens,
        n=p.n,
        stop=p.stop_list,
        stop_token_ids=p.stop_token_ids or (),
        stop_regex=p.stop_regex or (),
        temperature=p.temperature,
        top_p=p.top_p,
        top_k=p.top_k,
        min_p=p.min_p,
        frequency_penalty=p.frequency_penalty,
        presence_penalty=p.presence_penalty,
        ignore_eos=p.ignore_eos,
        logprobs=bool(p.return_logprob),
        top_logprobs=p.top_logprobs_num if p.return_logprob else 0,
    )
    constraint = p.constraint_kwargs()
    if constraint:
        kw["constraint"] = constraint  # SamplingParams converts it with Constraint.from_params
    kw.update(override)
    return SamplingParams(**kw)


class Runtime(BaseBackend):
    """`Runtime(model_path=None, **engine_args)`, or `Runtime(engine=existing_engine)`."""

    def __init__(
        self, model_path: str | None = None, *, engine: Engine | None = None, **kwargs: Any
    ) -> None:
        self._template: ChatTemplate | None = None
        if engine is not None:
            self.engine = engine
            return
        self.engine = Engine(model_path, **engine_kwargs(kwargs))
        # NOTE: stop our engine's loop thread before interpreter teardown when a script ends
        # with programs still running (a daemon thread killed inside torch aborts the process).
        weakref.finalize(self, self.engine.shutdown)

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompt: str, params: GenParams) -> tuple[str | list[str], Meta]:
        res = self.engine.generate(prompt, sampling_params(params))
        assert isinstance(res, GenerateResult)
        _raise_if_failed(res.error, res.finish_reason)
        texts = [o.text for o in res.outputs]
        return (texts if params.n and params.n > 1 else texts[0]), self._meta(res, params)

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, Meta]]:
        if params.n and params.n > 1:
            raise ValueError("gen: n > 1 cannot be streamed")
        sp = sampling_params(params)
        tokens = 0
        for delta in self.engine.stream(prompt, sp):
            _raise_if_failed(delta.error, delta.finish_reason)
            tokens += len(delta.token_ids)
            meta = {
                "id": delta.request_id,
                "prompt_tokens": delta.prompt_tokens,
                "cached_tokens": delta.cached_tokens,
                "completion_tokens": tokens,
                "finish_reason": sglang_finish_reason(
                    delta.finish_reason, delta.stop_reason, tokens
                ),
            }
            yield delta.text, meta

    def cache_prefix(self, prompt: str | Sequence[int]) -> None:
        res = self.engine.generate(prompt, SamplingParams(max_new_tokens=1, temperature=0.0))
        assert isinstance(res, GenerateResult)
        _raise_if_failed(res.error, res.finish_reason)

    def score(self, prompts: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[Any]]:
        plist = [
            SamplingParams(max_new_tokens=1, temperature=0.0, logprob_start_len=s) for s in starts
        ]
        results = self.engine.generate([list(p) for p in prompts], plist)
        assert isinstance(results, list)
        for r in results:
            _raise_if_failed(r.error, r.finish_reason)
        return check_scores([r.prompt_logprobs for r in results], prompts, starts)

    # ---- model facts and control --------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        return self.engine.tokenize(text)

    def get_tokenizer(self) -> Any:
        return self.engine.tokenizer

    def get_chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_tokenizer(self.engine.tokenizer)
        return self._template

    def stats(self) -> dict[str, Any]:
        return dataclasses.asdict(self.engine.stats())

    def flush_cache(self) -> bool:
        self.engine.wait_idle(timeout=30)
        return self.engine.flush_cache()

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> Runtime:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @staticmethod
    def _meta(res: GenerateResult, params: GenParams) -> Meta:
        first = res.outputs[0]
        meta: Meta = {
            "id": res.request_id,
            "prompt_tokens": res.usage.prompt_tokens,
            "completion_tokens": res.usage.completion_tokens,
            "cached_tokens": res.usage.cached_tokens,
            "finish_reason": sglang_finish_reason(
                first.finish_reason, first.stop_reason, len(first.output_token_ids)
            ),
        }
        if params.return_logprob:
            per = [[[lp.logprob, lp.token_id, None] for lp in o.logprobs] for o in res.outputs]
            top = [[[[v, t, None] for t, v in lp.top] for lp in o.logprobs] for o in res.outputs]
            multi = params.n is not None and params.n > 1
            meta["output_token_logprobs"] = per if multi else per[0]
            meta["output_top_logprobs"] = top if multi else top[0]
        return meta


def _raise_if_failed(error: str | None, reason: str | None) -> None:
    if error or reason in ("error", "abort"):
        raise RuntimeError(f"the engine failed the request ({reason}): {error}")
