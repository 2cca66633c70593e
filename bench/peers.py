"""The exported rope model served by vLLM and by llama.cpp, beside ``ordinal serve``: the same
greedy completions from all of them.

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
a completion differs.

    python -m bench.peers [--checkpoint checkpoints/rope] [--engines vllm llama.cpp] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.http import free_port, running_process, serve_command
from model.checkpoint import load_checkpoint
from model.config import write_json_atomic
from model.interop.gguf_export import export_gguf
from model.interop.hf_export import export_folder, served_context
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


def llama_cpp_command(model: Path, port: int, context: int) -> list[str]:
    """llama.cpp's server: the ``llama-server`` binary if on PATH, else llama-cpp-python's."""
    binary = shutil.which("llama-server")
    if binary:
        return [binary, "-m", str(model), "--port", str(port), "-c", str(context)]
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(model),
        "--port",
        str(port),
        "--n_ctx",
        str(context),
    ]


def vllm_command(folder: Path, port: int, context: int, tensor_parallel: int) -> list[str]:
    return [
        sys.executable,
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


# Each engine: whether it is installed, and its ready URL path.
ENGINES: dict[str, tuple[Callable[[], bool], str]] = {
    "vllm": (lambda: importlib.util.find_spec("vllm") is not None, "/health"),
    "llama.cpp": (
        lambda: (
            bool(shutil.which("llama-server")) or importlib.util.find_spec("llama_cpp") is not None
        ),
        "/v1/models",
    ),
}


def installed_engines() -> list[str]:
    return [name for name, (installed, _) in ENGINES.items() if installed()]


def complete(url: str, prompt: str, tokens: int, sampling: dict[str, Any]) -> str:
    """The text of one greedy completion of ``prompt`` from the server at ``url``."""
    body = {"model": "rope", "prompt": prompt, "max_tokens": tokens, **sampling}
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=300)
    response.raise_for_status()
    return response.json()["choices"][0]["text"]


def completions(
    command: list[str], url: str, ready: str, name: str, tokens: int, sampling: dict[str, Any]
) -> list[str]:
    with running_process(command, f"{url}{ready}", name, READY_TIMEOUT):
        return [complete(url, prompt, tokens, sampling) for prompt in PROMPTS]


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
            if engine == "vllm":
                export_folder(checkpoint, Path(work) / "hf")
                command = vllm_command(Path(work) / "hf", port, context, args.tensor_parallel)
            else:
                export_gguf(checkpoint, Path(work) / "rope.gguf")
                command = llama_cpp_command(Path(work) / "rope.gguf", port, context)
            url = f"http://127.0.0.1:{port}"
            sampling = {**PEER_GREEDY, **no_end}
            texts = completions(command, url, ENGINES[engine][1], engine, args.tokens, sampling)
            report[engine] = texts
            report[f"{engine}_matches"] = [a == b for a, b in zip(texts, reference, strict=True)]
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/rope"))
    parser.add_argument(
        "--engines", nargs="+", choices=list(ENGINES), help="default: every one installed"
    )
    parser.add_argument("--tokens", type=int, default=NEW_TOKENS, help="greedy tokens per prompt")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="vLLM's GPUs")
    parser.add_argument("--out", type=Path, help="write the completions and matches as JSON")
    args = parser.parse_args(argv)
    available = installed_engines()
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
    return 0 if every_match else 1


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())
