"""`RuntimeEndpoint`: a frontend backend over the native HTTP API (`POST /generate`).

Works with `radixlm serve` (and SGLang's server, which speaks the same API). Nothing is sent at
construction, so an unreachable server shows up as the first call's error, on the program's
state. Every request has a timeout. The tokenizer (needed by `select` and by roles, which are
rendered with the model's chat template) is loaded lazily from the server's `tokenizer_path`
(`/get_model_info`), or from `tokenizer_path=` when the server's path is not readable here.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from radixlm.lang.backend.base import BaseBackend, Meta, check_scores
from radixlm.lang.chat_template import ChatTemplate
from radixlm.lang.ir import GenParams


class RuntimeEndpoint(BaseBackend):
    """`RuntimeEndpoint("http://127.0.0.1:30000", api_key=None)`."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 600.0,
        connect_timeout: float = 5.0,
        tokenizer_path: str | None = None,
    ) -> None:
        try:
            import httpx
        except ImportError:
            raise ImportError("RuntimeEndpoint needs httpx: pip install httpx") from None

        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=512, max_keepalive_connections=64),
        )
        self._tokenizer_path = tokenizer_path
        self._tokenizer: Any = None
        self._template: ChatTemplate | None = None
        self._lock = threading.Lock()

    # ---- HTTP ---------------------------------------------------------------------------------

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        import httpx

        try:
            r = self._client.request(method, path, json=body)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{self.base_url}{path}: no answer in time ({exc!r})") from None
        except httpx.HTTPError as exc:
            raise ConnectionError(f"cannot reach {self.base_url}{path}: {exc!r}") from None
        if r.status_code != 200:
            raise RuntimeError(f"{self.base_url}{path}: HTTP {r.status_code}: {_message(r.text)}")
        return r.json() if r.content else None

    def _generate(self, body: dict[str, Any]) -> Any:
        return self._request("POST", "/generate", body)

    def get_model_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_model_info")

    def get_server_info(self) -> dict[str, Any]:
        return self._request("GET", "/get_server_info")

    # ---- generation ---------------------------------------------------------------------------

    def generate(self, prompt: str, params: GenParams) -> tuple[str | list[str], Meta]:
        obj = self._generate(self._body(prompt, params, stream=False))
        outs = obj if isinstance(obj, list) else [obj]
        texts = [o["text"] for o in outs]
        meta = outs[0]["meta_info"]
        if params.n and params.n > 1:
            return texts, meta
        return texts[0], meta

    def generate_stream(self, prompt: str, params: GenParams) -> Iterator[tuple[str, Meta]]:
        import httpx

        if params.n and params.n > 1:
            raise ValueError("gen: n > 1 cannot be streamed")
        body = self._body(prompt, params, stream=True)
        seen = 0
        try:
            with self._client.stream("POST", "/generate", json=body) as r:
                if r.status_code != 200:
                    r.read()
                    raise RuntimeError(f"/generate: HTTP {r.status_code}: {_message(r.text)}")
                for line in r.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    data = line[5:].strip()
                    if data == "[DONE]":
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise RuntimeError(f"/generate: {_message(data)}")
                    text = event["text"]  # cumulative (SGLang's convention)
                    yield text[seen:], event["meta_info"]
                    seen = len(text)
        except httpx.TimeoutException as exc:
            raise TimeoutError(f"{self.base_url}/generate: no answer in time ({exc!r})") from None
        except httpx.HTTPError as exc:
            raise ConnectionError(f"cannot reach {self.base_url}/generate: {exc!r}") from None

    def cache_prefix(self, prompt: str | Sequence[int]) -> None:
        key = "text" if isinstance(prompt, str) else "input_ids"
        value = prompt if isinstance(prompt, str) else list(prompt)
        self._generate({key: value, "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}})

    def score(self, prompts: Sequence[Sequence[int]], starts: Sequence[int]) -> list[list[Any]]:
        # NOTE: logprob_start_len is one value per request body: score from the earliest start
        # and drop the extra positions of the others.
        first = min(starts)
        obj = self._generate(
            {
                "input_ids": [list(p) for p in prompts],
                "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
                "return_logprob": True,
                "logprob_start_len": first,
            }
        )
        outs = obj if isinstance(obj, list) else [obj]
        scored = [
            [e[0] for e in o["meta_info"]["input_token_logprobs"]][s - first :]
            for o, s in zip(outs, starts)
        ]
        return check_scores(scored, prompts, starts)

    def _body(self, prompt: str, p: GenParams, stream: bool) -> dict[str, Any]:
        sp: dict[str, Any] = {
            "max_new_tokens": p.max_new_tokens,
            "min_new_tokens": p.min_new_tokens,
            "n": p.n,
            "stop": p.stop_list or None,
            "stop_token_ids": list(p.stop_token_ids or ()) or None,
            "stop_regex": list(p.stop_regex or ()) or None,
            "temperature": float(p.temperature or 0.0),
            "top_p": float(p.top_p if p.top_p is not None else 1.0),
            "top_k": p.top_k,
            "min_p": float(p.min_p or 0.0),
            "frequency_penalty": float(p.frequency_penalty or 0.0),
            "presence_penalty": float(p.presence_penalty or 0.0),
            "ignore_eos": p.ignore_eos,
        }
        sp.update(p.constraint_kwargs())
        body: dict[str, Any] = {
            "text": prompt,
            "sampling_params": {k: v for k, v in sp.items() if v is not None},
            "stream": stream,
        }
        if p.return_logprob:
            body["return_logprob"] = True
            body["top_logprobs_num"] = p.top_logprobs_num or 0
        return body

    # ---- model facts and control --------------------------------------------------------------

    def get_tokenizer(self) -> Any:
        with self._lock:
            if self._tokenizer is None:
                from radixlm.runtime.models.loader import load_tokenizer

                path = self._tokenizer_path or self.get_model_info().get("tokenizer_path")
                if not path or not Path(path).is_dir():
                    raise RuntimeError(
                        f"the model's tokenizer is not readable here ({path!r}); select and "
                        "roles need it: pass RuntimeEndpoint(..., tokenizer_path=LOCAL_DIR)"
                    )
                self._tokenizer = load_tokenizer(Path(path))
            return self._tokenizer

    def tokenize(self, text: str) -> list[int]:
        return self.get_tokenizer().encode(text, add_special_tokens=False)

    def get_chat_template(self) -> ChatTemplate:
        if self._template is None:
            self._template = ChatTemplate.from_tokenizer(self.get_tokenizer())
        return self._template

    def stats(self) -> dict[str, Any]:
        return self.get_server_info()["engine_stats"]

    def flush_cache(self) -> bool:
        try:
            self._request("POST", "/flush_cache")
        except RuntimeError:
            return False
        return True

    def shutdown(self) -> None:
        self._client.close()


def _message(text: str) -> str:
    """The `error.message` of an OpenAI-style error body, else the body itself (shortened)."""
    try:
        err = json.loads(text).get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
    except (ValueError, AttributeError):
        pass
    return text[:500]
