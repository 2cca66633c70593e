"""Properties of model.sampling: filters keep the right sets, draws follow the filtered
distribution, and a seeded row gives the same tokens whatever batch it sits in."""

import dataclasses
import math

import pytest
import torch

from model.sampling import (
    UNIFORM_BLOCK,
    RowSampler,
    SamplingBatch,
    SamplingMetadata,
    _sorted_stages,
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    sampling_stages,
    token_logprobs,
)
from model.sampling_params import (
    MAX_REPETITION_PENALTY,
    MAX_TOP_K,
    MIN_REPETITION_PENALTY,
    MIN_TEMPERATURE,
    FailureReason,
    SamplingParams,
)

VOCAB = 50


def filtered_probs(logits: torch.Tensor, **columns: torch.Tensor) -> torch.Tensor:
    """The distribution each row samples from, after the filters (model.sampling's steps 2-5):
    logits [B, V], ``columns`` any of SamplingMetadata's [B] columns → [B, V] in vocabulary
    order, each row summing to 1 (one-hot at the argmax where temperature is 0)."""
    meta = SamplingMetadata.filled(logits.shape[0], logits.device, **columns)
    stages, sorted_ids = _sorted_stages(logits, meta)
    return torch.zeros_like(stages[-1].probs).scatter(-1, sorted_ids, stages[-1].probs)


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

MIXED = [  # every path: temperature only, sorted, greedy, vocabulary order (penalised)
    SamplingParams(temperature=0.9, seed=1),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.9, seed=2),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.8, min_p=0.05, repetition_penalty=1.3, seed=4),
]


class BrokenSampler(RowSampler):
    def next_uniform(self) -> float:
        raise RuntimeError("this row's generator broke")


def draw_steps(
    rows: list[RowSampler], steps: int, bad_row: int | None, how: str, good: int = len(MIXED)
) -> list:
    """Each step's (tokens, failures) for ``rows``: the ``good`` rows get the same logits
    whether or not row ``bad_row`` sits among them and fails the way ``how`` says (a NaN
    logit, every logit ±inf, or its generator raises)."""
    out = []
    for step in range(steps):
        logits = random_logits(good, seed=300 + step)
        if bad_row is not None:
            bad = random_logits(1, seed=400 + step)
            bad[0, 3] = math.nan if how == "nan" else bad[0, 3]
            if how in ("inf", "-inf"):
                bad = torch.full_like(bad, math.inf if how == "inf" else -math.inf)
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


TEMPERED = [SamplingParams(temperature=t, seed=i) for i, t in enumerate((0.7, 0.9, 1.0, 1.3))]


@pytest.mark.parametrize("how", ["nan", "inf", "-inf", "raises"])
@pytest.mark.parametrize("bad_row", [0, 2, 4])
def test_a_failing_row_among_tempered_rows_fails_alone(how: str, bad_row: int) -> None:
    """The same among rows that all draw at a temperature alone, where the draw kernel checks
    the logits itself: the rows beside the failing one draw what they draw without it."""
    rows = [RowSampler(p) for p in TEMPERED]
    bad_params = SamplingParams(temperature=1.0, seed=9)
    rows.insert(bad_row, BrokenSampler(bad_params) if how == "raises" else RowSampler(bad_params))
    with torch.no_grad():  # as while decoding: the kernel applies
        alone = draw_steps([RowSampler(p) for p in TEMPERED], 4, None, how, len(TEMPERED))
        together = draw_steps(rows, 4, bad_row, how, len(TEMPERED))
    reason = FailureReason.SAMPLING_ERROR if how == "raises" else FailureReason.NON_FINITE_LOGITS
    for (tokens, failures), (expected, none) in zip(together, alone, strict=True):
        assert none == {} and failures == {bad_row: reason}
        assert torch.equal(torch.cat([tokens[:bad_row], tokens[bad_row + 1 :]]), expected)


@pytest.mark.usefixtures("every_isa")
def test_tempered_rows_draw_in_one_checked_kernel_call_the_tokens_of_the_general_way(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = random_logits(len(TEMPERED), seed=8)
    general = SamplingBatch([RowSampler(p) for p in TEMPERED])
    general._tempered_only = False
    fast = SamplingBatch([RowSampler(p) for p in TEMPERED])

    def refused(*args: object) -> None:
        raise AssertionError("a clean tempered step took the general way")

    with torch.no_grad():  # as while decoding: the kernel applies
        expected = general.draw(logits)
        monkeypatch.setattr(SamplingBatch, "_checked_draw", refused)
        tokens, failures = fast.draw(logits)
    assert failures == {} == expected.failures
    assert torch.equal(tokens, expected.tokens)


def test_finite_rows_whose_batch_sum_overflows_do_not_fail() -> None:
    """The batch-wide sum only screens: rows near float32's largest value sum to infinity
    together, and each is then checked alone (finite) and drawn as it would be alone."""
    logits = torch.zeros(3, VOCAB)
    logits[0, 5] = logits[1, 9] = logits[2, 11] = 3e38  # each row's sum finite, the batch's not
    rows = [RowSampler(SamplingParams(temperature=0.0)) for _ in range(3)]
    tokens, failures = SamplingBatch(rows).draw(logits)
    assert failures == {}
    assert tokens.tolist() == [5, 9, 11]


def test_rows_of_opposite_infinities_both_fail() -> None:
    """+inf in one row and -inf in another make the batch's sum NaN: the row check then finds
    both (each row's own sum is infinite), and a finite row beside them draws as usual."""
    logits = random_logits(3, seed=4)
    logits[0, 1], logits[2, 2] = math.inf, -math.inf
    rows = [RowSampler(SamplingParams(temperature=0.0)) for _ in range(3)]
    tokens, failures = SamplingBatch(rows).draw(logits)
    assert failures == {0: FailureReason.NON_FINITE_LOGITS, 2: FailureReason.NON_FINITE_LOGITS}
    assert tokens[1].item() == logits[1].argmax().item()


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


# ---- references computed by hand from the module docstring's definitions --------------------


def reference_stages(
    logits: list[float],
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    penalty: float = 1.0,
    seen: set[int] = frozenset(),
) -> dict[str, list[float]]:
    """Each stage's distribution in vocabulary order, in float64, from the module docstring:
    CTRL penalty, temperature (greedy below MIN_TEMPERATURE), top-k, top-p (keep a token while
    the mass strictly before it is below p), min-p (at least min_p x the top probability), each
    renormalised before the next."""

    def softmax(values: list[float]) -> list[float]:
        top = max(values)
        weights = [math.exp(v - top) for v in values]
        return [w / sum(weights) for w in weights]

    def normalised(probs: list[float]) -> list[float]:
        return [q / sum(probs) for q in probs]

    stages = {"logits": softmax(logits)}
    if penalty != 1.0:
        logits = [
            (v / penalty if v > 0 else v * penalty) if i in seen else v
            for i, v in enumerate(logits)
        ]
        stages["repetition_penalty"] = softmax(logits)
    # Ties go to the lowest id, as argmax and the stable sort do.
    order = sorted(range(len(logits)), key=lambda i: (-logits[i], i))
    if temperature < MIN_TEMPERATURE:
        probs = [1.0 if i == order[0] else 0.0 for i in range(len(logits))]
    else:
        probs = softmax([v / temperature for v in logits])
    stages["temperature"] = probs
    if top_k:
        keep = set(order[:top_k])
        probs = normalised([q if i in keep else 0.0 for i, q in enumerate(probs)])
        stages["top_k"] = probs
    if top_p < 1:
        before, keep = 0.0, set()
        for i in order:
            if before < top_p or not keep:
                keep.add(i)
            before += probs[i]
        probs = normalised([q if i in keep else 0.0 for i, q in enumerate(probs)])
        stages["top_p"] = probs
    if min_p:
        threshold = min_p * max(probs)
        probs = normalised([q if q >= threshold else 0.0 for q in probs])
        stages["min_p"] = probs
    return stages


def seeded_draws(params: SamplingParams, logits: torch.Tensor, rows: int, steps: int):
    """Token counts of ``rows`` seeded copies of ``params`` (seeds 0..rows-1) over ``steps``."""
    batch = SamplingBatch(
        [RowSampler(dataclasses.replace(params, seed=seed)) for seed in range(rows)]
    )
    draws = torch.cat([batch.sample(logits.expand(rows, -1)) for _ in range(steps)])
    return torch.bincount(draws, minlength=logits.shape[-1]).double()


def total_variation(counts: torch.Tensor, expected: list[float]) -> float:
    return 0.5 * (counts / counts.sum() - torch.tensor(expected, dtype=torch.float64)).abs().sum()


# Probabilities in a shuffled vocabulary order, so that the sorted path really has to sort.
SHUFFLED = [0.05, 0.3, 0.02, 0.2, 0.08, 0.25, 0.07, 0.03]


@pytest.mark.parametrize(
    ("params", "support"),
    [
        # top-p alone: masses before 0.3, 0.25, 0.2 are 0, 0.3, 0.55 < 0.7; then 0.75 stops.
        (SamplingParams(top_p=0.7), {1, 5, 3}),
        # min-p alone (drawn in vocabulary order): 0.4 x 0.3 = 0.12 keeps 0.3, 0.25, 0.2.
        (SamplingParams(min_p=0.4), {1, 5, 3}),
        (SamplingParams(temperature=0.8, top_p=0.5), {1, 5}),
        (SamplingParams(temperature=1.3, min_p=0.2), {0, 1, 3, 4, 5, 6}),
        (SamplingParams(temperature=0.7, top_k=4, min_p=0.3), {1, 3, 5}),
    ],
    ids=["top_p alone", "min_p alone", "temperature+top_p", "temperature+min_p", "k+min_p"],
)
def test_draws_over_many_seeds_follow_the_filtered_distribution(
    params: SamplingParams, support: set[int]
) -> None:
    """20,000 draws (1000 seeds x 20 steps) against the distribution computed by hand: no
    token outside the filter's support, total variation within 0.02 (about 3x its expected
    value for 8 tokens)."""
    logits = torch.tensor([SHUFFLED]).log()
    expected = reference_stages(
        logits[0].tolist(), params.temperature, params.top_k, params.top_p, params.min_p
    )
    final = list(expected.values())[-1]
    assert {i for i, q in enumerate(final) if q > 0} == support
    counts = seeded_draws(params, logits, rows=1000, steps=20)
    assert {i for i, c in enumerate(counts.tolist()) if c > 0} == support
    assert total_variation(counts, final) < 0.02


class FixedUniform(RowSampler):
    """A row whose every uniform is ``value`` (to drive the inverse CDF to its edges)."""

    def __init__(self, params: SamplingParams, value: float) -> None:
        super().__init__(params)
        self.value = value

    def next_uniform(self) -> float:
        return self.value


def inverse_cdf(probs: list[float], order: list[int], uniform: float) -> int:
    """The first token along ``order`` whose cumulative mass reaches ``uniform``."""
    cumulative = 0.0
    for i in order:
        cumulative += probs[i]
        if probs[i] > 0 and cumulative >= uniform:
            return i
    return next(i for i in reversed(order) if probs[i] > 0)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.9),
        SamplingParams(temperature=1.2, min_p=0.1),
        SamplingParams(top_k=5),
        SamplingParams(temperature=0.8, top_p=0.9, min_p=0.05),
    ],
    ids=["plain", "min_p", "top_k", "top_p+min_p"],
)
def test_a_seeded_row_draws_by_inverse_cdf_with_its_generators_uniform(
    params: SamplingParams,
) -> None:
    """Step 6 of the docstring, pinned: the row's uniform is torch.rand(1) of a CPU generator
    seeded with its seed; rows without top-k and top-p walk the vocabulary in id order, the
    others in descending probability (ties: lowest id first)."""
    logits = random_logits(1, seed=21)[:, :16]
    stages = reference_stages(
        logits[0].tolist(), params.temperature, params.top_k, params.top_p, params.min_p
    )
    probs = list(stages.values())[-1]
    sorts = params.top_k > 0 or params.top_p < 1
    order = sorted(range(16), key=lambda i: (-probs[i], i)) if sorts else list(range(16))
    cdf = torch.tensor([probs[i] for i in order], dtype=torch.float64).cumsum(0)
    checked = 0
    for seed in range(200):
        generator = torch.Generator().manual_seed(seed)
        uniforms = [torch.rand(1, generator=generator).item() for _ in range(3)]
        if any((cdf - u).abs().min() < 1e-5 for u in uniforms):
            continue  # too close to a boundary for float32 to agree with float64
        batch = SamplingBatch([RowSampler(dataclasses.replace(params, seed=seed))])
        tokens = [batch.sample(logits).item() for _ in range(3)]
        assert tokens == [inverse_cdf(probs, order, u) for u in uniforms]
        checked += 1
    assert checked > 150


def test_the_largest_uniform_draws_the_last_token_with_mass() -> None:
    # Logits whose renormalised float32 mass sums to just under 1: a uniform just under 1
    # must still land on a real token, the last one with mass.
    def total(seed: int) -> float:
        stages = sampling_stages(random_logits(1, seed=seed)[0, :7], SamplingParams(min_p=0.05))
        return stages[-1].probs.cumsum(-1)[-1].item()

    seed = next(seed for seed in range(100) if total(seed) < 1)
    logits = random_logits(1, seed=seed)[:, :7]
    last = 1 - 2**-24  # the largest float32 below 1
    probs = sampling_stages(logits[0], SamplingParams(min_p=0.05))[-1].probs
    row = FixedUniform(SamplingParams(min_p=0.05), last)
    tokens, failures = SamplingBatch([row]).draw(logits)
    assert failures == {} and tokens.item() == int(probs.nonzero().max())
    # and uniform 0 lands on the first token with mass, never on a filtered-out one before it
    logits[0, 0] = logits.min() - 10  # token 0 is filtered out by min-p
    tokens, failures = SamplingBatch([FixedUniform(SamplingParams(min_p=0.05), 0.0)]).draw(logits)
    probs = sampling_stages(logits[0], SamplingParams(min_p=0.05))[-1].probs
    assert failures == {} and tokens.item() == int(probs.nonzero().min()) > 0


@pytest.mark.parametrize("uniform", [1.5, 2.0])
def test_a_token_past_the_vocabulary_fails_its_row(uniform: float) -> None:
    """A uniform outside [0, 1) (a broken generator) lands one past the vocabulary: that row
    is reported, the other keeps its token."""
    logits = random_logits(2, seed=22)
    good = SamplingParams(temperature=0.7, seed=3)
    expected = SamplingBatch([RowSampler(good)]).sample(logits[1:])
    rows = [FixedUniform(SamplingParams(), uniform), RowSampler(good)]
    tokens, failures = SamplingBatch(rows).draw(logits)
    assert failures == {0: FailureReason.SAMPLING_ERROR}
    assert tokens[1:].tolist() == expected.tolist()


# ---- the tie and boundary rules -------------------------------------------------------------


def test_min_p_keeps_a_token_exactly_at_the_threshold() -> None:
    # softmax of log [4, 2, 2, 1] is exactly [4, 2, 2, 1] / 9 in float32: 2/9 = 0.5 x 4/9.
    logits = torch.tensor([[4.0, 2.0, 2.0, 1.0]]).log()
    assert logits.softmax(-1)[0, 1] == 0.5 * logits.softmax(-1)[0, 0]
    sorted_path = filtered_probs(logits, **columns(1, min_p=0.5))
    unsorted_path = sampling_stages(logits[0], SamplingParams(min_p=0.5))[-1].probs
    for probs in (sorted_path[0], unsorted_path):
        assert torch.allclose(probs, torch.tensor([0.5, 0.25, 0.25, 0.0]))


def test_mass_within_the_tolerance_of_p_counts_as_reaching_it() -> None:
    # Four equal tokens: the mass before the third is exactly 0.5, within 1e-6 of p.
    top_p = torch.tensor([0.5 + 1e-6])
    assert (top_p - 1e-6).item() == 0.5
    probs = filtered_probs(torch.zeros(1, 4), **{**columns(1), "top_p": top_p})
    assert kept(probs) == [{0, 1}]


def test_the_minimum_temperature_itself_samples() -> None:
    # At exactly MIN_TEMPERATURE two logits 1e-6 apart are 0.1 apart after scaling: not greedy.
    logits = torch.tensor([[0.0, -1e-6, -1.0]])
    expected = (logits.double() / MIN_TEMPERATURE).softmax(-1).float()
    for top_k in (0, 2):
        probs = filtered_probs(logits, **columns(1, temperature=MIN_TEMPERATURE, top_k=top_k))
        assert torch.allclose(probs, expected, atol=1e-3)
    just_below = filtered_probs(logits, **columns(1, temperature=MIN_TEMPERATURE * 0.999))
    assert just_below.tolist() == [[1.0, 0.0, 0.0]]
    counts = seeded_draws(SamplingParams(MIN_TEMPERATURE, top_k=2), logits, rows=200, steps=1)
    assert counts[0] > 50 and counts[1] > 50 and counts[2] == 0


# ---- parameter validation: the exact messages and the boundaries that are allowed ------------


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("temperature", -0.1, "temperature must be a finite number >= 0 (below 1e-05 = greedy)"),
        ("top_k", -1, "top_k must be an integer in [0, 2**63) (0 = off)"),
        ("top_p", 0.0, "top_p must be in (0, 1] (1 = off)"),
        ("min_p", 1.5, "min_p must be in [0, 1] (0 = off)"),
        ("repetition_penalty", 0.0, "repetition_penalty must be in [0.01, 100] (1 = off)"),
        ("seed", -1, "seed must be None or an integer in [0, 2**64)"),
    ],
)
def test_invalid_params_say_what_is_allowed(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value) == f"{message}, got {value!r}"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", 0.0),
        ("top_k", 0),
        ("top_k", MAX_TOP_K),
        ("top_p", 1.0),
        ("top_p", 1e-9),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("repetition_penalty", MIN_REPETITION_PENALTY),
        ("repetition_penalty", MAX_REPETITION_PENALTY),
        ("seed", 0),
        ("seed", 2**64 - 1),
    ],
)
def test_the_edges_of_each_range_are_allowed(field: str, value: object) -> None:
    assert getattr(SamplingParams(**{field: value}), field) == value


def test_an_empty_batch_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"^rows must hold at least one RowSampler$"):
        SamplingBatch([])


def test_a_batchs_columns_live_on_its_device() -> None:
    rows = [RowSampler(p) for p in MIXED]
    batch = SamplingBatch(rows, device="meta")
    for name in ("temperature", "top_k", "top_p", "min_p", "repetition_penalty"):
        column = getattr(batch.metadata, name)
        assert column.device.type == "meta" and column.shape == (len(rows),)


# ---- token_logprobs --------------------------------------------------------------------------


def test_token_logprobs_allow_the_whole_vocabulary() -> None:
    logits = random_logits(3, seed=23)
    tokens = torch.tensor([4, 0, VOCAB - 1])
    chosen, top_values, top_ids = token_logprobs(logits, tokens, top_n=VOCAB)
    reference = [reference_stages(row)["logits"] for row in logits.tolist()]
    for row, probs in enumerate(reference):
        assert math.isclose(chosen[row].item(), math.log(probs[tokens[row]]), abs_tol=1e-5)
        order = sorted(range(VOCAB), key=lambda i: -probs[i])
        assert top_ids[row].tolist() == order
        assert torch.allclose(
            top_values[row].double().exp(), torch.tensor(sorted(probs)[::-1], dtype=torch.float64)
        )
    with pytest.raises(ValueError) as raised:
        token_logprobs(logits, tokens, top_n=-1)
    assert str(raised.value) == f"top_n must be in [0, {VOCAB}], got -1"


# ---- sampling_stages (POST /v1/trace) ---------------------------------------------------------

STAGE_CASES = [
    (SamplingParams(), ["logits", "temperature"]),
    (SamplingParams(temperature=0.7, min_p=0.1), ["logits", "temperature", "min_p"]),
    (SamplingParams(top_p=0.8), ["logits", "temperature", "top_p"]),
    (SamplingParams(top_k=1), ["logits", "temperature", "top_k"]),
    (
        SamplingParams(temperature=1.4, top_k=12, top_p=0.9, min_p=0.05),
        ["logits", "temperature", "top_k", "top_p", "min_p"],
    ),
    (SamplingParams(temperature=0.0, top_k=3), ["logits", "temperature", "top_k"]),
    (
        SamplingParams(temperature=0.9, min_p=0.2, repetition_penalty=1.8),
        ["logits", "repetition_penalty", "temperature", "min_p"],
    ),
    (
        SamplingParams(temperature=0.6, top_p=0.7, repetition_penalty=0.5),
        ["logits", "repetition_penalty", "temperature", "top_p"],
    ),
]


@pytest.mark.parametrize(("params", "names"), STAGE_CASES)
def test_sampling_stages_match_the_definitions(params: SamplingParams, names: list[str]) -> None:
    logits = random_logits(1, seed=24)[0, :20] * 0.7
    logits[3] = 0.0  # a zero logit: the penalty leaves it where it is
    seen = torch.zeros(20, dtype=torch.bool)
    seen[[0, 3, 5, 7, 11]] = True
    seen_ids = set(seen.nonzero().flatten().tolist())
    stages = sampling_stages(logits.to(torch.bfloat16).float(), params, seen)
    expected = reference_stages(
        logits.to(torch.bfloat16).float().tolist(),
        params.temperature,
        params.top_k,
        params.top_p,
        params.min_p,
        params.repetition_penalty,
        seen_ids,
    )
    assert [stage.name for stage in stages] == names == list(expected)
    for stage in stages:
        assert stage.probs.shape == (20,) and stage.probs.dtype == torch.float32
        reference = torch.tensor(expected[stage.name])
        assert torch.allclose(stage.probs, reference, atol=1e-6), stage.name
        assert set(stage.probs.nonzero().flatten().tolist()) == set(
            reference.nonzero().flatten().tolist()
        ), stage.name


@pytest.mark.parametrize(("params", "names"), STAGE_CASES)
def test_the_last_stage_is_what_the_batch_draws_from(
    params: SamplingParams, names: list[str]
) -> None:
    logits = random_logits(1, seed=25)[:, :20]
    last = sampling_stages(logits[0], params)[-1].probs
    if params.greedy:
        assert last.tolist() == torch.nn.functional.one_hot(logits.argmax(), 20).tolist()
    elif names[-1] != "min_p" or "top_k" in names or "top_p" in names:
        filters = columns(1, params.temperature, params.top_k, params.top_p, params.min_p)
        assert torch.allclose(last, filtered_probs(logits, **filters)[0], atol=1e-7)


def test_sampling_stages_without_seen_or_with_penalty_one_skip_the_penalty() -> None:
    logits = random_logits(1, seed=26)[0]
    seen = torch.ones(VOCAB, dtype=torch.bool)
    names = [s.name for s in sampling_stages(logits, SamplingParams(repetition_penalty=2.0))]
    assert names == ["logits", "temperature"]
    names = [s.name for s in sampling_stages(logits, SamplingParams(), seen)]
    assert names == ["logits", "temperature"]
    # The penalty stage is the softmax of the penalised logits.
    stages = sampling_stages(logits, SamplingParams(repetition_penalty=2.0), seen)
    penalised = torch.where(logits > 0, logits / 2, logits * 2)
    assert torch.allclose(stages[1].probs, penalised.softmax(-1))
    assert torch.allclose(stages[2].probs, penalised.softmax(-1))


# ---- the batched draw: no slow path unless something failed, and one uniform per row ---------


def solo_tokens(params: list[SamplingParams], logits, seen) -> list[int]:
    """Each row drawn alone, in its own one-row batch (fresh generators)."""
    return [
        SamplingBatch([RowSampler(p)]).sample(logits[i : i + 1], seen[i : i + 1]).item()
        for i, p in enumerate(params)
    ]


MANY_PATHS = [  # two or more rows on each path, so that every group is indexed
    SamplingParams(temperature=0.9, seed=1),
    SamplingParams(temperature=0.0, repetition_penalty=1.5),
    SamplingParams(temperature=1.1, top_k=10, top_p=0.9, seed=2),
    SamplingParams(temperature=0.6, min_p=0.1, repetition_penalty=1.3, seed=3),
    SamplingParams(temperature=0.0),
    SamplingParams(top_p=0.8, repetition_penalty=0.7, seed=4),
    SamplingParams(temperature=1.5, seed=5),
    SamplingParams(temperature=0.7, min_p=0.2, seed=6),
]


def test_a_healthy_mixed_batch_never_takes_the_row_by_row_path(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    logits = random_logits(len(MANY_PATHS), seed=27)
    seen = torch.rand(len(MANY_PATHS), VOCAB, generator=torch.Generator().manual_seed(1)) < 0.3
    seen[:, logits[0].argmax()] = True
    expected = solo_tokens(MANY_PATHS, logits, seen)

    def slow_path(*args: object) -> None:
        raise AssertionError("the batched draw raised on healthy rows")

    monkeypatch.setattr(SamplingBatch, "_draw_each", slow_path)
    batch = SamplingBatch([RowSampler(p) for p in MANY_PATHS])
    tokens, failures = batch.draw(logits, seen)
    assert failures == {} and tokens.dtype == torch.long and tokens.tolist() == expected
    for params in (MANY_PATHS[:1] * 3, MANY_PATHS[2:3] * 3, MANY_PATHS[1:2] * 3):
        rows = [RowSampler(p) for p in params]
        tokens = SamplingBatch(rows).sample(logits[:3], seen[:3])
        assert tokens.dtype == torch.long
        assert tokens.tolist() == solo_tokens(params, logits[:3], seen[:3])


def test_every_row_draws_one_uniform_per_step_and_greedy_batches_none() -> None:
    params = [dataclasses.replace(p, seed=seed) for seed, p in enumerate(MANY_PATHS)]
    rows, fresh = [RowSampler(p) for p in params], [RowSampler(p) for p in params]
    SamplingBatch(rows).sample(random_logits(len(rows), seed=28))
    for row, reference in zip(rows, fresh, strict=True):
        reference.next_uniform()  # the one the step used
        assert row.next_uniform() == reference.next_uniform()
    greedy = [RowSampler(SamplingParams(temperature=0.0, seed=i)) for i in range(3)]
    untouched = [RowSampler(SamplingParams(temperature=0.0, seed=i)) for i in range(3)]
    SamplingBatch(greedy).sample(random_logits(3, seed=29))
    assert [r.next_uniform() for r in greedy] == [r.next_uniform() for r in untouched]


@pytest.mark.parametrize("seed", [0, 7, 2**40])
def test_uniforms_drawn_in_blocks_are_the_generators_one_at_a_time(seed: int) -> None:
    """A row's uniforms, drawn UNIFORM_BLOCK at a time, are the numbers a generator of its seed
    gives one call at a time: block draws leave every seeded output as it was."""
    row = RowSampler(SamplingParams(temperature=1.0, seed=seed))
    generator = torch.Generator().manual_seed(seed)
    count = 2 * UNIFORM_BLOCK + 3  # across two refills
    one_at_a_time = [torch.rand(1, generator=generator).item() for _ in range(count)]
    assert [row.next_uniform() for _ in range(count)] == one_at_a_time


MARKER = 777.0  # a logit that, in this test, makes any draw of its row raise


@pytest.mark.parametrize("greedy", [False, True])
def test_after_a_batched_failure_each_row_draws_alone(
    monkeypatch: pytest.MonkeyPatch, greedy: bool
) -> None:
    """The batched draw raises (a kernel that fails on batches, and on one poisoned row):
    every row then draws alone, with its penalty and its own uniform; the rows already failed
    are skipped and the poisoned row fails alone."""
    params = [SamplingParams(temperature=0.0, repetition_penalty=1.4)] * 4 if greedy else MIXED
    logits = random_logits(len(params), seed=30)
    seen = torch.zeros(len(params), VOCAB, dtype=torch.bool)
    seen[:, logits.argmax(dim=-1)] = True  # the penalty changes greedy choices
    expected = solo_tokens(params, logits, seen)
    batched = SamplingBatch._draw

    def fragile(self: SamplingBatch, logits: torch.Tensor, *args: object) -> torch.Tensor:
        if len(logits) > 1 or (logits == MARKER).any():
            raise RuntimeError("a batched kernel failed")
        return batched(self, logits, *args)

    monkeypatch.setattr(SamplingBatch, "_draw", fragile)
    tokens, failures = SamplingBatch([RowSampler(p) for p in params]).draw(logits, seen)
    assert failures == {} and tokens.dtype == torch.long and tokens.tolist() == expected

    # Row 1 fails before the draw (NaN), row 3 too where it samples (a broken generator); row
    # 2 fails inside it. The rows after each failure are still drawn.
    first = params[0]
    rows = [RowSampler(first), RowSampler(first), RowSampler(first)]
    rows += [RowSampler(first) if greedy else BrokenSampler(SamplingParams(seed=1))]
    rows += [RowSampler(p) for p in params]
    bad = random_logits(3, seed=31)
    bad[0, 5] = math.nan
    bad[1, 7] = MARKER
    everything = torch.cat([logits[:1], bad, logits])
    everything_seen = torch.cat([seen[:1], seen[:3], seen])
    tokens, failures = SamplingBatch(rows).draw(everything, everything_seen)
    expected_failures = {1: FailureReason.NON_FINITE_LOGITS, 2: FailureReason.SAMPLING_ERROR}
    if not greedy:
        expected_failures[3] = FailureReason.SAMPLING_ERROR
    assert failures == expected_failures
    healthy = [i for i in range(len(rows)) if i not in failures]
    monkeypatch.undo()
    assert tokens.dtype == torch.long
    assert [tokens[i].item() for i in healthy] == [
        SamplingBatch([RowSampler(rows[i].params)])
        .sample(everything[i : i + 1], everything_seen[i : i + 1])
        .item()
        for i in healthy
    ]


# ---- logit bias and OpenAI's frequency / presence penalties (steps 0 and 1) -----------------


def adjusted_reference(
    logits: torch.Tensor, params: SamplingParams, seen=None, counts=None
) -> torch.Tensor:
    """Steps 0-1 by hand, in float64: bias, CTRL penalty on seen tokens, then
    logit - frequency x count - presence x (count > 0)."""
    out = logits.double().clone()
    for token, bias in params.logit_bias:
        if token < out.shape[-1]:
            out[token] += bias
    if seen is not None and params.repetition_penalty != 1.0:
        p = params.repetition_penalty
        out = torch.where(seen & (out > 0), out / p, torch.where(seen, out * p, out))
    if counts is not None:
        counts = counts.double()
        out = out - params.frequency_penalty * counts - params.presence_penalty * (counts > 0)
    return out


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("frequency_penalty", 2.5, "frequency_penalty must be in [-2, 2]"),
        ("presence_penalty", -2.01, "presence_penalty must be in [-2, 2]"),
        ("logit_bias", ((-1, 1.0),), "logit_bias must be pairs of a token id >= 0 and a bias "),
        ("logit_bias", ((3, 100.5),), "logit_bias must be pairs of a token id >= 0 and a bias "),
        ("logit_bias", ((True, 1.0),), "logit_bias must be pairs of a token id >= 0 and a bias "),
    ],
)
def test_openai_penalties_and_bias_are_validated(field: str, value: object, message: str) -> None:
    with pytest.raises(ValueError) as raised:
        SamplingParams(**{field: value})
    assert str(raised.value).startswith(message) and str(raised.value).endswith(f"{value!r}")
    for edge in (-2.0, 2.0):
        assert (
            SamplingParams(frequency_penalty=edge, presence_penalty=edge).presence_penalty == edge
        )
    assert SamplingParams(logit_bias=((0, -100.0), (7, 100.0))).logit_bias == (
        (0, -100.0),
        (7, 100.0),
    )


def test_openai_penalties_follow_their_formula() -> None:
    logits = random_logits(4, seed=40)
    counts = torch.randint(0, 3, (4, VOCAB), generator=torch.Generator().manual_seed(2))
    frequency = torch.tensor([0.0, 0.5, -1.0, 2.0])
    presence = torch.tensor([1.0, 0.0, 0.7, -2.0])
    out = apply_frequency_presence_penalties(logits, counts, frequency, presence)
    for row in range(4):
        params = SamplingParams(
            frequency_penalty=float(frequency[row]), presence_penalty=float(presence[row])
        )
        expected = adjusted_reference(logits[row], params, counts=counts[row]).float()
        assert out.dtype == torch.float32 and torch.allclose(out[row], expected, atol=1e-6)
    with pytest.raises(ValueError) as raised:
        apply_frequency_presence_penalties(logits, counts[:, 1:], frequency, presence)
    assert str(raised.value) == f"counts must have shape (4, {VOCAB}), got (4, {VOCAB - 1})"


ADJUSTED = [  # greedy rows, so that the argmax of the adjusted logits is the token
    SamplingParams(temperature=0.0, logit_bias=((3, 100.0), (VOCAB + 5, 100.0))),
    SamplingParams(temperature=0.0, frequency_penalty=2.0, presence_penalty=1.0),
    SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0),
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, logit_bias=((0, -100.0),), frequency_penalty=-2.0),
]


def test_bias_and_penalties_move_each_rows_argmax() -> None:
    logits = random_logits(len(ADJUSTED), seed=41)
    counts = torch.zeros(len(ADJUSTED), VOCAB)
    counts[:, logits.argmax(-1)] = 3.0  # every row has generated its argmax three times
    seen = counts > 0
    expected = [
        adjusted_reference(logits[i], p, seen[i], counts[i]).argmax().item()
        for i, p in enumerate(ADJUSTED)
    ]
    assert expected[0] == 3 and expected[3] == logits[3].argmax()
    assert expected[1] != logits[1].argmax() and expected[2] != logits[2].argmax()
    batch = SamplingBatch([RowSampler(p) for p in ADJUSTED])
    assert batch.sample(logits, seen, counts).tolist() == expected
    # counts not given: no frequency / presence penalty (the bias still applies)
    without = [
        adjusted_reference(logits[i], p, seen[i]).argmax().item() for i, p in enumerate(ADJUSTED)
    ]
    assert batch.sample(logits, seen).tolist() == without
    # a narrower vocabulary rebuilds the bias table
    narrow = logits[:, : VOCAB - 10]
    assert batch.sample(narrow).tolist() == [
        adjusted_reference(narrow[i], p).argmax().item() for i, p in enumerate(ADJUSTED)
    ]


def test_the_row_by_row_path_keeps_bias_and_penalties(monkeypatch: pytest.MonkeyPatch) -> None:
    logits = random_logits(len(ADJUSTED), seed=42)
    counts = torch.zeros(len(ADJUSTED), VOCAB)
    counts[:, logits.argmax(-1)] = 2.0
    seen = counts > 0
    expected = SamplingBatch([RowSampler(p) for p in ADJUSTED]).sample(logits, seen, counts)
    batched = SamplingBatch._draw

    def fails_for_batches(self: SamplingBatch, logits: torch.Tensor, *args: object):
        if len(logits) > 1:
            raise RuntimeError("a batched kernel failed")
        return batched(self, logits, *args)

    monkeypatch.setattr(SamplingBatch, "_draw", fails_for_batches)
    tokens, failures = SamplingBatch([RowSampler(p) for p in ADJUSTED]).draw(logits, seen, counts)
    assert failures == {} and tokens.tolist() == expected.tolist()


def test_sampling_stages_show_bias_and_penalties_in_order() -> None:
    logits = random_logits(1, seed=43)[0]
    counts = torch.zeros(VOCAB)
    counts[[1, 2, 3]] = torch.tensor([1.0, 2.0, 4.0])
    seen = counts > 0
    params = SamplingParams(
        temperature=0.8,
        repetition_penalty=1.5,
        frequency_penalty=0.5,
        presence_penalty=0.25,
        logit_bias=((4, 3.0), (5, -3.0)),
        min_p=0.05,
    )
    stages = sampling_stages(logits, params, seen, counts)
    assert [s.name for s in stages] == [
        "logits",
        "logit_bias",
        "repetition_penalty",
        "frequency_presence_penalty",
        "temperature",
        "min_p",
    ]
    biased = adjusted_reference(logits, SamplingParams(logit_bias=params.logit_bias))
    penalised = adjusted_reference(
        logits, dataclasses.replace(params, frequency_penalty=0.0, presence_penalty=0.0), seen
    )
    final = adjusted_reference(logits, params, seen, counts)
    for stage, reference in zip(
        stages[1:5], [biased, penalised, final, final / params.temperature], strict=True
    ):
        assert torch.allclose(stage.probs, reference.softmax(-1).float(), atol=1e-6), stage.name
    no_counts = [s.name for s in sampling_stages(logits, params, seen)]
    assert "frequency_presence_penalty" not in no_counts and "logit_bias" in no_counts
    plain = [s.name for s in sampling_stages(logits, SamplingParams(), seen, counts)]
    assert plain == ["logits", "temperature"]


def test_penalties_and_bias_move_the_greedy_choice_in_the_documented_order() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 3], logits[0, 5] = 2.0, 1.5
    counts = torch.zeros(1, VOCAB)
    counts[0, 3] = 1  # token 3 was generated once

    def greedy(**params: object) -> int:
        row = RowSampler(SamplingParams(temperature=0.0, **params))  # type: ignore[arg-type]
        return SamplingBatch([row]).sample(logits, counts=counts).item()

    assert greedy() == 3
    assert greedy(frequency_penalty=0.6) == 5  # 2.0 - 0.6 < 1.5
    assert greedy(presence_penalty=0.4) == 3  # 2.0 - 0.4 > 1.5
    assert greedy(presence_penalty=0.6) == 5
    assert greedy(logit_bias=((9, 100.0),)) == 9
    assert greedy(logit_bias=((3, -100.0),)) == 5
    # the bias applies before the penalties: +1 on token 3, then -0.6 × 1 leaves 2.4 > 1.5
    assert greedy(logit_bias=((3, 1.0),), frequency_penalty=0.6) == 3
    assert greedy(logit_bias=((VOCAB + 5, 100.0),)) == 3  # ids past the logits are ignored


def test_the_logit_bias_table_is_built_with_tensor_ops_at_each_batch_change() -> None:
    """64 rows × 1,024 biased tokens (OpenAI's most): the table the batch builds from each row's
    two tensors (made once, when the request arrives) is the entry-by-entry table; ids past the
    vocabulary are ignored. (Its cost, 153 ms of Python before: docs/testing.md, not timed here.)"""
    vocab = 4096
    generator = torch.Generator().manual_seed(0)
    rows = []
    for row in range(64):
        ids = torch.randperm(vocab + 50, generator=generator)[:1024].tolist()
        bias = tuple((token, float((token + row) % 201 - 100)) for token in ids)
        rows.append(RowSampler(SamplingParams(logit_bias=bias)))
    rows.append(RowSampler(SamplingParams()))  # a row without bias
    for sampler in rows:
        _ = sampler.bias  # made once, when the request arrives
    table = SamplingBatch(rows)._bias_table(torch.zeros(len(rows), vocab))
    expected = torch.zeros(len(rows), vocab)
    for row, sampler in enumerate(rows):
        for token, value in sampler.params.logit_bias:
            if token < vocab:
                expected[row, token] = value
    assert torch.equal(table, expected)
