"""Prefix caching and the step's shared token budget, through the real server (rope alone).

``ttft``: the time to first token of a 400-token prompt repeated with a new ending (its first
384 tokens the same every time, then 16 new ones), from a server with the prefix cache (the
default) and from one with ``--prefix-cache-tokens 0``, both running, the requests alternating
between them; medians and p90 of ``--repeats`` each (the first request of each server is a
warm-up, and fills the cache).

``load``: time to first token p99 and inter-token gap p99 (``--stream-interval 0``, so each gap
is a step) of 32 and 64 streams sending sampled 128-token requests back to back, as
bench.http's levels, on a server started with ``--flags``; run it alternately from two source
trees to compare them.

    python -m bench.prefix ttft --out bench/results/prefix.json
    python -m bench.prefix load --flags "--prefix-cache-tokens 0" [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import shlex
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson

from bench.http import (
    MAX_BATCH,
    percentile,
    prompt_ids,
    running_server,
    stream_completion,
)
from model.files import write_json_atomic

PROMPT_TOKENS = 400
NEW_ENDING = 16  # the tokens that change every time: one block
SHARED = PROMPT_TOKENS - NEW_ENDING
LOAD_LEVELS = ((32, 128), (64, 128))  # (streams, tokens per request)


def repeated_prompts(head: list[int], count: int) -> list[list[int]]:
    """``count`` prompts of PROMPT_TOKENS: the same SHARED first tokens (``head`` repeated),
    each with its own NEW_ENDING last ones."""
    shared = (head * (SHARED // len(head) + 1))[:SHARED]
    return [
        shared + [(17 * index + 3 * k) % 1000 + 10 for k in range(NEW_ENDING)]
        for index in range(count)
    ]


async def first_token_ms(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, int]:
    """(ms to the first streamed token of a 1-token greedy completion, cached_tokens)."""
    body = {
        "model": "rope",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    sent, first, cached = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: {"):
                continue
            if first is None and '"choices":[{' in line:
                first = time.perf_counter()
            if '"usage":{' in line:
                cached = orjson.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert first is not None
    return 1000 * (first - sent), cached


async def alternate(urls: dict[str, str], repeats: int) -> dict[str, Any]:
    clients = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()}
    try:
        head = await prompt_ids(next(iter(clients.values())))
        prompts = repeated_prompts(head, repeats + 1)
        times: dict[str, list[float]] = {name: [] for name in clients}
        cached: dict[str, list[int]] = {name: [] for name in clients}
        for index, prompt in enumerate(prompts):
            for name, client in clients.items():  # the servers take turns, prompt by prompt
                ms, reused = await first_token_ms(client, prompt)
                if index:  # the first fills the cache (and warms the server)
                    times[name].append(ms)
                    cached[name].append(reused)
    finally:
        for client in clients.values():
            await client.aclose()
    result: dict[str, Any] = {
        "prompt_tokens": PROMPT_TOKENS,
        "new_ending": NEW_ENDING,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": os.getloadavg()[0],  # this machine is shared: say how busy
    }
    for name in clients:
        result[name] = {
            "requests": repeats,
            "ttft_ms_p50": percentile(times[name], 50),
            "ttft_ms_p90": percentile(times[name], 90),
            "cached_tokens": int(np.median(cached[name])),
        }
    result["cached_over_uncached_p50"] = (
        result["cached"]["ttft_ms_p50"] / result["uncached"]["ttft_ms_p50"]
    )
    return result


def ttft(checkpoints: Path, repeats: int) -> dict[str, Any]:
    """Cached against uncached, both servers up, their requests interleaved."""
    flags = {"cached": (), "uncached": ("--prefix-cache-tokens", "0")}
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(running_server(checkpoints, ["rope"], extra=extra))[0]
            for name, extra in flags.items()
        }
        return asyncio.run(alternate(urls, repeats))


async def load_level(url: str, streams: int, tokens: int, min_seconds: float) -> dict[str, Any]:
    """``streams`` closed-loop clients for ``min_seconds`` (two requests each at least)."""
    limits = httpx.Limits(max_connections=2 * MAX_BATCH, max_keepalive_connections=2 * MAX_BATCH)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        prompt = await prompt_ids(client)
        for seed in range(3):
            await stream_completion(client, prompt, 16, seed)
        done, seeds, start = [], itertools.count(), time.perf_counter()

        async def client_loop() -> None:
            rounds = 0
            while rounds < 2 or time.perf_counter() - start < min_seconds:
                done.append(await stream_completion(client, prompt, tokens, next(seeds)))
                rounds += 1

        await asyncio.gather(*(client_loop() for _ in range(streams)))
        wall = time.perf_counter() - start
    gaps = [1000 * (b - a) for s in done for a, b in itertools.pairwise(s.token_times)]
    return {
        "streams": streams,
        "requests": len(done),
        "tokens_per_s": sum(s.tokens for s in done) / wall,
        "ttft_ms_p50": percentile([1000 * s.ttft for s in done], 50),
        "ttft_ms_p99": percentile([1000 * s.ttft for s in done], 99),
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p99": percentile(gaps, 99),
    }


def load(checkpoints: Path, flags: str, min_seconds: float) -> dict[str, Any]:
    extra = ("--stream-interval", "0", *shlex.split(flags))
    with running_server(checkpoints, ["rope"], extra=extra) as (url, _):
        levels = [
            asyncio.run(load_level(url, streams, tokens, min_seconds))
            for streams, tokens in LOAD_LEVELS
        ]
    return {"flags": " ".join(extra), "levels": levels}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=("ttft", "load"))
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, help="write the result here (JSON)")
    parser.add_argument("--repeats", type=int, default=20, help="ttft: prompts per server")
    parser.add_argument("--flags", default="", help="load: more flags of ordinal serve")
    parser.add_argument("--min-seconds", type=float, default=10.0, help="load: per level")
    args = parser.parse_args()
    if args.stage == "ttft":
        result = ttft(args.checkpoints.resolve(), args.repeats)
    else:
        result = load(args.checkpoints.resolve(), args.flags, args.min_seconds)
    print(result, flush=True)
    if args.out:
        write_json_atomic(args.out, result)


if __name__ == "__main__":
    main()
