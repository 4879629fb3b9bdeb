"""Request bodies of the HTTP API as pydantic models (OpenAI-compatible and SGLang-native).

Every model is strict (no `"1"` for an int, no `true` for a number) and forbids unknown fields,
so a typo'd or unsupported argument is a 400 naming it instead of being silently ignored.
Range checks that `SamplingParams` repeats live here too, so errors name the API's field
(`max_tokens`), not the engine's (`max_new_tokens`).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from radixlm.runtime.sampling_params import MAX_TOP_LOGPROBS

_STRICT = ConfigDict(strict=True, extra="forbid")

PositiveInt = Annotated[int, Field(ge=1)]
TokenId = Annotated[int, Field(ge=0)]
Temperature = Annotated[float, Field(ge=0.0)]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0)]
Seed = Annotated[int, Field(ge=0, lt=2**64)]
Stop = str | list[str]
Timeout = Annotated[float, Field(gt=0.0, le=86400.0)]


class _Strict(BaseModel):
    model_config = _STRICT


# ---- OpenAI: shared pieces ---------------------------------------------------------------------


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaSpec(_Strict):
    name: str = "response"
    description: str | None = None
    # NOTE: `schema` shadows a BaseModel attribute, hence the alias.
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """`{"type": "text" | "json_object" | "json_schema", "json_schema": {...}}`."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _schema_iff_json_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("type json_schema needs a json_schema object")
        return self


class _OpenAISampling(_Strict):
    """Fields shared by /v1/completions and /v1/chat/completions (OpenAI + vLLM/SGLang extras)."""

    model: str | None = None
    n: PositiveInt = 1
    temperature: Temperature | None = None
    top_p: TopP | None = None
    stop: Stop | None = None
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # extra body fields (SGLang / vLLM names)
    top_k: int | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    min_tokens: Annotated[int, Field(ge=0)] | None = None
    ignore_eos: bool = False
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    regex: str | None = None
    ebnf: str | None = None
    grammar_best_effort: bool = False  # ignore schema keywords the backend cannot enforce
    grammar_whitespace: Literal["compact", "any"] = "compact"  # whitespace in generated JSON
    rid: str | None = None
    # Deadline in seconds from submission (default: the server's --request-timeout); past it
    # the request is aborted and answered 408.
    timeout: Timeout | None = None


class CompletionRequest(_OpenAISampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: Annotated[int, Field(ge=1)] | None = 16
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool = False
    best_of: PositiveInt | None = None
    suffix: str | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    # NOTE: not `extra="forbid"`: clients echo back assistant messages with extra keys
    # (refusal, annotations, audio); those are ignored, but `content` is checked strictly.
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(_Strict):
    """`tools[i].function`: the name is checked in `radixlm.server.tools` (a-z, A-Z, 0-9, `_`,
    `-`; at most 64), `parameters` is a JSON schema object (default: any object)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """`{"type": "function", "function": {"name": ...}}`."""

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_OpenAISampling):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # None: true unless continue_final_message (vLLM); both true is a 400.
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---- SGLang native -----------------------------------------------------------------------------

OptInt = Annotated[int, Field(ge=0)] | None
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class NativeSamplingParams(_Strict):
    """SGLang 0.5.x's `sampling_params` (sglang/srt/sampling/sampling_params.py).

    Like SGLang, `null` means "the default" for every field. The fields in
    `NATIVE_DEFAULT_ONLY` are accepted only at their defaults (native_api refuses any other
    value with a 400 naming it); `seed`, `grammar_best_effort` and `grammar_whitespace` are
    radixlm's own additions.
    """

    max_new_tokens: Annotated[int, Field(ge=0)] | None = 128  # 0: prefill only; null: to the end
    min_new_tokens: OptInt = 0
    temperature: Temperature | None = 1.0
    top_p: TopP | None = 1.0
    top_k: int | None = -1
    min_p: MinP | None = 0.0
    frequency_penalty: Penalty | None = 0.0
    presence_penalty: Penalty | None = 0.0
    repetition_penalty: Annotated[float, Field(gt=0.0, le=2.0)] | None = 1.0
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    stop_regex: Stop | None = None
    ignore_eos: bool | None = False
    skip_special_tokens: bool | None = True
    no_stop_trim: bool | None = False
    n: PositiveInt | None = 1
    sampling_seed: Seed | None = None
    seed: Seed | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # radixlm: a `tool_calls` constraint spec ({"tools": [{"name", "parameters"}], "mode":
    # "required" | "auto", "parallel": bool}), what `gen(tools=...)` sends
    tool_calls: str | dict[str, Any] | None = None
    grammar_best_effort: bool = False
    grammar_whitespace: Literal["compact", "any"] = "compact"
    stream_interval: PositiveInt | None = None  # pacing hint; every delta is sent
    # Accepted only at their defaults (see NATIVE_DEFAULT_ONLY).
    spaces_between_special_tokens: bool | None = True
    beam_width: int | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None
    watermark: Any = None


class GenerateReqInput(_Strict):
    """Body of `POST /generate` (SGLang's `GenerateReqInput`): one prompt or a batch, as text or
    token ids. `return_logprob`, `logprob_start_len` and `top_logprobs_num` may be one value or
    one per prompt, as in SGLang."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: TopLogprobs | None | list[TopLogprobs | None] = None
    return_text_in_logprobs: bool = False
    # Metadata SGLang accepts; they do not change the result.
    session_id: str | None = None
    routing_key: str | None = None
    conversation_id: str | None = None
    log_metrics: bool = True
    # A router (smg) forwards SGLang's full request shape: `model` and these, at defaults.
    model: str | None = None
    no_logs: bool = False
    return_bytes: Any = False
    return_entropy: Any = False
    timeout: Timeout | None = None  # deadline in seconds (default: --request-timeout)
    modalities: list[str] | None = None
    # Accepted only at their defaults (see NATIVE_DEFAULT_ONLY).
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    mm_hashes: Any = None
    mm_content_hashes: Any = None
    use_audio_in_video: Any = False
    video_config: Any = None
    watermark: Any = None
    token_ids_logprob: Any = None
    return_sampling_mask: Any = None
    sampling_logprobs_mode: Any = None
    return_flat_raw_top_logprobs: Any = False
    return_flat_raw_output_top_logprobs: Any = False
    return_flat_raw_top_logprobs_b64: Any = False
    return_hidden_states: Any = False
    return_routed_experts: Any = False
    routed_experts_start_len: Any = 0
    return_indexer_topk: Any = False
    session_params: Any = None
    lora_path: Any = None
    lora_id: Any = None
    custom_logit_processor: Any = None
    positional_embed_overrides: Any = None
    bootstrap_host: Any = None
    bootstrap_port: Any = None
    bootstrap_room: Any = None
    bootstrap_pair_key: Any = None
    decode_tp_size: Any = None
    routed_dp_rank: Any = None
    data_parallel_rank: Any = None
    disagg_prefill_dp_rank: Any = None
    background: Any = False
    require_reasoning: Any = False


# Field -> (the values accepted, why nothing else is). Every other value is a 400 naming the
# field. Keys of `sampling_params` are prefixed with "sampling_params.".
_MM = "multimodal input is not supported (text-only models)"
_FLAT = "flat top-logprob arrays are not supported"
_DISAGG = "prefill/decode disaggregation and data-parallel routing are not supported"
NATIVE_DEFAULT_ONLY: dict[str, tuple[tuple[Any, ...], str]] = {
    "sampling_params.spaces_between_special_tokens": (
        (None, True),
        "false is not supported (special tokens are decoded without spaces between them)",
    ),
    "sampling_params.beam_width": ((None, 1), "beam search is not supported"),
    "sampling_params.custom_params": (
        (None, {}),
        "custom_params is not supported (no custom logit processors)",
    ),
    "sampling_params.watermark": ((None,), "watermarking is not supported"),
    "input_embeds": ((None,), "input embeddings are not supported; send text or input_ids"),
    "image_data": ((None, []), _MM),
    "video_data": ((None, []), _MM),
    "audio_data": ((None, []), _MM),
    "mm_hashes": ((None,), _MM),
    "mm_content_hashes": ((None,), _MM),
    "use_audio_in_video": ((False, None), _MM),
    "video_config": ((None,), _MM),
    "watermark": ((None,), "watermarking is not supported"),
    "token_ids_logprob": ((None,), "logprobs of chosen token ids are not supported"),
    "return_sampling_mask": ((None, False), "sampling masks are not returned"),
    "sampling_logprobs_mode": ((None,), "sampling masks are not returned"),
    "return_flat_raw_top_logprobs": ((False, None), _FLAT),
    "return_flat_raw_output_top_logprobs": ((False, None), _FLAT),
    "return_flat_raw_top_logprobs_b64": ((False, None), _FLAT),
    "return_hidden_states": ((False, None), "hidden states are not returned"),
    "return_bytes": ((False, None), "token bytes are not returned"),
    "return_entropy": ((False, None), "entropies are not returned"),
    "return_routed_experts": ((False, None), "not a mixture-of-experts server"),
    "routed_experts_start_len": ((0, None), "not a mixture-of-experts server"),
    "return_indexer_topk": ((False, None), "not a sparse-attention server"),
    "session_params": ((None,), "sessions (session_params) are not supported"),
    "lora_path": ((None,), "LoRA adapters are not supported"),
    "lora_id": ((None,), "LoRA adapters are not supported"),
    "custom_logit_processor": ((None,), "custom logit processors are not supported"),
    "positional_embed_overrides": ((None,), "embedding overrides are not supported"),
    "bootstrap_host": ((None,), _DISAGG),
    "bootstrap_port": ((None,), _DISAGG),
    "bootstrap_room": ((None,), _DISAGG),
    "bootstrap_pair_key": ((None,), _DISAGG),
    "decode_tp_size": ((None,), _DISAGG),
    "routed_dp_rank": ((None, 0), _DISAGG),
    "data_parallel_rank": ((None, 0), _DISAGG),
    "disagg_prefill_dp_rank": ((None,), _DISAGG),
    "background": ((False, None), "background requests are not supported"),
    "require_reasoning": ((False, None), "not a reasoning model server"),
}


class EncodeReqInput(_Strict):
    """Body of `POST /encode` (SGLang's `EmbeddingReqInput`, text-only)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    log_metrics: bool = True
    modalities: list[str] | None = None
    lora_path: Any = None
    input_embeds: Any = None
    image_data: Any = None
    video_data: Any = None
    audio_data: Any = None
    is_cross_encoder_request: bool = False


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False
    # SGLang's AbortReq also carries these; they do not change what is aborted.
    finished_reason: dict[str, Any] | None = None
    abort_message: str | None = None
