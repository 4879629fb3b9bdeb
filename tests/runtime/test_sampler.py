from __future__ import annotations

from collections.abc import Sequence

import pytest
import torch

from radixlm.runtime.sampler import (
    Sampler,
    apply_penalties,
    filter_logits,
)
from radixlm.runtime.sampling_batch import (
    SamplingBatchInfo,
    make_generator,
    min_tokens_suppress_ids,
)
from radixlm.runtime.sampling_params import SamplingParams

torch.set_num_threads(1)

V = 5


def build(
    params: Sequence[SamplingParams],
    vocab_size: int = V,
    generators: Sequence[torch.Generator | None] | None = None,
    prompt_ids: Sequence[Sequence[int]] | None = None,
    output_ids: Sequence[Sequence[int]] | None = None,
    suppress: Sequence[Sequence[int]] | None = None,
) -> SamplingBatchInfo:
    b = len(params)
    return SamplingBatchInfo.build(
        list(params),
        list(generators) if generators is not None else [None] * b,
        prompt_ids if prompt_ids is not None else [[] for _ in range(b)],
        output_ids if output_ids is not None else [[] for _ in range(b)],
        vocab_size,
        "cpu",
        suppress_token_ids=suppress,
    )


def counts_of(tokens: list[int], vocab: int = V) -> torch.Tensor:
    return torch.bincount(torch.tensor(tokens), minlength=vocab).double()


def test_build_neutral_values_and_flags() -> None:
    params = [
        SamplingParams(temperature=0.0, top_k=3),
        SamplingParams(top_k=50, top_p=0.9),
        SamplingParams(top_k=2, min_p=0.1),
    ]
    info = build(params, vocab_size=10)
    assert info.top_ks.tolist() == [3, 10, 2]
    assert info.temperatures.tolist() == [1.0, 1.0, 1.0]
    assert info.is_greedy == [True, False, False]
    assert info.top_k_list == [3, 10, 2]
    assert info.need_top_k_top_p and info.need_min_p
    assert not info.all_greedy and not info.need_penalties and not info.need_logprobs
    greedy_only = build([SamplingParams(temperature=0, top_p=0.5, min_p=0.2)])
    assert greedy_only.all_greedy
    assert not (greedy_only.need_top_k_top_p or greedy_only.need_min_p)
    assert not build([SamplingParams(top_k=V)]).need_top_k_top_p  # top_k >= vocab: disabled


def test_penalty_entries_are_sparse_and_distinct() -> None:
    params = [SamplingParams(presence_penalty=0.5), SamplingParams()]
    info = build(params, prompt_ids=[[1, 1, 2], [0]], output_ids=[[2, 3, 3], [4]])
    assert info.penalty_rows is not None and info.penalty_tokens is not None
    assert info.penalty_counts is not None
    entries = zip(
        info.penalty_rows.tolist(),
        info.penalty_tokens.tolist(),
        info.penalty_counts.tolist(),
        strict=True,
    )
    assert sorted(entries) == [(0, 1, 0.0), (0, 2, 1.0), (0, 3, 2.0)]
    assert not build([SamplingParams()] * 2).need_penalties


def test_greedy_equals_argmax_any_dtype() -> None:
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    info = build([SamplingParams(temperature=0.0)] * 8, vocab_size=100)
    out = Sampler()(logits, info)
    assert out.next_token_ids == logits.argmax(-1).tolist()
    assert out.logprobs is None and out.top_logprobs is None
    bf16 = logits.bfloat16()
    assert Sampler()(bf16, info).next_token_ids == bf16.float().argmax(-1).tolist()


def test_top_k_one_and_tiny_top_p_are_greedy() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, 50)
    expected = logits.argmax(-1).tolist()
    sampler = Sampler(seed=0)
    info = build([SamplingParams(top_k=1, temperature=1.5)] * 64, vocab_size=50)
    assert info.is_greedy[0]
    assert sampler(logits, info).next_token_ids == expected
    info = build([SamplingParams(top_p=1e-6, temperature=1.0)] * 64, vocab_size=50)
    assert not info.is_greedy[0]
    for _ in range(5):
        assert sampler(logits, info).next_token_ids == expected


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(6, 30)
    params = [SamplingParams(temperature=0.0 if i % 2 else 2.0) for i in range(6)]
    out = Sampler(seed=3)(logits, build(params, vocab_size=30)).next_token_ids
    for i in range(1, 6, 2):
        assert out[i] == logits[i].argmax().item()


def test_filter_top_k_top_p_min_p_by_hand() -> None:
    probs = torch.tensor([[0.05, 0.5, 0.15, 0.3]])
    logits = probs.log()  # softmax(logits) == probs
    cases = [
        (SamplingParams(top_k=2), {1, 3}),
        (SamplingParams(top_p=0.75), {1, 3}),
        (SamplingParams(top_p=0.85), {1, 2, 3}),
        (SamplingParams(min_p=0.5), {1, 3}),  # threshold 0.25
        (SamplingParams(min_p=0.2), {1, 2, 3}),  # threshold 0.1
        (SamplingParams(min_p=0.0), {0, 1, 2, 3}),
        # top_p applies after top_k, over the renormalized survivors {0.5, 0.3} -> {.625, .375}
        (SamplingParams(top_k=2, top_p=0.6), {1}),
        (SamplingParams(top_k=3, top_p=0.6), {1, 3}),
    ]
    for params, kept in cases:
        out = filter_logits(logits, build([params], vocab_size=4))
        got = {i for i in range(4) if out[0, i].item() != float("-inf")}
        assert got == kept, params
        for i in kept:
            assert out[0, i].item() == pytest.approx(logits[0, i].item())


def test_filters_are_per_row() -> None:
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]] * 3)
    params = [SamplingParams(top_k=1, temperature=1), SamplingParams(), SamplingParams(top_k=3)]
    out = filter_logits(logits, build(params, vocab_size=4))
    assert torch.isinf(out).sum(-1).tolist() == [3, 0, 1]


def test_sampling_never_leaves_filtered_set() -> None:
    torch.manual_seed(4)
    logits = torch.randn(1, 20).expand(2000, 20)
    allowed = set(logits[0].topk(3).indices.tolist())
    out = Sampler(seed=5)(logits, build([SamplingParams(top_k=3)] * 2000, vocab_size=20))
    assert set(out.next_token_ids) == allowed

    probs = logits[0].softmax(-1)
    keep = {i for i in range(20) if probs[i] >= 0.3 * probs.max()}
    out = Sampler(seed=6)(logits, build([SamplingParams(min_p=0.3)] * 2000, vocab_size=20))
    assert set(out.next_token_ids) == keep


def reference_filter(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Kept token ids for one row, the slow obvious way (full sort, Python loops)."""
    probs = logits.double().softmax(-1)
    alive = [i for i in range(len(probs)) if probs[i] >= p.min_p * probs.max()]
    alive.sort(key=lambda i: -probs[i].item())
    if p.top_k > 0:
        alive = alive[: p.top_k]
    mass = sum(probs[i].item() for i in alive)
    kept, cum = [], 0.0
    for i in alive:
        if p.top_p < 1 and cum >= p.top_p and kept:
            break
        kept.append(i)
        cum += probs[i].item() / mass
    return set(kept)


@pytest.mark.parametrize("spread", [0.5, 3.0, 10.0])
def test_filters_match_reference_on_a_large_vocab(spread: float) -> None:
    """Covers every candidate width (64, 1024, full sort) on peaked and flat distributions."""
    torch.manual_seed(11)
    vocab = 3000
    params = [
        SamplingParams(top_p=0.9),
        SamplingParams(top_p=0.99),
        SamplingParams(top_p=0.3, top_k=2000),
        SamplingParams(top_k=40),
        SamplingParams(top_k=100, top_p=0.8),
        SamplingParams(top_k=1500),
        SamplingParams(min_p=0.05, top_p=0.95),
        SamplingParams(min_p=0.2),
        SamplingParams(),
    ]
    logits = torch.randn(len(params), vocab) * spread
    out = filter_logits(logits, build(params, vocab_size=vocab))
    for row, p in enumerate(params):
        kept = set(torch.nonzero(out[row] > -torch.inf).flatten().tolist())
        ref = reference_filter(logits[row], p)
        # float32 vs float64 may disagree on a token sitting exactly at a threshold
        assert len(kept ^ ref) <= 1, (p, len(kept), len(ref))


def chi_square(tokens: list[int], probs: torch.Tensor) -> float:
    expected = probs.double() * len(tokens)
    return float(((counts_of(tokens) - expected) ** 2 / expected).sum())


def test_temperature_sampling_matches_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0])
    n, temp = 20000, 0.7
    info = build([SamplingParams(temperature=temp)] * n)
    tokens = Sampler(seed=123)(logits.expand(n, V), info).next_token_ids
    # df = 4: the 0.999 quantile of chi2 is 18.5; the wrong temperature is far above it.
    assert chi_square(tokens, (logits / temp).softmax(-1)) < 18.5
    assert chi_square(tokens, logits.softmax(-1)) > 100


def test_filtered_sampling_matches_renormalized_probs() -> None:
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0])
    n = 20000
    info = build([SamplingParams(top_k=3, temperature=1.0)] * n)
    tokens = Sampler(seed=321)(logits.expand(n, V), info).next_token_ids
    expected = logits.masked_fill(logits < logits.topk(3).values[-1], -torch.inf).softmax(-1)
    keep = expected > 0
    assert chi_square_on(tokens, expected, keep) < 13.8  # df = 2, 0.999 quantile


def chi_square_on(tokens: list[int], probs: torch.Tensor, keep: torch.Tensor) -> float:
    assert counts_of(tokens)[~keep].sum() == 0
    expected = probs.double()[keep] * len(tokens)
    return float(((counts_of(tokens)[keep] - expected) ** 2 / expected).sum())


def test_seeded_row_is_independent_of_batch_composition() -> None:
    torch.manual_seed(7)
    vocab = 40
    target = torch.randn(vocab)
    target_params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234)

    def run(others: list[tuple[SamplingParams, torch.Generator | None]], at: int) -> list[int]:
        gen = make_generator(1234)
        tokens = []
        for step in range(20):
            params = [p for p, _ in others]
            gens = [g for _, g in others]
            params.insert(at, target_params)
            gens.insert(at, gen)
            rows = [torch.randn(vocab) for _ in others]
            rows.insert(at, target)
            outputs = [[step % vocab] * step for _ in params]
            info = build(params, vocab, gens, output_ids=outputs)
            tokens.append(Sampler()(torch.stack(rows), info).next_token_ids[at])
        return tokens

    alone = run([], 0)
    crowded = run(
        [
            (SamplingParams(temperature=0.0), None),
            (SamplingParams(top_k=3, min_p=0.1), None),
            (SamplingParams(repetition_penalty=1.3, frequency_penalty=0.5), make_generator(9)),
        ],
        2,
    )
    assert alone == crowded
    assert len(set(alone)) > 1  # the row really samples
    other_seed = SamplingParams(temperature=0.9, top_p=0.95, seed=99)
    info = build([other_seed] * 1, vocab, [make_generator(99)])
    diff = [Sampler()(target[None], info).next_token_ids[0] for _ in range(20)]
    assert diff != alone


def test_penalties_match_hand_computation() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    info = build([params], prompt_ids=[[0, 1]], output_ids=[[3, 3, 2]])
    out = apply_penalties(logits, info)
    # token 0, 1: prompt only -> repetition only; 2: once in output; 3: twice; 4: unseen.
    expected = [2.0 / 2, -1.0 * 2, 0.5 / 2 - 0.5 - 0.25, 3.0 / 2 - 0.5 * 2 - 0.25, -2.0]
    assert out[0].tolist() == pytest.approx(expected)
    assert logits[0].tolist() == [2.0, -1.0, 0.5, 3.0, -2.0]  # not modified in place

    greedy = SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5)
    info = build(
        [greedy, SamplingParams(temperature=0.0)],
        prompt_ids=[[0, 1], [0, 1]],
        output_ids=[[3, 3, 2], [3, 3, 2]],
    )
    got = Sampler()(logits.expand(2, V), info).next_token_ids
    assert got == [0, 3]  # penalized row: [1, -2, -0.25, 0.5, -2] -> 0; neutral row untouched


def test_logprobs_are_raw_log_softmax() -> None:
    torch.manual_seed(8)
    logits = torch.randn(3, 30)
    params = [
        SamplingParams(
            temperature=0.5, top_k=4, logprobs=True, top_logprobs=5, repetition_penalty=1.5
        ),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, logprobs=True),
    ]
    info = build(params, 30, output_ids=[[1, 2], [], [3]])
    out = Sampler(seed=0)(logits.bfloat16(), info)
    ref = logits.bfloat16().float().log_softmax(-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for i in (0, 2):
        tok = out.next_token_ids[i]
        assert out.logprobs[i] == pytest.approx(ref[i, tok].item(), abs=1e-5)
    assert out.logprobs[1] is None and out.top_logprobs[1] is None
    assert out.top_logprobs[2] == []
    top = out.top_logprobs[0]
    assert top is not None and len(top) == 5
    assert [t for t, _ in top] == ref[0].topk(5).indices.tolist()
    values = [v for _, v in top]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(ref[0].topk(5).values.tolist(), abs=1e-5)


def test_vocab_mask_and_suppress_ids() -> None:
    logits = torch.tensor([[5.0, 1.0, 0.0, 4.0, 3.0]] * 2)
    mask = torch.tensor([[False, True, False, True, False], [True] * 5])
    greedy = [SamplingParams(temperature=0.0)] * 2
    assert Sampler()(logits, build(greedy), vocab_mask=mask).next_token_ids == [3, 0]
    info = build(greedy, suppress=[[], [0, 3]])
    assert Sampler()(logits, info).next_token_ids == [0, 4]
    assert Sampler()(logits, info, vocab_mask=mask).next_token_ids == [3, 4]

    n = 500
    sample_mask = torch.zeros(n, V, dtype=torch.bool)
    sample_mask[:, [1, 2]] = True
    info = build([SamplingParams(temperature=2.0)] * n, suppress=[[2]] * n)
    out = Sampler(seed=1)(logits[:1].expand(n, V), info, vocab_mask=sample_mask)
    assert set(out.next_token_ids) == {1}
    info = build([SamplingParams(temperature=2.0)] * n)
    out = Sampler(seed=1)(logits[:1].expand(n, V), info, vocab_mask=sample_mask)
    assert set(out.next_token_ids) == {1, 2}


def test_min_tokens_suppress_ids() -> None:
    p = SamplingParams(min_new_tokens=2, stop_token_ids=[7])
    assert sorted(min_tokens_suppress_ids(p, [2], 0)) == [2, 7]
    assert sorted(min_tokens_suppress_ids(p, [2], 1)) == [2, 7]
    assert min_tokens_suppress_ids(p, [2], 2) == []
    q = SamplingParams(min_new_tokens=2, ignore_eos=True, stop_token_ids=[7])
    assert min_tokens_suppress_ids(q, [2], 0) == [7]


def test_logit_bias_shifts_the_logits_of_its_row_only() -> None:
    logits = torch.tensor([[1.0, 2.0, 3.0, 0.0, 0.0], [1.0, 2.0, 3.0, 0.0, 0.0]])
    biased = SamplingParams(temperature=0.0, logit_bias={4: 100.0, 2: -100.0})
    plain = SamplingParams(temperature=0.0)
    out = Sampler()(logits, build([biased, plain]))
    assert out.next_token_ids == [4, 2]
    # Raw logprobs stay the model's (OpenAI reports the unbiased distribution).
    lp_params = SamplingParams(temperature=0.0, logit_bias={0: 5.0}, logprobs=True)
    out = Sampler()(logits[:1], build([lp_params]))
    assert out.next_token_ids == [0]
    assert out.logprobs[0] == pytest.approx(torch.log_softmax(logits[0], -1)[0].item(), abs=1e-5)
    # Sampled rows: a -100 bias bans the token in practice.
    gen = [make_generator(k) for k in range(50)]
    banned = SamplingParams(temperature=1.0, logit_bias={2: -100.0})
    out = Sampler()(logits[:1].expand(50, -1), build([banned] * 50, generators=gen))
    assert 2 not in out.next_token_ids


def test_logit_bias_params_are_validated() -> None:
    assert SamplingParams(logit_bias={3: 1, 1: -2.5}).logit_bias == ((1, -2.5), (3, 1.0))
    for bad in ({-1: 1.0}, {3: 101.0}, {3: float("nan")}, {"3": 1.0}, [(1, 2, 3)]):
        with pytest.raises(ValueError, match="logit_bias"):
            SamplingParams(logit_bias=bad)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab", [1, 15, 16, 49152 + 7])
def test_argmax_rows_is_torchs_argmax(dtype: torch.dtype, vocab: int) -> None:
    """The compiled greedy argmax (``sampling_ops.cpp``) gives torch.argmax's indices: the first
    of tied maxima, a NaN (its first) over everything, all -inf rows, +inf, rows inside a wider
    tensor; the op is the one called on CPU."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import argmax_rows

    gen = torch.Generator().manual_seed(vocab)
    wide = torch.randn(7, vocab + 5, generator=gen).to(dtype)
    x = wide[:, :vocab]  # rows vocab + 5 apart
    x[1] = float("-inf")
    if vocab > 3:
        x[2, [1, 3]] = 50.0  # a tie: the first wins
        x[3, [2, vocab - 1]] = float("nan")
        x[4, vocab - 1] = float("inf")
        x[5, vocab // 2] = float("nan")
        x[5, 0] = float("inf")
        x[6] = -1.0
        x[6, 2], x[6, 3] = -0.0, 0.0  # equal maxima of both signs: the first
    want = x.float().argmax(dim=-1)
    assert torch.equal(argmax_rows(x), want)
    assert torch.equal(x.argmax(dim=-1), want)
    op = load_op()
    assert op is not None and torch.equal(op.argmax_rows(x), want)
    assert argmax_rows(torch.empty(0, vocab, dtype=dtype)).shape == (0,)


def _torch_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import radixlm.runtime.sampler as sampler_mod

    monkeypatch.setattr(sampler_mod, "_cpu_op", lambda x: None)


@pytest.mark.parametrize("vocab", [5, 300, 49152 + 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_redraw_row_op_is_inverse_cdf_without_removed(vocab: int, dtype: torch.dtype) -> None:
    """The compiled redraw (``sampling_ops.cpp``) zeroes the tokens whose logits are -inf in
    place and picks the first token whose running mass exceeds ``u * total``: ``pick``'s token
    on the zeroed row (up to rounding where the target sits on a boundary of the cdf); never a
    removed token; -1 under the minimum mass or with nothing left."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import pick

    op = load_op()
    assert op is not None
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen)
    gone = torch.rand(vocab, generator=gen) < 0.4
    gone[0] = vocab > 5  # the first token removed too
    logits = logits.masked_fill(gone, float("-inf")).to(dtype)
    probs = torch.randn(vocab, generator=gen).softmax(-1)
    zeroed = probs.masked_fill(gone, 0.0)
    cdf = zeroed.double().cumsum(0)
    for u in torch.rand(200, generator=gen).tolist() + [0.0, 1.0 - 1e-9]:
        values = probs.clone()
        tok = op.redraw_row_(values, logits, False, u, 1e-4)
        assert torch.equal(values, zeroed)
        assert not gone[tok] and zeroed[tok] > 0
        want = int(pick(zeroed[None], torch.tensor([u]))[0])
        if tok != want:  # only where the target is within rounding of a boundary
            target = u * float(cdf[-1])
            assert abs(float(cdf[min(tok, want)]) - target) < 1e-5
    assert op.redraw_row_(probs.clone(), logits, False, 0.5, 2.0) == -1  # mass 1 < 2
    none_left = torch.full((vocab,), float("-inf"), dtype=dtype)
    assert op.redraw_row_(probs.clone(), none_left, False, 0.5, 1e-4) == -1
    scores = torch.randn(vocab, generator=gen)
    tok = op.redraw_row_(scores.clone(), logits, True, 0.0, 1e-4)
    assert tok == int(scores.masked_fill(gone, float("-inf")).argmax())
    assert op.redraw_row_(scores.clone(), none_left, True, 0.0, 1e-4) == -1


@pytest.mark.parametrize("vocab", [300, 49152 + 7])
def test_redraw_of_the_removed_tokens_is_the_full_redraw_bit_for_bit(vocab: int) -> None:
    """``redraw_removed_`` (the next redraw of a row given only the tokens removed since, its
    block sums kept by the last one) leaves the values and block sums, and draws the token, that
    ``redraw_row_``'s full pass over the masked logits gives, bit for bit, removal after
    removal; -1 once too little mass is left."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import REDRAW_BLOCK

    op = load_op()
    assert op is not None
    gen = torch.Generator().manual_seed(vocab)
    logits = torch.randn(vocab, generator=gen)
    logits[torch.rand(vocab, generator=gen) < 0.4] = float("-inf")
    probs = (torch.randn(vocab, generator=gen) * 3).softmax(-1)
    probs[torch.isneginf(logits)] = 0.0  # what the sampler drew from: the masked row
    nb = -(-vocab // REDRAW_BLOCK)
    values, sums = probs.clone(), torch.empty(nb, dtype=torch.float64)
    tok = op.redraw_row_(values, logits, False, 0.3, 1e-4, sums)
    for k in range(40):
        removed = [tok] + (torch.randint(vocab, (2,), generator=gen).tolist() if k % 3 else [])
        logits[removed] = float("-inf")
        u = float(torch.rand(1, generator=gen))
        tok = op.redraw_removed_(values, sums, torch.tensor(removed), u, 1e-4)
        full, full_sums = probs.clone(), torch.empty(nb, dtype=torch.float64)
        assert tok == op.redraw_row_(full, logits, False, u, 1e-4, full_sums)
        assert torch.equal(values, full) and torch.equal(sums, full_sums)
        assert tok >= 0 and not torch.isneginf(logits[tok])
    rest = torch.nonzero(values > 0).flatten().tolist()
    assert op.redraw_removed_(values, sums, torch.tensor(rest), 0.5, 1e-4) == -1


@pytest.mark.parametrize("vocab", [300, 49152 + 7])
def test_a_sampled_rows_block_sums_start_its_redraws_bit_for_bit(vocab: int) -> None:
    """``sample_rows`` hands out each row's block sums (``sums``) with the same tokens and
    probabilities as without them; a kept row's first redraw from those sums, told only the
    tokens removed since the draw (``redraw_removed_``), draws the token and leaves the values
    and sums that ``redraw_row_``'s pass over the masked row gives, bit for bit."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import REDRAW_BLOCK

    op = load_op()
    assert op is not None
    gen = torch.Generator().manual_seed(vocab)
    rows, nb = 3, -(-vocab // REDRAW_BLOCK)
    x = torch.randn(rows, vocab, generator=gen) * 3
    x[torch.rand(rows, vocab, generator=gen) < 0.4] = float("-inf")  # the grammar's mask
    temps, u = torch.tensor([0.7, 1.0, 1.3]), torch.rand(rows, generator=gen)
    off = (torch.full((rows,), vocab), torch.ones(rows), torch.zeros(rows))  # no filters
    probs, sums = torch.empty(rows, vocab), torch.empty(rows, nb, dtype=torch.float64)
    tokens = op.sample_rows(x, temps, *off, u, probs, sums)
    plain = torch.empty(rows, vocab)
    assert torch.equal(op.sample_rows(x, temps, *off, u, plain), tokens)
    assert torch.equal(plain, probs)
    for r in range(rows):
        allowed = torch.nonzero(torch.isfinite(x[r])).flatten()
        picks = torch.randint(len(allowed), (3,), generator=gen)
        removed = [int(tokens[r])] + allowed[picks].tolist()
        logits = x[r].clone()
        logits[removed] = float("-inf")
        values, kept = probs[r].clone(), sums[r].clone()
        tok = op.redraw_removed_(values, kept, torch.tensor(removed), 0.4, 1e-4)
        full, full_sums = probs[r].clone(), torch.empty(nb, dtype=torch.float64)
        assert tok == op.redraw_row_(full, logits, False, 0.4, 1e-4, full_sums)
        assert torch.equal(values, full) and torch.equal(kept, full_sums)
        assert tok >= 0 and tok not in removed


@pytest.mark.parametrize("compiled", [True, False])
def test_redraw_is_the_sampler_with_tokens_removed(
    compiled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kept row's redraw with token 3 at -inf has the distribution of the sampler on logits
    where token 3 is -inf (chi-square over 20000 draws), a second removal keeps the first;
    greedy rows take the next argmax; rows with min-p / top-k / top-p are not kept (their
    filters depend on what is left); None when nothing is left."""
    if not compiled:
        _torch_only(monkeypatch)
    logits = torch.tensor([[1.0, 0.5, -0.3, 2.0, 0.0]])
    temp = 0.7
    sampler = Sampler(seed=5)
    info = build([SamplingParams(temperature=temp)])
    masked = logits.clone()
    masked[0, 3] = float("-inf")
    tokens = []
    for _ in range(20000):
        row = sampler(logits, info, keep=True).kept[0]  # type: ignore[index]
        assert not row.greedy
        tokens.append(sampler.redraw(row, masked[0], None))
    expected = (masked[0] / temp).softmax(-1)
    assert chi_square_on(tokens, expected, expected > 0) < 16.3  # df = 3, 0.999 quantile
    row = sampler(logits, info, keep=True).kept[0]  # type: ignore[index]
    assert sampler.redraw(row, masked[0], None) != 3
    masked[0, 0] = float("-inf")
    assert all(sampler.redraw(row, masked[0], None) in (1, 2, 4) for _ in range(50))
    # the verifier's path: each redraw told the tokens removed since the last one
    tokens = []
    for _ in range(4000):
        row = sampler(logits, info, keep=True).kept[0]  # type: ignore[index]
        assert (row.sums is not None) == compiled  # the op's block sums start the redraws
        first = masked[0].clone()
        first[0] = 0.0  # token 3 only, first
        assert sampler.redraw(row, first, None, [3]) != 3
        tokens.append(sampler.redraw(row, masked[0], None, [0]))
    expected = (masked[0] / temp).softmax(-1)
    assert chi_square_on(tokens, expected, expected > 0) < 13.8  # df = 2, 0.999 quantile
    assert sampler.redraw(row, torch.full((V,), float("-inf")), None) is None

    mixed = build(
        [SamplingParams(temperature=0), SamplingParams(temperature=1.0, top_p=0.9),
         SamplingParams(temperature=1.0, top_k=2), SamplingParams(temperature=1.0, min_p=0.1),
         SamplingParams(temperature=1.0)]
    )  # fmt: skip
    out = sampler(logits.expand(5, V).to(torch.bfloat16), mixed, keep=True)
    assert out.kept is not None and sorted(out.kept) == [0, 4]
    greedy = out.kept[0]
    assert greedy.greedy and sampler.redraw(greedy, masked[0], None) == 1  # 3 and 0 removed
    hot = sampler(logits.to(torch.bfloat16), build([SamplingParams(temperature=0)]), keep=True)
    assert hot.kept is not None and sampler.redraw(hot.kept[0], masked[0], None) == 1
    assert sampler(logits, info).kept is None


def test_redraw_under_the_minimum_mass_defers_to_the_sampler() -> None:
    """When the tokens left hold almost no probability (some may have underflowed to 0), the
    redraw says so (None) instead of drawing from rounded values."""
    logits = torch.tensor([[30.0, 0.0, -1.0, -2.0, -3.0]])
    sampler = Sampler(seed=0)
    row = sampler(logits, build([SamplingParams(temperature=1.0)]), keep=True).kept[0]  # type: ignore[index]
    masked = logits[0].clone()
    masked[0] = float("-inf")
    assert sampler.redraw(row, masked, None) is None


@pytest.mark.parametrize("masked", ["a third", "most"])
@pytest.mark.parametrize("vocab", [5, 300, 49152 + 7])
def test_sample_rows_op_is_the_torch_sampler(vocab: int, masked: str) -> None:
    """The compiled temperature sampler (``sampling_ops.cpp``): ``probs`` is
    ``softmax(x / T)``, a masked (-inf) token has probability 0 and is never drawn, and the
    token is ``pick``'s on those probabilities for the same uniform (up to rounding where the
    target sits on a boundary of the cdf). "most": rows masked as a grammar masks them (~98%,
    whole vectors of -inf, which the op does not exponentiate)."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import pick

    op = load_op()
    assert op is not None
    gen = torch.Generator().manual_seed(vocab)
    rows = 6
    x = torch.randn(rows, vocab + 3, generator=gen)[:, :vocab] * 4  # rows vocab + 3 apart
    if masked == "most":
        keep = torch.rand(rows, vocab, generator=gen) < 0.02
        keep[:, 0] = True  # a token left in every row
        x[~keep] = float("-inf")
    else:
        x[:, 1::3] = float("-inf")
    temps = torch.tensor([0.3, 0.7, 1.0, 1.5, 2.0, 0.05])
    off = (torch.full((rows,), vocab), torch.ones(rows), torch.zeros(rows))  # no filter
    for _ in range(20):
        u = torch.rand(rows, generator=gen)
        probs = torch.empty(rows, vocab)
        tokens = op.sample_rows(x, temps, *off, u, probs)
        want_p = (x / temps[:, None]).softmax(-1)
        # rtol: at T = 0.05 torch's x / T (~330) is rounded before the max is subtracted
        assert torch.allclose(probs / probs.sum(-1, keepdim=True), want_p, atol=1e-7, rtol=1e-4)
        assert not bool(torch.isinf(x.gather(1, tokens[:, None])).any())
        want = pick(want_p, u)
        cdf = want_p.double().cumsum(-1)
        for r in range(rows):
            t, w = int(tokens[r]), int(want[r])
            if t != w:  # only at a boundary of the cdf
                assert abs(float(cdf[r, min(t, w)]) - float(u[r]) * float(cdf[r, -1])) < 1e-5
    none = torch.full((1, vocab), float("-inf"))
    assert op.sample_rows(none, temps[:1], *[f[:1] for f in off], u[:1], probs[:1]).tolist() == [-1]


def test_sampler_takes_the_compiled_op(monkeypatch: pytest.MonkeyPatch) -> None:
    """Sampled rows go through ``sample_rows`` on CPU, with or without filters, and give the
    torch ops' tokens for the same seed."""
    from radixlm.kernels.cpu.build import load_op

    op = load_op()
    calls: list[int] = []

    class Counting:
        def __getattr__(self, name: str):  # noqa: ANN204
            if name == "sample_rows":
                calls.append(1)
            return getattr(op, name)

    import radixlm.runtime.sampler as sampler_mod

    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(0)) * 3
    for n, params in enumerate(
        [SamplingParams(temperature=0.9), SamplingParams(temperature=0.9, top_p=0.9, top_k=20)]
    ):
        info = build([params] * 4, vocab_size=1000)
        monkeypatch.setattr(sampler_mod, "_cpu_op", lambda x: Counting())
        compiled = Sampler(seed=11)(logits, info).next_token_ids
        assert calls == [1] * (n + 1)
        monkeypatch.setattr(sampler_mod, "_cpu_op", lambda x: None)
        assert Sampler(seed=11)(logits, info).next_token_ids == compiled


@pytest.mark.parametrize("vocab", [7, 1000, 49152])
@pytest.mark.parametrize("spread", [1.0, 4.0])
def test_sample_rows_filters_keep_what_the_torch_filters_keep(vocab: int, spread: float) -> None:
    """min-p, top-k and top-p in the compiled sampler keep exactly the tokens
    ``filter_logits`` keeps (a stable descending sort's rule), ties and a row with few allowed
    tokens included, and draw what ``pick`` draws on the filtered softmax for the same uniform
    (a boundary of the cdf aside)."""
    from radixlm.kernels.cpu.build import load_op
    from radixlm.runtime.sampler import pick

    op = load_op()
    assert op is not None
    gen = torch.Generator().manual_seed(vocab + int(spread))
    cases = [  # (top_k, top_p, min_p, temperature)
        (vocab, 0.9, 0.0, 1.0), (vocab, 0.5, 0.0, 0.7), (50, 1.0, 0.0, 1.0), (5, 0.8, 0.0, 1.2),
        (vocab, 1.0, 0.05, 1.0), (40, 0.95, 0.02, 0.8), (1, 1.0, 0.0, 1.0), (vocab, 1e-6, 0.0, 1.0),
    ]  # fmt: skip
    rows = len(cases)
    x = (torch.randn(rows, vocab, generator=gen) * spread).round(decimals=1)  # ties
    x[3, : vocab // 2] = float("-inf")  # few allowed
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, min_p=m) for k, p, m, t in cases]
    info = build(params, vocab_size=vocab)
    want_logits = filter_logits(x / info.temperatures[:, None], info)  # [R, V]
    want_p = want_logits.softmax(-1)
    for _ in range(10):
        u = torch.rand(rows, generator=gen)
        probs = torch.empty(rows, vocab)
        tokens = op.sample_rows(
            x, info.temperatures, info.top_ks, info.top_ps, info.min_ps, u, probs
        )
        got = probs / probs.sum(-1, keepdim=True)
        # The same number kept; the same tokens but among those tied at the last kept value
        # (torch.topk, the reference's first candidates, orders ties as it likes).
        assert torch.equal((got > 0).sum(-1), (want_p > 0).sum(-1))
        last = want_logits.masked_fill(want_p == 0, float("inf")).amin(-1, keepdim=True)
        scaled = x / info.temperatures[:, None]
        tied = scaled == last  # [R, V]
        assert torch.equal((got > 0) & ~tied, (want_p > 0) & ~tied)
        assert torch.allclose(got[~tied], want_p[~tied], atol=1e-6, rtol=1e-4)
        want = pick(want_p, u)
        cdf = want_p.double().cumsum(-1)
        for r in range(rows):
            t, w = int(tokens[r]), int(want[r])
            assert got[r, t] > 0
            if t != w and not bool(tied[r].any()):  # a boundary of the cdf
                assert abs(float(cdf[r, min(t, w)]) - float(u[r]) * float(cdf[r, -1])) < 1e-5


def test_a_row_with_no_token_allowed_does_not_fail_the_batch() -> None:
    """A sampled row whose logits are all -inf (the callers' invariant broken) leaves the
    compiled op to the torch ops, as without it: the other rows are sampled, nothing raises."""
    logits = torch.randn(3, 300, generator=torch.Generator().manual_seed(2))
    logits[1] = float("-inf")
    logits[2, 5:] = float("-inf")
    info = build([SamplingParams(temperature=0.7)] * 3, vocab_size=300)
    tokens = Sampler(seed=4)(logits, info).next_token_ids
    assert tokens[2] < 5 and 0 <= tokens[0] < 300
