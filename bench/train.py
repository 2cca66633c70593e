"""Training speed: tokens/s of a preset's training steps on this machine and, with ``--profile``,
the share of a step's time by phase (batch, forward, backward, clip, each optimiser) and by op.

    python -m bench.train                          # ordinal train's default preset, rope, 1 thread
    python -m bench.train --preset tiny --scheme alibi --steps 2 --threads 0  # 0: torch's own
    python -m bench.train --profile --out bench/results/train.json
    python -m bench.train --malloc-defaults        # without ordinal train's keep_freed_memory

The steps are ``ordinal train``'s own (``lab.train.TrainingRun.optimise``, with the run's data,
model and optimisers built as ``ordinal train`` builds them), after ``--warmup`` untimed steps;
nothing is saved but the ``--out`` JSON. ``make bench-train`` runs the first line. Measure on a
quiet machine: another process on the cores inflates every figure (shares less so).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile

import ordinal
from lab.train import TrainingRun, configs_from_args, keep_freed_memory
from model.config import DEFAULT_PRESET, PRESETS
from model.device import DEVICES, resolve_device
from model.files import write_json_atomic

# record_function labels in lab.train, and the profiler's own for optimiser steps.
PHASES = ("batch", "forward", "backward", "clip", "Optimizer.step#AdamW.step")
PHASES += ("Optimizer.step#Muon.step", "Optimizer.zero_grad#AdamW.zero_grad")
PHASES += ("Optimizer.zero_grad#Muon.zero_grad",)


def training_run(args: argparse.Namespace, out: Path) -> TrainingRun:
    """The run ``ordinal train --preset P --scheme S --threads N`` would start (nothing saved)."""
    flags = ["train", "--preset", args.preset, "--scheme", args.scheme, "--out", str(out / "ck")]
    flags += ["--tokenizer", str(args.tokenizer), "--threads", str(args.threads)]
    train_args = ordinal.build_parser().parse_args(flags)
    model_config, train_config = configs_from_args(train_args)
    needed = args.warmup + args.steps * (2 if args.profile else 1)
    if train_config.steps < needed:
        raise SystemExit(f"the {args.preset} preset has {train_config.steps} steps, not {needed}")
    if not args.malloc_defaults:
        keep_freed_memory()  # as lab.train.run does
    return TrainingRun.start(
        train_args, model_config, train_config, resolve_device(args.device), 0, 1
    )


def time_steps(run: TrainingRun, first: int, count: int) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds (this process's, all threads) of each of ``count`` optimisation
    steps from step ``first``. On a shared machine the CPU time is the steadier figure."""
    wall, cpu = [], []
    for step in range(first, first + count):
        start, start_cpu = time.perf_counter(), time.process_time()
        run.optimise(step)
        if run.device.type == "cuda":
            torch.cuda.synchronize()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    return wall, cpu


def phase_shares(run: TrainingRun, first: int, count: int) -> tuple[dict[str, float], str]:
    """Share of profiled step time in each phase, and the profiler's table of ops by self time."""
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        time_steps(run, first, count)
    events = profiler.key_averages()
    total = sum(event.self_cpu_time_total for event in events)
    shares = {event.key: event.cpu_time_total / total for event in events if event.key in PHASES}
    return shares, events.table(sort_by="self_cpu_time_total", row_limit=25)


def measure(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as scratch:
        run = training_run(args, Path(scratch))
        time_steps(run, 0, args.warmup)
        seconds, cpu_seconds = time_steps(run, args.warmup, args.steps)
        config = run.model.config
        tokens = run.train_config.batch_size * run.train_config.grad_accum * config.context_length
        result: dict[str, Any] = {
            "preset": args.preset,
            "scheme": args.scheme,
            "threads": torch.get_num_threads(),
            "malloc_defaults": args.malloc_defaults,
            "tokens_per_step": tokens,
            "steps": args.steps,
            "median_step_seconds": statistics.median(seconds),
            "tokens_per_second": tokens * args.steps / sum(seconds),
            "median_step_cpu_seconds": statistics.median(cpu_seconds),
            "step_seconds": seconds,
        }
        if args.profile:
            shares, table = phase_shares(run, args.warmup + args.steps, args.steps)
            result["phase_shares"] = shares
            print(table)
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=list(PRESETS))
    parser.add_argument("--scheme", default="rope", choices=ordinal.SCHEMES)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's own)")
    parser.add_argument("--device", default="cpu", choices=DEVICES)
    parser.add_argument("--tokenizer", type=Path, default=Path("runs/tokenizer.json"))
    parser.add_argument("--profile", action="store_true", help="also profile --steps more steps")
    parser.add_argument(
        "--malloc-defaults",
        action="store_true",
        help="the C library's own malloc settings (to time what keep_freed_memory saves)",
    )
    parser.add_argument("--out", type=Path, help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = measure(args)
    print(
        f"{args.preset} {args.scheme}, {result['threads']} thread(s): "
        f"{result['tokens_per_second']:.0f} tokens/s, median step "
        f"{1e3 * result['median_step_seconds']:.1f} ms "
        f"(CPU {1e3 * result['median_step_cpu_seconds']:.1f} ms) over {args.steps} steps"
    )
    for phase, share in sorted(result.get("phase_shares", {}).items(), key=lambda kv: -kv[1]):
        print(f"  {phase:40s} {100 * share:5.1f}%")
    if args.out:
        write_json_atomic(args.out, result)
    return result


if __name__ == "__main__":
    main()
