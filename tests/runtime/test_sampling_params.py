from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from radixlm.runtime.sampling_params import SamplingParams


def test_defaults_are_valid() -> None:
    p = SamplingParams()
    assert p.max_new_tokens == 128
    assert p.min_new_tokens == 0
    assert p.temperature == 1.0
    assert p.top_k == -1
    assert p.top_p == 1.0
    assert p.min_p == 0.0
    assert p.stop == ()
    assert p.stop_token_ids == ()
    assert p.seed is None
    assert p.n == 1
    assert not p.is_greedy
    assert not p.needs_penalties
    assert p.skip_special_tokens and not p.ignore_eos and not p.logprobs


def test_normalization() -> None:
    p = SamplingParams(stop="###", top_k=0, stop_token_ids=[3, 4], temperature=1, top_p=1)
    assert p.stop == ("###",)
    assert p.top_k == -1
    assert p.stop_token_ids == (3, 4)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=None).stop == ()
    assert SamplingParams(top_logprobs=3).logprobs is True
    assert SamplingParams(stop=["x", "hello"]).max_stop_str_len == 5


def test_frozen_hashable_and_replace() -> None:
    p = SamplingParams(stop=["a"])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop="a"))
    q = dataclasses.replace(p, temperature=0.0)
    assert q.is_greedy and q.stop == ("a",)
    with pytest.raises(ValueError, match="temperature"):
        dataclasses.replace(p, temperature=-1.0)


@pytest.mark.parametrize(
    ("kwargs", "greedy", "penalties"),
    [
        ({"temperature": 0.0}, True, False),
        ({"top_k": 1}, True, False),
        ({"temperature": 0.7, "top_k": 5}, False, False),
        ({"repetition_penalty": 1.2}, False, True),
        ({"frequency_penalty": -0.5}, False, True),
        ({"presence_penalty": 0.1, "temperature": 0}, True, True),
    ],
)
def test_properties(kwargs: dict[str, Any], greedy: bool, penalties: bool) -> None:
    p = SamplingParams(**kwargs)
    assert p.is_greedy == greedy
    assert p.needs_penalties == penalties


INVALID: list[tuple[str, Any, dict[str, Any]]] = [
    ("max_new_tokens", 0, {}),
    ("max_new_tokens", 1.5, {}),
    ("max_new_tokens", True, {}),
    ("min_new_tokens", -1, {}),
    ("min_new_tokens", 10, {"max_new_tokens": 5}),
    ("temperature", -1, {}),
    ("temperature", math.nan, {}),
    ("temperature", math.inf, {}),
    ("temperature", "0.5", {}),
    ("temperature", True, {}),
    ("top_k", -2, {}),
    ("top_k", 2.0, {}),
    ("top_p", 0.0, {}),
    ("top_p", 1.5, {}),
    ("top_p", math.nan, {}),
    ("min_p", -0.1, {}),
    ("min_p", 1.1, {}),
    ("repetition_penalty", 0.0, {}),
    ("repetition_penalty", -1.0, {}),
    ("frequency_penalty", 2.5, {}),
    ("frequency_penalty", -2.1, {}),
    ("presence_penalty", 3.0, {}),
    ("presence_penalty", -2.5, {}),
    ("seed", -1, {}),
    ("seed", 1.0, {}),
    ("seed", 2**64, {}),
    ("stop", [""], {}),
    ("stop", "", {}),
    ("stop", [1], {}),
    ("stop", 5, {}),
    ("stop_token_ids", [-1], {}),
    ("stop_token_ids", [1.0], {}),
    ("stop_token_ids", "12", {}),
    ("ignore_eos", 1, {}),
    ("skip_special_tokens", "yes", {}),
    ("logprobs", 0, {}),
    ("include_stop_str_in_output", None, {}),
    ("top_logprobs", 21, {}),
    ("top_logprobs", -1, {}),
    ("n", 0, {}),
    ("n", 129, {}),
    ("n", False, {}),
]


@pytest.mark.parametrize(("name", "value", "extra"), INVALID)
def test_invalid_field_raises_naming_it(name: str, value: Any, extra: dict[str, Any]) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{name: value, **extra})
    msg = str(exc.value)
    assert msg.startswith(name), msg
    assert "got" in msg


def test_boundary_values_are_valid() -> None:
    SamplingParams(
        max_new_tokens=1,
        min_new_tokens=1,
        temperature=0,
        top_k=1,
        top_p=1e-9,
        min_p=1.0,
        repetition_penalty=1e-3,
        frequency_penalty=-2,
        presence_penalty=2,
        seed=0,
        top_logprobs=20,
        n=128,
    )
    SamplingParams(seed=2**64 - 1, stop_token_ids=[0])
