"""Incremental detokenization with stop strings.

Decoding uses the prefix/read-offset technique of vLLM / TGI: each step decodes only a small
window ``ids[prefix_offset:]`` and releases what extends past
``decode(ids[prefix_offset:read_offset])``.
The window starts a few prompt tokens back, so tokenizers that drop a leading space at the start
of a decode (SentencePiece, some byte-level ones) still render it mid-sequence.

Invariants:

- a delta never ends in a partial UTF-8 character: while the decoded window ends with U+FFFD the
  text is held back (``finish()`` flushes whatever is left);
- a stop string never appears in a released delta unless ``include_stop_str_in_output``: text
  that could still be the start of a stop string is held back;
- ``"".join(every delta returned so far) == text`` at all times;
- the first stop string to *complete* wins (ties: the one starting first), which is what a
  character-by-character scan would find, independent of tokenization;
- ``stop_regex``: the generated text is searched after every character it grows by, so the
  first match to complete wins (against stop strings too; a tie goes to the stop string); the
  output ends exactly where that match ends: the match is kept (SGLang's behaviour) and nothing
  after it is ever released. Text before a possible match needs no hold-back, since it is part
  of the output either way. ``stop_reason`` is then the pattern.
- deltas are decoded with ``clean_up_tokenization_spaces=False`` so the streamed text equals
  ``tokenizer.decode(ids, skip_special_tokens=..., clean_up_tokenization_spaces=False)``.

Stop token ids and EOS are the scheduler's job (see ``stop_token_hit``); a finishing stop token
should only be appended here when its text is wanted in the output.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from typing import Any

from radixlm.runtime.sampling_params import SamplingParams

REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5
_UNBOUNDED = 2**31  # `getwidth()` reports an unbounded repeat as a huge number


def stop_token_hit(
    token_id: int, params: SamplingParams, eos_token_ids: Iterable[int], num_output_tokens: int
) -> int | None:
    """``token_id`` if it finishes the request, else None. ``num_output_tokens`` counts the
    generated tokens including this one; nothing stops before ``min_new_tokens`` are generated."""
    if num_output_tokens <= params.min_new_tokens:
        return None
    if token_id in params.stop_token_ids:
        return token_id
    if not params.ignore_eos and token_id in set(eos_token_ids):
        return token_id
    return None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into released text deltas, one token at a time.

    ``tokenizer`` is a Hugging Face tokenizer (anything with ``decode(ids, skip_special_tokens=,
    clean_up_tokenization_spaces=)``). After a stop string is found ``stopped`` is True,
    ``stop_reason`` holds the stop string, and further ``append`` calls return "".
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        context_tokens: int = PROMPT_CONTEXT_TOKENS,
    ) -> None:
        self._tokenizer = tokenizer
        self._skip_special = params.skip_special_tokens
        self._stop = params.stop
        # (pattern, longest match in characters or None when unbounded)
        self._regex = [(r, _max_width(r)) for r in params.compiled_stop_regex]
        self._checked = 0  # characters of text + pending already searched for stop_regex
        self._include_stop = params.include_stop_str_in_output
        # NOTE: _ids holds only the decode window; ids before prefix_offset are dropped.
        self._ids: list[int] = list(prompt_ids[-context_tokens:]) if context_tokens > 0 else []
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached
        self._pending = ""  # decoded but held back (could begin a stop string)
        self._chunks: list[str] = []  # released deltas
        self.num_tokens = 0
        self.stopped = False
        self.stop_reason: str | None = None
        self.finished = False

    @property
    def text(self) -> str:
        """The released output text: the concatenation of all deltas returned so far."""
        if len(self._chunks) > 1:
            self._chunks = ["".join(self._chunks)]
        return self._chunks[0] if self._chunks else ""

    def append(self, token_id: int) -> str:
        """Feed one generated token; return the newly released text (possibly "")."""
        if self.stopped or self.finished:
            return ""
        self.num_tokens += 1
        self._ids.append(token_id)
        self._pending += self._decode_window(final=False)
        return self._release(final=False)

    def finish(self) -> str:
        """Flush held-back text (end by length / EOS / stop token); return the last delta."""
        if self.stopped or self.finished:
            return ""
        self.finished = True
        self._pending += self._decode_window(final=True)
        return self._release(final=True)

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )

    def _decode_window(self, final: bool) -> str:
        """Newly decodable text of the window; advances the offsets when it returns text."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(self._prefix_text):
            return ""
        if not final and new_text.endswith(REPLACEMENT_CHAR):
            return ""  # a multi-byte character is still incomplete
        delta = new_text[len(self._prefix_text) :]
        # Slide the window: the new prefix is what was just read.
        del self._ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(self._ids)
        self._prefix_text = None
        return delta

    def _release(self, final: bool) -> str:
        """Move the releasable part of ``_pending`` to the output, handling stop strings."""
        pending = self._pending
        hit = self._find_stop(pending) if self._stop and pending else None
        if self._regex and pending:
            regex_hit = self._find_regex(pending)
            if regex_hit is not None and (hit is None or regex_hit[0] < hit[0] + len(hit[1])):
                end, pattern = regex_hit
                self._pending = ""
                self.stopped, self.stop_reason = True, pattern
                return self._emit(pending[:end])
        if hit is not None:
            start, stop = hit
            cut = start + len(stop) if self._include_stop else start
            self._pending = ""
            self.stopped, self.stop_reason = True, stop
            return self._emit(pending[:cut])
        hold = 0 if final else self._holdback(pending)
        self._pending = pending[len(pending) - hold :] if hold else ""
        return self._emit(pending[: len(pending) - hold])

    def _find_stop(self, text: str) -> tuple[int, str] | None:
        """(start, stop string) of the occurrence that ends first; ties: the one starting first."""
        best: tuple[int, int, str] | None = None
        for stop in self._stop:
            start = text.find(stop)
            if start >= 0:
                key = (start + len(stop), start, stop)
                if best is None or key[:2] < best[:2]:
                    best = key
        return None if best is None else (best[1], best[2])

    def _find_regex(self, pending: str) -> tuple[int, str] | None:
        """(end within ``pending``, pattern) of the stop_regex match that completes first.

        Each end position not searched before is tried in order, so the result does not
        depend on how the text was split into tokens; a bounded pattern only searches the
        window where a match ending there could start."""
        released = len(self.text)
        full = self.text + pending
        first = max(self._checked, released) + 1
        self._checked = len(full)
        for end in range(first, len(full) + 1):
            for pattern, width in self._regex:
                lo = 0 if width is None else max(0, end - width)
                if pattern.search(full, lo, end) is not None:
                    return end - released, pattern.pattern
        return None

    def _holdback(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        hold = 0
        for stop in self._stop:
            for k in range(min(len(stop) - 1, len(text)), hold, -1):
                if text.endswith(stop[:k]):
                    hold = k
                    break
        return hold

    def _emit(self, delta: str) -> str:
        if delta:
            self._chunks.append(delta)
        return delta


def _max_width(pattern: re.Pattern[str]) -> int | None:
    """Most characters one match of ``pattern`` can span; None when unbounded."""
    try:
        from re import _parser as parser  # Python >= 3.11
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_parse as parser  # type: ignore[no-redef]
    try:
        width = parser.parse(pattern.pattern, pattern.flags).getwidth()[1]
    except Exception:  # noqa: BLE001 - fall back to searching the whole text
        return None
    return None if width >= _UNBOUNDED else width
