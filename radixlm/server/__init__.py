"""The HTTP server: OpenAI-compatible (`/v1/completions`, `/v1/chat/completions`, `/v1/models`)
and SGLang-native (`/generate`, `/get_model_info`, `/health`, `/flush_cache`, `/abort_request`,
...) endpoints plus Prometheus `/metrics`, over one `Engine`.

    radixlm serve [--model PATH_OR_GGUF] [--host 127.0.0.1] [--port 30000] [engine flags...]

Modules: `protocol` (pydantic request models), `serving` (engine bridge: `EngineClient`,
`ServerConfig`), `request_group` (one HTTP request's prompts in flight: `RequestGroup`),
`openai_api` / `native_api` / `control_api` / `router_api` (routes), `errors` (OpenAI-style
error bodies), `metrics`, `app` (`create_app`), `launch` (uvicorn runner).
"""

from __future__ import annotations

from radixlm.server.app import create_app
from radixlm.server.server_config import ServerConfig

__all__ = ["create_app", "ServerConfig"]
