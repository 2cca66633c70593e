"""The small measurements behind docs/performance.md's design choices, on one torch thread.

1. ``F.linear`` with the weight row-major (as nn.Linear allocates it) against column-major (as
   ``Transformer`` stores it), at the shipped model's decode shapes.
2. Exact (erf) GELU against GPT-2's tanh form.
3. One sampling step: rows with top-p (a sort of the vocabulary) against temperature only
   (drawn in vocabulary order).
4. The continuous-batching engine without HTTP: the shipped rope checkpoint decoding 1 and 32
   sampled streams of 256 tokens, with the event loop woken every step (``stream_interval`` 0)
   and at most every 20 ms — what the server costs before any HTTP work.

    python -m bench.micro            # prints markdown tables
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from model.checkpoint import load_checkpoint
from model.generate import SequenceState, StopMatcher
from model.sampling import RowSampler, SamplingBatch, SamplingParams
from model.tokenizer import IncrementalDecoder, special_ids, token_bytes
from server.engine import Engine
from server.job import Job
from server.metrics import Metrics

LINEAR_SHAPES = ((128, 384), (128, 128), (128, 512), (512, 128), (128, 2048))  # (in, out)
VOCAB = 2048


def microseconds(function: Callable[..., object], *args: object, repeats: int = 2000) -> float:
    """Mean µs per ``function(*args)`` after a warm-up."""
    for _ in range(repeats // 10):
        function(*args)
    start = time.perf_counter()
    for _ in range(repeats):
        function(*args)
    return 1e6 * (time.perf_counter() - start) / repeats


def linear_layouts() -> str:
    rows = []
    for inputs, outputs in LINEAR_SHAPES:
        for batch in (1, 32):
            x = torch.randn(batch, 1, inputs)
            row_major = torch.randn(outputs, inputs)
            column_major = row_major.t().contiguous().t()
            bias = torch.randn(outputs)
            before = microseconds(F.linear, x, row_major, bias)
            after = microseconds(F.linear, x, column_major, bias)
            rows.append(f"| [{batch},{inputs}]·[{inputs},{outputs}] | {before:.1f} | {after:.1f} |")
    header = "| product | row-major µs | column-major µs |\n|---|---|---|\n"
    return "F.linear, weight layouts:\n\n" + header + "\n".join(rows) + "\n"


def gelu_forms() -> str:
    rows = []
    for batch in (1, 32):
        x = torch.randn(batch, 1, 512)
        exact = microseconds(F.gelu, x)
        tanh = microseconds(partial(F.gelu, approximate="tanh"), x)
        rows.append(f"| [{batch}, 512] | {exact:.1f} | {tanh:.1f} |")
    header = "| input | exact (erf) µs | tanh µs |\n|---|---|---|\n"
    return "GELU:\n\n" + header + "\n".join(rows) + "\n"


def sampling_paths() -> str:
    rows = []
    for batch in (1, 32):
        logits = torch.randn(batch, VOCAB)
        for label, params in (
            ("temperature 0.8, top-p 0.95 (sorts)", SamplingParams(0.8, top_p=0.95, seed=1)),
            ("temperature 0.8 (no sort)", SamplingParams(0.8, seed=1)),
        ):
            sampler = SamplingBatch([RowSampler(params) for _ in range(batch)])
            cost = microseconds(sampler.sample, logits, repeats=200)
            rows.append(f"| {batch} | {label} | {cost:,.0f} |")
    header = "| batch | sampling | µs per step |\n|---|---|---|\n"
    return f"One sampling step over {VOCAB} logits:\n\n" + header + "\n".join(rows) + "\n"


def engine_without_http(checkpoint: Path) -> str:
    loaded = load_checkpoint(checkpoint, device="cpu", dtype="float32")
    table = token_bytes(loaded.tokenizer)
    prompt = [special_ids(loaded.tokenizer).bos, *range(10, 41)]  # 32 tokens

    async def rate(streams: int, interval: float) -> float:
        metrics = Metrics().for_model("bench")
        engine = Engine(
            "bench", loaded.model, vocab=len(table), filler=prompt[0], max_batch_size=64,
            max_context=512, max_queue=64, metrics=metrics, stream_interval=interval,
        )  # fmt: skip
        engine.start(asyncio.get_running_loop())

        async def one(seed: int) -> None:
            decoder = IncrementalDecoder(loaded.tokenizer, table)
            # eos_id None: every stream runs its 256 tokens, as with ignore_eos.
            state = SequenceState(prompt, 256, decoder, StopMatcher([]), None)
            job = Job(prompt, state, SamplingParams(0.8, seed=seed), None, False)
            engine.submit(job)
            while not (await job.next_events())[-1].finish_reason:
                pass

        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            await asyncio.gather(*(one(seed) for seed in range(streams)))
            best = max(best, streams * 256 / (time.perf_counter() - start))
        await engine.close()
        return best

    rows = []
    for interval in (0.0, 0.02):
        one_stream, many = (asyncio.run(rate(n, interval)) for n in (1, 32))
        ratio = many / one_stream
        rows.append(f"| {interval * 1000:g} ms | {one_stream:,.0f} | {many:,.0f} | {ratio:.1f}× |")
    header = "| stream interval | 1 stream | 32 streams | ratio |\n|---|---|---|---|\n"
    return (
        "The engine without HTTP (shipped rope, 256 sampled tokens per stream, tokens/s):\n\n"
        + header
        + "\n".join(rows)
        + "\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/rope"))
    args = parser.parse_args()
    torch.set_num_threads(1)
    with torch.inference_mode():
        for section in (linear_layouts, gelu_forms, sampling_paths):
            print(section() + "\n", flush=True)
    print(engine_without_http(args.checkpoint), flush=True)


if __name__ == "__main__":
    main()
