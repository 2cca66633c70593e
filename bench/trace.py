"""``POST /v1/trace`` in-process: what the engine does for one trace of 256 tokens with attention
(the forward with its recorder, the response document, orjson), and the gzip the API process
then applies, on the shipped checkpoints. The figure is in docs/performance.md.

    python -m bench.trace                       # rope and alibi, 256 tokens, one thread
    python -m bench.trace --schemes alibi --logit-lens
"""

from __future__ import annotations

import argparse
import gzip
import statistics
import time
from pathlib import Path

import orjson
import torch

from model.checkpoint import load_checkpoint
from model.sampling_params import SamplingParams
from server.api.schemas import MAX_TRACE_TOKENS
from server.engine.loader import prepare
from server.engine.trace import trace_document


def measure(
    scheme: str, tokens: int, repeats: int, logit_lens: bool, encoding: str
) -> dict[str, float]:
    """Median milliseconds of the engine's trace work and of its gzip, and the bytes."""
    folder = Path("checkpoints") / scheme
    model, tokenizer = load_checkpoint(folder, "cpu")
    loaded = prepare(scheme, scheme, model, tokenizer, None, time.perf_counter())
    ids = tokenizer.encode(Path("README.md").read_text()).ids[: tokens - 1]
    prompt = [loaded.bos, *ids]
    traced, zipped = [], []
    document = b""
    for _ in range(repeats + 1):  # the first is a warm-up
        started = time.perf_counter()
        document = orjson.dumps(
            trace_document(
                loaded,
                prompt,
                SamplingParams(),
                True,
                20,
                MAX_TRACE_TOKENS,
                logit_lens=logit_lens,
                attention_encoding=encoding,
            ),
            option=orjson.OPT_SERIALIZE_NUMPY,
        )
        middle = time.perf_counter()
        compressed = gzip.compress(document, compresslevel=1)  # server.api.app's level
        traced.append(middle - started)
        zipped.append(time.perf_counter() - middle)
    return {
        "trace_ms": 1000 * statistics.median(traced[1:]),
        "gzip_ms": 1000 * statistics.median(zipped[1:]),
        "json_mb": len(document) / 1e6,
        "gzip_mb": len(compressed) / 1e6,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--schemes", nargs="+", default=["rope", "alibi"])
    parser.add_argument("--tokens", type=int, default=MAX_TRACE_TOKENS)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--logit-lens", action="store_true")
    parser.add_argument("--encodings", nargs="+", default=["uint8", "lists"])
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    print("| scheme | attention | trace (engine) ms | gzip ms | total ms | JSON MB | gzip MB |")
    print("|---|---|---|---|---|---|---|")
    for scheme in args.schemes:
        for encoding in args.encodings:
            r = measure(scheme, args.tokens, args.repeats, args.logit_lens, encoding)
            total = r["trace_ms"] + r["gzip_ms"]
            print(
                f"| {scheme} | {encoding} | {r['trace_ms']:.0f} | {r['gzip_ms']:.0f} | "
                f"{total:.0f} | {r['json_mb']:.2f} | {r['gzip_mb']:.2f} |"
            )


if __name__ == "__main__":
    main()
