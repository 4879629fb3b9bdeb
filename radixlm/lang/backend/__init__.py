"""Backends a frontend program runs on: `Runtime` (in-process Engine) and `RuntimeEndpoint`
(radixlm's or SGLang's native HTTP API). Imported lazily: `Runtime` pulls in torch."""

from __future__ import annotations

from radixlm.lang.backend.base import BaseBackend

__all__ = ["BaseBackend"]
