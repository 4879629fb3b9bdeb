"""SGLang-native endpoints: `/generate`, `/get_model_info`, `/get_server_info`, `/health`,
`/health_generate`, `/flush_cache`, `/abort_request`, and `/metrics`.

`/generate` follows SGLang's shapes so that SGLang's own frontend (`RuntimeEndpoint`) and
radixlm's DSL can talk to it: the body takes `text` or `input_ids` (one prompt or a batch) and
`sampling_params` with SGLang's names; a response is `{"text", "output_ids", "meta_info"}` (a
list of them for a batch or `n > 1`, prompt-major), and `meta_info.finish_reason` is SGLang's
dict (`{"type": "stop", "matched": ...}`, `{"type": "length", "length": n}`, `{"type": "abort"}`).
Streaming sends SSE events whose `text` is cumulative (SGLang's convention), tagged with
`index`, then `data: [DONE]`. Accepted and without effect here: `stream_interval` (every delta is
sent), `spaces_between_special_tokens`, `modalities`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from radixlm.runtime.outputs import Completion
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.constraints import (
    RequestConstraint,
    check_constraint,
    grammar_backend,
    make_constraint,
)
from radixlm.server.errors import ApiError, OrjsonResponse
from radixlm.server.metrics import CONTENT_TYPE
from radixlm.server.protocol import AbortReqInput, GenerateReqInput, NativeSamplingParams
from radixlm.server.serving import (
    SSE_DONE,
    EngineClient,
    GenerationRequest,
    RequestGroup,
    SSEResponse,
    collect,
    raise_if_failed,
    run_until_disconnect,
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


def _client(request: Request) -> EngineClient:
    return request.app.state.client


# ---- /generate -----------------------------------------------------------------------------------


@router.post("/generate")
async def generate(body: GenerateReqInput, request: Request) -> Response:
    client = _client(request)
    prompts, prompt_param, single = _prompts(body)
    if len(prompts) > client.config.max_batch_prompts:
        raise ApiError(f"{prompt_param}: at most {client.config.max_batch_prompts} prompts")
    plist = _per_prompt_params(body, len(prompts))
    rids = _rids(client, body.rid, len(prompts))
    reqs = []
    for prompt, sp, rid in zip(prompts, plist, rids):
        ids = await client.tokenize(prompt, prompt_param)
        client.check_n(sp.n, f"{_SP}.n")
        constraint = _constraint(sp)
        await check_constraint(client.engine, constraint)
        if body.logprob_start_len < -1:
            raise ApiError("logprob_start_len must be >= -1", param="logprob_start_len")
        params = _params(sp, body, constraint)
        client.check_length(ids, max(sp.max_new_tokens, 1), prompt_param, f"{_SP}.max_new_tokens")
        reqs.append(GenerationRequest(ids, params, rid, constraint))
    group = client.submit(reqs)
    start = time.perf_counter()
    if body.stream:
        return SSEResponse(_stream(client, group, body, plist, start), on_close=group.close)
    try:
        outs = await run_until_disconnect(request, lambda: collect(group))
    finally:
        group.close()
    raise_if_failed(outs)
    e2e = time.perf_counter() - start
    results = [
        _result(client, group, k, _visible(c, plist[k]), body, e2e)
        for k, per in enumerate(outs)
        for c in per
    ]
    return OrjsonResponse(results[0] if single and len(results) == 1 else results)


def _prompts(body: GenerateReqInput) -> tuple[list[str | list[int]], str, bool]:
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


def _per_prompt_params(body: GenerateReqInput, count: int) -> list[NativeSamplingParams]:
    sp = body.sampling_params
    if sp is None:
        return [NativeSamplingParams()] * count
    if isinstance(sp, NativeSamplingParams):
        return [sp] * count
    if len(sp) != count:
        raise ApiError(f"{_SP}: got {len(sp)} for {count} prompts", param=_SP)
    return list(sp)


def _rids(client: EngineClient, rid: str | list[str] | None, count: int) -> list[str]:
    if isinstance(rid, list):
        if len(rid) != count or len(set(rid)) != count:
            raise ApiError(f"rid: need {count} distinct request ids, got {rid!r}", param="rid")
        return [client.new_request_id("", r) for r in rid]
    base = client.new_request_id("", rid)
    return [base] if count == 1 else [f"{base}-{k}" for k in range(count)]


def _params(
    sp: NativeSamplingParams, body: GenerateReqInput, constraint: RequestConstraint | None
) -> SamplingParams:
    if sp.logit_bias:
        raise ApiError(f"{_SP}.logit_bias: not supported", param=f"{_SP}.logit_bias")
    if sp.custom_params:
        raise ApiError(f"{_SP}.custom_params: not supported", param=f"{_SP}.custom_params")
    names = {f.name: f"{_SP}.{f.name}" for f in dataclasses.fields(SamplingParams)}
    return sampling_params(
        {**names, **NATIVE_NAMES},
        max_new_tokens=max(sp.max_new_tokens, 1),
        min_new_tokens=sp.min_new_tokens,
        temperature=sp.temperature,
        top_p=sp.top_p,
        top_k=sp.top_k,
        min_p=sp.min_p,
        frequency_penalty=sp.frequency_penalty,
        presence_penalty=sp.presence_penalty,
        repetition_penalty=sp.repetition_penalty,
        stop=sp.stop,
        stop_token_ids=sp.stop_token_ids or (),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        include_stop_str_in_output=sp.no_stop_trim,
        n=sp.n,
        seed=sp.sampling_seed if sp.sampling_seed is not None else sp.seed,
        logprobs=body.return_logprob,
        top_logprobs=body.top_logprobs_num if body.return_logprob else 0,
        logprob_start_len=body.logprob_start_len if body.return_logprob else -1,
        constraint=constraint.constraint if constraint else None,
    )


def _constraint(sp: NativeSamplingParams) -> RequestConstraint | None:
    found = [
        make_constraint(
            kind,  # type: ignore[arg-type]
            getattr(sp, kind),
            f"{_SP}.{kind}",
            best_effort=sp.grammar_best_effort,
            whitespace=sp.grammar_whitespace,
        )
        for kind in ("json_schema", "regex", "ebnf", "structural_tag", "tool_calls")
        if getattr(sp, kind) is not None
    ]
    if len(found) > 1:
        raise ApiError(
            f"{_SP}: only one of json_schema, regex, ebnf, structural_tag and tool_calls may be "
            "given",
            param=found[1].param,
        )
    return found[0] if found else None


def _finish_reason(c: Completion) -> dict[str, Any] | None:
    if c.finish_reason is None:
        return None
    if c.finish_reason == "length":
        return {"type": "length", "length": len(c.output_token_ids)}
    if c.finish_reason == "stop":
        return {"type": "stop", "matched": c.stop_reason}
    return {"type": c.finish_reason, "message": c.error}


def _visible(c: Completion, sp: NativeSamplingParams) -> Completion:
    """`max_new_tokens: 0` (SGLang's prefill-only request, e.g. the frontend's cache_prefix):
    the engine generated one token to get there; the client sees none."""
    if sp.max_new_tokens > 0 or c.finish_reason in (None, "error"):
        return c
    return Completion(index=c.index, finish_reason="length", error=c.error)


def _result(
    client: EngineClient,
    group: RequestGroup,
    k: int,
    c: Completion,
    body: GenerateReqInput,
    e2e: float,
) -> dict[str, Any]:
    member = group.members[k]
    meta: dict[str, Any] = {
        "id": member.request_id,
        "finish_reason": _finish_reason(c),
        "prompt_tokens": member.prompt_tokens,
        "completion_tokens": len(c.output_token_ids),
        "cached_tokens": member.cached_tokens,
        "e2e_latency": e2e,
    }
    if body.return_logprob:

        def text(t: int) -> str | None:
            return client.token_text(t) if body.return_text_in_logprobs else None

        # SGLang's format: [logprob, token_id, text] for prompt positions logprob_start_len..
        start = max(body.logprob_start_len, 0)
        ids = group.prompt_ids[k][start:] if c.prompt_logprobs is not None else []
        meta["input_token_logprobs"] = [
            [lp, t, text(t)] for lp, t in zip(c.prompt_logprobs or [], ids)
        ]
        meta["input_top_logprobs"] = [None] * len(ids)
        meta["output_token_logprobs"] = [
            [lp.logprob, lp.token_id, text(lp.token_id)] for lp in c.logprobs
        ]
        meta["output_top_logprobs"] = [[[v, t, text(t)] for t, v in lp.top] for lp in c.logprobs]
    return {
        "text": c.text,
        "output_ids": list(c.output_token_ids),
        "meta_info": meta,
        "index": k * member.n + c.index,
    }


async def _stream(
    client: EngineClient,
    group: RequestGroup,
    body: GenerateReqInput,
    plist: list[NativeSamplingParams],
    start: float,
) -> AsyncIterator[bytes]:
    acc = [[Completion(index=i) for i in range(m.n)] for m in group.members]
    try:
        async for k, out in group:
            if out.finish_reason == "error":
                err = ApiError(f"the engine failed this request: {out.error}", status_code=500)
                logger.error("streamed request failed: %s", out.error)
                yield sse(err.body())
                yield SSE_DONE
                return
            c = acc[k][out.index]
            c.add(out)
            if not (out.finished or (out.text and plist[k].max_new_tokens > 0)):
                continue
            e2e = time.perf_counter() - start
            yield sse(_result(client, group, k, _visible(c, plist[k]), body, e2e))
        yield SSE_DONE
    finally:
        group.close()


# ---- info, health, control -----------------------------------------------------------------------


@router.get("/health")
async def health() -> Response:
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token end to end; 503 when the engine does not answer within 20 s."""
    client = _client(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    group = client.submit([GenerationRequest([0], params, f"health-{time.monotonic_ns()}")])
    try:
        outs = await asyncio.wait_for(collect(group), timeout=20.0)
    except asyncio.TimeoutError:
        raise ApiError("engine did not answer in 20 s", status_code=503) from None
    finally:
        group.close()
    raise_if_failed(outs)
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    client = _client(request)
    return OrjsonResponse(
        {
            "model_path": str(client.engine.model_dir),
            "tokenizer_path": str(client.engine.model_dir),
            "served_model_name": client.model_name,
            "is_generation": True,
            "max_model_len": client.engine.max_model_len,
            "context_length": client.engine.max_model_len,
            "preferred_sampling_params": None,
        }
    )


@router.get("/get_server_info")
def get_server_info(request: Request) -> Response:
    """Server and engine configuration, engine stats, and a KV-accounting integrity check."""
    client = _client(request)
    engine = client.engine
    try:
        engine.check_integrity()
        integrity = "ok"
    except AssertionError as exc:
        integrity = f"failed: {exc}"
    server = dataclasses.asdict(client.config)
    server["api_key"] = None if client.config.api_key is None else "***"
    return OrjsonResponse(
        {
            "server_config": server,
            "engine_config": dataclasses.asdict(engine.config),
            "engine_stats": dataclasses.asdict(engine.stats()),
            "kv_integrity": integrity,
            "active_requests": len(client.active),
            "grammar_backend": grammar_backend(engine),
            "max_model_len": engine.max_model_len,
        }
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
def flush_cache(request: Request) -> Response:
    if _client(request).engine.flush_cache():
        return OrjsonResponse({"success": True, "message": "cache flushed"})
    raise ApiError("cannot flush the cache while requests are running or waiting")


@router.post("/abort_request")
async def abort_request(body: AbortReqInput, request: Request) -> Response:
    client = _client(request)
    if body.abort_all:
        return OrjsonResponse({"success": True, "aborted": client.abort_all()})
    if not body.rid:
        raise ApiError("rid: give a request id or abort_all=true", param="rid")
    return OrjsonResponse({"success": True, "found": client.abort(body.rid)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data = await run_in_threadpool(_client(request).metrics.render)
    return Response(content=data, media_type=CONTENT_TYPE)
