"""Speed through the real server: ``ordinal serve`` in a subprocess, driven over HTTP.

Measures (a) one stream's tokens/s and time to first token (TTFT), with the in-process
benchmark's request: a 32-token prompt, 256 new tokens, greedy, EOS ignored; (b) at 1, 8 and 32
concurrent clients sending sampled 256-token requests back to back, and 64 sending 128-token
ones, aggregate tokens/s, TTFT p50/p99, time per output token p50 and the peak RSS of all the
server's processes, with the CPU time of this load generator and of the server (a Python load
generator on two cores can itself be the bottleneck); (c) the server's resident memory with
every shipped model loaded, and with rope alone; (d) the inter-token latency of 16 streams
while 511-token prompts arrive. (a) and (b) run against the server's defaults: every model in
the folder loaded, the default batch and stream interval.

    python -m bench.http --out bench/results/http.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import itertools
import os
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

import aiohttp
import httpx
import numpy as np
import orjson
import psutil

from bench.decode import bench_device
from model.files import write_json_atomic
from server.api.settings import Settings

PROMPT = (
    "ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and Juliet is "
    "the sun. Arise, fair sun, and kill the envious moon,"
)
PROMPT_TOKENS = 32  # as bench.decode
SINGLE_TOKENS = 256  # as bench.decode
SINGLE_REPEATS = 3
LEVEL_TOKENS = 256
# (concurrent clients, tokens per request): issue #12's rows; 64 streams send 128-token requests.
LEVELS = ((1, LEVEL_TOKENS), (8, LEVEL_TOKENS), (32, LEVEL_TOKENS), (64, 128))
INTERFERENCE_STREAMS = 16
LONG_PROMPT_TOKENS = 511  # the longest prompt the shipped rope takes (512 context) and 1 token
# The server's defaults are measured: its batch holds the largest level (64 streams) at once.
MAX_BATCH = Settings.model_fields["max_batch_size"].default
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
    def time_per_token(self) -> float | None:
        """Mean seconds between tokens after the first (the server may send several at once)."""
        if self.tokens < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (self.tokens - 1)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def serve_command(
    checkpoints: Path,
    port: int,
    models: list[str] | None,
    extra: tuple[str, ...] = (),
    dtype: str | None = None,
) -> list[str]:
    """``ordinal serve`` for this benchmark: ``dtype``, by default bfloat16 on a GPU and fp32 on
    CPU."""
    command = [sys.executable, "-m", "ordinal", "serve", "--port", str(port), *extra]
    command += ["--checkpoints", str(checkpoints)]
    if models:
        command += ["--models", ",".join(models)]
    return [*command, "--dtype", dtype or served_dtype()]


def served_dtype() -> str:
    """The in-process benchmark's dtype, so both stages run the model alike."""
    return str(bench_device()[1]).removeprefix("torch.")


@contextlib.contextmanager
def running_server(
    checkpoints: Path,
    models: list[str] | None,
    ready_timeout: float = 600.0,
    extra: tuple[str, ...] = (),
) -> Iterator[tuple[str, psutil.Process]]:
    """Start ``ordinal serve`` (``extra``: more flags), wait for ``/health`` 200, yield (base
    URL, process); stop it."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = serve_command(checkpoints, port, models, extra)
    with running_process(command, f"{url}/health", "ordinal serve", ready_timeout) as process:
        yield url, psutil.Process(process.pid)


@contextlib.contextmanager
def running_process(
    command: list[str],
    ready_url: str,
    name: str,
    ready_timeout: float,
    environment: dict[str, str] | None = None,
) -> Iterator[subprocess.Popen]:
    """Run the server ``command`` (with ``environment`` added to this one's) until the block
    ends (SIGINT, then kill after 30 s), once ``ready_url`` answers 200; its output goes to a
    temporary log, shown if it exits early."""
    env = None if environment is None else {**os.environ, **environment}
    with tempfile.TemporaryFile() as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            wait_until_healthy(ready_url, process, ready_timeout, log, name)
            yield process
        finally:
            process.send_signal(signal.SIGINT)  # uvicorn's graceful shutdown
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def wait_until_healthy(
    url: str, process: subprocess.Popen, timeout: float, log: IO[bytes], name: str
) -> None:
    """Poll ``url`` until 200; if the server exits first, raise with the end of its log."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            log.seek(0)
            tail = log.read().decode(errors="replace")[-2000:]
            raise RuntimeError(f"{name} exited with {process.returncode}:\n{tail}")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=5).status_code == 200:
                return
        time.sleep(0.5)
    raise TimeoutError(f"{name} at {url} was not ready within {timeout:g} s")


def session(url: str, connections: int = 100) -> aiohttp.ClientSession:
    """An aiohttp session for timed streams against ``url`` (at most ``connections`` at once,
    each kept alive); open it inside the event loop that uses it."""
    return aiohttp.ClientSession(
        base_url=url,
        connector=aiohttp.TCPConnector(limit=connections),
        timeout=aiohttp.ClientTimeout(total=600),
    )


async def stream_completion(
    client: aiohttp.ClientSession, prompt: list[int], max_tokens: int, seed: int | None
) -> Stream:
    """Send one streaming completion of exactly ``max_tokens`` tokens (EOS ignored) and time
    each chunk as it arrives. ``seed`` None: greedy; else sampled at temperature 0.8."""
    body = {
        "model": "rope",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0.0 if seed is None else 0.8,
        "seed": seed,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    return await stream_body(client, body)


async def stream_body(client: aiohttp.ClientSession, body: dict[str, Any]) -> Stream:
    """Send the streaming completion request ``body`` (any OpenAI-compatible server) and time
    each chunk that carries text as it arrives; aiohttp.ClientResponseError on a non-200."""
    stream = Stream(sent=time.perf_counter())
    data, headers = orjson.dumps(body), {"Content-Type": "application/json"}
    async with client.post("/v1/completions", data=data, headers=headers) as response:
        response.raise_for_status()
        async for line in response.content:  # one line at a time, its b"\n" kept
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            chunk = orjson.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"server error mid-stream: {chunk['error']}")
            choices = chunk.get("choices")
            # A chunk per token, or per the tokens that travelled together (ordinal's stream
            # interval; so tokens are counted from usage); a peer's closing chunk carries only
            # its finish_reason.
            if choices and any(choice.get("text") for choice in choices):
                stream.token_times.append(time.perf_counter())
            elif chunk.get("usage"):
                stream.usage_tokens = chunk["usage"]["completion_tokens"]
    return stream


def server_processes(process: psutil.Process) -> list[psutil.Process]:
    """The server: the API process and its children (the engine process)."""
    return [process, *process.children(recursive=True)]


def cpu_seconds(process: psutil.Process | None = None) -> float:
    """User + system CPU seconds of the server ``process`` and its children, or of this
    process when None."""
    if process is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    total = 0.0
    for member in server_processes(process):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = member.cpu_times()
            total += times.user + times.system
    return total


def rss(process: psutil.Process) -> int:
    """RSS of the server ``process`` and its children together (bytes)."""
    total = 0
    for member in server_processes(process):
        with contextlib.suppress(psutil.NoSuchProcess):
            total += member.memory_info().rss
    return total


async def peak_rss(process: psutil.Process, stop: asyncio.Event, every: float = 0.1) -> int:
    """The largest RSS of the server's processes together seen until ``stop`` is set."""
    peak = rss(process)
    while not stop.is_set():
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every)
        peak = max(peak, rss(process))
    return peak


def percentile(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) if values else None


async def prompt_ids(client: httpx.AsyncClient) -> list[int]:
    """The first ``PROMPT_TOKENS`` ids of PROMPT (``<|bos|>`` first), from the server."""
    response = await client.post("/v1/tokenize", json={"model": "rope", "prompt": PROMPT})
    response.raise_for_status()
    ids = response.json()["tokens"][:PROMPT_TOKENS]
    if len(ids) < PROMPT_TOKENS:
        raise ValueError(f"PROMPT is only {len(ids)} tokens; the benchmark needs {PROMPT_TOKENS}")
    return ids


async def single_stream(client: aiohttp.ClientSession, prompt: list[int]) -> dict[str, Any]:
    """The in-process benchmark's request over HTTP, ``SINGLE_REPEATS`` times; the best rate.

    The rate counts the whole request, from sending it to its last token (TTFT included).
    """
    streams = [
        await stream_completion(client, prompt, SINGLE_TOKENS, seed=None)
        for _ in range(SINGLE_REPEATS)
    ]
    best = min(streams, key=lambda s: s.token_times[-1] - s.sent)
    decoding = best.token_times[-1] - best.token_times[0]
    return {
        "requests": len(streams),
        "tokens": best.tokens,
        "seconds": best.token_times[-1] - best.sent,
        "tokens_per_s": best.tokens / (best.token_times[-1] - best.sent),
        # Between the first and the last token: the decode rate without TTFT.
        "decode_tokens_per_s": (best.tokens - 1) / decoding if decoding > 0 else None,
        "ttft_ms_p50": percentile([1000 * s.ttft for s in streams], 50),
    }


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off while requests are timed, collected before and on
    again after. A full collection in this load generator, tens of thousands of timestamps in,
    stopped every stream for ~130 ms now and then, and each request sent meanwhile counted it in
    its time to first token: 3 of 8 runs of a 32-stream level had requests at 163-306 ms, none
    of 6 with the collector off (docs/performance-log.md, seventh round)."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


async def closed_loops(
    url: str, prompt: list[int], streams: int, tokens: int, min_seconds: float, min_rounds: int
) -> tuple[list[Stream], float]:
    """``streams`` clients, each sending sampled ``tokens``-token requests back to back (a
    closed loop) over its own keep-alive connection, until each has sent ``min_rounds`` requests
    and ``min_seconds`` have passed → (every request's stream, wall seconds). Any error (a
    non-200 or an error event) raises.

    Each client is its own session (:func:`session`), as separate users are: with one pool
    shared by 64 closed loops, httpx left some requests waiting seconds for a connection while
    others sat idle (time to first token p99 2.3-3.9 s at the client, 78 ms by the server's own
    clock)."""
    done: list[Stream] = []
    seeds = itertools.count()
    clients = [session(url, connections=1) for _ in range(streams)]
    start = time.perf_counter()

    async def client_loop(client: aiohttp.ClientSession) -> None:
        rounds = 0
        while rounds < min_rounds or time.perf_counter() - start < min_seconds:
            done.append(await stream_completion(client, prompt, tokens, next(seeds)))
            rounds += 1

    try:
        with collector_paused():
            await asyncio.gather(*(client_loop(client) for client in clients))
            return done, time.perf_counter() - start
    finally:
        await asyncio.gather(*(client.close() for client in clients))


async def concurrency_level(
    url: str,
    server: psutil.Process,
    prompt: list[int],
    streams: int,
    tokens: int,
    min_seconds: float,
    min_rounds: int,
) -> dict[str, Any]:
    """:func:`closed_loops` with the server's CPU and peak memory measured alongside; a level
    that returns had no error."""
    stop = asyncio.Event()
    watcher = asyncio.create_task(peak_rss(server, stop))
    own_cpu, server_cpu = cpu_seconds(), cpu_seconds(server)
    done, wall = await closed_loops(url, prompt, streams, tokens, min_seconds, min_rounds)
    own_cpu, server_cpu = cpu_seconds() - own_cpu, cpu_seconds(server) - server_cpu
    stop.set()
    ttfts = [1000 * s.ttft for s in done]
    per_token = [1000 * s.time_per_token for s in done if s.time_per_token is not None]
    return {
        "streams": streams,
        "tokens_per_request": tokens,
        "requests": len(done),
        "seconds": wall,
        "tokens": sum(s.tokens for s in done),
        "tokens_per_s": sum(s.tokens for s in done) / wall,
        "ttft_ms_p50": percentile(ttfts, 50),
        "ttft_ms_p99": percentile(ttfts, 99),
        "time_per_token_ms_p50": percentile(per_token, 50),
        "loadgen_cpu_cores": own_cpu / wall,  # 1.0 = one core busy all the time
        "server_cpu_cores": server_cpu / wall,
        "server_peak_rss_mib": await watcher / MiB,
    }


async def drive(url: str, server: psutil.Process, min_seconds: float, min_rounds: int) -> dict:
    async with httpx.AsyncClient(base_url=url, timeout=300) as control:
        prompt = await prompt_ids(control)
    async with session(url) as client:
        for seed in range(3):  # warm-up: connection, allocator, kernels
            await stream_completion(client, prompt, 16, seed)
        single = await single_stream(client, prompt)
        print("http single stream", {k: round(v, 1) for k, v in single.items()}, flush=True)
        levels = []
        for streams, tokens in LEVELS:
            level = await concurrency_level(
                url, server, prompt, streams, tokens, min_seconds, min_rounds
            )
            print("http", {k: round(v or 0, 1) for k, v in level.items()}, flush=True)
            levels.append(level)
    return {"single_stream": single, "concurrency": levels}


async def prefill_interference(url: str, long_prompts: bool) -> dict[str, Any]:
    """``INTERFERENCE_STREAMS`` streams decoding ``LEVEL_TOKENS`` tokens each; with
    ``long_prompts``, ``LONG_PROMPT_TOKENS``-token prompts (one token each) arrive back to
    back meanwhile. Percentiles of the time between a stream's consecutive tokens."""
    async with httpx.AsyncClient(base_url=url, timeout=300) as control:
        prompt = await prompt_ids(control)
    async with session(url) as client:
        long = (prompt * (LONG_PROMPT_TOKENS // len(prompt) + 1))[:LONG_PROMPT_TOKENS]
        decoding = asyncio.Event()
        arrived = 0

        async def arrivals() -> None:
            nonlocal arrived
            await decoding.wait()
            while decoding.is_set():
                body = {"model": "rope", "prompt": long, "max_tokens": 1}
                async with client.post("/v1/completions", json=body) as response:
                    response.raise_for_status()
                    await response.read()
                arrived += 1

        with collector_paused():
            feeder = asyncio.create_task(arrivals()) if long_prompts else None
            streams = asyncio.gather(
                *(
                    stream_completion(client, prompt, LEVEL_TOKENS, seed)
                    for seed in range(INTERFERENCE_STREAMS)
                )
            )
            decoding.set()
            done = await streams
            decoding.clear()
            if feeder is not None:
                await feeder
    gaps = [1000 * (b - a) for s in done for a, b in itertools.pairwise(s.token_times)]
    return {
        "streams": INTERFERENCE_STREAMS,
        "long_prompts": arrived,
        "itl_ms_p50": percentile(gaps, 50),
        "itl_ms_p99": percentile(gaps, 99),
    }


def interference(checkpoints: Path) -> dict[str, Any]:
    """Inter-token latency of running streams with and without long prompts arriving, on a
    server that sends every token at once (``--stream-interval 0``: the gaps are the steps)."""
    extra = ("--stream-interval", "0")
    with running_server(checkpoints, models=["rope"], extra=extra) as (url, _):
        quiet = asyncio.run(prefill_interference(url, long_prompts=False))
        busy = asyncio.run(prefill_interference(url, long_prompts=True))
    return {"prompt_tokens": LONG_PROMPT_TOKENS, "quiet": quiet, "long_prompts": busy}


def wait_until_loaded(url: str) -> dict[str, Any]:
    """``/health``'s models once none is loading (it is 200 as soon as one model serves)."""
    while True:
        models = httpx.get(f"{url}/health", timeout=10).json()["models"]
        if all(model["state"] != "loading" for model in models.values()):
            return models
        time.sleep(0.5)


def run(checkpoints: Path, min_seconds: float = 10.0, min_rounds: int = 2) -> dict[str, Any]:
    """Every HTTP measurement, as one JSON-ready dict.

    The load runs against the server as ``ordinal serve`` starts by default: every model in
    ``checkpoints`` loaded (so the peak RSS is that of the whole deployment), rope driven."""
    with running_server(checkpoints, models=["rope"]) as (_, server):
        rope_only_rss = rss(server) / MiB
    with running_server(checkpoints, models=None) as (url, server):
        models = wait_until_loaded(url)
        memory = {"models": models, "rss_mib": rss(server) / MiB}
        results = asyncio.run(drive(url, server, min_seconds, min_rounds))
    results["memory"] = {"rope_only_rss_mib": rope_only_rss, **memory}
    results["interference"] = interference(checkpoints)
    served = Settings()  # what `ordinal serve` reads from the same environment
    results["server"] = {
        "max_batch_size": MAX_BATCH,
        "dtype": served_dtype(),
        "threads": served.threads,
        "stream_interval_s": served.stream_interval,
    }
    results["level_tokens"] = LEVEL_TOKENS
    results["models_loaded"] = len(memory["models"])
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
