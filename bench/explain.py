"""The explanations in-process: what ``/v1/trace``'s score parts and attribution add to a trace,
and what ``POST /v1/patch`` costs, on the shipped checkpoints. A patch runs in engine calls of
``PATCH_TOKENS_PER_CALL`` tokens, one a turn of the engine's loop: the longest call is what a
stream decoding beside it waits for at most, so it is set beside a plain trace's time.

    python -m bench.explain                      # rope, alibi, cope; 127-token patch; 1 thread
    python -m bench.explain --schemes fox --tokens 64
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from model.checkpoint import load_checkpoint
from model.sampling_params import SamplingParams
from server.api.explain import PATCH_TOKENS_PER_CALL, changed_sites
from server.engine.explain import patch_effects
from server.engine.loader import LoadedModel, prepare
from server.engine.trace import trace_document


def loaded_model(folder: Path) -> LoadedModel:
    model, tokenizer = load_checkpoint(folder, "cpu")
    return prepare(folder.name, folder.name, model, tokenizer, None, time.perf_counter())


def trace_ms(loaded: LoadedModel, prompt: list[int], repeats: int, explain: bool) -> float:
    """Median milliseconds of one trace (attention off), with or without the explanations."""
    extra = {"score_parts": (1, 0), "attribution": True} if explain else {}
    times = []
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        trace_document(loaded, prompt, SamplingParams(), False, 20, 256, **extra)
        times.append(time.perf_counter() - started)
    return 1000 * statistics.median(times[1:])


def patch_ms(loaded: LoadedModel, clean: list[int], corrupted: list[int]) -> tuple[float, float]:
    """The longest engine call of a patch (ms) and all of them (s), shared as the API shares."""
    sites = changed_sites(clean, corrupted, loaded.model.config.n_layers)
    per_call = max(1, PATCH_TOKENS_PER_CALL // len(clean))
    calls = []
    for begin in range(0, len(sites), per_call):
        started = time.perf_counter()
        patch_effects(
            loaded.model, loaded.vocab, clean, corrupted, None, sites[begin : begin + per_call]
        )
        calls.append(time.perf_counter() - started)
    return 1000 * max(calls[1:] or calls), sum(calls)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--schemes", nargs="+", default=["rope", "alibi", "cope"])
    parser.add_argument("--tokens", type=int, default=127, help="the patch's prompt length")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(
        "| scheme | trace ms (128 tokens) | + score parts and attribution | patch tokens | "
        "longest call ms | patch s |"
    )
    print("|---|---|---|---|---|---|")
    for scheme in args.schemes:
        loaded = loaded_model(args.checkpoints / scheme)
        text = loaded.tokenizer.encode(Path("README.md").read_text()).ids
        prompt = [loaded.bos, *text[:127]]
        plain = trace_ms(loaded, prompt, args.repeats, explain=False)
        explained = trace_ms(loaded, prompt, args.repeats, explain=True)
        clean = [loaded.bos, *text[: args.tokens - 1]]
        corrupted = [clean[0], (clean[1] + 1) % loaded.vocab, *clean[2:]]  # the first word
        longest, total = patch_ms(loaded, clean, corrupted)
        print(
            f"| {scheme} | {plain:.1f} | {explained:.1f} | {len(clean)} | {longest:.0f} | "
            f"{total:.2f} |"
        )


if __name__ == "__main__":
    main()
