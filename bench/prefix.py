"""Prefix caching and the step's shared token budget, through the real server (rope alone).

``ttft``: the time to first token of a 400-token prompt repeated with a new ending (its first
384 tokens the same every time, then 16 new ones), from a server with the prefix cache (the
default) and from one with ``--prefix-cache-tokens 0``, both running, the requests alternating
between them; medians and p90 of ``--repeats`` each (the first request of each server is a
warm-up, and fills the cache). Timed twice: with a lean client (h11 over a blocking socket,
kept alive) whose own cost is a few tens of µs, so the figure is the server's; and with httpx's
async client, the one most Python callers use, which spends ≈ 1–2.5 ms of Python per request of
its own on this 2-core machine, where it shares the cores with both server processes.

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
import socket
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import h11
import httpx
import numpy as np
import orjson

from bench.http import (
    closed_loops,
    percentile,
    prompt_ids,
    running_server,
    session,
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


def completion_body(prompt: list[int]) -> dict[str, Any]:
    """A streamed 1-token greedy completion of ``prompt``, with usage."""
    return {
        "model": "rope",
        "prompt": prompt,
        "max_tokens": 1,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def is_token_chunk(data: bytes) -> bool:
    """Whether streamed ``data`` holds a chunk with a choice (a token), not only usage."""
    return b'"choices":[{' in data


def cached_tokens(line: bytes, otherwise: int) -> int:
    """The usage chunk's ``cached_tokens`` if SSE ``line`` is that chunk, else ``otherwise``."""
    if not (line.startswith(b"data: {") and b'"usage":{' in line):
        return otherwise
    return orjson.loads(line[6:])["usage"]["prompt_tokens_details"]["cached_tokens"]


async def first_token_ms(client: httpx.AsyncClient, prompt: list[int]) -> tuple[float, int]:
    """(ms to the first streamed token of a 1-token greedy completion, cached_tokens)."""
    sent, first, cached = time.perf_counter(), None, 0
    body = completion_body(prompt)
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if first is None and is_token_chunk(line.encode()):
                first = time.perf_counter()
            cached = cached_tokens(line.encode(), cached)
    assert first is not None
    return 1000 * (first - sent), cached


class LeanClient:
    """One kept-alive HTTP/1.1 connection driven by h11 (the protocol library under httpx)
    over a blocking socket: a timing client with next to no cost of its own."""

    def __init__(self, url: str) -> None:
        parsed = httpx.URL(url)
        self.host = f"{parsed.host}:{parsed.port}"
        self.socket = socket.create_connection((parsed.host, parsed.port), timeout=300)
        self.socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connection = h11.Connection(h11.CLIENT)

    def first_token_ms(self, prompt: list[int]) -> tuple[float, int]:
        """As :func:`first_token_ms`, over this connection."""
        body = orjson.dumps(completion_body(prompt))
        head = h11.Request(
            method="POST",
            target="/v1/completions",
            headers=[
                ("Host", self.host),
                ("Content-Type", "application/json"),
                ("Content-Length", str(len(body))),
            ],
        )
        send = self.connection.send
        sent, first, cached, pending = time.perf_counter(), None, 0, b""
        self.socket.sendall(send(head) + send(h11.Data(data=body)) + send(h11.EndOfMessage()))
        while True:
            event = self.connection.next_event()
            if event is h11.NEED_DATA:
                self.connection.receive_data(self.socket.recv(65536))
            elif isinstance(event, h11.Response) and event.status_code != 200:
                raise RuntimeError(f"the server answered {event.status_code}")
            elif isinstance(event, h11.Data):
                if first is None and is_token_chunk(event.data):
                    first = time.perf_counter()
                pending += event.data
            elif isinstance(event, h11.EndOfMessage):
                break
        self.connection.start_next_cycle()
        for line in pending.split(b"\n"):
            cached = cached_tokens(line, cached)
        assert first is not None
        return 1000 * (first - sent), cached

    def close(self) -> None:
        self.socket.close()


def alternate_lean(urls: dict[str, str], prompts: list[list[int]]) -> dict[str, Any]:
    """Each server's first-token times over a :class:`LeanClient`, the servers taking turns."""
    clients = {name: LeanClient(url) for name, url in urls.items()}
    try:
        return summarise(
            [[client.first_token_ms(prompt) for client in clients.values()] for prompt in prompts],
            list(clients),
        )
    finally:
        for client in clients.values():
            client.close()


async def alternate_httpx(urls: dict[str, str], prompts: list[list[int]]) -> dict[str, Any]:
    """As :func:`alternate_lean`, through httpx's async client."""
    clients = {name: httpx.AsyncClient(base_url=url, timeout=300) for name, url in urls.items()}
    try:
        turns = [
            [await first_token_ms(client, prompt) for client in clients.values()]
            for prompt in prompts
        ]
    finally:
        for client in clients.values():
            await client.aclose()
    return summarise(turns, list(clients))


def summarise(turns: list[list[tuple[float, int]]], names: list[str]) -> dict[str, Any]:
    """Per server: p50 and p90 of the times after the first turn (which fills the cache and
    warms the server), the median cached tokens; and cached ÷ uncached at p50."""
    result: dict[str, Any] = {}
    for column, name in enumerate(names):
        times = [turn[column][0] for turn in turns[1:]]
        result[name] = {
            "requests": len(times),
            "ttft_ms_p50": percentile(times, 50),
            "ttft_ms_p90": percentile(times, 90),
            "cached_tokens": int(np.median([turn[column][1] for turn in turns[1:]])),
        }
    result["cached_over_uncached_p50"] = (
        result["cached"]["ttft_ms_p50"] / result["uncached"]["ttft_ms_p50"]
    )
    return result


def ttft(checkpoints: Path, repeats: int) -> dict[str, Any]:
    """Cached against uncached, both servers up, their requests interleaved."""
    flags = {"cached": (), "uncached": ("--prefix-cache-tokens", "0")}
    load_average = os.getloadavg()[0]
    with ExitStack() as stack:
        urls = {
            name: stack.enter_context(running_server(checkpoints, ["rope"], extra=extra))[0]
            for name, extra in flags.items()
        }
        prompts = repeated_prompts(asyncio.run(shared_head(urls["cached"])), 2 * (repeats + 1))
        # The lean client's turns, then httpx's, each on prompts of their own.
        lean = alternate_lean(urls, prompts[: repeats + 1])
        through_httpx = asyncio.run(alternate_httpx(urls, prompts[repeats + 1 :]))
    return {
        "prompt_tokens": PROMPT_TOKENS,
        "new_ending": NEW_ENDING,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_at_start": load_average,  # this machine is shared: say how busy
        "client": "h11, blocking socket",
        **lean,
        "httpx": through_httpx,
    }


async def shared_head(url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as client:
        return await prompt_ids(client)


async def load_level(url: str, streams: int, tokens: int, min_seconds: float) -> dict[str, Any]:
    """``streams`` closed-loop clients for ``min_seconds`` (two requests each at least)."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as control:
        prompt = await prompt_ids(control)
    async with session(url) as client:
        for seed in range(3):
            await stream_completion(client, prompt, 16, seed)
    done, wall = await closed_loops(url, prompt, streams, tokens, min_seconds, min_rounds=2)
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
    parser.add_argument("--repeats", type=int, default=40, help="ttft: prompts per server")
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
