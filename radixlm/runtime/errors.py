"""Typed errors of the engine's public API (torch-free)."""

from __future__ import annotations


class RequestValidationError(ValueError):
    """A request that `Engine.submit` refuses; nothing was queued. `field` names the offending
    input in the engine's terms (`prompt`, `stop_token_ids`, `logit_bias`, `constraint`, ...);
    `code` is a machine-readable reason (`context_length_exceeded`, ...) or None."""

    def __init__(self, message: str, field: str, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.field = field
        self.code = code


class EngineDeadError(RuntimeError):
    """The engine's step thread has died (or the engine is shut down): nothing more will run."""


class ConfigError(ValueError):
    """A configuration the engine cannot run (a bad knob, or a model/parallelism mismatch such
    as a tensor-parallel size that does not divide the heads); raised before anything starts.
    The CLI prints it as one line and exits 2."""
