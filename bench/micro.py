"""The small measurements behind docs/performance.md's design choices, on one torch thread.

1. ``F.linear`` with the weight row-major (as nn.Linear allocates it) against column-major (as
   ``Transformer`` stores it), at the shipped model's decode shapes.
2. Exact (erf) GELU against GPT-2's tanh form.
3. One sampling step: rows with top-p (a sort of the vocabulary) against temperature only
   (drawn in vocabulary order).
4. The engine process without HTTP: the shipped rope checkpoint decoding 1 and 32 sampled
   streams of 256 tokens after a 32-token prompt, with a frame sent every step
   (``stream_interval`` 0) and at most every 20 ms — what the server costs before any HTTP work.

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

from bench.decode import NEW_TOKENS, PROMPT_TOKENS
from bench.run import rate, ratio, table
from model.sampling import RowSampler, SamplingBatch
from model.sampling_params import SamplingParams
from server.api.job import Job
from server.api.service import Service
from server.api.settings import Settings

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
            rows.append(
                [f"[{batch},{inputs}]·[{inputs},{outputs}]", f"{before:.1f}", f"{after:.1f}"]
            )
    header = ["product", "row-major µs", "column-major µs"]
    return "F.linear, weight layouts:\n\n" + table(header, rows)


def gelu_forms() -> str:
    rows = []
    for batch in (1, 32):
        x = torch.randn(batch, 1, 512)
        exact = microseconds(F.gelu, x)
        tanh = microseconds(partial(F.gelu, approximate="tanh"), x)
        rows.append([f"[{batch}, 512]", f"{exact:.1f}", f"{tanh:.1f}"])
    return "GELU:\n\n" + table(["input", "exact (erf) µs", "tanh µs"], rows)


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
            rows.append([str(batch), label, f"{cost:,.0f}"])
    header = ["batch", "sampling", "µs per step"]
    return f"One sampling step over {VOCAB} logits:\n\n" + table(header, rows)


def engine_without_http(checkpoint: Path) -> str:
    """The engine process (``server.engine.core``) fed by the API process's client, jobs submitted
    from an asyncio loop without HTTP: what the server costs before any HTTP work."""

    async def tokens_per_s(streams: int, interval: float) -> float:
        settings = Settings(
            checkpoints=checkpoint.parent, models=[checkpoint.name], device="cpu",
            max_batch_size=64, max_queue=64, stream_interval=interval, max_context=512,
        )  # fmt: skip
        service = Service(settings)
        await service.load()
        while not service.settled:
            await asyncio.sleep(0.05)
        served = service.models[checkpoint.name]
        prompt = [served.bos, *range(10, 9 + PROMPT_TOKENS)]

        async def one(seed: int) -> None:
            # eos_id None: every stream runs all its tokens, as with ignore_eos.
            job = Job(prompt, SamplingParams(0.8, seed=seed), max_tokens=NEW_TOKENS)
            served.engine.submit(job)
            while not job.is_last((await job.next_events())[-1]):
                pass

        best = 0.0
        for _ in range(3):
            start = time.perf_counter()
            await asyncio.gather(*(one(seed) for seed in range(streams)))
            best = max(best, streams * NEW_TOKENS / (time.perf_counter() - start))
        await service.close()
        return best

    rows = []
    for interval in (0.0, 0.02):
        one_stream, many = (asyncio.run(tokens_per_s(n, interval)) for n in (1, 32))
        rows.append(
            [f"{interval * 1000:g} ms", rate(one_stream), rate(many), ratio(many / one_stream)]
        )
    header = ["stream interval", "1 stream", "32 streams", "ratio"]
    return (
        f"The engine process without HTTP (shipped rope, {NEW_TOKENS} sampled tokens per stream, "
        "tokens/s):\n\n" + table(header, rows)
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
