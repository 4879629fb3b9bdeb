"""SGLang-native info, health and control endpoints: `/health`, `/health_generate`,
`/get_model_info` (`/model_info`), `/get_server_info` (the flat `/server_info` is in
`router_api`), `/flush_cache`, `/abort_request`, and Prometheus `/metrics`."""

from __future__ import annotations

import asyncio
import dataclasses
import time

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.constraints import grammar_backend
from radixlm.server.errors import ApiError, OrjsonResponse
from radixlm.server.metrics import CONTENT_TYPE
from radixlm.server.protocol import AbortReqInput
from radixlm.server.request_group import GenerationRequest
from radixlm.server.serving import collect, engine_client, raise_if_failed

router = APIRouter()


@router.get("/health")
async def health(request: Request) -> Response:
    """200 while the engine's step thread lives; 503 once it died or the server is stopping."""
    client = engine_client(request)
    if not client.engine.healthy:
        raise ApiError(client.engine._dead_message(), status_code=503, code="engine_unavailable")
    if client.draining:
        raise ApiError("the server is shutting down", status_code=503, code="shutting_down")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    """Generate one token end to end; 503 when the engine does not answer within 20 s."""
    client = engine_client(request)
    params = SamplingParams(max_new_tokens=1, temperature=0.0)
    group = await client.submit([GenerationRequest([0], params, f"health-{time.monotonic_ns()}")])
    try:
        outs = await asyncio.wait_for(collect(group), timeout=20.0)
    except asyncio.TimeoutError:
        raise ApiError("engine did not answer in 20 s", status_code=503) from None
    finally:
        group.close()
    raise_if_failed(outs)
    return Response(status_code=200)


@router.get("/get_model_info")
@router.get("/model_info")
async def get_model_info(request: Request) -> Response:
    """SGLang's model description (the router reads `model_type`, `architectures`, ...)."""
    client = engine_client(request)
    engine = client.engine
    info = engine.model_info
    return OrjsonResponse(
        {
            "model_path": str(engine.model_dir),
            "tokenizer_path": str(engine.model_dir),
            "served_model_name": client.model_name,
            "is_generation": True,
            "model_type": info.model_type,
            "architectures": [info.architecture],
            "max_model_len": engine.max_model_len,
            "context_length": engine.max_model_len,
            "eos_token_ids": sorted(engine.eos_token_ids),
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "preferred_sampling_params": None,
        }
    )


@router.get("/get_server_info")
def get_server_info(request: Request, check_integrity: bool = False) -> Response:
    """Server and engine configuration and engine stats: O(1) counters, no engine lock.
    `?check_integrity=true` also runs the KV-accounting integrity check (O(pages), under the
    engine lock: for tests and debugging, not for scrapers)."""
    client = engine_client(request)
    engine = client.engine
    integrity = "not checked"
    if check_integrity:
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
            "engine_alive": engine.healthy,
            "grammar_backend": grammar_backend(engine),
            "max_model_len": engine.max_model_len,
            "tp_size": engine.tp_size,
            # the resident size of this rank's weights (quantized, prepacked or float)
            "weight_bytes": getattr(engine.runner, "weight_bytes", None),
            "linears": getattr(engine.runner, "linear_method", None),
        }
    )


@router.api_route("/flush_cache", methods=["GET", "POST"])
def flush_cache(request: Request) -> Response:
    if engine_client(request).engine.flush_cache():
        return OrjsonResponse({"success": True, "message": "cache flushed"})
    raise ApiError("cannot flush the cache while requests are running or waiting")


@router.post("/abort_request")
async def abort_request(body: AbortReqInput, request: Request) -> Response:
    client = engine_client(request)
    if body.abort_all:
        return OrjsonResponse({"success": True, "aborted": client.abort_all()})
    if not body.rid:
        raise ApiError("rid: give a request id or abort_all=true", param="rid")
    return OrjsonResponse({"success": True, "found": client.abort(body.rid)})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    data = await run_in_threadpool(engine_client(request).metrics.render)
    return Response(content=data, media_type=CONTENT_TYPE)
