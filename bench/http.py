"""Speed through the real server: ``ordinal serve`` in a subprocess, driven over HTTP.

Measures (a) one stream's tokens/s and time to first token (TTFT); (b) at 1, 8, 32 and 64
concurrent clients, aggregate tokens/s, TTFT p50/p99 and inter-token latency p50, with the CPU
time of this load generator and of the server (a Python load generator on two cores can itself be
the bottleneck); (c) the server's resident memory with every shipped model loaded.

    python -m bench.http --out bench/results/http.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx
import numpy as np
import orjson
import psutil
import torch

from model.config import write_json_atomic

PROMPT = "ROMEO:\nBut soft, what light through yonder window breaks? It is the east,"
SINGLE_TOKENS = 256
LEVEL_TOKENS = 128
LEVELS = (1, 8, 32, 64)
MAX_BATCH = 64  # so that the largest level decodes as one batch
MiB = 2**20


@dataclass
class Stream:
    """One streamed completion's timeline (``time.perf_counter`` seconds)."""

    sent: float
    token_times: list[float] = field(default_factory=list)
    usage_tokens: int | None = None

    @property
    def tokens(self) -> int:
        return self.usage_tokens if self.usage_tokens is not None else len(self.token_times)

    @property
    def ttft(self) -> float:
        return self.token_times[0] - self.sent

    @property
    def gaps(self) -> list[float]:
        return list(np.diff(self.token_times))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(checkpoints: Path, port: int, models: list[str] | None) -> list[str]:
    """``ordinal serve`` for this benchmark: bfloat16 on a GPU, fp32 on CPU (the default)."""
    command = [sys.executable, "-m", "server.cli", "serve", "--port", str(port)]
    command += ["--checkpoints", str(checkpoints), "--max-batch-size", str(MAX_BATCH)]
    command += ["--max-queue", str(MAX_BATCH)]
    if models:
        command += ["--models", ",".join(models)]
    return [*command, "--dtype", served_dtype()]


def served_dtype() -> str:
    return "bfloat16" if torch.cuda.is_available() else "float32"


@contextlib.contextmanager
def running_server(
    checkpoints: Path, models: list[str] | None, ready_timeout: float = 600.0
) -> Iterator[tuple[str, psutil.Process]]:
    """Start ``ordinal serve``, wait for ``/health`` 200, yield (base URL, process); stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(
            serve_command(checkpoints, port, models), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            wait_until_healthy(url, process, ready_timeout, log)
            yield url, psutil.Process(process.pid)
        finally:
            process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until_healthy(url: str, process: subprocess.Popen, timeout: float, log: IO[bytes]) -> None:
    """Poll ``/health`` until 200; if the server exits first, raise with the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"ordinal serve exited with {process.returncode}:\n{tail}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"ordinal serve at {url} was not healthy within {timeout:g} s")


async def stream_completion(client: httpx.AsyncClient, max_tokens: int, seed: int) -> Stream:
    """Send one streaming completion and time each token's chunk as it arrives."""
    body = {
        "model": "rope",
        "prompt": PROMPT,
        "max_tokens": max_tokens,
        "temperature": 0.8,  # sampled as a user would; most completions still end on EOS early
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    stream = Stream(sent=time.perf_counter())
    async with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"server error mid-stream: {chunk['error']}")
            if chunk.get("choices"):  # one chunk per generated token
                stream.token_times.append(time.perf_counter())
            elif chunk.get("usage"):
                stream.usage_tokens = chunk["usage"]["completion_tokens"]
    return stream


def cpu_seconds(process: psutil.Process | None = None) -> float:
    """User + system CPU seconds of ``process``, or of this process when None."""
    if process is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    times = process.cpu_times()
    return times.user + times.system


async def peak_rss(process: psutil.Process, stop: asyncio.Event, every: float = 0.1) -> int:
    """The largest RSS of ``process`` seen until ``stop`` is set (bytes)."""
    peak = process.memory_info().rss
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        peak = max(peak, process.memory_info().rss)
    return peak


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def single_stream(client: httpx.AsyncClient) -> dict[str, Any]:
    """One client's requests, one after another, until ``SINGLE_TOKENS`` tokens have come.

    The server has no ``ignore_eos``, and sampled completions of the shipped model end on EOS
    after ~40 tokens, so one request rarely runs long: the rate is over back-to-back requests,
    each paying its own prefill and HTTP round trip (in-process decode pays one prefill).
    """
    streams: list[Stream] = []
    start = time.perf_counter()
    while sum(s.tokens for s in streams) < SINGLE_TOKENS:
        streams.append(await stream_completion(client, SINGLE_TOKENS, seed=len(streams)))
    wall = time.perf_counter() - start
    tokens = sum(s.tokens for s in streams)
    decoding = sum(s.token_times[-1] - s.token_times[0] for s in streams)
    return {
        "requests": len(streams),
        "tokens": tokens,
        "seconds": wall,
        "tokens_per_s": tokens / wall,
        # Between each request's first and last token: the decode rate without TTFT.
        "decode_tokens_per_s": (tokens - len(streams)) / decoding if decoding > 0 else None,
        "ttft_ms_p50": percentile([1000 * s.ttft for s in streams], 50),
    }


async def concurrency_level(
    client: httpx.AsyncClient,
    server: psutil.Process,
    streams: int,
    min_seconds: float,
    min_rounds: int,
) -> dict[str, Any]:
    """``streams`` clients, each sending 128-token requests back to back (a closed loop, so the
    concurrency holds although completions end early on EOS), until each has sent
    ``min_rounds`` requests and ``min_seconds`` have passed."""
    done: list[Stream] = []
    seeds = itertools.count()
    start = time.perf_counter()

    async def client_loop() -> None:
        rounds = 0
        while rounds < min_rounds or time.perf_counter() - start < min_seconds:
            done.append(await stream_completion(client, LEVEL_TOKENS, next(seeds)))
            rounds += 1

    stop = asyncio.Event()
    watcher = asyncio.create_task(peak_rss(server, stop))
    own_cpu, server_cpu = cpu_seconds(), cpu_seconds(server)
    await asyncio.gather(*(client_loop() for _ in range(streams)))
    wall = time.perf_counter() - start
    own_cpu, server_cpu = cpu_seconds() - own_cpu, cpu_seconds(server) - server_cpu
    stop.set()
    ttfts = [1000 * s.ttft for s in done]
    gaps = [1000 * gap for s in done for gap in s.gaps]
    return {
        "streams": streams,
        "requests": len(done),
        "seconds": wall,
        "tokens": sum(s.tokens for s in done),
        "tokens_per_s": sum(s.tokens for s in done) / wall,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "itl_ms_p50": percentile(gaps, 50),
        "loadgen_cpu_cores": own_cpu / wall,  # 1.0 = one core busy all the time
        "server_cpu_cores": server_cpu / wall,
        "server_peak_rss_mib": await watcher / MiB,
    }


async def drive(url: str, server: psutil.Process, min_seconds: float, min_rounds: int) -> dict:
    limits = httpx.Limits(max_connections=2 * MAX_BATCH, max_keepalive_connections=2 * MAX_BATCH)
    async with httpx.AsyncClient(base_url=url, limits=limits, timeout=300) as client:
        for seed in range(3):  # warm-up: connection, allocator, kernels
            await stream_completion(client, 16, seed)
        single = await single_stream(client)
        print("http single stream", {k: round(v, 1) for k, v in single.items()}, flush=True)
        levels = []
        for streams in LEVELS:
            level = await concurrency_level(client, server, streams, min_seconds, min_rounds)
            print("http", {k: round(v or 0, 1) for k, v in level.items()}, flush=True)
            levels.append(level)
    return {"single_stream": single, "concurrency": levels}


def loaded_memory(checkpoints: Path) -> dict[str, Any]:
    """RSS of a server that loaded every model in ``checkpoints`` (the default ``--models``)."""
    with running_server(checkpoints, models=None) as (url, server):
        models = httpx.get(f"{url}/health", timeout=10).json()["models"]
        return {"models": models, "rss_mib": server.memory_info().rss / MiB}


def run(checkpoints: Path, min_seconds: float = 10.0, min_rounds: int = 2) -> dict[str, Any]:
    """Every HTTP measurement, as one JSON-ready dict."""
    with running_server(checkpoints, models=["rope"]) as (url, server):
        rope_only_rss = server.memory_info().rss / MiB
        results = asyncio.run(drive(url, server, min_seconds, min_rounds))
    results["memory"] = {"rope_only_rss_mib": rope_only_rss, **loaded_memory(checkpoints)}
    results["server"] = {"max_batch_size": MAX_BATCH, "dtype": served_dtype()}
    results["prompt"] = PROMPT
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/http.json"))
    parser.add_argument("--min-seconds", type=float, default=10.0, help="per concurrency level")
    parser.add_argument("--min-rounds", type=int, default=2, help="per concurrency level")
    args = parser.parse_args()
    write_json_atomic(args.out, run(args.checkpoints, args.min_seconds, args.min_rounds))


if __name__ == "__main__":
    main()
