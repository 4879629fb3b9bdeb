"""OpenAI-compatible endpoints: `/v1/completions`, `/v1/chat/completions`, `/v1/models`."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from starlette.responses import Response

from radixlm.runtime.outputs import Completion
from radixlm.runtime.request import RequestOutput, TokenLogprob
from radixlm.runtime.sampling_params import SamplingParams
from radixlm.server.client import EngineClient
from radixlm.server.constraints import RequestConstraint, make_constraint
from radixlm.server.errors import ApiError, OrjsonResponse
from radixlm.server.limits import (
    check_constraint_size,
    check_logit_bias,
    check_prompt_chars,
    check_stop,
    check_top_logprobs,
)
from radixlm.server.protocol import ChatCompletionRequest, CompletionRequest, StreamOptions
from radixlm.server.request_group import GenerationRequest, RequestGroup
from radixlm.server.serving import (
    SSE_DONE,
    engine_client,
    error_event,
    respond,
    sampling_params,
    sse,
)
from radixlm.server.tools import ChoiceToolState, tool_request

logger = logging.getLogger(__name__)
router = APIRouter()

COMPLETION_NAMES = {
    "max_new_tokens": "max_tokens",
    "min_new_tokens": "min_tokens",
    "top_logprobs": "logprobs",
}
CHAT_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}

# Builds one choice of a chunk: (choice index, delta, text offset so far) -> choice dict, or
# None when the delta has nothing to send yet.
ChoiceBuilder = Callable[[int, RequestOutput, int], dict[str, Any] | None]


# ---- request -> engine ---------------------------------------------------------------------------


def _reject(cond: bool, param: str, message: str) -> None:
    if cond:
        raise ApiError(f"{param}: {message}", param=param, code="unsupported_parameter")


def _constraint(
    client: EngineClient, body: CompletionRequest | ChatCompletionRequest
) -> RequestConstraint | None:
    """The request's constraint, within the server's size limits (400s name the field); the
    engine validates it for its grammar backend at submission. Best effort:
    `grammar_best_effort`, or `response_format.json_schema.strict: false`."""
    cfg = client.config
    limits = (cfg.max_constraint_chars, cfg.max_schema_depth, cfg.max_schema_nodes)
    rf = body.response_format
    if rf is not None and rf.json_schema is not None:
        check_constraint_size(rf.json_schema.schema_, "response_format", *limits)
    for name in ("regex", "ebnf"):
        check_constraint_size(getattr(body, name), name, *limits)
    found = []
    kw = {"best_effort": body.grammar_best_effort, "whitespace": body.grammar_whitespace}
    if rf is not None and rf.type == "json_object":
        found.append(make_constraint("json_object", "", "response_format", **kw))
    elif rf is not None and rf.type == "json_schema" and rf.json_schema is not None:
        lax = body.grammar_best_effort or rf.json_schema.strict is False
        schema = rf.json_schema.schema_
        found.append(
            make_constraint("json_schema", schema, "response_format", **{**kw, "best_effort": lax})
        )
    if body.regex is not None:
        found.append(make_constraint("regex", body.regex, "regex", **kw))
    if body.ebnf is not None:
        found.append(make_constraint("ebnf", body.ebnf, "ebnf", **kw))
    if len(found) > 1:
        raise ApiError(
            "only one of response_format (json), regex and ebnf may be given", param=found[1].param
        )
    return found[0] if found else None


def _params(
    client: EngineClient,
    body: CompletionRequest | ChatCompletionRequest,
    names: dict[str, str],
    max_new_tokens: int,
    logprobs: bool,
    top_logprobs: int,
    constraint: RequestConstraint | None,
) -> SamplingParams:
    cfg = client.config
    check_stop(body.stop, cfg.max_stop_strings, cfg.max_stop_chars, "stop")
    lp_param = names.get("top_logprobs", "top_logprobs")
    check_top_logprobs(top_logprobs, cfg.max_top_logprobs, lp_param)
    bias = check_logit_bias(body.logit_bias, cfg.max_logit_bias, "logit_bias")
    return sampling_params(
        names,
        max_new_tokens=max_new_tokens,
        min_new_tokens=body.min_tokens or 0,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        top_k=-1 if body.top_k is None else body.top_k,
        min_p=body.min_p or 0.0,
        repetition_penalty=body.repetition_penalty or 1.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        seed=body.seed,
        stop=body.stop,
        stop_token_ids=body.stop_token_ids or (),
        ignore_eos=body.ignore_eos,
        skip_special_tokens=body.skip_special_tokens,
        include_stop_str_in_output=body.include_stop_str_in_output,
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        n=body.n,
        logit_bias=bias,
        constraint=constraint.constraint if constraint else None,
    )


def _request_ids(client: EngineClient, prefix: str, rid: str | None, count: int) -> list[str]:
    """One id per prompt: `rid`, or `rid-k` for a batch (uniqueness is checked at submission)."""
    base = client.new_request_id(prefix, rid)
    return [base] if count == 1 else [f"{base}-{k}" for k in range(count)]


# ---- /v1/completions -----------------------------------------------------------------------------


@router.post("/v1/completions")
async def completions(body: CompletionRequest, request: Request) -> Response:
    client = engine_client(request)
    _reject(body.suffix is not None, "suffix", "not supported")
    _reject(body.best_of not in (None, body.n), "best_of", "only best_of == n is supported")
    _reject(body.echo and body.logprobs is not None, "echo", "prompt logprobs are not supported")
    prompts = _prompt_list(body.prompt)
    if len(prompts) > client.config.max_batch_prompts:
        raise ApiError(
            f"prompt: at most {client.config.max_batch_prompts} prompts per request", "prompt"
        )
    client.check_n(body.n)
    constraint = _constraint(client, body)
    params = _params(
        client,
        body,
        COMPLETION_NAMES,
        body.max_tokens or 16,
        body.logprobs is not None,
        body.logprobs or 0,
        constraint,
    )
    rids = _request_ids(client, "cmpl-", body.rid, len(prompts))
    reqs = []
    for prompt, rid in zip(prompts, rids):
        ids = await client.tokenize(prompt, "prompt")
        client.check_length(ids, params.max_new_tokens, "prompt", "max_tokens")
        reqs.append(GenerationRequest(ids, params, rid, constraint, {"prompt": "prompt"}))
    echo = [_echo_text(client, p) if body.echo else "" for p in prompts]
    group = await client.submit(reqs, body.timeout)
    head = {"id": rids[0], "object": "text_completion", "created": int(time.time())}
    head["model"] = client.model_name

    def choice(index: int, out: RequestOutput | Completion, offset: int) -> dict[str, Any]:
        prefix = echo[index // body.n] if offset == 0 else ""
        lps = None
        if body.logprobs is not None:
            lps = _completion_logprobs(client, out.logprobs, offset + len(prefix))
        finished = out.finish_reason is not None
        return {
            "index": index,
            "text": prefix + out.text,
            "logprobs": lps,
            "finish_reason": out.finish_reason if finished else None,
            "stop_reason": out.stop_reason if finished else None,
        }

    def build(outs: list[list[Completion]]) -> dict[str, Any]:
        choices = [choice(k * body.n + c.index, c, 0) for k, cs in enumerate(outs) for c in cs]
        return {**head, "choices": choices, "usage": group.usage()}

    def chunks() -> AsyncIterator[bytes]:
        return _stream(group, body, head, choice, first=None)

    return await respond(request, group, body.stream, build, chunks)


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise ApiError("prompt: must not be empty", param="prompt")
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def _echo_text(client: EngineClient, prompt: str | list[int]) -> str:
    return prompt if isinstance(prompt, str) else client.engine.tokenizer.decode(prompt)


def _completion_logprobs(
    client: EngineClient, lps: list[TokenLogprob], offset: int
) -> dict[str, Any]:
    tokens, offsets = [], []
    for lp in lps:
        offsets.append(offset)
        text = client.token_text(lp.token_id)
        tokens.append(text)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [lp.logprob for lp in lps],
        "top_logprobs": [{client.token_text(t): v for t, v in lp.top} for lp in lps],
        "text_offset": offsets,
    }


# ---- /v1/chat/completions ------------------------------------------------------------------------


@router.post("/v1/chat/completions")
async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
    client = engine_client(request)
    _reject(bool(body.top_logprobs) and not body.logprobs, "top_logprobs", "requires logprobs=true")
    _reject(
        bool(body.add_generation_prompt) and body.continue_final_message,
        "add_generation_prompt",
        "cannot be true together with continue_final_message",
    )
    client.check_n(body.n)
    tools = await tool_request(client.engine, client.config, body)
    constraint = tools.constraint if tools and tools.constraint else _constraint(client, body)
    messages = [_message_dict(m) for m in body.messages]
    total = "".join(m["content"] for m in messages)
    check_prompt_chars(total, client.max_prompt_chars, "messages")
    add_prompt = body.add_generation_prompt
    add_prompt = not body.continue_final_message if add_prompt is None else add_prompt
    prompt = await client.chat_prompt(
        messages, body.continue_final_message, tools.tools if tools else None, add_prompt
    )
    ids = await client.tokenize(prompt, "messages")
    limit_param = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    remaining = max(client.engine.max_model_len - len(ids), 1)
    max_new = body.max_completion_tokens or body.max_tokens or remaining
    client.check_length(ids, max_new, "messages", limit_param)
    names = {**CHAT_NAMES, "max_new_tokens": limit_param}
    params = _params(
        client, body, names, max_new, body.logprobs, body.top_logprobs or 0, constraint
    )
    [rid] = _request_ids(client, "chatcmpl-", body.rid, 1)
    req = GenerationRequest(ids, params, rid, constraint, {"prompt": "messages"})
    group = await client.submit([req], body.timeout)
    head = {"id": rid, "object": "chat.completion", "created": int(time.time())}
    head["model"] = client.model_name
    parse_calls = tools is not None and tools.parses_calls
    states: dict[int, ChoiceToolState] = {}

    def state(index: int) -> ChoiceToolState:
        return states.setdefault(index, ChoiceToolState())

    def choice(out: RequestOutput | Completion, key: str, body_: dict[str, Any]) -> dict[str, Any]:
        lps = {"content": _chat_logprobs(client, out.logprobs)} if body.logprobs else None
        finished = out.finish_reason is not None
        reason = out.finish_reason if finished else None
        if parse_calls and finished:
            reason = state(out.index).finish_reason(reason)
        return {
            "index": out.index,
            key: body_,
            "logprobs": lps,
            "finish_reason": reason,
            "stop_reason": out.stop_reason if finished else None,
        }

    def message(out: Completion) -> dict[str, Any]:
        if not parse_calls:
            return choice(out, "message", {"role": "assistant", "content": out.text})
        st = state(out.index)
        st.delta(out.text, finished=True)
        calls = st.message_tool_calls()
        content = st.parser.result().content
        msg: dict[str, Any] = {"role": "assistant", "content": content or None}
        if calls:
            msg["tool_calls"] = calls
        elif not content:
            msg["content"] = ""
        return choice(out, "message", msg)

    def delta(index: int, out: RequestOutput, _offset: int) -> dict[str, Any] | None:
        if not parse_calls:
            return choice(out, "delta", _delta(out))
        st = state(out.index)
        parsed = st.delta(out.text, out.finished)
        d: dict[str, Any] = {}
        if parsed.content:
            d["content"] = parsed.content
        if parsed.calls:
            d["tool_calls"] = st.delta_tool_calls(parsed)
        if not d and not out.finished and not (body.logprobs and out.logprobs):
            return None  # held back: might be the start of a call
        return choice(out, "delta", d)

    def build(outs: list[list[Completion]]) -> dict[str, Any]:
        choices = [message(c) for c in outs[0]]
        return {**head, "choices": choices, "usage": group.usage()}

    def first(index: int) -> dict[str, Any]:
        delta = {"role": "assistant", "content": None if parse_calls else ""}
        return {"index": index, "delta": delta, "logprobs": None, "finish_reason": None}

    def chunks() -> AsyncIterator[bytes]:
        stream_head = {**head, "object": "chat.completion.chunk"}
        return _stream(group, body, stream_head, delta, first)

    return await respond(request, group, body.stream, build, chunks)


def _delta(out: RequestOutput | Completion) -> dict[str, Any]:
    return {"content": out.text} if out.text or out.finish_reason is None else {}


def _message_dict(m: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": m.text()}
    for key in ("name", "tool_calls", "tool_call_id"):
        if getattr(m, key) is not None:
            d[key] = getattr(m, key)
    return d


def _chat_logprobs(client: EngineClient, lps: list[TokenLogprob]) -> list[dict[str, Any]]:
    def entry(token_id: int, logprob: float) -> dict[str, Any]:
        text = client.token_text(token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return [
        {**entry(lp.token_id, lp.logprob), "top_logprobs": [entry(t, v) for t, v in lp.top]}
        for lp in lps
    ]


# ---- streaming -----------------------------------------------------------------------------------


async def _stream(
    group: RequestGroup,
    body: CompletionRequest | ChatCompletionRequest,
    head: dict[str, Any],
    choice: ChoiceBuilder,
    first: Callable[[int], dict[str, Any]] | None,
) -> AsyncIterator[bytes]:
    """SSE chunks: one choice per chunk, exactly one `finish_reason` per choice, then the usage
    chunk (when `stream_options.include_usage`) and `[DONE]`."""
    opts = body.stream_options
    include_usage = bool(opts and opts.include_usage)
    continuous = bool(opts and opts.continuous_usage_stats)
    offsets: dict[int, int] = {}
    try:
        if first is not None:
            for index in range(len(group.members) * body.n):
                yield sse({**head, "choices": [first(index)], **_usage(group, opts)})
        async for k, out in group:
            if out.finish_reason == "error":
                yield error_event(out)
                yield SSE_DONE
                return
            if not (out.text or out.logprobs or out.finished):
                continue  # tokens that do not complete a character yet
            index = k * body.n + out.index
            offset = offsets.get(index, 0)
            c = choice(index, out, offset)
            if c is None:
                continue
            c["index"] = index
            offsets[index] = offset + len(c.get("text", ""))
            yield sse({**head, "choices": [c], **_usage(group, opts)})
        if include_usage or continuous:
            yield sse({**head, "choices": [], "usage": group.usage()})
        yield SSE_DONE
    except ApiError as err:  # the deadline passed (the group aborted the request)
        yield sse(err.body())
        yield SSE_DONE
    finally:
        group.close()


def _usage(group: RequestGroup, opts: StreamOptions | None) -> dict[str, Any]:
    """`usage` of a non-final chunk: null with include_usage, running totals with
    continuous_usage_stats (vLLM's extension), absent otherwise."""
    if opts is None:
        return {}
    if opts.continuous_usage_stats:
        return {"usage": group.usage()}
    return {"usage": None} if opts.include_usage else {}


# ---- /v1/models ----------------------------------------------------------------------------------


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    client = engine_client(request)
    card = {
        "id": client.model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "radixlm",
        "root": str(client.engine.model_dir),
        "max_model_len": client.engine.max_model_len,
    }
    return OrjsonResponse({"object": "list", "data": [card]})
