"""The interpreter on a scripted backend: text, variables, roles, fork/join, streaming, errors."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
from fake_backend import FakeBackend

import radixlm as sgl
from radixlm.lang.chat_template import chatml
from radixlm.lang.ir import REGEX_INT


def test_text_variables_and_prompt():
    be = FakeBackend(lambda prompt, p: " Paris")

    @sgl.function
    def qa(s, question):
        s += "Q: " + question + "\nA:" + sgl.gen("answer", max_tokens=5, stop="\n")
        s += "\nDone."

    s = qa.run(question="Capital of France?", backend=be, temperature=0.3)
    assert s.error() is None
    assert s["answer"] == " Paris"
    assert s.text() == "Q: Capital of France?\nA: Paris\nDone."
    kind, prompt, params = be.calls[0]
    assert (kind, prompt) == ("gen", "Q: Capital of France?\nA:")
    assert params.max_new_tokens == 5 and params.stop == "\n"
    assert params.temperature == 0.3  # the run's default, not overridden by gen
    assert s.get_meta_info("answer") == {"prompt_tokens": 24, "cached_tokens": 0}


def test_gen_overrides_run_defaults_and_positional_args():
    be = FakeBackend()

    @sgl.function
    def prog(s, a, b):
        s += a + b + sgl.gen("x", temperature=0.0, top_k=5)

    s = prog.run("1", "2", backend=be, temperature=0.9, max_new_tokens=7)
    params = be.calls[0][2]
    assert (params.temperature, params.top_k, params.max_new_tokens) == (0.0, 5, 7)
    assert s.text() == "12ok"


def test_roles_render_the_chat_template():
    be = FakeBackend(lambda prompt, p: "Hello!")

    @sgl.function
    def chat(s):
        s += sgl.system("Be brief.")
        with s.user():
            s += "Hi"
        s += sgl.assistant(sgl.gen("reply"))
        s += sgl.user_begin() + "Bye" + sgl.user_end()

    s = chat.run(backend=be)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Bye"},
    ]
    assert s.error() is None
    assert s.messages() == messages
    assert s.text() == chatml(messages)
    assert be.calls[0][1] == chatml(messages[:2]) + "<|im_start|>assistant\n"


def test_nested_role_is_an_error_on_the_state():
    @sgl.function
    def bad(s):
        with s.user():
            s += sgl.assistant("no")

    s = bad.run(backend=FakeBackend())
    assert isinstance(s.error(), ValueError) and "nesting" in str(s.error())


def test_unknown_variable_is_a_clear_error():
    @sgl.function
    def prog(s):
        s += sgl.gen("a")
        s += s["missing"]

    s = prog.run(backend=FakeBackend())
    assert isinstance(s.error(), KeyError)
    assert "missing" in str(s.error()) and "'a'" in str(s.error())
    with pytest.raises(KeyError, match="not defined"):
        s["other"]


def test_backend_failure_skips_the_rest_and_wakes_readers():
    def reply(prompt, params):
        if "boom" in prompt:
            raise RuntimeError("model exploded")
        return "fine"

    be = FakeBackend(reply)

    @sgl.function
    def prog(s):
        s += "boom" + sgl.gen("a") + sgl.gen("b")
        s += sgl.gen("c")

    s = prog.run(backend=be)
    assert isinstance(s.error(), RuntimeError) and "exploded" in str(s.error())
    assert be.kinds() == ["gen"]  # b and c were skipped
    with pytest.raises(KeyError, match="exploded"):
        s["c"]


def test_adding_a_non_expression_is_reported():
    @sgl.function
    def prog(s):
        s += 5

    s = prog.run(backend=FakeBackend())
    assert isinstance(s.error(), TypeError) and "int" in str(s.error())


def test_no_backend_raises():
    @sgl.function
    def prog(s):
        s += "x"

    sgl.set_default_backend(None)
    with pytest.raises(ValueError, match="no backend"):
        prog.run()


def test_default_backend_and_bind():
    be = FakeBackend()

    @sgl.function
    def prog(s, a, b):
        s += a + b

    sgl.set_default_backend(be)
    try:
        assert prog.bind(a="x").run(b="y").text() == "xy"
        with pytest.raises(TypeError, match="unknown"):
            prog.bind(c=1)
    finally:
        sgl.set_default_backend(None)


def test_fork_join_runs_branches_concurrently_after_caching_the_prefix():
    barrier = threading.Barrier(3, timeout=10)

    def reply(prompt, params):
        barrier.wait()  # deadlocks (then times out) unless all 3 branches are in flight
        return prompt[-2:]

    be = FakeBackend(reply)

    @sgl.function
    def prog(s):
        s += "Shared prefix. "
        forks = s.fork(3)
        forks += lambda i: f"b{i}" + sgl.gen("x")
        forks.join()
        s += "Merged."

    s = prog.run(backend=be)
    assert s.error() is None
    assert s["x"] == ["b0", "b1", "b2"]
    assert be.calls[0] == ("cache", "Shared prefix. ", None)
    assert sorted(c[1] for c in be.calls[1:]) == [f"Shared prefix. b{i}" for i in range(3)]
    assert s.text() == "Shared prefix. Merged."


def test_fork_branch_error_reaches_the_parent():
    def reply(prompt, params):
        if prompt.endswith("b1"):
            raise RuntimeError("branch 1 failed")
        return "ok"

    @sgl.function
    def prog(s):
        forks = s.fork(2)
        for i in range(2):
            forks[i] += f"b{i}" + sgl.gen("x")
        forks.join()

    s = prog.run(backend=FakeBackend(reply))
    assert "branch 1 failed" in str(s.error())


def test_copy_and_var_scope():
    @sgl.function
    def prog(s):
        with s.var_scope("scoped"):
            s += "abc" + sgl.gen("g")
        with s.copy() as c:
            c += sgl.gen("y")
        s += "!"

    s = prog.run(backend=FakeBackend())
    assert s["scoped"] == "abcok"
    assert s["y"] == ["ok"]
    assert s.text() == "abcok!"
    assert sgl.var_scope  # exported


def test_n_branches_and_gen_int_params():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("many", n=3) + sgl.gen_int("num") + sgl.gen_string("word")

    s = prog.run(backend=be)
    assert s["many"] == ["ok0", "ok1", "ok2"]
    assert s.text() == "ok0okok"
    assert be.calls[1][2].constraint_kwargs() == {"regex": REGEX_INT}
    assert be.calls[2][2].dtype == "str"


def test_gen_argument_errors():
    with pytest.raises(ValueError, match="invalid regex"):
        sgl.gen("x", regex="[")
    with pytest.raises(ValueError, match="at most one"):
        sgl.gen("x", regex="a+", json_schema={"type": "object"})
    with pytest.raises(ValueError, match="dtype"):
        sgl.gen("x", dtype=list)
    with pytest.raises(ValueError, match="stop_regex: invalid pattern"):
        sgl.gen("x", stop_regex="(")
    with pytest.raises(ValueError, match="stop_regex: .* matches the empty string"):
        sgl.gen("x", stop_regex=["a", "b*"])
    with pytest.raises(ValueError, match="choices"):
        sgl.select("x", choices=[])
    assert isinstance(sgl.gen("x", choices=["a", "b"]), type(sgl.select("x", ["a"])))


def test_stop_regex_reaches_the_backend_and_run_defaults_apply():
    be = FakeBackend()

    @sgl.function
    def prog(s):
        s += sgl.gen("a", stop_regex=r"\d+") + sgl.gen("b")

    prog.run(backend=be, stop_regex=["x", "y"])
    assert be.calls[0][2].stop_regex == (r"\d+",)
    assert be.calls[1][2].stop_regex == ("x", "y")


def test_streaming_text_iter_and_async_iter():
    resume = threading.Event()
    be = FakeBackend(lambda prompt, p: "one two three four", stream_delay=0.01, resume=resume)

    @sgl.function
    def prog(s):
        s += "Say:" + sgl.gen("words")
        s += " end"

    s = prog.run(backend=be, stream=True)
    it = s.text_iter("words")
    chunks = [next(it)]  # the stream holds its second piece until resumed
    resume.set()
    chunks += list(it)
    assert len(chunks) > 1 and "".join(chunks) == "one two three four"
    assert "".join(s.text_iter()) == "Say:one two three four end" == s.text()

    s2 = prog.run(backend=be, stream=True)

    async def collect():
        return [c async for c in s2.text_async_iter("words")]

    assert "".join(asyncio.run(collect())) == "one two three four"

    with pytest.raises(KeyError):
        list(prog.run(backend=be, stream=True).text_iter("never"))


def test_text_iter_without_stream_yields_the_final_value():
    @sgl.function
    def prog(s):
        s += sgl.gen("a")

    s = prog.run(backend=FakeBackend())
    assert list(s.text_iter("a")) == ["ok"]


def test_run_batch_isolates_a_failing_program_and_shows_progress(capsys):
    @sgl.function
    def prog(s, x):
        if x == 2:
            raise ValueError("bad input 2")
        s += f"x={x}" + sgl.gen("y")

    states = prog.run_batch([{"x": i} for i in range(5)], backend=FakeBackend(), progress_bar=True)
    assert [s.error() is None for s in states] == [True, True, False, True, True]
    assert "bad input 2" in str(states[2].error())
    assert [s.text() for s in states if s.error() is None] == [f"x={i}ok" for i in (0, 1, 3, 4)]
    assert "5/5" in capsys.readouterr().err


def test_never_hangs_on_a_slow_reader():
    """A reader blocked on a variable wakes when the program fails later."""

    def reply(prompt, params):
        time.sleep(0.2)
        raise RuntimeError("late failure")

    @sgl.function
    def prog(s):
        s += sgl.gen("a")

    s = prog.run(backend=FakeBackend(reply), stream=True)
    t0 = time.monotonic()
    with pytest.raises(KeyError, match="late failure"):
        s["a"]
    assert time.monotonic() - t0 < 5
