"""``make bench``: run every speed benchmark, keep the results, write docs/benchmarks.md.

Stages: ``decode`` (in-process, bench.decode; the long one), ``http`` (the real server,
bench.http), ``bound`` (matmul bound, bench.bound), ``prefix`` (a repeated prompt's time to
first token with and without the prefix cache, bench.prefix) and ``structured`` (what a
choice-constrained row costs its batch, bench.structured). Each writes
bench/results/<class>/<stage>.json, where the class is the kernel variant the run decodes with
(``model.kernels``: avx512, avx2, ... or torch; ``ORDINAL_CPU_ISA=avx2`` measures the AVX2 code
on an AVX-512 machine); a stage left out of ``--stages`` is read back from there, so one figure
can be redone alone. docs/benchmarks.md has a section per class, each naming its CPU.

    python -m bench.run                      # everything, several minutes
    python -m bench.run --quick              # one repeat, rope only, short HTTP levels
    python -m bench.run --stages http        # redo the HTTP figures, reuse the rest
    python -m bench.run --stages             # only re-render the report from the results
    bench/cuda.sh                            # on a CUDA machine: its tests and figures
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch

import model.cpu as cpu
from bench import bound, decode, http, prefix, structured
from lab.markdown import markdown_table
from model.files import write_json_atomic, write_text_atomic
from model.positional import SCHEMES

STAGES = ("decode", "http", "bound", "prefix", "structured")
GPT2_LAYOUT = "learned+bias"  # bench.decode's row with GPT-2's exact layout
Results = dict[str, Any]


def cpu_model() -> str:
    """The CPU's name and the widest vector ISA it runs ("AMD EPYC with AVX-512"): one name
    covers CPUs of several classes, and a run may force a narrower variant than its CPU's."""
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    widest = cpu.widest()
    return f"{name} with {CLASS_TITLES[widest]}" if widest else name


def cpu_class() -> str:
    """The CPU class this process's figures belong to, and their folder under bench/results: the
    kernel variant it decodes with (``torch``: none), and where that is a narrower one forced on
    a wider CPU (``ORDINAL_CPU_ISA=avx2`` on an AVX-512 machine), that CPU's too, as
    ``avx2-on-avx512``: the AVX2 code measured on an AVX-512 CPU is kept beside a real AVX2
    CPU's figures, never over them."""
    variant, widest = cpu.chosen() or "torch", cpu.widest()
    if variant in ("torch", "scalar") or widest in (None, variant):
        return variant
    return f"{variant}-on-{widest}"


def variant_of(cpu_class: str) -> str:
    """The kernel variant of a CPU class (``avx2-on-avx512`` → ``avx2``)."""
    return cpu_class.split("-on-")[0]


# Each class's title in docs/benchmarks.md, in the order the sections come.
CLASS_TITLES = {
    "avx512": "AVX-512",
    "avx2": "AVX2",
    "avx2-on-avx512": "AVX2 forced on an AVX-512 CPU",
    "neon": "NEON",
    "scalar": "scalar kernels",
    "torch": "no kernels (torch)",
}


def machine() -> dict[str, Any]:
    """What the figures were measured on: the CPU, and the kernel variant decoding."""
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return {
        "cpu": cpu_model(),
        "cpu_isa": cpu_class(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "gpu": gpu,
        "load_average_at_start": os.getloadavg()[0],
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }


def run_stage(stage: str, args: argparse.Namespace) -> Results:
    if stage == "decode":
        return decode.run(args.checkpoints, args.repeats, args.schemes)
    if stage == "http":
        return http.run(args.checkpoints, args.min_seconds, args.min_rounds)
    if stage == "prefix":
        return prefix.ttft(args.checkpoints.resolve(), 5 if args.quick else 40)
    if stage == "structured":
        return structured.measure(args.checkpoints, [8, 32], 2 if args.quick else 9)
    return bound.run(args.checkpoints, 0.05 if args.quick else 0.5)


# ----------------------------------------------------------------------------- rendering


def table(header: list[str], rows: list[list[str]]) -> str:
    return "\n".join(markdown_table(header, rows)) + "\n"


def rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


def ratio(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}×"


def percent(value: float | None) -> str:
    return "—" if value is None else f"{value:.1%}"


def target(value: float | None, goal: float, text: str, at_most: bool = False) -> str:
    """The target beside a figure, with whether this run met it (shown, never asserted)."""
    if value is None:
        return text
    met = value <= goal if at_most else value >= goal
    return f"{text} {'✓' if met else '✗'}"


def divide(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def machine_section(info: Results, decoded: Results) -> str:
    device = f"GPU {info['gpu']} (bfloat16)" if info["gpu"] else "CPU (float32)"
    where = f"{decoded.get('device', 'cpu')} in {decoded.get('dtype', 'float32')}"
    # the class's variant (runs before the variants were all on AVX-512)
    variant = variant_of(info.get("cpu_isa", "avx512"))
    return (
        f"Measured {info['date']} on {info['cpu']} with the {variant} kernels, "
        f"{info['cores']} cores "
        f"(torch {info['torch']}, {info['torch_threads']} threads), device: {device}; "
        f"load average at start {info['load_average_at_start']:.2f}. In-process decode runs on "
        f"{where} with random weights, greedy, EOS ignored.\n"
    )


def decode_section(results: Results) -> str:
    parts = [
        f"## In-process decode\n\nPrompt {results['prompt_tokens']} tokens, "
        f"{results['new_tokens']} new tokens, tokens/s best of the repeats; each round runs every "
        "scheme once in turn, so that the machine's noise falls on all of them alike.\n"
    ]
    for size, data in results["sizes"].items():
        schemes = {k: v for k, v in data["ours"].items() if k != GPT2_LAYOUT}
        fastest = max(row["batch_1"] for row in schemes.values())
        rows = [
            [
                name,
                "kernel" if on_kernel(name) else "torch",
                rate(row["batch_1"]),
                rate(row["batch_32"]),
                target(
                    row["batch_1"] / fastest, SLOWEST_SCHEME_GOAL, ratio(row["batch_1"] / fastest)
                )
                if on_kernel(name)
                else ratio(row["batch_1"] / fastest),
            ]
            for name, row in schemes.items()
        ]
        header = [
            "scheme",
            "decoded by",
            "batch 1",
            "batch 32",
            f"batch 1 ÷ fastest (≥ {SLOWEST_SCHEME_GOAL:g}× on the kernel)",
        ]
        parts.append(f"### {size}\n\n" + table(header, rows))
    return "\n".join(parts)


def graphs_section(results: Results) -> str:
    """CUDA graphs on and off (``bench.decode.graphs_on_and_off``), where measured (a GPU)."""
    figures = results.get("cuda_graphs")
    if not figures:
        return ""
    rows = []
    for size, data in figures.items():
        for batch in data["graphs"]:
            graphs, eager = data["graphs"][batch], data["eager"][batch]
            label = batch.replace("_", " ")
            rows.append([size, label, rate(graphs), rate(eager), ratio(divide(graphs, eager))])
    header = ["size", "batch", "CUDA graphs (default)", "eager", "graphs ÷ eager"]
    return (
        "## CUDA graphs\n\nrope, tokens/s, decode steps replayed from CUDA graphs "
        "(`model/captured.py`) and eager (`ORDINAL_CUDA_GRAPHS=0`), same run.\n\n"
        + table(header, rows)
    )


# Our decode ÷ transformers' generate at 4L-256d-v4096 (issue #23; #12 asked 2× at both).
TRANSFORMERS_GOALS = {"batch_1": 3.0, "batch_32": 2.5}
SLOWEST_SCHEME_GOAL = 0.7  # the slowest scheme's batch-1 rate ÷ the fastest's


def transformers_section(results: Results) -> str:
    rows = []
    for size, data in results["sizes"].items():
        ours, theirs = data["ours"][GPT2_LAYOUT], data["transformers"]
        for batch, goal in TRANSFORMERS_GOALS.items():
            speedup = divide(ours[batch], theirs[batch])
            shown = target(speedup, goal, f"{ratio(speedup)} (≥ {goal:g}×)")
            label = batch.replace("_", " ")
            rows.append([size, label, rate(ours[batch]), rate(theirs[batch]), shown])
    header = ["size", "batch", "ours: learned, GPT-2 layout", "transformers generate", "ratio"]
    return (
        "## Against Hugging Face transformers\n\nGPT-2's layout (learned positions, biases, "
        "tanh GELU) in both, same dimensions, timed in the same rounds (each round runs every "
        "scheme and transformers once in turn); tokens/s.\n\n" + table(header, rows)
    )


def http_section(results: Results, in_process: float | None, one_thread: float | None) -> str:
    single = results["single_stream"]
    # The target is against one thread, as the server runs; the two-thread figure is shown
    # beside it without one.
    share = divide(single["tokens_per_s"], one_thread)
    header = ["in-process rope, batch 1", "HTTP, 1 client", "ratio", "HTTP decode only"]
    header += ["TTFT p50", "in-process, one thread (the server's default)", "ratio"]
    singles = table(
        header,
        [
            [
                rate(in_process),
                rate(single["tokens_per_s"]),
                ratio(divide(single["tokens_per_s"], in_process)),
                rate(single["decode_tokens_per_s"]),
                f"{single['ttft_ms_p50']:.1f} ms",
                rate(one_thread),
                target(share, 0.9, f"{ratio(share)} (≥ 0.9×)"),
            ]
        ],
    )
    levels = {level["streams"]: level for level in results["concurrency"]}
    base = levels.get(1, {}).get("tokens_per_s")
    rows = [
        [
            str(n),
            str(level.get("tokens_per_request", results.get("level_tokens", 256))),
            str(level["requests"]),
            rate(level["tokens_per_s"]),
            ratio(divide(level["tokens_per_s"], base)),
            f"{level['ttft_ms_p50']:.0f}",
            f"{level['ttft_ms_p99']:.0f}",
            f"{level['time_per_token_ms_p50']:.1f}",
            f"{level['loadgen_cpu_cores']:.2f}",
            f"{level['server_cpu_cores']:.2f}",
            f"{level['server_peak_rss_mib']:.0f}",
        ]
        for n, level in levels.items()
    ]
    header = ["clients", "tokens each", "requests", "tokens/s", "× 1 client"]
    header += ["TTFT p50 ms", "TTFT p99 ms"]
    header += ["ms/token p50", "load-gen CPU cores", "server CPU cores", "server peak RSS MiB"]
    at_32 = levels.get(32, {})
    scaling = divide(at_32.get("tokens_per_s"), base)
    p99 = at_32.get("ttft_ms_p99")
    p99_text = "—" if p99 is None else f"{p99:.0f} ms (target ≤ 150 ms)"
    return (
        "## Through the HTTP server\n\n`ordinal serve` with its defaults (every shipped "
        f"model loaded: {results.get('models_loaded', 1)}; the rope model driven; "
        f"`--max-batch-size {results['server']['max_batch_size']}`, "
        f"{results['server']['dtype']}) in a subprocess; one asyncio aiohttp client process "
        "(a session per client); streaming, `ignore_eos` so every request runs to "
        "`max_tokens`. The single stream sends the in-process request (32-token prompt, 256 "
        "new tokens, greedy; best of "
        f"{results['single_stream']['requests']}) and its rate counts the whole request, time "
        "to first token included; 'HTTP decode only' leaves that out. At each concurrency "
        "level every client sends requests of the row's length sampled at temperature 0.8 "
        "(seeded) back to back; any error aborts the run, so every row had none. The server "
        "sends a stream's tokens in batches "
        f"at most {1000 * results['server'].get('stream_interval_s', 0):g} ms apart "
        "(`--stream-interval`; first and last tokens at once), so 'ms/token' is each stream's "
        "mean time between tokens after the first.\n\n"
        + singles
        + "\n"
        + table(header, rows)
        + "\n"
        f"32 clients ÷ 1 client: {target(scaling, 8.0, f'{ratio(scaling)} (target ≥ 8×)')}; "
        f"TTFT p99 at 32 clients: {target(p99, 150.0, p99_text, at_most=True)}."
        "\n\nLoad-generator and server CPU are in cores (1.0 = one core busy the whole level): "
        "with both on the same cores, a busy load generator caps the figures.\n"
        + interference_section(results)
    )


def interference_section(results: Results) -> str:
    """Inter-token latency of running streams while long prompts arrive (#12), if measured."""
    found = results.get("interference")
    if found is None:
        return ""
    quiet, busy = found["quiet"], found["long_prompts"]
    rows = [
        ["none", "—", f"{quiet['itl_ms_p50']:.1f}", f"{quiet['itl_ms_p99']:.1f}"],
        [
            f"{found['prompt_tokens']} tokens, back to back",
            str(busy["long_prompts"]),
            f"{busy['itl_ms_p50']:.1f}",
            f"{busy['itl_ms_p99']:.1f}",
        ],
    ]
    header = ["prompts arriving", "how many", "inter-token ms p50", "p99"]
    return (
        f"\n{quiet['streams']} streams decoding while long prompts arrive (`--stream-interval 0`, "
        "so each gap is one step; long prompts are prefilled at most `--prefill-chunk` tokens a "
        "step):\n\n" + table(header, rows)
    )


def on_kernel(scheme: str) -> bool:
    """Whether the CPU decode kernel runs ``scheme`` (the schemes that declare no
    ``kernel_bias`` decode with the torch blocks: irope, stick-breaking, PoPE, PaTH)."""
    return scheme in SCHEMES and SCHEMES[scheme].kernel_bias is not None


def slowest_shares(decoded: Results) -> dict[str, float]:
    """Each size's slowest kernel-decoded scheme's batch-1 rate ÷ its fastest's (GPT-2's layout
    and the torch-decoded schemes aside: the target is the kernel's, across its schemes)."""
    shares = {}
    for size, data in decoded["sizes"].items():
        rates = [row["batch_1"] for name, row in data["ours"].items() if on_kernel(name)]
        shares[size] = min(rates) / max(rates)
    return shares


def targets_section(results: dict[str, Results]) -> str:
    """Issues #12 and #23's table: each serving and decode target beside this run's figure."""
    decoded, served = results["decode"], results["http"]
    levels = {level["streams"]: level for level in served["concurrency"]}
    single, at_32, at_64 = levels[1], levels[32], levels[64]
    ours_hf = decoded["sizes"]["4L-256d-v4096"]
    speedups = {
        batch: divide(ours_hf["ours"][GPT2_LAYOUT][batch], ours_hf["transformers"][batch])
        for batch in ("batch_1", "batch_32")
    }
    http_share = divide(
        served["single_stream"]["tokens_per_s"], decoded.get("rope_batch_1_one_thread")
    )
    scaling = divide(at_32["tokens_per_s"], single["tokens_per_s"])
    peak = max(level["server_peak_rss_mib"] for level in served["concurrency"])
    p64 = f"TTFT p50 {at_64['ttft_ms_p50']:.0f} ms, p99 {at_64['ttft_ms_p99']:.0f} ms, 0 errors"

    def row(
        label: str,
        shown: str,
        goal_text: str,
        value: float | None,
        goal: float,
        at_most: bool = False,
    ) -> list[str]:
        return [label, shown, goal_text, target(value, goal, "", at_most).strip() or "—"]

    rows = [
        row(
            "HTTP single stream ÷ in-process (one thread)",
            ratio(http_share),
            "≥ 0.9×",
            http_share,
            0.9,
        ),
        row("32 concurrent streams, aggregate ÷ 1 stream", ratio(scaling), "≥ 8×", scaling, 8.0),
        row(
            "TTFT p99 at 32 streams",
            f"{at_32['ttft_ms_p99']:.0f} ms",
            "≤ 150 ms",
            at_32["ttft_ms_p99"],
            150.0,
            at_most=True,
        ),
        row(
            f"64 concurrent streams of {at_64.get('tokens_per_request', 128)} tokens",
            p64,
            "p99 ≤ 300 ms, 0 errors",
            at_64["ttft_ms_p99"],
            300.0,
            at_most=True,
        ),
        row(
            "batch-1 decode ÷ transformers `generate`, 4L-256d-v4096",
            ratio(speedups["batch_1"]),
            f"≥ {TRANSFORMERS_GOALS['batch_1']:g}×",
            speedups["batch_1"],
            TRANSFORMERS_GOALS["batch_1"],
        ),
        row(
            "batch-32 decode ÷ transformers `generate`, 4L-256d-v4096",
            ratio(speedups["batch_32"]),
            f"≥ {TRANSFORMERS_GOALS['batch_32']:g}×",
            speedups["batch_32"],
            TRANSFORMERS_GOALS["batch_32"],
        ),
        *(
            row(
                f"slowest kernel-decoded scheme ÷ fastest at batch 1, {size}",
                ratio(share),
                f"≥ {SLOWEST_SCHEME_GOAL:g}×",
                share,
                SLOWEST_SCHEME_GOAL,
            )
            for size, share in slowest_shares(decoded).items()
        ),
        row(
            f"peak RSS of the server's processes, {served.get('models_loaded', '?')} models "
            "loaded, during the load",
            f"{peak:,.0f} MiB",
            "≤ 1,024 MiB",
            peak,
            1024.0,
            at_most=True,
        ),
    ]
    return (
        "## Targets (issues #12 and #23)\n\n"
        + runs_of(results)
        + "; the sections below say how each was measured.\n\n"
        + table(["", "measured", "target", "met"], rows)
    )


def runs_of(results: dict[str, Results]) -> str:
    """Which `bench.run` the targets' rows come from: one, or (after ``--stages http``) the
    decode run and a later server run."""
    decoded_at, served_at = results.get("machine", {}).get("date"), results["http"].get("date")
    # A whole run dates its server stage when that stage starts, minutes after the run began:
    # the run's own start (``run``) says it is the same run.
    if served_at is None or decoded_at in (served_at, results["http"].get("run")):
        return "Every row from this one `make bench` run (`python -m bench.run`)"
    return (
        f"The in-process rows from the `python -m bench.run` of {decoded_at}, the server's from "
        f"`python -m bench.run --stages http` at {served_at} (the HTTP ÷ in-process row divides "
        "one by the other)"
    )


def prefix_section(results: Results) -> str:
    """Issue #24's prefix-caching figure: a repeated prompt's TTFT, cached against uncached,
    timed with the lean client (the server's figure) and with httpx."""
    lean, through_httpx = results, results["httpx"]

    def times(row: dict[str, Any]) -> str:
        return f"{row['ttft_ms_p50']:.1f} / {row['ttft_ms_p90']:.1f}"

    rows = [
        [
            name,
            str(lean[server]["cached_tokens"]),
            times(lean[server]),
            times(through_httpx[server]),
        ]
        for name, server in (
            ("prefix cache (default)", "cached"),
            ("`--prefix-cache-tokens 0`", "uncached"),
        )
    ]
    share, share_httpx = lean["cached_over_uncached_p50"], through_httpx["cached_over_uncached_p50"]
    return (
        f"## Prefix caching\n\nA {results['prompt_tokens']}-token prompt repeated with a new "
        f"ending (its last {results['new_ending']} tokens change), {lean['cached']['requests']} "
        "requests to each of two rope servers running side by side, taking turns; streamed, one "
        "token, time to its first token (`python -m bench.prefix ttft`; measured "
        f"{results['date']}, load average {results['load_average_at_start']:.1f} at start). "
        f"Timed with a lean client ({results['client']}: the server's own time), then with "
        "httpx's async client, which adds ≈ 1–2.5 ms of its own Python to every request here."
        "\n\n"
        + table(["server", "cached tokens", "TTFT ms p50 / p90", "through httpx"], rows)
        + "\nCached ÷ uncached, p50: "
        + target(share, 0.3, f"{share:.0%} (goal ≤ 30%)", at_most=True)
        + f"; through httpx {share_httpx:.0%}.\n"
    )


def memory_section(results: Results) -> str:
    memory = results["memory"]
    rows = [
        [str(len(memory["models"])), ", ".join(memory["models"]), f"{memory['rss_mib']:.0f}"],
        ["1", "rope", f"{memory['rope_only_rss_mib']:.0f}"],
    ]
    return "## Server memory\n\nResident set once `/health` is 200.\n\n" + table(
        ["models", "loaded", "RSS MiB"], rows
    )


def structured_section(results: Results) -> str:
    rows = [
        [
            others,
            *(rate(row["tokens_per_s"][variant]) for variant in structured.VARIANTS),
            f"{row['cost_vs_alone']:.1%} ({row['cost_vs_alone_range'][0]:.1%} to "
            f"{row['cost_vs_alone_range'][1]:.1%})",
            f"{row['cost_vs_free_row']:.1%}",
            f"{row['cost_of_a_free_row']:.1%}",
        ]
        for others, row in results["batches"].items()
    ]
    header = ["other rows", *structured.VARIANTS, "choice row's cost (rounds)", "vs a free row"]
    intro = (
        "## A constrained row's cost to its batch\n\n"
        "`python -m bench.structured`: the other rows' tokens per CPU second over "
        f"{results['steps']} decode steps (rope, one torch thread), the median of "
        f"{results['rounds']} interleaved rounds, beside no extra row, a free one, and one "
        "that keeps to "
        "`structured_outputs.choice` (the cost: the median of each round's paired ratio, and "
        "their range; the three batches stepped in turn, each step's thread CPU time). Goal "
        "(issue #24): ≤ 5%, read as the constraint's cost: against the same batch with a free "
        f"row in its place. Measured {results['date']}, load average "
        f"{results['load_average_at_start']:.1f} at the start.\n\n"
    )
    return intro + table([*header, "a free row's cost"], rows)


class Measured(NamedTuple):
    """A measured rate to hold against the bound of ``size`` at ``batch`` on ``device``."""

    label: str
    device: str  # "cpu", "cuda"
    size: str
    batch: str  # "batch_1", "batch_32"
    tokens_per_s: float | None


def measured_rates(results: dict[str, Results]) -> list[Measured]:
    """In-process rope (CPU) at both sizes and batches; the server at 1 and 32 clients."""
    rates = []
    decoded = results.get("decode", {})
    for size, data in decoded.get("sizes", {}).items():
        rope = data["ours"].get("rope", {})
        for batch in ("batch_1", "batch_32"):
            label = f"in-process rope, {size}, {batch.replace('_', ' ')}"
            rates.append(
                Measured(label, decoded.get("device", "cpu"), size, batch, rope.get(batch))
            )
    if "http" in results:
        device = "cuda" if results["machine"]["gpu"] else "cpu"
        levels = {level["streams"]: level for level in results["http"]["concurrency"]}
        for clients in (1, 32):
            served = levels.get(clients, {}).get("tokens_per_s")
            label = f"HTTP, {clients} client{'' if clients == 1 else 's'}"
            rates.append(Measured(label, device, "shipped", f"batch_{clients}", served))
    return rates


def bound_section(results: Results, measured: list[Measured]) -> str:
    parts = [
        "## The machine's bound\n\nA decode step's matrix products timed alone at their exact "
        f"shapes (attention at {results['context']} cached tokens, the decode benchmark's mean); "
        "the bound is batch ÷ that time (the fastest block of repeats). FLOPs per token count 2 "
        "per multiply-add.\n"
    ]
    for device, data in results["devices"].items():
        square = data["square"]["gflops"]
        rows = [
            [
                size,
                batch.replace("_", " "),
                f"{results['flops_per_token'][size] / 1e6:.2f}",
                f"{step['step_ms']:.3f}",
                rate(step["bound_tokens_per_s"]),
                *roofline_cells(step.get("roofline")),
            ]
            for size, steps in data["steps"].items()
            for batch, step in steps.items()
        ]
        header = [
            "size", "batch", "MFLOP/token", "products ms/step", "per-call bound tokens/s",
            "MB read/token", "read GB/s at the footprint", "true bound tokens/s",
        ]  # fmt: skip
        parts.append(
            f"### {device}\n\nLarge square product [{data['square']['size']}]²: "
            f"{square:,.1f} GFLOP/s; reading 256 MiB: {data.get('dram_read_gbs', 0):,.1f} GB/s. "
            "The true bound is max(FLOPs ÷ that peak, bytes ÷ the read bandwidth at the step's "
            "footprint), per step.\n\n" + table(header, rows)
        )
        fractions = []
        for m in measured:
            if not device.startswith(m.device):
                continue
            bound_rate = data["steps"][m.size][m.batch]["bound_tokens_per_s"]
            true_rate = data["steps"][m.size][m.batch].get("roofline", {}).get("tokens_per_s")
            flops = results["flops_per_token"][m.size]
            achieved = None if m.tokens_per_s is None else m.tokens_per_s * flops / 1e9
            fractions.append(
                [
                    m.label,
                    rate(m.tokens_per_s),
                    percent(divide(m.tokens_per_s, bound_rate)),
                    percent(divide(m.tokens_per_s, true_rate)),
                    "—" if achieved is None else f"{achieved:.2f}",
                    percent(divide(achieved, square)),
                ]
            )
        header = [
            "measured", "tokens/s", "of per-call bound", "of true bound", "GFLOP/s",
            "of square peak",
        ]  # fmt: skip
        if fractions:
            parts.append("Fraction of the bound reached:\n\n" + table(header, fractions))
        parts.append(products_table(data["steps"]))
    return "\n".join(parts)


def roofline_cells(roofline: Results | None) -> list[str]:
    """MB read per token, the read bandwidth at the footprint and the true bound (— for a
    bound.json from before it had them)."""
    if roofline is None:
        return ["—", "—", "—"]
    return [
        f"{roofline['bytes_per_token'] / 1e6:.2f}",
        f"{roofline['read_gbs']:,.0f}",
        f"{rate(roofline['tokens_per_s'])} ({roofline['bound_by']})",
    ]


def products_table(steps: dict[str, Results]) -> str:
    rows = []
    for size, batches in steps.items():
        pairs = zip(batches["batch_1"]["products"], batches["batch_32"]["products"], strict=True)
        for one, many in pairs:
            rows.append(
                [
                    size,
                    f"{one['count']}×",
                    one["shape"],
                    f"{one['gflops']:.1f}",
                    many["shape"],
                    f"{many['gflops']:.1f}",
                ]
            )
    header = ["size", "per step", "batch 1", "GFLOP/s", "batch 32", "GFLOP/s"]
    return "GFLOP/s of each product:\n\n" + table(header, rows)


PEER_NAMES = {"vllm": "vLLM", "llama.cpp": "llama.cpp"}


def peers_section(load: Results) -> str:
    """``bench.peers --load``'s table: ordinal beside each peer at each load, with ordinal's
    ratio (tokens/s: ordinal ÷ peer, higher is better; latencies: ordinal ÷ peer, lower is)."""
    medians, engines = load["medians"], load["engines"]
    rows = []

    def cells(label: str, key: str, ordinal_name: str = "ordinal") -> list[str]:
        ours = medians[label][ordinal_name][key]
        found = [f"{ours:,.1f}" if key != "tokens_per_s" else rate(ours)]
        for engine in engines:
            theirs = medians[label].get(engine, {}).get(key)
            shown = (
                "—"
                if theirs is None
                else (rate(theirs) if key == "tokens_per_s" else f"{theirs:,.1f}")
            )
            found.append(f"{shown} (ordinal {ratio(divide(ours, theirs))})")
        return found

    loads = load["loads"]
    for entry in loads:
        rows.append([f"{entry['label']}, tokens/s", *cells(entry["label"], "tokens_per_s")])
    for entry in loads[1:]:
        rows.append(
            [
                f"time to first token p99, {entry['label']}, ms",
                *cells(entry["label"], "ttft_ms_p99"),
            ]
        )
    for entry in loads[1:]:
        label = f"inter-token gap p99, {entry['label']}, ms (ordinal `--stream-interval 0`)"
        rows.append([label, *cells(entry["label"], "gap_ms_p99", "ordinal, stream interval 0")])
    header = ["load", "ordinal", *(PEER_NAMES.get(engine, engine) for engine in engines)]
    return (
        "## Against vLLM and llama.cpp (`bench.peers --load`)\n\n"
        f"`{load['command']}`, {load['date']}"
        + (f", {load['cpu']}" if "cpu" in load else "")
        + (f", ordinal's {variant_of(load['cpu_isa'])} kernels" if "cpu_isa" in load else "")
        + ", load average at start "
        f"{load['load_average_at_start']:.2f}; medians of {load['rounds']} interleaved rounds, "
        "the same streaming client (aiohttp) and greedy requests for every server, one compute "
        "thread each. Ratios are ordinal ÷ the peer (tokens/s: above 1 is ordinal faster; "
        "latencies: below 1 is ordinal faster).\n\n" + table(header, rows)
    )


def load_results(folder: Path) -> dict[str, Results]:
    """Every result kept in ``folder`` (machine, each stage's, and bench.peers' load) that
    exists, as ``render`` takes them."""
    results: dict[str, Results] = {}
    for name in ("machine", *STAGES, "peers"):
        path = folder / f"{name}.json"
        if path.exists():
            results[name] = json.loads(path.read_text())
    return results


def render(results: dict[str, Results]) -> str:
    """One CPU class's part of docs/benchmarks.md from its stage results (a missing stage is
    left out), its sections headed ``## ``."""
    decoded = results.get("decode", {"sizes": {}})
    in_process = decoded["sizes"].get("shipped", {}).get("ours", {}).get("rope", {}).get("batch_1")
    one_thread = decoded.get("rope_batch_1_one_thread")
    sections: list[tuple[str, Callable[[], str]]] = [
        ("targets", lambda: targets_section(results)),
        ("decode", lambda: decode_section(decoded) + "\n" + transformers_section(decoded)),
        ("decode", lambda: graphs_section(decoded)),
        ("http", lambda: http_section(results["http"], in_process, one_thread)),
        ("http", lambda: memory_section(results["http"])),
        ("bound", lambda: bound_section(results["bound"], measured_rates(results))),
        ("prefix", lambda: prefix_section(results["prefix"])),
        ("structured", lambda: structured_section(results["structured"])),
        ("peers", lambda: peers_section(results["peers"])),
    ]
    # The targets need both the decode and the HTTP figures.
    present = set(results) | ({"targets"} if {"decode", "http"} <= set(results) else set())
    body = [text for stage, make in sections if stage in present and (text := make())]
    opening = machine_section(results["machine"], decoded) + "\n" if "machine" in results else ""
    return opening + "\n".join(body)


def result_classes(folder: Path) -> list[Path]:
    """The CPU classes with results under ``folder`` (bench/results), in CLASS_TITLES' order."""
    found = [path for path in folder.iterdir() if path.is_dir() and any(path.glob("*.json"))]
    order = list(CLASS_TITLES)
    return sorted(found, key=lambda path: order.index(path.name) if path.name in order else 99)


def render_all(folder: Path) -> str:
    """docs/benchmarks.md: a section per CPU class under ``folder``, each naming its CPU."""
    intro = (
        "# Benchmarks\n\nWritten by `make bench` (`python -m bench.run`) and `bench.peers "
        "--load`, one section per CPU class: the kernel variant that decoded (model/kernels; "
        "`ORDINAL_CPU_ISA` forces one), and the CPU that ran it. Targets are shown beside the "
        "figures, ✓ where the run met them.\n"
    )
    parts = [intro]
    for path in result_classes(folder):
        results = load_results(path)
        cpu = next((r["cpu"] for r in results.values() if "cpu" in r), "an unrecorded CPU")
        title = CLASS_TITLES.get(path.name, path.name)
        demoted = re.sub(r"^(#+) ", r"#\1 ", render(results), flags=re.M)
        parts.append(f"## {title}: {cpu}\n\n{demoted}")
    return "\n".join(parts)


# ----------------------------------------------------------------------------- command line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    parser.add_argument("--quick", action="store_true", help="one repeat, short levels")
    parser.add_argument("--schemes", nargs="+", choices=list(SCHEMES), help="for decode")
    parser.add_argument(
        "--stages", nargs="*", choices=STAGES, default=list(STAGES), help="none: only re-render"
    )
    parser.add_argument("--repeats", type=int, help="decode: timed runs each (default 3)")
    parser.add_argument("--min-seconds", type=float, help="http: per level (default 10)")
    parser.add_argument("--min-rounds", type=int, help="http: per level (default 2)")
    args = parser.parse_args()
    args.schemes = args.schemes or (["rope"] if args.quick else list(SCHEMES))
    defaults = {"repeats": (1, 3), "min_seconds": (2.0, 10.0), "min_rounds": (1, 2)}
    for name, (quick, full) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)

    info = machine()
    folder = args.results / info["cpu_isa"]
    variant = variant_of(info["cpu_isa"])
    print(f"measuring on {info['cpu']} with the {variant} kernels, into {folder}")
    if "decode" in args.stages:  # the page's header dates the decode run (and the machine)
        write_json_atomic(folder / "machine.json", info)
    for stage in args.stages:
        started = time.strftime("%Y-%m-%d %H:%M")
        result = run_stage(stage, args)
        if stage == "http":  # the report dates a server run apart from the decode run
            result["date"], result["run"] = started, info["date"]
        write_json_atomic(folder / f"{stage}.json", result)
    write_text_atomic(args.doc, render_all(args.results))
    print(f"wrote {args.doc}")


if __name__ == "__main__":
    main()
