"""How tools and tool turns are rendered into the prompt (no server needed): the default block
for a template that ignores tools, Hugging Face's conventions for one that renders them."""

from __future__ import annotations

import json
from typing import Any

import pytest

from radixlm.server.errors import ApiError
from radixlm.server.tools import messages_for_template
from radixlm.tool_calls import format_tool_call, parse_tool_calls, tools_prompt

TOOLS = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
CALL = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":1}'}}
HISTORY: list[dict[str, Any]] = [
    {"role": "user", "content": "1 plus 2?"},
    {"role": "assistant", "content": "", "tool_calls": [CALL]},
    {"role": "tool", "content": "3", "tool_call_id": "call_1"},
]


def test_default_block_and_calls_as_generated_text() -> None:
    out = messages_for_template(HISTORY, TOOLS, template_has_tools=False)
    assert out[0] == {"role": "system", "content": tools_prompt(TOOLS)}
    assistant = out[2]
    assert "tool_calls" not in assistant
    # exactly the text the grammar makes the model write: the history is a cached prefix
    assert assistant["content"] == format_tool_call("add", '{"a":1}')
    assert [(c.name, c.args) for c in parse_tool_calls(assistant["content"]).calls] == [
        ("add", {"a": 1})
    ]
    assert out[3] == HISTORY[2]
    with_system = [{"role": "system", "content": "Be brief."}, *HISTORY]
    out = messages_for_template(with_system, TOOLS, template_has_tools=False)
    assert out[0]["content"] == "Be brief.\n\n" + tools_prompt(TOOLS)
    assert len(out) == len(with_system)


def test_tool_aware_template_gets_dict_arguments() -> None:
    out = messages_for_template(HISTORY, TOOLS, template_has_tools=True)
    assert len(out) == len(HISTORY)  # no extra system block: the template renders tools
    fn = out[1]["tool_calls"][0]["function"]
    assert fn == {"name": "add", "arguments": {"a": 1}}
    assert HISTORY[1]["tool_calls"][0]["function"]["arguments"] == '{"a":1}'  # not mutated


def test_a_tool_aware_template_renders_the_converted_history() -> None:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"a": 0}, "a")))
    tok.chat_template = (
        "{% if tools %}TOOLS:{{ tools | tojson }}\n{% endif %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content or '' }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} "
        "{{ c.function.arguments | tojson }}{% endfor %}\n{% endfor %}"
    )
    msgs = messages_for_template(HISTORY, TOOLS, template_has_tools=True)
    text = tok.apply_chat_template(msgs, tools=TOOLS, tokenize=False)
    assert text.startswith("TOOLS:") and 'CALL add {"a": 1}' in text


def test_malformed_history_call_is_a_400() -> None:
    bad = [{"role": "assistant", "content": "", "tool_calls": [{"function": {}}]}]
    with pytest.raises(ApiError) as exc:
        messages_for_template(bad, TOOLS, template_has_tools=False)
    assert exc.value.param == "messages"
    json.dumps(messages_for_template(HISTORY, None, template_has_tools=False))
