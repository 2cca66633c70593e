"""The exported rope model served by vLLM and by llama.cpp, beside ``ordinal serve``: the same
greedy completions from all of them, and (``--load``) each one's speed under the same client.

The checkpoint is exported (``ordinal export``: a Hugging Face folder for vLLM, a GGUF file for
llama.cpp) into a temporary folder; each installed engine then serves it on a free port next to
``ordinal serve`` serving the checkpoint itself, and every prompt of :data:`PROMPTS` is sent to
each as the same OpenAI completion request at temperature 0 with every other sampling stage
off. Each engine tokenizes the prompt itself (so their tokenizers, <|bos|> included, are checked
too) and the completions' texts must be identical. vLLM runs in float32 (the comparison is of
greedy tokens, which bfloat16 would move); ``--tensor-parallel N`` spreads it over N GPUs.
llama.cpp is ``llama-server`` where it is on PATH, else llama-cpp-python's server
(``pip install 'llama-cpp-python[server]'``).

With neither installed it says so and exits 0: there is nothing to compare. Exit status 1 when
a completion differs. The peers may live in their own virtual environments (they pin their own
torch): ``--llama-cpp-python`` and ``--vllm-python`` name the interpreter that runs each server.

``--load`` then serves every engine at once, each on one compute thread (ordinal's default), and
drives each in turn with the same streaming client (:mod:`bench.http`'s ``stream_completion``,
the text prompt tokenised by each server, greedy, <|eos|> banned so every request runs all its
tokens): one stream of 256 tokens, then bursts of 32 and 64 streams of 128 tokens, engines
interleaved within each round with an idle gap before each run, medians over ``--rounds``. The
inter-token gaps come from a second ordinal server with ``--stream-interval 0`` (every token its
own event, as the peers send them). The table, with ordinal's ratio to each peer, goes into
docs/benchmarks.md (re-rendered with ``bench.run``'s other results) from
bench/results/<class>/peers.json, the class being ordinal's kernel variant (``bench.run``).
``bench/install-peers.sh`` installs both outside the repository (vLLM's CPU build, and the C++
``llama-server`` built from the llama.cpp source in llama-cpp-python's source package). The
final figures are taken on a quiet machine with:

    PATH=/work/peers:$PATH python -m bench.peers --load --rounds 5 \
        --vllm-python /work/peers/vllm-venv/bin/python

and a smoke run of the same path (one round, short requests, nothing written to the docs) is
``--load --rounds 1 --smoke``.

    python -m bench.peers [--checkpoint checkpoints/rope] [--engines vllm llama.cpp] [--out FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from bench.http import (
    PROMPT,
    collector_paused,
    free_port,
    percentile,
    running_process,
    serve_command,
    session,
    stream_body,
)
from bench.run import cpu_class, cpu_model, peers_section, render_all
from interop.gguf_export import export_gguf
from interop.hf_export import export_folder, served_context
from model.checkpoint import load_checkpoint
from model.config import write_json_atomic
from model.files import write_text_atomic
from model.tokenizer import special_ids

# Each stops mid-speech, so that no engine's completion is only the end of the speech.
PROMPTS = (
    "ROMEO:\n",
    "JULIET:\nO Romeo, Romeo! wherefore art thou Romeo?\nDeny thy father and",
    "First Citizen:\nBefore we proceed any further, hear me speak.\n\nAll:\nSpeak, speak.\n\n"
    "First Citizen:\nYou are all resolved rather to",
)
NEW_TOKENS = 50
READY_TIMEOUT = 900.0  # vLLM compiles and profiles before it answers
# Every sampling stage but greedy off, under each engine's own names (unknown ones are ignored
# by the peers; ordinal is sent only the OpenAI fields).
GREEDY = {"temperature": 0.0, "top_p": 1.0}
PEER_GREEDY = {**GREEDY, "top_k": 0, "min_p": 0.0, "repeat_penalty": 1.0, "repetition_penalty": 1.0}


# Load rows: (label, streams, tokens per request).
LOADS = (("1 stream × 256", 1, 256), ("32 streams × 128", 32, 128), ("64 streams × 128", 64, 128))
SMOKE_LOADS = (("1 stream × 32", 1, 32), ("4 streams × 16", 4, 16), ("8 streams × 16", 8, 16))
IDLE_GAP = 2.0  # seconds before each run: vLLM keeps both cores busy ~1 s after a burst
ORDINAL_STREAMING = "ordinal, stream interval 0"  # the second ordinal server, for the gaps


def llama_cpp_command(
    model: Path, port: int, context: int, python: str = sys.executable, threads: int = 1
) -> list[str]:
    """llama.cpp's server: the ``llama-server`` binary if on PATH, else llama-cpp-python's;
    ``threads`` compute threads, a float32 KV cache (exact, as ordinal's), one slot per
    stream of the largest load."""
    slots = str(max(streams for _, streams, _ in LOADS))
    binary = shutil.which("llama-server")
    if binary:
        return [
            binary, "-m", str(model), "--port", str(port), "-c", str(context * int(slots)),
            "-t", str(threads), "-tb", str(threads), "-np", slots, "-ctk", "f32", "-ctv", "f32",
        ]  # fmt: skip
    return [
        python, "-m", "llama_cpp.server", "--model", str(model), "--port", str(port),
        "--n_ctx", str(context), "--n_threads", str(threads), "--n_threads_batch", str(threads),
        "--type_k", "0", "--type_v", "0",  # 0: GGML_TYPE_F32
        # Its default cancels the running stream whenever another request arrives; it serves
        # one request at a time either way (no batching in llama-cpp-python's server).
        "--interrupt_requests", "False",
    ]  # fmt: skip


def vllm_command(
    folder: Path, port: int, context: int, tensor_parallel: int, python: str = sys.executable
) -> list[str]:
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(folder),
        "--served-model-name",
        "rope",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--max-model-len",
        str(context),
        "--tensor-parallel-size",
        str(tensor_parallel),
    ]


# Each engine: the module its server needs, and its ready URL path.
ENGINES: dict[str, tuple[str, str]] = {
    "vllm": ("vllm", "/health"),
    "llama.cpp": ("llama_cpp", "/v1/models"),
}
# vLLM's CPU backend: one OpenMP thread bound to core 0, a 1 GiB KV cache (the model is tiny).
VLLM_ENVIRONMENT = {"VLLM_CPU_OMP_THREADS_BIND": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}


def has_module(python: str, module: str) -> bool:
    """Whether ``python`` (an interpreter, perhaps another virtual environment's) imports
    ``module``'s spec (found, not imported: vLLM's import alone takes seconds)."""
    probe = f"import importlib.util, sys; sys.exit(importlib.util.find_spec({module!r}) is None)"
    return subprocess.run([python, "-c", probe], capture_output=True).returncode == 0


def installed_engines(pythons: dict[str, str] | None = None) -> list[str]:
    """The peers installed: under ``pythons[engine]`` (default this interpreter); llama.cpp
    also when ``llama-server`` is on PATH."""
    pythons = pythons or {}
    found = []
    for name, (module, _) in ENGINES.items():
        python = pythons.get(name, sys.executable)
        if (name == "llama.cpp" and shutil.which("llama-server")) or has_module(python, module):
            found.append(name)
    return found


def complete(url: str, prompt: str, tokens: int, sampling: dict[str, Any]) -> str:
    """The text of one greedy completion of ``prompt`` from the server at ``url``."""
    body = {"model": "rope", "prompt": prompt, "max_tokens": tokens, **sampling}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def completions(
    command: list[str],
    url: str,
    ready: str,
    name: str,
    tokens: int,
    sampling: dict[str, Any],
    environment: dict[str, str] | None = None,
) -> list[str]:
    with running_process(command, f"{url}{ready}", name, READY_TIMEOUT, environment):
        return [complete(url, prompt, tokens, sampling) for prompt in PROMPTS]


def peer_command(
    engine: str, checkpoint: Path, work: Path, port: int, context: int, args: argparse.Namespace
) -> tuple[list[str], dict[str, str] | None]:
    """The command serving the export of ``checkpoint`` (written under ``work`` once) with
    ``engine`` on ``port``, and the environment it needs beside this one's (None: none)."""
    if engine == "vllm":
        folder = work / "hf"
        if not folder.exists():
            export_folder(checkpoint, folder)
        command = vllm_command(folder, port, context, args.tensor_parallel, args.vllm_python)
        return command, VLLM_ENVIRONMENT
    gguf = work / "rope.gguf"
    if not gguf.exists():
        export_gguf(checkpoint, gguf)
    return llama_cpp_command(gguf, port, context, args.llama_cpp_python), None


def compare(args: argparse.Namespace, engines: list[str]) -> dict[str, Any]:
    """Every engine's completions beside ordinal's, and whether each matches."""
    checkpoint = args.checkpoint.resolve()
    model, tokenizer = load_checkpoint(checkpoint, device="cpu")
    context = served_context(model)
    # <|eos|> banned (OpenAI's logit_bias, which every engine here takes): each completion is
    # the whole --tokens long, not the few tokens to the end of a speech.
    no_end = {"logit_bias": {str(special_ids(tokenizer).eos): -100}}
    port = free_port()
    ordinal_url = f"http://127.0.0.1:{port}"
    reference = completions(
        serve_command(checkpoint.parent, port, [checkpoint.name], dtype="float32"),
        ordinal_url,
        "/health",
        "ordinal serve",
        args.tokens,
        {**GREEDY, **no_end},
    )
    report: dict[str, Any] = {"checkpoint": str(args.checkpoint), "prompts": list(PROMPTS)}
    report["ordinal"] = reference
    with tempfile.TemporaryDirectory() as work:
        for engine in engines:
            port = free_port()
            command, environment = peer_command(engine, checkpoint, Path(work), port, context, args)
            url = f"http://127.0.0.1:{port}"
            sampling = {**PEER_GREEDY, **no_end}
            texts = completions(
                command, url, ENGINES[engine][1], engine, args.tokens, sampling, environment
            )
            report[engine] = texts
            report[f"{engine}_matches"] = [a == b for a, b in zip(texts, reference, strict=True)]
    return report


def request_body(engine: str, tokens: int, no_end: dict[str, Any]) -> dict[str, Any]:
    """The streaming greedy request every engine gets for a load: PROMPT's text (each server
    tokenises it), ``tokens`` long with <|eos|> banned, its last chunk counting the tokens (a
    chunk of ordinal's may carry several: its stream interval)."""
    sampling = GREEDY if engine.startswith("ordinal") else PEER_GREEDY
    body = {"model": "rope", "prompt": PROMPT, "max_tokens": tokens, "stream": True}
    usage = {"stream_options": {"include_usage": True}}
    return {**body, **usage, **sampling, **no_end}


async def burst(url: str, streams: int, body: dict[str, Any]) -> dict[str, float | None]:
    """``streams`` copies of ``body`` sent at once: aggregate tokens/s (all their tokens over
    the time from the first send to the last token), p99 time to first token, and p99 of the
    gaps between a stream's consecutive tokens (ms)."""
    async with session(url, connections=streams) as client:
        with collector_paused():
            done = await asyncio.gather(*(stream_body(client, body) for _ in range(streams)))
    tokens = sum(stream.tokens for stream in done)
    wall = max(s.token_times[-1] for s in done) - min(s.sent for s in done)
    gaps = [1000 * (b - a) for s in done for a, b in itertools.pairwise(s.token_times)]
    return {
        "tokens": tokens,
        "tokens_per_s": tokens / wall,
        "ttft_ms_p99": percentile([1000 * s.ttft for s in done], 99),
        "gap_ms_p99": percentile(gaps, 99),
    }


@contextlib.contextmanager
def every_server(
    checkpoint: Path, engines: list[str], args: argparse.Namespace, work: Path
) -> Iterator[dict[str, str]]:
    """ordinal (its defaults, and with ``--stream-interval 0``) and each peer on its export,
    all running at once; yields each one's URL."""
    model, _ = load_checkpoint(checkpoint, device="cpu")
    context = served_context(model)
    with contextlib.ExitStack() as servers:
        urls: dict[str, str] = {}
        ordinal_flags = {"ordinal": (), ORDINAL_STREAMING: ("--stream-interval", "0")}
        for name, flags in ordinal_flags.items():
            port = free_port()
            command = serve_command(checkpoint.parent, port, [checkpoint.name], flags, "float32")
            urls[name] = f"http://127.0.0.1:{port}"
            servers.enter_context(running_process(command, f"{urls[name]}/health", name, 300))
        for engine in engines:
            port = free_port()
            command, environment = peer_command(engine, checkpoint, work, port, context, args)
            urls[engine] = f"http://127.0.0.1:{port}"
            ready = f"{urls[engine]}{ENGINES[engine][1]}"
            servers.enter_context(
                running_process(command, ready, engine, READY_TIMEOUT, environment)
            )
        yield urls


def measure_load(args: argparse.Namespace, engines: list[str]) -> dict[str, Any]:
    """Every load against every server, interleaved, ``args.rounds`` times; the medians."""
    checkpoint = args.checkpoint.resolve()
    _, tokenizer = load_checkpoint(checkpoint, device="cpu")
    no_end = {"logit_bias": {str(special_ids(tokenizer).eos): -100}}
    loads = SMOKE_LOADS if args.smoke else LOADS
    runs: dict[str, dict[str, list[dict[str, float | None]]]] = {label: {} for label, *_ in loads}
    load_average = os.getloadavg()[0]
    with (
        tempfile.TemporaryDirectory() as work,
        every_server(checkpoint, engines, args, Path(work)) as urls,
    ):
        # Warm-up, unrecorded: every load once against every server (connections, allocators,
        # kernels, caches grown to each load's rows). After two short streams only, ordinal's
        # 32-stream rounds sped up round by round (8,890, 11,386, 15,579, then ~19,500
        # tokens/s), and the median of five took the third.
        for _, streams, tokens in loads:
            for name, url in urls.items():
                if streams > 1 or name != ORDINAL_STREAMING:
                    time.sleep(IDLE_GAP)
                    asyncio.run(burst(url, streams, request_body(name, tokens, no_end)))
        for round_index in range(args.rounds):
            for label, streams, tokens in loads:
                names = list(urls) if streams > 1 else [n for n in urls if n != ORDINAL_STREAMING]
                shift = round_index % len(names)  # a different engine goes first each round
                for name in names[shift:] + names[:shift]:
                    time.sleep(IDLE_GAP)
                    result = asyncio.run(
                        burst(urls[name], streams, request_body(name, tokens, no_end))
                    )
                    runs[label].setdefault(name, []).append(result)
                    print(
                        round_index,
                        label,
                        name,
                        {k: round(v or 0, 1) for k, v in result.items()},
                        flush=True,
                    )
    medians = {
        label: {
            name: {
                key: statistics.median(run[key] for run in results if run[key] is not None)
                for key in ("tokens_per_s", "ttft_ms_p99", "gap_ms_p99")
            }
            for name, results in by_name.items()
        }
        for label, by_name in runs.items()
    }
    return {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "cpu": cpu_model(),  # the hosts differ between sessions, and every engine with them
        "cpu_isa": cpu_class(),  # ordinal's kernel variant (ORDINAL_CPU_ISA forces one)
        "load_average_at_start": load_average,
        "rounds": args.rounds,
        "engines": engines,
        "loads": [{"label": label, "streams": n, "tokens": t} for label, n, t in loads],
        "medians": medians,
        "runs": runs,
        "command": reproducing_command(engines),
    }


def reproducing_command(engines: list[str]) -> str:
    """This run's command line, with the PATH that found ``llama-server`` (the C++ server
    differs from llama-cpp-python's, which runs one request at a time)."""
    command = "python -m bench.peers " + " ".join(sys.argv[1:])
    binary = shutil.which("llama-server")
    if "llama.cpp" in engines and binary:
        command = f"PATH={Path(binary).parent}:$PATH {command}"
    return command


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/rope"))
    parser.add_argument(
        "--engines", nargs="+", choices=list(ENGINES), help="default: every one installed"
    )
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS, help="greedy tokens per prompt")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="vLLM's GPUs")
    parser.add_argument("--out", type=Path, help="write the completions and matches as JSON")
    parser.add_argument("--llama-cpp-python", default=sys.executable, help="runs llama.cpp")
    parser.add_argument("--vllm-python", default=sys.executable, help="runs vLLM")
    parser.add_argument("--load", action="store_true", help="then time every engine under load")
    parser.add_argument("--rounds", type=int, default=5, help="--load: rounds (medians)")
    parser.add_argument(
        "--smoke", action="store_true", help="--load: short requests, docs left as they are"
    )
    parser.add_argument("--results", type=Path, default=Path("bench/results"))
    parser.add_argument("--doc", type=Path, default=Path("docs/benchmarks.md"))
    args = parser.parse_args(argv)
    pythons = {"llama.cpp": args.llama_cpp_python, "vllm": args.vllm_python}
    available = installed_engines(pythons)
    engines = args.engines or available
    missing = sorted(set(engines) - set(available))
    if missing:
        parser.error(f"not installed: {', '.join(missing)}")
    if not engines:
        print(
            "bench.peers: neither vLLM nor llama.cpp is installed (pip install vllm, or "
            "'llama-cpp-python[server]' / llama-server on PATH): nothing to compare"
        )
        return 0
    report = compare(args, engines)
    if args.out:
        write_json_atomic(args.out, report)
    every_match = True
    for engine in engines:
        matches = report[f"{engine}_matches"]
        every_match &= all(matches)
        print(f"{engine}: {sum(matches)}/{len(matches)} greedy completions equal ordinal's")
        for prompt, text, match in zip(PROMPTS, report[engine], matches, strict=True):
            if not match:
                print(f"  differs on {prompt!r}: {text!r}", file=sys.stderr)
    if args.load:
        load = measure_load(args, engines)
        print(peers_section(load))
        folder = args.results / load["cpu_isa"]
        if args.smoke:
            write_json_atomic(folder / "peers-smoke.json", load)
        else:
            write_json_atomic(folder / "peers.json", load)
            write_text_atomic(args.doc, render_all(args.results))
            print(f"wrote {args.doc}")
    return 0 if every_match else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
