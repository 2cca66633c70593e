"""The small measurements behind docs/performance.md's design choices, on one torch thread.

1. ``F.linear`` with the weight row-major (as nn.Linear allocates it) against column-major (as
   ``Transformer`` stores it), at the shipped model's decode shapes.
2. Exact (erf) GELU against GPT-2's tanh form.
3. One sampling step: rows with top-p (a sort of the vocabulary) against temperature only
   (drawn in vocabulary order).
4. The decode kernel for projections (``model.kernels.linear``) against ``F.linear`` (MKL): a
   decode step's 17 products at 4L-256d-v4096, with the weights in cache and evicted, and whole
   greedy decodes with the kernel on and off (interleaved rounds, medians).
5. The engine process without HTTP: the shipped rope checkpoint decoding 1 and 32 sampled
   streams of 256 tokens after a 32-token prompt, with a frame sent every step
   (``stream_interval`` 0) and at most every 20 ms — what the server costs before any HTTP work.
6. PaTH's pass in blocks of ``model.positional.path.BLOCK`` tokens against one triangular system
   over the whole pass (the block as long as the prompt): the shipped path checkpoint's forward
   over prompts of 128 to 1,024 tokens (interleaved rounds, medians).

``--profile`` instead profiles one decode step (``DecodeBatch.step``: the forward, the cache and
the sampling) of the shipped rope checkpoint at batch 1 and 32, sampled at temperature 0.8:
the torch ops it issues from Python (a count that does not move with the machine's load) and
where their time goes (torch.profiler, self CPU time by op).

    python -m bench.micro            # prints markdown tables
    python -m bench.micro --profile  # ops per decode step, and their time
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import model.kernels as kernels
import model.positional.path as path
from bench.decode import GPT2_LAYOUT, GREEDY, NEW_TOKENS, PROMPT_TOKENS, model_sizes
from bench.run import rate, ratio, table
from model.checkpoint import load_checkpoint
from model.config import ModelConfig
from model.decode import DecodeBatch, Row, Tokens
from model.generate import decode_tokens
from model.kernels import decode_step
from model.kernels import linear as linear_kernel
from model.sampling import RowSampler, SamplingBatch
from model.sampling_params import SamplingParams
from model.transformer import Transformer
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


# A decode step's products at 4L-256d-v4096 (bench.decode's larger size), in, out: qkv, the
# attention's output, the MLP's up and down for each of 4 layers, then the unembedding.
STEP_PRODUCTS = ((256, 768), (256, 256), (256, 1024), (1024, 256)) * 4 + ((256, 4096),)


def linear_kernel_products(rounds: int = 30) -> str:
    """The step's 17 products through F.linear and through the kernel, timed as a chain; 'cold'
    evicts the weights (a pass over 48 MB, past the L3 cache) before each chain."""
    if not kernels.ready():
        return "The kernels could not be built here (no compiler), or ORDINAL_CPU_ISA=torch.\n"
    weights = [torch.randn(inputs, outputs).t() for inputs, outputs in STEP_PRODUCTS]
    biases = [torch.randn(outputs) for _, outputs in STEP_PRODUCTS]
    evict = torch.empty(12_000_000)
    rows = []
    for batch in (1, 4, 32):
        inputs = {width: torch.randn(batch, width) for width, _ in STEP_PRODUCTS}

        def chain(product: Callable[..., torch.Tensor], inputs: dict = inputs) -> None:
            for (width, _), weight, bias in zip(STEP_PRODUCTS, weights, biases, strict=True):
                product(inputs[width], weight, bias)

        for label, cold in (("in cache", False), ("evicted", True)):
            times: dict[str, list[float]] = {"mkl": [], "kernel": []}
            for _ in range(rounds):
                for name, product in (("mkl", F.linear), ("kernel", linear_kernel.linear)):
                    if cold:
                        evict.fill_(1.0)
                    start = time.perf_counter()
                    chain(product)
                    times[name].append(time.perf_counter() - start)
            mkl, kernel = (1e3 * statistics.median(times[name]) for name in ("mkl", "kernel"))
            rows.append([str(batch), label, f"{mkl:.3f}", f"{kernel:.3f}", f"{mkl / kernel:.2f}×"])
    header = ["rows", "weights", "F.linear (MKL) ms", "kernel ms", "speed-up"]
    return "A decode step's 17 products, 4L-256d-v4096:\n\n" + table(header, rows)


def linear_kernel_decode(rounds: int = 7) -> str:
    """Greedy decodes (32-token prompt, 128 tokens) with the CPU decode kernels (the blocks'
    and the projections') on and off in turn."""
    if not kernels.ready():
        return ""
    rows = []
    sizes = model_sizes(Path("checkpoints"))
    for size, layout in (
        ("shipped", {"positional": {"scheme": "rope"}}),
        ("4L-256d-v4096", GPT2_LAYOUT),
    ):
        torch.manual_seed(0)
        model = Transformer(ModelConfig.from_dict({**sizes[size], **layout})).eval()
        for batch in (1, 32):
            prompts = torch.randint(3, model.config.vocab_size, (batch, PROMPT_TOKENS)).tolist()
            rates: dict[int, list[float]] = {linear_kernel.MAX_ROWS: [], 0: []}
            for _ in range(rounds):
                for max_rows in rates:
                    kept = linear_kernel.MAX_ROWS, decode_step.MAX_ROWS
                    linear_kernel.MAX_ROWS = decode_step.MAX_ROWS = max_rows  # 0: off
                    start = time.perf_counter()
                    for _ in decode_tokens(model, prompts, 128, GREEDY):
                        pass
                    rates[max_rows].append(batch * 128 / (time.perf_counter() - start))
                    linear_kernel.MAX_ROWS, decode_step.MAX_ROWS = kept
            on, off = (statistics.median(rates[key]) for key in rates)
            rows.append([size, str(batch), rate(off), rate(on), f"{on / off:.2f}×"])
    header = ["size", "batch", "torch tokens/s", "kernels tokens/s", "ratio"]
    title = "Greedy decode, the decode kernels off and on (medians of interleaved rounds)"
    return f"{title}:\n\n" + table(header, rows)


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


def step_profile(checkpoint: Path, steps: int = 20) -> str:
    """Ops and time of one ``DecodeBatch.step`` at batch 1 and 32 (after a 32-token prompt)."""
    model, _ = load_checkpoint(checkpoint, device="cpu", dtype="float32")
    vocab = model.config.vocab_size
    parts = []
    for batch in (1, 32):
        params = SamplingParams(0.8, seed=1)
        rows = [
            Row(Tokens(list(range(3, 3 + PROMPT_TOKENS)), []), RowSampler(params))
            for _ in range(batch)
        ]
        decoding: DecodeBatch[Row] = DecodeBatch(model, batch, PROMPT_TOKENS + 64, vocab, 0)
        decoding.step([(row, PROMPT_TOKENS) for row in rows])
        for _ in range(5):  # warm-up: allocator, the rope table
            decoding.step()
        with profile(activities=[ProfilerActivity.CPU]) as profiler:
            for _ in range(steps):
                decoding.step()
        issued: Counter[str] = Counter()  # ops called from Python, not from inside another op
        for event in profiler.events():
            parent = event.cpu_parent
            if event.name.startswith("aten::") and not (
                parent and parent.name.startswith("aten::")
            ):
                issued[event.name.removeprefix("aten::")] += 1
        ops = ", ".join(f"{name} {count / steps:g}" for name, count in issued.most_common())
        averages = sorted(profiler.key_averages(), key=lambda e: -e.self_cpu_time_total)
        total = sum(e.self_cpu_time_total for e in averages)
        rows_shown = [
            [e.key.removeprefix("aten::"), f"{e.self_cpu_time_total / steps:,.0f}",
             f"{e.self_cpu_time_total / total:.0%}", f"{e.count / steps:g}"]
            for e in averages[:12]
        ]  # fmt: skip
        parts.append(
            f"Batch {batch}: {sum(issued.values()) / steps:g} torch ops issued per step ({ops}); "
            f"self CPU time by op, µs per step (under the profiler):\n\n"
            + table(["op", "µs / step", "share", "calls / step"], rows_shown)
        )
    return "One decode step of the shipped rope checkpoint, profiled:\n\n" + "\n".join(parts)


def path_blocks(checkpoint: Path = Path("checkpoints/path"), rounds: int = 5) -> str:
    """The path checkpoint's forward, its pass in blocks and as one system, by prompt length."""
    model = load_checkpoint(checkpoint)[0].eval()
    blocked = path.BLOCK
    rows = []
    try:
        for length in (128, 512, 1024):
            tokens = torch.randint(model.config.vocab_size, (1, length))
            times: dict[int, list[float]] = {blocked: [], length: []}
            for _ in range(rounds):
                for block in times:
                    path.BLOCK = block
                    start = time.perf_counter()
                    model(tokens)
                    times[block].append(time.perf_counter() - start)
            one, blocks = (1e3 * statistics.median(times[block]) for block in (length, blocked))
            rows.append([str(length), f"{one:.1f}", f"{blocks:.1f}", f"{one / blocks:.2f}×"])
    finally:
        path.BLOCK = blocked
    header = ["prompt tokens", "one system ms", f"blocks of {blocked} ms", "speed-up"]
    return "PaTH's forward over a prompt (shipped path checkpoint):\n\n" + table(header, rows)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/rope"))
    parser.add_argument("--profile", action="store_true", help="ops and time of a decode step")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.profile:
        with torch.inference_mode():
            print(step_profile(args.checkpoint), flush=True)
        return
    with torch.inference_mode():
        sections = (linear_layouts, linear_kernel_products, linear_kernel_decode)
        for section in (*sections, gelu_forms, sampling_paths, path_blocks):
            print(section() + "\n", flush=True)
    print(engine_without_http(args.checkpoint), flush=True)


if __name__ == "__main__":
    main()
