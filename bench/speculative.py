"""Speculative decoding (``--speculative ngram``) against decoding without it: one stream
through the real server, on the shipped rope.

Two servers run side by side, one started with ``--speculative ngram
--num-speculative-tokens K``, one without; each prompt goes to one then the other (the order
alternating by round), one request at a time. Two prompt sets of ``--prompts`` each, cut from
the validation plays:

- ``repeat``: the first 50 characters of a passage said three times, the case the method is
  for (text that repeats its prompt); what it gains depends on how far the model's own text
  goes on repeating the passage;
- ``ordinary``: a passage as it is: drafts come only from the model's own repetitions.

Each request: greedy, ``--tokens`` new tokens, EOS ignored, streamed. A set's tokens/s is its
tokens over the sum of its requests' times (sent → last token), the best of ``--rounds``. Both
servers' texts must be identical; /metrics gives the drafts' acceptance.

    python -m bench.speculative --out bench/results/avx512/speculative.json
"""

from __future__ import annotations

import argparse
import asyncio
import random
import re
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import orjson

from bench.http import running_server, session
from bench.run import machine
from lab.corpus import load_corpus
from model.files import write_json_atomic

SHIPPED = Path(__file__).resolve().parent.parent / "checkpoints"
PASSAGE_CHARACTERS = 160  # ~64 tokens
REPEATED = 50  # characters of it said three times: ~60 tokens


def prompt_sets(count: int) -> dict[str, list[str]]:
    """``count`` passages of the validation plays (the same for a given count), as they are
    and said three times."""
    text = "".join(load_corpus().validation)
    rng = random.Random(0)
    passages = []
    for _ in range(count):
        start = rng.randrange(len(text) - PASSAGE_CHARACTERS)
        passages.append(text[start : start + PASSAGE_CHARACTERS])
    # the repeated passage is shorter, so that both sets' prompts and completions stay inside
    # the 128 positions the shipped models were trained on
    return {"repeat": [passage[:REPEATED] * 3 for passage in passages], "ordinary": passages}


async def completion(client: aiohttp.ClientSession, prompt: str, tokens: int) -> tuple[str, float]:
    """One greedy streamed completion of exactly ``tokens`` tokens → (text, seconds from sent
    to the last token)."""
    body = {
        "model": "rope",
        "prompt": prompt,
        "max_tokens": tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
    }
    loop = asyncio.get_running_loop()
    sent, last, text = loop.time(), 0.0, []
    async with client.post("/v1/completions", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.startswith(b"data: {"):
                chunk = orjson.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0].get("text"):
                    text.append(chunk["choices"][0]["text"])
                    last = loop.time()
    return "".join(text), last - sent


def acceptance(url: str) -> dict[str, float]:
    """The speculative server's counters from /metrics (totals since it started)."""
    metrics = httpx.get(f"{url}/metrics").text
    found = {}
    for name in ("drafts", "draft_tokens", "accepted_tokens"):
        match = re.search(
            rf'^ordinal_spec_decode_num_{name}_total{{model_name="rope"}} (\S+)$', metrics, re.M
        )
        found[name] = float(match[1]) if match else 0.0
    return found


async def measure(
    urls: dict[str, str], sets: dict[str, list[str]], tokens: int, rounds: int
) -> dict[str, Any]:
    clients = {mode: session(url, connections=1) for mode, url in urls.items()}
    results: dict[str, Any] = {}
    try:
        for name, prompts in sets.items():
            before = acceptance(urls["speculative"])
            best = {mode: 0.0 for mode in urls}
            texts: dict[str, list[str]] = {mode: [] for mode in urls}
            for round_index in range(rounds + 1):  # round 0 warms both servers up
                seconds = {mode: 0.0 for mode in urls}
                texts = {mode: [] for mode in urls}
                for prompt in prompts:
                    order = list(urls) if round_index % 2 else list(reversed(urls))
                    for mode in order:
                        text, took = await completion(clients[mode], prompt, tokens)
                        texts[mode].append(text)
                        seconds[mode] += took
                if round_index:
                    for mode in urls:
                        best[mode] = max(best[mode], tokens * len(prompts) / seconds[mode])
            kept = acceptance(urls["speculative"])
            kept = {key: value - before[key] for key, value in kept.items()}
            generated = tokens * len(prompts) * (rounds + 1)  # every round, the warm-up's too
            results[name] = {
                "tokens_per_second": best,
                "speedup": best["speculative"] / best["plain"],
                "identical_texts": texts["speculative"] == texts["plain"],
                "acceptance": kept,  # this set's drafts, every round
                # each kept draft saves a step: the tokens a step gave the stream
                "tokens_per_step": generated / (generated - kept["accepted_tokens"]),
            }
    finally:
        for client in clients.values():
            await client.close()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--checkpoints", type=Path, default=SHIPPED)
    parser.add_argument("--speculative-tokens", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    flags = ("--speculative", "ngram", "--num-speculative-tokens", str(args.speculative_tokens))
    with ExitStack() as stack:
        urls = {
            "plain": stack.enter_context(running_server(args.checkpoints, ["rope"]))[0],
            "speculative": stack.enter_context(
                running_server(args.checkpoints, ["rope"], extra=flags)
            )[0],
        }
        sets = prompt_sets(args.prompts)
        results = asyncio.run(measure(urls, sets, args.tokens, args.rounds))
    report = {
        "machine": machine(),
        "command": "python -m bench.speculative "
        + " ".join(
            f"--{k.replace('_', '-')} {v}"
            for k, v in vars(args).items()
            if k not in ("out", "checkpoints")
        ),
        "speculative_tokens": args.speculative_tokens,
        "requests": {"prompts_per_set": args.prompts, "new_tokens": args.tokens, "greedy": True},
        **results,
    }
    for name in sets:
        row = results[name]
        rates = row["tokens_per_second"]
        print(
            f"{name:9s} plain {rates['plain']:7.0f} tok/s  speculative {rates['speculative']:7.0f}"
            f" tok/s  {row['speedup']:.2f}x  identical {row['identical_texts']}"
        )
        kept = row["acceptance"]
        print(
            f"{'':9s} {kept['accepted_tokens']:.0f} of {kept['draft_tokens']:.0f} draft tokens kept"
            f" in {kept['drafts']:.0f} proposals: {row['tokens_per_step']:.2f} tokens a step"
        )
    if args.out:
        write_json_atomic(args.out, report)


if __name__ == "__main__":
    main()
