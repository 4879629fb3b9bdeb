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
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None


# ---- SGLang native -----------------------------------------------------------------------------


class NativeSamplingParams(_Strict):
    """SGLang's `sampling_params` names (sglang/srt/sampling/sampling_params.py)."""

    max_new_tokens: Annotated[int, Field(ge=0)] = 128  # 0: prefill (and cache) only
    min_new_tokens: Annotated[int, Field(ge=0)] = 0
    temperature: Temperature = 1.0
    top_p: TopP = 1.0
    top_k: int = -1
    min_p: MinP = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    stop: Stop | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    no_stop_trim: bool = False
    n: PositiveInt = 1
    seed: Seed | None = None
    sampling_seed: Seed | None = None
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None
    # radixlm: a `tool_calls` constraint spec ({"tools": [{"name", "parameters"}], "mode":
    # "required" | "auto", "parallel": bool}), what `gen(tools=...)` sends
    tool_calls: str | dict[str, Any] | None = None
    grammar_best_effort: bool = False
    grammar_whitespace: Literal["compact", "any"] = "compact"
    stream_interval: PositiveInt | None = None
    logit_bias: dict[str, float] | None = None
    custom_params: dict[str, Any] | None = None


class GenerateReqInput(_Strict):
    """Body of `POST /generate`: one prompt or a batch, as text or token ids."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: NativeSamplingParams | list[NativeSamplingParams] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] = 0
    return_text_in_logprobs: bool = False
    # Accepted for compatibility with SGLang clients; they change nothing here.
    modalities: list[str] | None = None
    lora_path: None = None
    custom_logit_processor: None = None


class AbortReqInput(_Strict):
    rid: str = ""
    abort_all: bool = False
