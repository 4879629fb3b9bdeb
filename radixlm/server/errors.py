"""OpenAI-style error bodies for every endpoint: `{"error": {message, type, param, code}}`.

FastAPI's 422 validation errors become 400s naming the offending field (`messages[0].content`),
HTTP errors (404, 405) get the same shape, and anything unexpected is a 500 that does not take
the server down.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

logger = logging.getLogger(__name__)

# Segments pydantic adds to an error location to say which union member failed.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "bytes"})


class OrjsonResponse(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY)


class ApiError(Exception):
    """An error that becomes an HTTP response (400 unless told otherwise)."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        status_code: int = 400,
        code: str | None = None,
        err_type: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.status_code = status_code
        self.code = code
        self.err_type = err_type or _default_type(status_code)
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.err_type, self.param, self.code)

    def response(self) -> OrjsonResponse:
        return OrjsonResponse(self.body(), status_code=self.status_code, headers=self.headers)


def _default_type(status_code: int) -> str:
    if status_code == 401:
        return "authentication_error"
    if status_code == 404:
        return "not_found_error"
    if status_code == 503:
        return "overloaded_error"
    if status_code >= 500:
        return "internal_server_error"
    return "invalid_request_error"


def error_body(
    message: str, err_type: str, param: str | None = None, code: str | int | None = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": err_type, "param": param, "code": code}}


def loc_to_param(loc: Sequence[str | int]) -> str | None:
    """`("body", "messages", 0, "content", "str")` -> `"messages[0].content"`;
    `("body", "sampling_params", "NativeSamplingParams", "n")` -> `"sampling_params.n"`."""
    parts = list(loc)
    if parts and parts[0] == "body":
        parts = parts[1:]
    out = ""
    for part in parts:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        if part[:1].isupper():
            continue  # union member tag naming a model: its fields follow
        if part in _TYPE_TAGS or any(c in part for c in "[]()-,"):
            break  # union member tag of a plain type: the field itself is named already
        out += f".{part}" if out else part
    return out or None


def validation_error(exc: RequestValidationError) -> ApiError:
    errors = exc.errors()
    if not errors:
        return ApiError("invalid request body")
    err = errors[0]
    if err.get("type") == "json_invalid":
        detail = err.get("ctx", {}).get("error", "")
        return ApiError(f"Invalid JSON body: {detail}".rstrip(": "), code="invalid_json")
    loc = tuple(err.get("loc", ()))
    param = loc_to_param(loc)
    msg = str(err.get("msg", "invalid value"))
    if err.get("type") == "extra_forbidden":
        return ApiError(f"Unrecognized request argument supplied: {param}", param=param)
    if param is None:
        if err.get("type") in ("model_attributes_type", "dict_type", "model_type", "missing"):
            msg = "must be a JSON object (send Content-Type: application/json)"
        return ApiError(f"Request body: {msg}", code="invalid_body")
    return ApiError(f"{param}: {msg}", param=param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> Response:
        if exc.status_code >= 500:
            logger.error("request failed: %s", exc.message)
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        err = ApiError(str(exc.detail), status_code=exc.status_code)
        return OrjsonResponse(err.body(), status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> Response:
        logger.exception("unhandled error")
        err = ApiError(f"internal error: {type(exc).__name__}: {exc}", status_code=500)
        return err.response()
