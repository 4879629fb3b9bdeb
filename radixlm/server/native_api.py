"""SGLang-native generation endpoints: `/generate` and `/encode` (the info, health and
control routes are in `control_api`).

`/generate` follows SGLang 0.5.x so that SGLang's own frontend (`sglang.RuntimeEndpoint`) and
radixlm's DSL can talk to it: the body takes `text` or `input_ids` (one prompt or a batch) and
`sampling_params` with SGLang's names (`null` = the default, as in SGLang); fields radixlm cannot
honour are accepted at their defaults only (`NATIVE_DEFAULT_ONLY`), any other value is a 400
naming the field. A response is `{"text", "output_ids", "meta_info"}` (a list of them for a batch
or `n > 1`, prompt-major), and `meta_info.finish_reason` is SGLang's dict (`{"type": "stop",
"matched": ...}`, `{"type": "length", "length": n}`, `{"type": "abort"}`).

Logprobs (`return_logprob`), in SGLang's layout: `output_token_logprobs` is one
`[logprob, token_id, text]` per generated token (`text` is null unless
`return_text_in_logprobs`); `input_token_logprobs` one per prompt position from
`logprob_start_len` on (`-1`: none), whose logprob is that of the prompt token given the tokens
before it (null at position 0); with `top_logprobs_num > 0`, `output_top_logprobs` /
`input_top_logprobs` hold one list of `[logprob, token_id, text]` per position (null at
position 0). `max_new_tokens: 0` computes (and caches) the prompt only: no output tokens.

Streaming sends SSE events whose `text` is cumulative (SGLang's convention), tagged with
`index`, then `data: [DONE]`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from pydantic import BaseModel
from starlette.responses import Response

from radixlm.runtime.outputs import Completion, sglang_finish_reason
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.client import EngineClient
from radixlm.server.constraints import RequestConstraint, make_constraint
from radixlm.server.errors import ApiError
from radixlm.server.limits import (
    check_constraint_size,
    check_logit_bias,
    check_stop,
    check_top_logprobs,
)
from radixlm.server.protocol import (
    NATIVE_DEFAULT_ONLY,
    EncodeReqInput,
    GenerateReqInput,
    NativeSamplingParams,
)
from radixlm.server.request_group import GenerationRequest, RequestGroup
from radixlm.server.serving import (
    SSE_DONE,
    engine_client,
    error_event,
    respond,
    sampling_params,
    sse,
)

logger = logging.getLogger(__name__)
router = APIRouter()

_SP = "sampling_params"
NATIVE_NAMES = {
    "include_stop_str_in_output": f"{_SP}.no_stop_trim",
    "top_logprobs": "top_logprobs_num",
    "logprobs": "return_logprob",
}
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class _LogprobArgs:
    """One prompt's logprob request (SGLang allows one value per prompt)."""

    enabled: bool
    start: int  # -1: no prompt logprobs
    top: int


# ---- /generate -----------------------------------------------------------------------------------


@router.post("/generate")
async def generate(body: GenerateReqInput, request: Request) -> Response:
    client = engine_client(request)
    _refuse_non_defaults(body)
    prompts, prompt_param, single = _prompts(body)
    if len(prompts) > client.config.max_batch_prompts:
        raise ApiError(f"{prompt_param}: at most {client.config.max_batch_prompts} prompts")
    plist = _per_prompt(body.sampling_params, len(prompts), _SP, NativeSamplingParams())
    for sp in plist:
        _refuse_non_defaults(sp, prefix=f"{_SP}.")
    lps = _logprob_args(body, plist)
    rids = _rids(client, body.rid, len(prompts))
    for lp in lps:
        check_top_logprobs(lp.top, client.config.max_top_logprobs, "top_logprobs_num")
    names = {
        "prompt": prompt_param,
        "stop_token_ids": f"{_SP}.stop_token_ids",
        "logit_bias": f"{_SP}.logit_bias",
    }
    reqs = []
    for prompt, sp, lp, rid in zip(prompts, plist, lps, rids):
        ids = await client.tokenize(prompt, prompt_param)
        client.check_n(sp.n or 1, f"{_SP}.n")
        if lp.start > len(ids):
            raise ApiError(
                f"logprob_start_len={lp.start} is higher than the number of input tokens "
                f"({len(ids)})",
                param="logprob_start_len",
            )
        constraint = _constraint(client, sp)
        max_new = sp.max_new_tokens
        if max_new is None:  # SGLang: up to the context length
            max_new = max(client.engine.max_model_len - len(ids), 1)
        params = _params(client, sp, max(max_new, 1), lp, constraint)
        client.check_length(ids, max(max_new, 1), prompt_param, f"{_SP}.max_new_tokens")
        reqs.append(GenerationRequest(ids, params, rid, constraint, names))
    group = await client.submit(reqs, body.timeout)
    start = time.perf_counter()

    def build(outs: list[list[Completion]]) -> Any:
        e2e = time.perf_counter() - start
        results = [
            _result(client, group, k, _visible(c, plist[k]), body, lps[k], e2e)
            for k, per in enumerate(outs)
            for c in per
        ]
        return results[0] if single and len(results) == 1 else results

    return await respond(
        request, group, body.stream, build, lambda: _stream(client, group, body, plist, start)
    )


def _refuse_non_defaults(model: BaseModel, prefix: str = "") -> None:
    """400 naming the first field of `NATIVE_DEFAULT_ONLY` set to a value radixlm cannot honour."""
    for name in model.model_fields_set:
        rule = NATIVE_DEFAULT_ONLY.get(prefix + name)
        if rule is None:
            continue
        accepted, why = rule
        value = getattr(model, name)
        if not any(value == a and type(value) is type(a) for a in accepted):
            raise ApiError(
                f"{prefix}{name}: {why} (accepted only at {accepted[0]!r}, got {value!r})",
                param=prefix + name,
                code="unsupported_parameter",
            )


def _prompts(body: GenerateReqInput | EncodeReqInput) -> tuple[list[str | list[int]], str, bool]:
    if (body.text is None) == (body.input_ids is None):
        raise ApiError("exactly one of text and input_ids must be given", param="text")
    if body.text is not None:
        if isinstance(body.text, str):
            return [body.text], "text", True
        if not body.text:
            raise ApiError("text: the batch must not be empty", param="text")
        return list(body.text), "text", False
    ids = body.input_ids or []
    if not ids:
        raise ApiError("input_ids: must not be empty", param="input_ids")
    if isinstance(ids[0], int):
        return [ids], "input_ids", True
    return list(ids), "input_ids", False


def _per_prompt(value: T | Sequence[T] | None, count: int, param: str, default: T) -> list[T]:
    """SGLang's per-prompt fields: one value for every prompt, or a list of one per prompt."""
    if value is None:
        return [default] * count
    if not isinstance(value, list):
        return [value] * count  # type: ignore[list-item]
    if len(value) != count:
        raise ApiError(f"{param}: got {len(value)} values for {count} prompts", param=param)
    return [default if v is None else v for v in value]


def _logprob_args(body: GenerateReqInput, plist: list[NativeSamplingParams]) -> list[_LogprobArgs]:
    """Per prompt. `logprob_start_len: -1` means output tokens only (SGLang), except on a
    prefill-only request (`max_new_tokens: 0`), which has no output tokens: there it means the
    whole prompt, which SGLang's frontend expects for `unconditional_likelihood_normalized`."""
    count = len(plist)
    enabled = _per_prompt(body.return_logprob, count, "return_logprob", False)
    starts = _per_prompt(body.logprob_start_len, count, "logprob_start_len", -1)
    tops = _per_prompt(body.top_logprobs_num, count, "top_logprobs_num", 0)
    out = []
    for on, start, top, sp in zip(enabled, starts, tops, plist):
        if start < -1:
            raise ApiError("logprob_start_len must be >= -1", param="logprob_start_len")
        if start == -1 and sp.max_new_tokens == 0:
            start = 0
        # SGLang ignores logprob_start_len and top_logprobs_num without return_logprob.
        out.append(_LogprobArgs(on, start if on else -1, top if on else 0))
    return out


def _rids(client: EngineClient, rid: str | list[str] | None, count: int) -> list[str]:
    """One id per prompt: the client's list, or `rid` / `rid-k` for a batch (uniqueness
    against the requests in flight is checked at submission)."""
    if isinstance(rid, list):
        if len(rid) != count or len(set(rid)) != count:
            raise ApiError(f"rid: need {count} distinct request ids, got {rid!r}", param="rid")
        return list(rid)
    base = client.new_request_id("", rid)
    return [base] if count == 1 else [f"{base}-{k}" for k in range(count)]


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def _params(
    client: EngineClient,
    sp: NativeSamplingParams,
    max_new_tokens: int,
    lp: _LogprobArgs,
    constraint: RequestConstraint | None,
) -> SamplingParams:
    cfg = client.config
    check_stop(sp.stop, cfg.max_stop_strings, cfg.max_stop_chars, f"{_SP}.stop")
    bias = check_logit_bias(sp.logit_bias, cfg.max_logit_bias, f"{_SP}.logit_bias")
    names = {f.name: f"{_SP}.{f.name}" for f in dataclasses.fields(SamplingParams)}
    seed = sp.sampling_seed if sp.sampling_seed is not None else sp.seed
    return sampling_params(
        {**names, **NATIVE_NAMES},
        max_new_tokens=max_new_tokens,
        min_new_tokens=_or(sp.min_new_tokens, 0),
        temperature=_or(sp.temperature, 1.0),
        top_p=_or(sp.top_p, 1.0),
        top_k=_or(sp.top_k, -1),
        min_p=_or(sp.min_p, 0.0),
        frequency_penalty=_or(sp.frequency_penalty, 0.0),
        presence_penalty=_or(sp.presence_penalty, 0.0),
        repetition_penalty=_or(sp.repetition_penalty, 1.0),
        stop=sp.stop,
        stop_regex=sp.stop_regex,
        stop_token_ids=sp.stop_token_ids or (),
        ignore_eos=_or(sp.ignore_eos, False),
        skip_special_tokens=_or(sp.skip_special_tokens, True),
        include_stop_str_in_output=_or(sp.no_stop_trim, False),
        n=_or(sp.n, 1),
        seed=seed,
        logprobs=lp.enabled,
        top_logprobs=lp.top,
        logprob_start_len=lp.start,
        logit_bias=bias,
        constraint=constraint.constraint if constraint else None,
    )


def _constraint(client: EngineClient, sp: NativeSamplingParams) -> RequestConstraint | None:
    cfg = client.config
    for kind in ("json_schema", "regex", "ebnf"):
        check_constraint_size(
            getattr(sp, kind),
            f"{_SP}.{kind}",
            cfg.max_constraint_chars,
            cfg.max_schema_depth,
            cfg.max_schema_nodes,
        )
    found = [
        make_constraint(
            kind,  # type: ignore[arg-type]
            getattr(sp, kind),
            f"{_SP}.{kind}",
            best_effort=sp.grammar_best_effort,
            whitespace=sp.grammar_whitespace,
        )
        for kind in ("json_schema", "regex", "ebnf", "structural_tag", "tool_calls")
        if getattr(sp, kind)  # SGLang: an empty grammar means "unset"
    ]
    if len(found) > 1:
        raise ApiError(
            f"{_SP}: only one of json_schema, regex, ebnf, structural_tag and tool_calls may be "
            "given",
            param=found[1].param,
        )
    return found[0] if found else None


def _visible(c: Completion, sp: NativeSamplingParams) -> Completion:
    """`max_new_tokens: 0` (SGLang's prefill-only request, e.g. the frontend's cache_prefix and
    select): the engine generated one token to get there; the client sees none."""
    if sp.max_new_tokens != 0 or c.finish_reason in (None, "error"):
        return c
    return Completion(
        index=c.index,
        finish_reason="length",
        error=c.error,
        prompt_logprobs=c.prompt_logprobs,
        prompt_top_logprobs=c.prompt_top_logprobs,
    )


def _result(
    client: EngineClient,
    group: RequestGroup,
    k: int,
    c: Completion,
    body: GenerateReqInput,
    lp: _LogprobArgs,
    e2e: float,
) -> dict[str, Any]:
    member = group.members[k]
    meta: dict[str, Any] = {
        "id": member.request_id,
        "finish_reason": sglang_finish_reason(
            c.finish_reason, c.stop_reason, len(c.output_token_ids), c.error
        ),
        "prompt_tokens": member.prompt_tokens,
        "completion_tokens": len(c.output_token_ids),
        "cached_tokens": member.cached_tokens,
        "e2e_latency": e2e,
    }
    if lp.enabled:
        meta.update(_logprob_meta(client, group.prompt_ids[k], c, lp, body.return_text_in_logprobs))
    return {
        "text": c.text,
        "output_ids": list(c.output_token_ids),
        "meta_info": meta,
        "index": k * member.n + c.index,
    }


def _logprob_meta(
    client: EngineClient, prompt_ids: list[int], c: Completion, lp: _LogprobArgs, with_text: bool
) -> dict[str, Any]:
    """SGLang's logprob fields: `[logprob, token_id, text or None]` entries."""

    def entry(logprob: float | None, t: int) -> list[Any]:
        return [logprob, t, client.token_text(t) if with_text else None]

    def top_list(pairs: list[tuple[int, float]] | None) -> list[list[Any]] | None:
        return None if not pairs else [entry(v, t) for t, v in pairs]

    ids = prompt_ids[lp.start :] if lp.start >= 0 and c.prompt_logprobs is not None else []
    meta: dict[str, Any] = {
        "input_token_logprobs": [entry(v, t) for v, t in zip(c.prompt_logprobs or [], ids)],
        "output_token_logprobs": [entry(x.logprob, x.token_id) for x in c.logprobs],
        "output_token_logprobs_length": len(c.logprobs),
    }
    if lp.top > 0:
        prompt_top = c.prompt_top_logprobs or []
        meta["input_top_logprobs"] = [top_list(prompt_top[j]) for j in range(len(ids))]
        meta["output_top_logprobs"] = [top_list(x.top) for x in c.logprobs]
    return meta


async def _stream(
    client: EngineClient,
    group: RequestGroup,
    body: GenerateReqInput,
    plist: list[NativeSamplingParams],
    start: float,
) -> AsyncIterator[bytes]:
    acc = [[Completion(index=i) for i in range(m.n)] for m in group.members]
    lps = _logprob_args(body, plist)
    try:
        async for k, out in group:
            if out.finish_reason == "error":
                yield error_event(out)
                yield SSE_DONE
                return
            c = acc[k][out.index]
            c.add(out)
            if not (out.finished or (out.text and plist[k].max_new_tokens != 0)):
                continue
            e2e = time.perf_counter() - start
            yield sse(_result(client, group, k, _visible(c, plist[k]), body, lps[k], e2e))
        yield SSE_DONE
    except ApiError as err:  # the deadline passed (the group aborted the request)
        yield sse(err.body())
        yield SSE_DONE
    finally:
        group.close()


# ---- /encode -------------------------------------------------------------------------------------


@router.api_route("/encode", methods=["POST", "PUT"])
async def encode(body: EncodeReqInput, request: Request) -> Response:
    """SGLang's embedding endpoint. The body is validated like SGLang's `EmbeddingReqInput`;
    radixlm serves generation models only, so a valid request gets the 400 that SGLang's own
    server gives a generation model launched without `--is-embedding`."""
    client = engine_client(request)
    for name in ("input_embeds", "image_data", "video_data", "audio_data", "lora_path"):
        if getattr(body, name) not in (None, []):
            raise ApiError(f"{name}: not supported", param=name, code="unsupported_parameter")
    prompts, prompt_param, _ = _prompts(body)
    for prompt in prompts:
        await client.tokenize(prompt, prompt_param)
    raise ApiError(
        "This model does not appear to be an embedding model by default: radixlm serves "
        "generation models only (no embedding endpoint).",
        param="text",
        code="not_an_embedding_model",
    )
