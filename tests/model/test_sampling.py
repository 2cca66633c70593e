"""Properties of model.sampling: filters keep the right sets, draws follow the filtered
distribution, and a seeded row gives the same tokens whatever batch it sits in."""

import math

import pytest
import torch

from model.sampling import (
    MAX_REPETITION_PENALTY,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    FailureReason,
    RowSampler,
    SamplingBatch,
    SamplingParams,
    apply_repetition_penalty,
    filtered_probs,
    token_logprobs,
)

VOCAB = 50


def columns(batch: int, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> dict[str, torch.Tensor]:
    """Keyword arguments for filtered_probs with one value repeated over `batch` rows."""
    return {
        "temperature": torch.full((batch,), float(temperature)),
        "top_k": torch.full((batch,), top_k, dtype=torch.long),
        "top_p": torch.full((batch,), float(top_p)),
        "min_p": torch.full((batch,), float(min_p)),
    }


def kept(probs: torch.Tensor) -> list[set[int]]:
    """The support of each row of a [B, V] distribution."""
    return [set(torch.nonzero(row > 0).flatten().tolist()) for row in probs]


def random_logits(batch: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, VOCAB, generator=generator) * 3).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_temperature_zero_and_top_k_one_are_argmax(dtype: torch.dtype) -> None:
    logits = random_logits(200, seed=1, dtype=dtype)
    argmax = logits.float().argmax(dim=-1)
    greedy = SamplingBatch([RowSampler(SamplingParams(temperature=0.0)) for _ in range(200)])
    top1 = SamplingBatch([RowSampler(SamplingParams(top_k=1, seed=i)) for i in range(200)])
    # A greedy row beside a sampling row takes the sorted path rather than the argmax shortcut.
    mixed = SamplingBatch([RowSampler(SamplingParams(temperature=t)) for t in [0.0, 1.0] * 100])
    assert torch.equal(greedy.sample(logits), argmax)
    assert torch.equal(top1.sample(logits), argmax)
    assert torch.equal(mixed.sample(logits)[0::2], argmax[0::2])
    one_hot = filtered_probs(logits, **columns(200, temperature=0.0))
    assert torch.equal(one_hot.argmax(dim=-1), argmax)
    assert torch.all(one_hot.max(dim=-1).values == 1.0)


@pytest.mark.parametrize(("top_p", "expected_count"), [(0.5, 1), (0.6, 2), (0.85, 3), (1.0, 5)])
def test_top_p_on_known_distribution(top_p: float, expected_count: int) -> None:
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    probs = filtered_probs(logits, **columns(1, top_p=top_p))
    assert kept(probs) == [set(range(expected_count))]


@pytest.mark.parametrize("size", [3, 10, 20])
def test_top_p_counts_mass_that_reaches_p_despite_rounding(size: int) -> None:
    # On a uniform distribution p = j / size is reached after exactly j tokens; float32 sums
    # land just below j / size for many j, which must not pull in token j + 1.
    logits = torch.zeros(size - 1, size)
    top_p = torch.arange(1, size) / size
    probs = filtered_probs(logits, **{**columns(size - 1), "top_p": top_p})
    assert (probs > 0).sum(dim=-1).tolist() == list(range(1, size))


def test_top_p_sees_distribution_renormalised_after_top_k() -> None:
    # After top-k 2 the probabilities are [0.71, 0.29]: the first alone reaches p = 0.7.
    logits = torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]).log()
    probs = filtered_probs(logits, **columns(1, top_k=2, top_p=0.7))
    assert kept(probs) == [{0}]


def test_top_p_keeps_smallest_prefix_reaching_p() -> None:
    logits = random_logits(300, seed=2)
    top_p = torch.rand(300, generator=torch.Generator().manual_seed(3)) * 0.99 + 0.01
    raw = logits.softmax(dim=-1)
    probs = filtered_probs(logits, **{**columns(300), "top_p": top_p})
    for row, p in enumerate(top_p.tolist()):
        order = raw[row].argsort(descending=True).tolist()
        support = kept(probs[row : row + 1])[0]
        nucleus = raw[row, order[: len(support)]]
        assert support == set(order[: len(support)])
        assert nucleus.sum() >= p - 1e-5
        assert nucleus[:-1].sum() < p
        assert torch.allclose(probs[row, order[: len(support)]], nucleus / nucleus.sum())


def test_top_k_and_min_p_keep_expected_sets() -> None:
    logits = random_logits(100, seed=4)
    raw = logits.softmax(dim=-1)
    top_k = torch.randint(1, VOCAB + 10, (100,), generator=torch.Generator().manual_seed(5))
    min_p = torch.rand(100, generator=torch.Generator().manual_seed(6))
    by_k = kept(filtered_probs(logits, **{**columns(100), "top_k": top_k}))
    by_min_p = kept(filtered_probs(logits, **{**columns(100), "min_p": min_p}))
    for row in range(100):
        k = min(int(top_k[row]), VOCAB)
        assert by_k[row] == set(raw[row].topk(k).indices.tolist())
        threshold = min_p[row] * raw[row].max()
        assert by_min_p[row] == set(torch.nonzero(raw[row] >= threshold).flatten().tolist())


def test_repetition_penalty_follows_ctrl_rule() -> None:
    logits = random_logits(20, seed=7)
    generator = torch.Generator().manual_seed(8)
    seen = torch.rand(20, VOCAB, generator=generator) < 0.3
    penalty = 1.0 + torch.rand(20, generator=generator) * 2
    out = apply_repetition_penalty(logits, seen, penalty)
    p = penalty.unsqueeze(-1).expand_as(logits)
    positive, negative = seen & (logits > 0), seen & (logits < 0)
    assert torch.allclose(out[positive], logits[positive] / p[positive])
    assert torch.allclose(out[negative], logits[negative] * p[negative])
    assert torch.all(out[seen & (logits != 0)] < logits[seen & (logits != 0)])
    assert torch.equal(out[~seen], logits[~seen])


def test_repetition_penalty_can_change_greedy_choice() -> None:
    logits = torch.tensor([[2.0, 1.5, -1.0]])
    seen = torch.tensor([[True, False, False]])
    batch = SamplingBatch([RowSampler(SamplingParams(temperature=0.0, repetition_penalty=2.0))])
    assert batch.sample(logits, seen).item() == 1
    assert batch.sample(logits, seen=None).item() == 0


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.8, top_k=20, top_p=0.9, min_p=0.02, seed=1234),  # sorted
        SamplingParams(temperature=0.8, min_p=0.02, seed=1234),  # drawn in vocabulary order
    ],
)
def test_seeded_row_is_batch_independent(target: SamplingParams) -> None:
    steps = [random_logits(1, seed=100 + step) for step in range(50)]
    alone = SamplingBatch([RowSampler(target)])
    expected = [alone.sample(logits).item() for logits in steps]

    row = RowSampler(target)
    companions = torch.Generator().manual_seed(9)
    tokens = []
    for step, logits in enumerate(steps):
        if step % 10 == 0:  # rows join and leave: rebuild with new companions, new index
            others = [
                RowSampler(
                    SamplingParams(
                        temperature=float(torch.rand(1, generator=companions)) * 2,
                        top_k=int(torch.randint(0, 30, (1,), generator=companions)) * (i % 2),
                        top_p=float(torch.rand(1, generator=companions)) * 0.9 + 0.1
                        if i % 3
                        else 1.0,
                        seed=step + i,
                    )
                )
                for i in range(7)
            ]
            index = step // 10 + 1
            batch = SamplingBatch([*others[:index], row, *others[index:]])
        batch_logits = torch.randn(8, VOCAB, generator=companions)
        batch_logits[index] = logits[0]
        tokens.append(batch.sample(batch_logits)[index].item())
    assert tokens == expected


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_seeded_rows_draw_the_same_tokens_on_cuda() -> None:
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i) for i in range(8)]
    cpu = SamplingBatch([RowSampler(p) for p in params])
    cuda = SamplingBatch([RowSampler(p) for p in params], device="cuda")
    for step in range(20):
        logits = random_logits(8, seed=200 + step)
        assert torch.equal(cpu.sample(logits), cuda.sample(logits.cuda()).cpu())


def _reference_distribution(probs: list[float], top_k: int, top_p: float) -> list[float]:
    """Top-k then top-p by hand on an already-sorted distribution, renormalising after each."""
    probs = [q if i < top_k else 0.0 for i, q in enumerate(probs)]
    probs = [q / sum(probs) for q in probs]
    cumulative, out = 0.0, []
    for q in probs:
        out.append(q if cumulative < top_p else 0.0)
        cumulative += q
    return [q / sum(out) for q in out]


def test_draws_match_truncated_distribution() -> None:
    # Sorted probabilities; temperature 0.7 sharpens them, then top-k 8 and top-p 0.9 truncate.
    base = torch.tensor([0.22, 0.18, 0.14, 0.12, 0.1, 0.08, 0.06, 0.04, 0.03, 0.02, 0.01])
    temperature = 0.7
    logits = base.log().to(torch.bfloat16)  # the reference starts from the same rounded logits
    sharpened = (logits.float() / temperature).softmax(dim=-1).tolist()
    expected = torch.tensor(_reference_distribution(sharpened, top_k=8, top_p=0.9))
    assert 4 <= int((expected > 0).sum()) < 8  # both filters bite on this distribution

    # 1000 seeded rows x 20 steps = 20,000 draws. Expected total variation of the empirical
    # histogram is about 0.5 * sum(sqrt(2 q (1 - q) / (pi n))) < 0.006 for this support, so a
    # bound of 0.02 is over three times that; the seeds make the test deterministic anyway.
    params = [SamplingParams(temperature, top_k=8, top_p=0.9, seed=i) for i in range(1000)]
    batch = SamplingBatch([RowSampler(p) for p in params])
    draws = torch.cat([batch.sample(logits.expand(1000, -1)) for _ in range(20)])
    counts = torch.bincount(draws, minlength=len(base)).float()
    assert torch.all(counts[expected == 0] == 0)
    total_variation = 0.5 * (counts / counts.sum() - expected).abs().sum().item()
    assert total_variation < 0.02


def test_token_logprobs_use_raw_distribution() -> None:
    logits = random_logits(6, seed=10, dtype=torch.float16)
    tokens = torch.arange(6)
    chosen, top_values, top_ids = token_logprobs(logits, tokens, top_n=3)
    logprobs = logits.float().log_softmax(dim=-1)
    assert torch.allclose(chosen, logprobs[torch.arange(6), tokens])
    assert torch.equal(top_ids, logprobs.topk(3).indices)
    assert torch.allclose(top_values, logprobs.topk(3).values)
    assert token_logprobs(logits, tokens, top_n=0)[1].shape == (6, 0)
    with pytest.raises(ValueError, match="top_n"):
        token_logprobs(logits, tokens, top_n=VOCAB + 1)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.1),
        ("temperature", math.inf),
        ("temperature", math.nan),
        ("top_k", -1),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("seed", -1),
        ("seed", 2**64),
        ("seed", 3.0),
    ],
)
def test_invalid_params_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_bad_shapes_are_rejected() -> None:
    batch = SamplingBatch([RowSampler(SamplingParams(repetition_penalty=1.2))] * 2)
    with pytest.raises(ValueError, match="logits"):
        batch.sample(torch.zeros(3, VOCAB))
    with pytest.raises(ValueError, match="seen"):
        batch.sample(torch.zeros(2, VOCAB), seen=torch.zeros(2, VOCAB))
    with pytest.raises(ValueError, match="rows"):
        SamplingBatch([])


def test_draws_without_top_k_or_top_p_match_the_distribution() -> None:
    # This path never sorts; its draws must still follow temperature then min-p exactly.
    logits = random_logits(1, seed=5)[:, :12] * 2
    temperature, min_p = 0.9, 0.1
    expected = filtered_probs(logits, **columns(1, temperature=temperature, min_p=min_p))[0]
    assert 0 < int((expected == 0).sum()) < 11  # min-p bites

    params = [SamplingParams(temperature, min_p=min_p, seed=i) for i in range(1000)]
    batch = SamplingBatch([RowSampler(p) for p in params])
    draws = torch.cat([batch.sample(logits.expand(1000, -1)) for _ in range(20)])
    counts = torch.bincount(draws, minlength=logits.shape[-1]).float()
    assert torch.all(counts[expected == 0] == 0)
    total_variation = 0.5 * (counts / counts.sum() - expected).abs().sum().item()
    assert total_variation < 0.02


# ---- a row that cannot be sampled fails alone ------------------------------------------------

MIXED = [  # every path: vocabulary order, sorted, greedy, penalised
    SamplingParams(temperature=0.9, seed=1),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.9, seed=2),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=4),
]


class BrokenSampler(RowSampler):
    def next_uniform(self) -> torch.Tensor:
        raise RuntimeError("this row's generator broke")


def draw_steps(rows: list[RowSampler], steps: int, bad_row: int | None, how: str) -> list:
    """Each step's (tokens, failures) for ``rows``: the good rows get the same logits whether
    or not row ``bad_row`` sits among them and fails the way ``how`` says."""
    out = []
    for step in range(steps):
        logits = random_logits(len(MIXED), seed=300 + step)
        if bad_row is not None:
            bad = random_logits(1, seed=400 + step)
            bad[0, 3] = math.nan if how == "nan" else bad[0, 3]
            bad = torch.full_like(bad, math.inf) if how == "inf" else bad
            logits = torch.cat([logits[:bad_row], bad, logits[bad_row:]])
        seen = torch.zeros(len(rows), VOCAB, dtype=torch.bool)
        seen[:, :5] = True
        out.append(SamplingBatch(rows).draw(logits, seen))
    return out


@pytest.mark.parametrize("how", ["nan", "inf", "raises"])
@pytest.mark.parametrize("bad_row", [0, 1, 2, 3, 4])
def test_a_failing_row_fails_alone(how: str, bad_row: int) -> None:
    """Rows beside a failing one draw exactly the tokens they draw without it."""
    alone = draw_steps([RowSampler(p) for p in MIXED], 5, None, how)
    rows = [RowSampler(p) for p in MIXED]
    bad_params = SamplingParams(temperature=1.0, top_p=0.5, seed=9)
    rows.insert(bad_row, BrokenSampler(bad_params) if how == "raises" else RowSampler(bad_params))
    together = draw_steps(rows, 5, bad_row, how)
    reason = FailureReason.SAMPLING_ERROR if how == "raises" else FailureReason.NON_FINITE_LOGITS
    for (tokens, failures), (expected, none) in zip(together, alone, strict=True):
        assert none == {} and failures == {bad_row: reason}
        others = torch.cat([tokens[:bad_row], tokens[bad_row + 1 :]])
        assert torch.equal(others, expected)
        assert ((others >= 0) & (others < VOCAB)).all()


def test_a_draw_that_raises_is_retried_row_by_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """When the batched draw itself raises, every row draws alone with the same uniform, so
    the tokens are the ones the batched draw would have given."""
    rows = [RowSampler(p) for p in MIXED]
    logits = random_logits(len(rows), seed=7)
    expected = SamplingBatch([RowSampler(p) for p in MIXED]).draw(logits).tokens
    batched = SamplingBatch._draw

    def fails_for_batches(self: SamplingBatch, logits: torch.Tensor, *args: object) -> torch.Tensor:
        if len(self.rows) > 1:
            raise RuntimeError("a batched kernel failed")
        return batched(self, logits, *args)

    monkeypatch.setattr(SamplingBatch, "_draw", fails_for_batches)
    tokens, failures = SamplingBatch(rows).draw(logits)
    assert failures == {} and torch.equal(tokens, expected)
    with pytest.raises(ValueError, match=r"row 1 .* could not be sampled"):
        rows[1] = BrokenSampler(MIXED[1])
        SamplingBatch(rows).sample(logits)


@pytest.mark.parametrize("temperature", [0.0, 1e-40, 1e-30, 9.99e-6])
def test_a_temperature_below_the_minimum_is_greedy(temperature: float) -> None:
    logits = random_logits(3, seed=11) * 30  # large logits: x / 1e-40 would be inf
    row = RowSampler(SamplingParams(temperature=temperature, top_k=5, seed=1))
    assert row.params.greedy
    tokens, failures = SamplingBatch([row] * 3).draw(logits)
    assert failures == {} and torch.equal(tokens, logits.argmax(dim=-1))
    probs = filtered_probs(logits, **columns(3, temperature=temperature, top_k=5))
    assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), VOCAB).float())


def test_the_smallest_sampling_temperature_stays_finite() -> None:
    logits = random_logits(2, seed=12) * 1000
    row = RowSampler(SamplingParams(temperature=MIN_TEMPERATURE, seed=1))
    assert not row.params.greedy
    assert SamplingBatch([row, row]).draw(logits).failures == {}
    probs = filtered_probs(logits, **columns(2, temperature=MIN_TEMPERATURE, top_p=0.5))
    assert torch.isfinite(probs).all()


@pytest.mark.parametrize("penalty", [MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY, 0.5, 2.0])
def test_every_allowed_penalty_keeps_logits_finite(penalty: float) -> None:
    logits = random_logits(2, seed=13) * 50
    logits[:, 0] = 0.0  # 0 × a huge penalty would be NaN
    seen = torch.ones(2, VOCAB, dtype=torch.bool)
    penalised = apply_repetition_penalty(logits, seen, torch.full((2,), penalty))
    assert torch.isfinite(penalised).all()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("repetition_penalty", MIN_REPETITION_PENALTY / 2),
        ("repetition_penalty", MAX_REPETITION_PENALTY * 2),
        ("repetition_penalty", 1e-300),
        ("top_k", 2**63),
    ],
)
def test_values_the_sampler_cannot_hold_are_refused(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})
