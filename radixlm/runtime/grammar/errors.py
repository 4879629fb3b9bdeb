"""Grammar errors: a leaf module (no imports), so that every layer can raise and catch them."""

from __future__ import annotations


class GrammarError(ValueError):
    """A constraint that cannot be served: invalid, unsupported, or too slow to compile. The
    message is meant for the API caller (a 400) and names the problem."""


class GrammarTimeoutError(GrammarError):
    """Compilation did not finish within the manager's ``timeout_s``."""
