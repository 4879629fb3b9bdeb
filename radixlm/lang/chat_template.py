"""Role markers (`user()`, `with s.assistant():`) rendered with the model's own chat template.

The text a role adds around its content is found by rendering the conversation so far plus one
message whose content is a sentinel, and taking the difference from the conversation alone: the
part before the sentinel is the role's prefix (it includes whatever the template adds for a
first message, e.g. SmolLM2's default system prompt), the part after is its suffix. A template
that fails to render (or has none) falls back to ChatML.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)

Messages = list[dict[str, str]]
Render = Callable[[Messages], str]

_SENTINEL = "\x00radixlm-content\x00"


def chatml(messages: Messages) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)


class ChatTemplate:
    """`prefix_and_suffix(role, history)` for one model; `render` maps messages to the text the
    model's template produces (without a generation prompt)."""

    def __init__(self, render: Render | None = None, name: str = "model") -> None:
        self.render = render or chatml
        self.name = name if render is not None else "chatml"

    @classmethod
    def from_tokenizer(cls, tokenizer: object) -> ChatTemplate:
        if getattr(tokenizer, "chat_template", None) is None:
            return cls(None)

        def render(messages: Messages) -> str:
            return tokenizer.apply_chat_template(  # type: ignore[attr-defined]
                messages, tokenize=False, add_generation_prompt=False
            )

        return cls(render)

    def _render(self, messages: Messages) -> str:
        if not messages:
            return ""
        try:
            return self.render(messages)
        except Exception as exc:  # noqa: BLE001 - a template may reject a role order
            logger.debug("chat template failed (%s); using ChatML for this turn", exc)
            return chatml(messages)

    def prefix_and_suffix(self, role: str, history: Messages) -> tuple[str, str]:
        """The text before and after a `role` message's content, after `history`."""
        message = {"role": role, "content": _SENTINEL}
        base = self._render(history)
        full = self._render([*history, message])
        if full.startswith(base) and _SENTINEL in full[len(base) :]:
            new = full[len(base) :]
        else:  # a template that rewrites earlier turns: render the message alone
            new = self._render([message])
            if _SENTINEL not in new:
                new = chatml([message])
        prefix, suffix = new.split(_SENTINEL, 1)
        return prefix, suffix
