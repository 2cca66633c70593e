"""Each server process's memory and the API process's start-up, in under a minute.

``ordinal serve`` over the shipped checkpoints (every model loaded) in a subprocess: the time
until the API process answers ``/health`` (any status: it answers before a model has loaded)
and until every model has loaded; the resident memory of the API process, of the engine process
and of both, idle and at their peak under ``--streams`` concurrent streams. Also the import time
of ``server.api.app`` alone, in a fresh interpreter.

    python -m bench.memory --out bench/results/memory.json
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import psutil

from bench.http import MiB, free_port, prompt_ids, serve_command, session, stream_completion
from model.files import write_json_atomic


def rss_of(process: psutil.Process) -> dict[str, float]:
    """MiB resident: the API process, its children (the engine process), and both."""
    api = process.memory_info().rss
    engine = 0
    for child in process.children(recursive=True):
        with contextlib.suppress(psutil.NoSuchProcess):
            engine += child.memory_info().rss
    return {"api": api / MiB, "engine": engine / MiB, "total": (api + engine) / MiB}


async def under_load(url: str, process: psutil.Process, streams: int, seconds: float) -> dict:
    """Peak RSS (each process's own peak) while ``streams`` clients stream back to back."""
    peak = rss_of(process)
    tokens = 0
    async with httpx.AsyncClient(base_url=url, timeout=120) as control:
        prompt = await prompt_ids(control)
    async with session(url, connections=2 * streams) as client:
        seeds = itertools.count()
        start = time.perf_counter()

        async def client_loop() -> None:
            nonlocal tokens
            while time.perf_counter() - start < seconds:
                tokens += (await stream_completion(client, prompt, 64, next(seeds))).tokens

        async def watch() -> None:
            while time.perf_counter() - start < seconds:
                now = rss_of(process)
                for key in peak:
                    peak[key] = max(peak[key], now[key])
                await asyncio.sleep(0.1)

        await asyncio.gather(watch(), *(client_loop() for _ in range(streams)))
    return {"streams": streams, "seconds": seconds, "tokens": tokens, "peak_rss_mib": peak}


def import_seconds(module: str) -> float:
    """Wall time of ``python -c 'import module'`` (the interpreter's own start included)."""
    started = time.perf_counter()
    subprocess.run([sys.executable, "-c", f"import {module}"], check=True)
    return time.perf_counter() - started


def run(checkpoints: Path, streams: int, seconds: float) -> dict[str, Any]:
    results: dict[str, Any] = {"import_server_api_app_s": import_seconds("server.api.app")}
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryFile() as log:
        started = time.perf_counter()
        server = subprocess.Popen(
            serve_command(checkpoints, port, None), stdout=log, stderr=subprocess.STDOUT
        )
        try:
            process = psutil.Process(server.pid)
            while True:  # the API process answers: 503 while the models load
                with contextlib.suppress(httpx.TransportError):
                    health = httpx.get(f"{url}/health", timeout=5)
                    break
                if server.poll() is not None:
                    raise RuntimeError(f"ordinal serve exited with {server.returncode}")
                time.sleep(0.02)
            results["api_answers_s"] = time.perf_counter() - started
            results["api_rss_at_start_mib"] = process.memory_info().rss / MiB
            while any(m["state"] == "loading" for m in health.json()["models"].values()):
                time.sleep(0.2)
                health = httpx.get(f"{url}/health", timeout=5)
            results["all_loaded_s"] = time.perf_counter() - started
            results["models"] = sorted(health.json()["models"])
            time.sleep(1.0)  # let the loader's allocations settle
            results["idle_rss_mib"] = rss_of(process)
            results["load"] = asyncio.run(under_load(url, process, streams, seconds))
        finally:
            server.send_signal(signal.SIGINT)
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/memory.json"))
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=15.0, help="of load")
    args = parser.parse_args()
    results = run(args.checkpoints, args.streams, args.seconds)
    write_json_atomic(args.out, results)
    print(results)


if __name__ == "__main__":
    main()
