"""What one ``choice``-constrained row costs the other rows of its batch.

In process, on the shipped rope checkpoint (CPU float32): ``others`` rows decode 128 steps
(seeded, temperature 0.8, a 16-token prompt each) in three batches stepped in turn, step by
step, so that the machine's changing speed hits each alike: alone; with one more free row; with
one more row that keeps to ``structured_outputs.choice`` (four names from the plays, answered
back to back: when one is complete its matcher starts again, as under a stream of such
requests). Reported: the other rows' tokens per CPU second (this thread's CPU time of the
median step; one torch thread), the median over the rounds, and the cost of the constrained row
(the median of each round's paired ratio, and their range) against the batch without it and
against the same batch with a free row.

    python -m bench.structured --out bench/results/structured.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path
from typing import Any

import llguidance
import torch

from model import grammar as grammar_module
from model.checkpoint import load_checkpoint
from model.decode import DecodeBatch, Row, Sampled, Tokens
from model.files import write_json_atomic
from model.grammar import GrammarMatcher, grammar_of, grammar_tokenizer
from model.sampling import RowSampler
from model.sampling_params import SamplingParams
from model.tokenizer import special_ids

CHOICES = ["ROMEO", "JULIET", "MERCUTIO", "the Nurse"]
PROMPT_TOKENS, STEPS = 16, 128
VARIANTS = ("alone", "with a free row", "with a choice row")


class RepeatedChoice:
    """The matcher of a stream of choice requests, each answered as the last one ends (the
    matcher starts again: compiling is a request's own cost, paid once and off the loop).
    With the grammar's mask memo (``--memo-places``, on by default) the requests after the
    first walk paths it holds; with ``--memo-places 0`` every mask is asked of llguidance."""

    def __init__(self, tokenizer: llguidance.LLTokenizer, grammar: str) -> None:
        self.matcher = GrammarMatcher(tokenizer, grammar)

    def allowed(self) -> bytes:
        return self.matcher.allowed()

    def advance(self, token: int) -> None:
        self.matcher.advance(token)
        if self.matcher.complete:
            self.matcher.restart()

    @property
    def complete(self) -> bool:
        return False


def joined_batch(
    model: Any, vocab: int, others: int, extra: RepeatedChoice | bool | None, seed: int
) -> tuple[DecodeBatch[Row], Sampled[Row] | None]:
    """A batch of ``others`` rows, prefilled, beside no extra row (False), a free one (None)
    or a constrained one; the rows' first draw."""
    generator = torch.Generator().manual_seed(seed)
    rows = others + (extra is not False)
    batch: DecodeBatch[Row] = DecodeBatch(model, rows, PROMPT_TOKENS + STEPS + 1, vocab, 0)
    members = []
    for index in range(rows):
        prompt = torch.randint(3, vocab, (PROMPT_TOKENS,), generator=generator).tolist()
        params = SamplingParams(temperature=0.8, seed=seed + index)
        constraint = extra if index == others and isinstance(extra, RepeatedChoice) else None
        members.append(Row(Tokens(prompt, []), RowSampler(params, constraint)))
    return batch, batch.step([(row, PROMPT_TOKENS) for row in members])


def other_rows_rates(
    model: Any, vocab: int, others: int, extras: dict[str, RepeatedChoice | bool | None], seed: int
) -> dict[str, float]:
    """Tokens per CPU second of the ``others`` rows of each variant's batch over STEPS decode
    steps, the batches stepped in turn (so that a change in the machine's speed, which moves
    these figures by tens of percent within a minute here, hits every variant alike): others
    over the median step's CPU time (this thread's: one torch thread)."""
    batches = {
        variant: joined_batch(model, vocab, others, extra, seed)
        for variant, extra in extras.items()
    }
    times: dict[str, list[float]] = {variant: [] for variant in extras}
    for step in range(STEPS):
        for variant in list(extras) if step % 2 else list(extras)[::-1]:
            batch, sampled = batches[variant]
            assert sampled is not None
            for row, token in zip(sampled.rows, sampled.tokens, strict=True):
                row.tokens.generated_ids.append(token)
            start = time.thread_time()
            sampled = batch.step()
            times[variant].append(time.thread_time() - start)
            batches[variant] = batch, sampled
    return {variant: others / statistics.median(spent) for variant, spent in times.items()}


@torch.inference_mode()
def measure(checkpoints: Path, batches: list[int], rounds: int) -> dict[str, Any]:
    loaded = load_checkpoint(checkpoints / "rope")
    model, tokenizer = loaded.model, loaded.tokenizer
    vocab = tokenizer.get_vocab_size()
    tokens = grammar_tokenizer(tokenizer, special_ids(tokenizer).eos)
    grammar = grammar_of("choice", CHOICES)
    results: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": os.getloadavg()[0],
        "steps": STEPS,
        "rounds": rounds,
        "choices": CHOICES,
        "batches": {},
    }
    for others in batches:
        rates: dict[str, list[float]] = {variant: [] for variant in VARIANTS}
        for round_ in range(rounds + 1):  # round 0 warms up and is dropped
            extra_rows = [False, None, RepeatedChoice(tokens, grammar)]
            extras = dict(zip(VARIANTS, extra_rows, strict=True))
            round_rates = other_rows_rates(model, vocab, others, extras, seed=round_)
            if round_:
                for variant, rate in round_rates.items():
                    rates[variant].append(rate)
        results["batches"][str(others)] = row = summary(rates)
        print(
            f"{others} other rows: "
            + ", ".join(f"{variant} {rate:,.0f}" for variant, rate in row["tokens_per_s"].items())
            + f" tokens/CPU-s; the choice row costs them {row['cost_vs_alone']:.1%} "
            f"(rounds {row['cost_vs_alone_range'][0]:.1%} to {row['cost_vs_alone_range'][1]:.1%}), "
            f"against a free row {row['cost_vs_free_row']:.1%}"
        )
    return results


def summary(rates: dict[str, list[float]]) -> dict[str, Any]:
    """Median rates, and the constrained row's cost as the median of each round's paired ratio
    (the three variants of a round were stepped in turn, so a load change hits them alike)."""
    constrained = rates["with a choice row"]
    against_alone = [1 - c / a for c, a in zip(constrained, rates["alone"], strict=True)]
    against_free = [1 - c / f for c, f in zip(constrained, rates["with a free row"], strict=True)]
    return {
        "tokens_per_s": {variant: statistics.median(values) for variant, values in rates.items()},
        "cost_vs_alone": statistics.median(against_alone),
        "cost_vs_alone_range": [min(against_alone), max(against_alone)],
        "cost_vs_free_row": statistics.median(against_free),
        "cost_of_a_free_row": statistics.median(
            1 - f / a for f, a in zip(rates["with a free row"], rates["alone"], strict=True)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument(
        "--memo-places",
        type=int,
        default=grammar_module.MEMO_PLACES,
        help="places the grammar's mask memo keeps (0: none; every mask asked of llguidance)",
    )
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    torch.set_num_threads(1)  # one core for the model; the other for the machine's other work
    grammar_module.MEMO_PLACES = args.memo_places
    results = measure(args.checkpoints, args.batches, args.rounds)
    results["memo_places"] = args.memo_places
    if args.out:
        write_json_atomic(args.out, results)


if __name__ == "__main__":
    main()
