"""The ``tool_calls`` constraint (both backends, walked token by token) and the parser of the
tool-call format (streaming == whole text)."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import jsonschema
import pytest
from grammar_helpers import BYTE_VOCAB, EOS, grammar_accepts, walk
from hypothesis import given, settings
from hypothesis import strategies as st

from radixlm.runtime.grammar.base import GrammarBackend, get_backend
from radixlm.runtime.grammar.bitmask import allocate_bitmask, is_token_allowed
from radixlm.runtime.grammar.constraint import Constraint
from radixlm.runtime.grammar.errors import GrammarError
from radixlm.runtime.grammar.verified import VerifiedGrammar
from radixlm.tool_calls import (
    ToolCallParser,
    format_tool_call,
    parse_tool_calls,
    tools_prompt,
)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 20},
        "unit": {"enum": ["c", "f"]},
    },
    "required": ["city", "unit"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}, "b": {"type": "integer"}},
    "required": ["a", "b"],
}


# outlines cannot enforce integer bounds: it gets ADD without them
ADD_UNBOUNDED = {**ADD, "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}


def _spec(mode: str = "required", parallel: bool = False, **tools: Any) -> str:
    tools = tools or {"get_weather": WEATHER, "add": ADD}
    items = [{"name": n, "parameters": p} for n, p in tools.items()]
    return json.dumps({"mode": mode, "parallel": parallel, "tools": items})


def _c(mode: str = "required", parallel: bool = False, **tools: Any) -> Constraint:
    return Constraint("tool_calls", _spec(mode, parallel, **tools))


CALL_W = format_tool_call("get_weather", '{"city":"Paris","unit":"c"}')
CALL_A = format_tool_call("add", '{"a":3,"b":-4}')


def _accepts(matcher: Any, tokenizer: Any, text: str) -> bool:
    return matcher.accept_tokens(tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "llguidance"])
def test_required_accepts_exactly_calls(
    backend: str, tokenizer: Any, compile_for: Callable[[str, Constraint], Any]
) -> None:
    add = ADD_UNBOUNDED if backend == "outlines" else ADD
    single = compile_for(backend, _c(get_weather=WEATHER, add=add))
    walk(single.new_matcher(), tokenizer.encode(CALL_W, add_special_tokens=False))
    walk(single.new_matcher(), tokenizer.encode(CALL_A, add_special_tokens=False))
    # the start state cannot stop, and forbids free text and unknown tools
    m = single.new_matcher()
    mask = allocate_bitmask(1, m.vocab.vocab_size)
    m.fill_bitmask(mask, 0)
    assert not is_token_allowed(mask, 0, EOS)
    assert not _accepts(single.new_matcher(), tokenizer, "Hello")
    assert not _accepts(single.new_matcher(), tokenizer, format_tool_call("nope", "{}"))
    # arguments follow the schema: the enum and the integer bounds
    bad_enum = format_tool_call("get_weather", '{"city":"Paris","unit":"k"}')
    assert not _accepts(single.new_matcher(), tokenizer, bad_enum)
    if backend != "outlines":
        assert not _accepts(single.new_matcher(), tokenizer, format_tool_call("add", '{"a":12'))
    # without parallel, a second call is refused; with it, accepted
    m = single.new_matcher()
    assert _accepts(m, tokenizer, CALL_W)
    assert m.only_eos_allowed()
    both = tokenizer.encode(CALL_W + "\n" + CALL_A, add_special_tokens=False)
    parallel = compile_for(backend, _c(parallel=True, get_weather=WEATHER, add=add))
    walk(parallel.new_matcher(), both, eos_only_at_end=False)


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_auto_allows_text_then_a_constrained_call(
    backend: str, tokenizer: Any, compile_for: Callable[[str, Constraint], Any]
) -> None:
    auto = compile_for(backend, _c("auto"))
    text = tokenizer.encode("Sure, one moment.", add_special_tokens=False)
    walk(auto.new_matcher(), text, eos_only_at_end=False)  # plain text may stop
    ids = tokenizer.encode("Let me check.\n" + CALL_W, add_special_tokens=False)
    walk(auto.new_matcher(), ids, eos_only_at_end=False)
    m = auto.new_matcher()
    assert _accepts(m, tokenizer, "Ok <tool_call>")
    assert not m.is_completed()  # inside a call: cannot stop
    assert not _accepts(m, tokenizer, '\n{"name": "nope"')
    bad_args = 'x<tool_call>\n{"name": "add", "arguments": 5'
    assert not _accepts(auto.new_matcher(), tokenizer, bad_args)


def test_outlines_refuses_auto_by_name(backends: dict[str, GrammarBackend]) -> None:
    with pytest.raises(GrammarError, match="auto mode"):
        backends["outlines"].validate(_c("auto", add=ADD_UNBOUNDED))


UNIQUE_ITEMS = {"type": "array", "items": {"enum": [0, 1, 2, 3]}, "uniqueItems": True,
                "maxItems": 3}  # fmt: skip
UNIQUE_ARGS = {"type": "object", "properties": {"x": UNIQUE_ITEMS}, "required": ["x"],
               "additionalProperties": False}  # fmt: skip
# Not an object: the arguments' value ends at the character after it ("}" of the call's end).
NOT_ARGS = {"type": "integer", "not": {"enum": [3, 42]}}


def _byte_compile(backend: str, mode: str = "required", parallel: bool = True) -> Any:
    c = _c(mode, parallel, f=UNIQUE_ARGS, g=NOT_ARGS, add=ADD_UNBOUNDED)
    grammar_backend = get_backend(backend)(BYTE_VOCAB)
    grammar_backend.validate(c)
    compiled = grammar_backend.compile(c)
    assert isinstance(compiled, VerifiedGrammar)  # f and g need the verifier
    return compiled


@pytest.mark.parametrize("backend", ["xgrammar", "outlines", "llguidance"])
def test_tool_parameters_run_the_verifier(backend: str) -> None:
    """A tool whose ``parameters`` need the verifier is served: each call's arguments are
    checked against that tool's exact schema, the calls of other tools pass untouched."""
    compiled = _byte_compile(backend)
    ok = [format_tool_call("f", '{"x":[0,1,2]}'), format_tool_call("g", "5"),
          format_tool_call("add", '{"a":1,"b":1}')]  # fmt: skip
    for call in ok:
        assert grammar_accepts(compiled.new_matcher(), call), call
    assert grammar_accepts(compiled.new_matcher(), "\n".join(ok))
    bad = [format_tool_call("f", '{"x":[0,1,0]}'), format_tool_call("g", "3"),
           format_tool_call("g", "42")]  # fmt: skip
    for call in bad:
        assert not grammar_accepts(compiled.new_matcher(), call), call
    # the second call's arguments are checked afresh (its own items, not the first call's)
    assert grammar_accepts(compiled.new_matcher(), ok[0] + "\n" + ok[0])
    assert not grammar_accepts(compiled.new_matcher(), ok[1] + "\n" + bad[0])


@pytest.mark.parametrize("backend", ["xgrammar", "llguidance"])
def test_auto_mode_checks_only_the_arguments(backend: str) -> None:
    compiled = _byte_compile(backend, "auto", parallel=True)
    text = 'I will call f with "x": [0, 0].\n'  # free text is not checked
    assert grammar_accepts(compiled.new_matcher(), text)
    call = format_tool_call("f", '{"x":[3,2]}')
    assert grammar_accepts(compiled.new_matcher(), text + call + "\nDone [1,1].")
    assert not grammar_accepts(compiled.new_matcher(), text + format_tool_call("f", '{"x":[2,2]}'))


def test_arguments_with_whitespace_are_checked() -> None:
    grammar_backend = get_backend("llguidance")(BYTE_VOCAB)
    c = Constraint("tool_calls", _spec("auto", True, f=UNIQUE_ARGS), whitespace="any")
    compiled = grammar_backend.compile(c)
    ok = format_tool_call("f", '{ "x" : [ 0 , 1 ] }')
    assert grammar_accepts(compiled.new_matcher(), "ok " + ok + " done")
    assert not grammar_accepts(compiled.new_matcher(), format_tool_call("f", '{ "x" : [ 0 , 0 ] }'))


_ITEMS = st.lists(st.integers(min_value=0, max_value=3), max_size=3)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(calls=st.lists(st.one_of(_ITEMS, st.integers(min_value=0, max_value=99)), min_size=1,
                      max_size=3))  # fmt: skip
def test_tool_calls_accepted_iff_jsonschema_validates(calls: list[Any]) -> None:
    """Grammar + verifier accept a sequence of calls exactly when ``jsonschema`` validates
    every call's arguments (the arguments are always in the relaxation here)."""
    compiled = _byte_compile("llguidance")
    texts, valid = [], True
    for args in calls:
        if isinstance(args, list):
            value, schema, name = {"x": args}, UNIQUE_ARGS, "f"
        else:
            value, schema, name = args, NOT_ARGS, "g"
        texts.append(format_tool_call(name, json.dumps(value, separators=(",", ":"))))
        valid = valid and jsonschema.Draft202012Validator(schema).is_valid(value)
    assert grammar_accepts(compiled.new_matcher(), "\n".join(texts)) == valid


def test_malformed_specs_are_grammar_errors() -> None:
    with pytest.raises(GrammarError, match="duplicate"):
        Constraint("tool_calls", json.dumps({"tools": [{"name": "a"}, {"name": "a"}]}))
    with pytest.raises(GrammarError, match="tool name"):
        Constraint("tool_calls", json.dumps({"tools": [{"name": "a b"}]}))
    with pytest.raises(GrammarError, match="at least one"):
        Constraint("tool_calls", json.dumps({"tools": []}))
    with pytest.raises(GrammarError, match="mode"):
        Constraint("tool_calls", json.dumps({"mode": "none", "tools": [{"name": "a"}]}))
    # normalized: key order of keywords does not split the cache
    a = Constraint("tool_calls", json.dumps({"tools": [{"name": "a", "parameters": ADD}]}))
    b = Constraint.from_params(tool_calls={"tools": [{"parameters": ADD, "name": "a"}]})
    assert a == b


# ---- parser --------------------------------------------------------------------------------------


def _stream(text: str, cuts: list[int]) -> tuple[str, dict[int, list[Any]]]:
    parser, content, calls = ToolCallParser(), "", {}
    pieces = [text[i:j] for i, j in zip([0, *cuts], [*cuts, len(text)])]
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    for d in deltas:
        content += d.content
        for c in d.calls:
            entry = calls.setdefault(c.index, [None, ""])
            if c.name is not None:
                assert entry[0] is None, "a call's name is sent once"
                entry[0] = c.name
            entry[1] += c.arguments
    return content, calls


def test_parse_calls_and_content() -> None:
    out = parse_tool_calls(CALL_W + "\n" + CALL_A)
    assert out.content == "" and out.complete
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == [
        ("get_weather", {"city": "Paris", "unit": "c"}),
        ("add", {"a": 3, "b": -4}),
    ]
    out = parse_tool_calls("  I will check.\n" + CALL_W + "\n")
    assert out.content == "I will check." and len(out.calls) == 1
    assert parse_tool_calls("plain < text <tool").content == "plain < text <tool"
    nested = format_tool_call("f", '{"a":{"b":"}"},"c":[{}]}')
    assert parse_tool_calls(nested).calls[0].arguments == '{"a":{"b":"}"},"c":[{}]}'
    truncated = parse_tool_calls(CALL_W[:-8])
    assert not truncated.complete and truncated.calls[0].name == "get_weather"


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_streaming_pieces_concatenate_to_the_whole_parse(data: st.DataObject) -> None:
    text = data.draw(
        st.sampled_from(
            [
                CALL_W,
                CALL_W + "\n" + CALL_A,
                "Thinking...\n" + CALL_A + "\nDone. <tool",
                "no calls } here </tool_call>",
                format_tool_call("f", '{"a":{"b":"}"}}'),
                CALL_W[:-5],
            ]
        )
    )
    cuts = sorted(data.draw(st.lists(st.integers(1, max(1, len(text) - 1)), max_size=8)))
    whole = parse_tool_calls(text)
    content, calls = _stream(text, cuts)
    assert content == whole.content
    assert [(n, a) for n, a in calls.values()] == [(c.name, c.arguments) for c in whole.calls]


def test_tools_prompt_lists_every_tool() -> None:
    tools = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]
    text = tools_prompt(tools)
    assert '"name": "add"' in text and "<tool_call>" in text and "</tools>" in text
