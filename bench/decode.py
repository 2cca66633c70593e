"""In-process decode speed: tokens/s for every scheme, and against Hugging Face ``generate``.

For each model size (the shipped checkpoints' config, and 4 layers / 256 dims / 4 heads / vocab
4096) and batch size (1 and 32): a 32-token prompt, 256 new tokens, greedy, EOS ignored, timed
after a warm-up run. Hugging Face transformers' ``GPT2LMHeadModel.generate`` runs at identical
dimensions (random weights, built from a config, nothing downloaded) against our ``learned``
scheme in GPT-2's exact layout (biases, tanh GELU), the two timed in the same rounds.
Everything runs on a CUDA GPU in bfloat16 when one is present, else on the CPU in float32; on a
GPU, rope is also timed with its decode steps replayed from CUDA graphs (the default) and without.

    python -m bench.decode --out bench/results/decode.json
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from model import captured
from model.config import ModelConfig
from model.files import write_json_atomic
from model.generate import decode_tokens
from model.positional import SCHEMES
from model.sampling_params import SamplingParams
from model.transformer import Transformer

PROMPT_TOKENS = 32
NEW_TOKENS = 256
BATCHES = (1, 32)
GREEDY = SamplingParams(temperature=0.0)
# GPT-2's architecture in our config: learned positions, biases everywhere, tanh-approximate GELU.
GPT2_LAYOUT = {"positional": {"scheme": "learned"}, "bias": True, "mlp": "gelu_tanh"}
TRANSFORMERS = "transformers generate"  # its key among the interleaved runs


def bench_device() -> tuple[str, torch.dtype]:
    """Where the in-process figures are taken: a GPU in bfloat16 if present, else CPU float32."""
    if torch.cuda.is_available():
        return "cuda", torch.bfloat16
    return "cpu", torch.float32


def seconds(run_once: Callable[[], object]) -> float:
    """Wall seconds of one run, the GPU's queued work included."""
    synchronize()
    start = time.perf_counter()
    run_once()
    synchronize()
    return time.perf_counter() - start


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def model_sizes(checkpoints: Path) -> dict[str, dict[str, Any]]:
    """The architectures to time: the shipped one (from a checkpoint's config) and a larger one."""
    shipped = json.loads((checkpoints / "rope" / "config.json").read_text())
    shipped.pop("positional")
    shipped.pop("dtype")
    larger = {
        **shipped,
        "vocab_size": 4096,
        "d_model": 256,
        "n_layers": 4,
        "n_heads": 4,
        "d_ff": 1024,
    }
    for size in (shipped, larger):
        size["max_positions"] = max(size["max_positions"], PROMPT_TOKENS + NEW_TOKENS)
    return {"shipped": shipped, "4L-256d-v4096": larger}


def time_ours(config: ModelConfig, batch: int, repeats: int) -> float:
    """Best-of-``repeats`` tokens/s of our cached greedy decode."""
    return time_interleaved({"ours": our_decode(config, batch)}, batch, repeats)["ours"]


def time_interleaved(
    runs: dict[str, Callable[[], object]], batch: int, repeats: int
) -> dict[str, float]:
    """Best-of-``repeats`` tokens/s of every run (each decodes ``NEW_TOKENS`` for ``batch``
    rows), each round running every one once in turn, so that a noisy minute on a shared
    machine falls on all of them alike (one run after another's made their ratio mostly
    noise: transformers timed after our schemes gave 2.07-2.61x from one run to the next)."""
    best: dict[str, float] = {}
    for once in runs.values():  # warm-up: allocator, kernels
        once()
    for _ in range(repeats):
        for name, once in runs.items():
            rate = batch * NEW_TOKENS / seconds(once)
            best[name] = max(best.get(name, 0.0), rate)
    return best


def our_decode(config: ModelConfig, batch: int) -> Callable[[], None]:
    """One greedy decode of ``batch`` random prompts by a fresh model of ``config``."""
    device, dtype = bench_device()
    torch.manual_seed(0)
    model = Transformer(config).to(device, dtype).eval()
    prompts = torch.randint(3, config.vocab_size, (batch, PROMPT_TOKENS)).tolist()
    return functools.partial(_decode_all, model, prompts)


def _decode_all(model: Transformer, prompts: list[list[int]]) -> None:
    for _ in decode_tokens(model, prompts, NEW_TOKENS, GREEDY):
        pass


def transformers_decode(config: ModelConfig, batch: int) -> Callable[[], None] | None:
    """One greedy ``generate`` by transformers' GPT-2 at the dimensions of ``config`` (in
    GPT-2's layout), or None where transformers is not installed."""
    try:
        from transformers import GPT2Config, GPT2LMHeadModel
    except ImportError:
        return None
    device, dtype = bench_device()
    torch.manual_seed(0)
    gpt2 = GPT2LMHeadModel(
        GPT2Config(
            vocab_size=config.vocab_size,
            n_positions=config.max_positions,
            n_embd=config.d_model,
            n_layer=config.n_layers,
            n_head=config.n_heads,
            n_inner=config.d_ff,
            activation_function="gelu_new",  # GPT-2's tanh GELU, our gelu_tanh
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
            bos_token_id=None,
            eos_token_id=None,
        )
    )
    gpt2 = gpt2.to(device, dtype).eval()
    prompts = torch.randint(3, config.vocab_size, (batch, PROMPT_TOKENS), device=device)

    def once() -> None:
        with torch.inference_mode():
            gpt2.generate(
                prompts,
                attention_mask=torch.ones_like(prompts),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                pad_token_id=0,
            )

    return once


def rope_on_one_thread(checkpoints: Path, repeats: int) -> float:
    """Shipped-size rope at batch 1 on one torch thread, as ``ordinal serve`` runs by default."""
    shipped = model_sizes(checkpoints)["shipped"]
    config = ModelConfig.from_dict({**shipped, "positional": {"scheme": "rope"}})
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return time_ours(config, 1, repeats)
    finally:
        torch.set_num_threads(threads)


def graphs_on_and_off(checkpoints: Path, repeats: int) -> dict[str, Any] | None:
    """On a GPU: rope's decode at each size and batch with its steps replayed from CUDA graphs
    (the default there) and without (``ORDINAL_CUDA_GRAPHS=0``); None on a CPU."""
    if not torch.cuda.is_available():
        return None
    figures: dict[str, Any] = {}
    for size_name, fields in model_sizes(checkpoints).items():
        config = ModelConfig.from_dict({**fields, "positional": {"scheme": "rope"}})
        figures[size_name] = {}
        for switch, label in (("1", "graphs"), ("0", "eager")):
            with graphs_switched(switch):
                rates = {f"batch_{b}": time_ours(config, b, repeats) for b in BATCHES}
            figures[size_name][label] = rates
            print(size_name, label, {k: round(v) for k, v in rates.items()}, flush=True)
    return figures


@contextlib.contextmanager
def graphs_switched(value: str) -> Iterator[None]:
    """``ORDINAL_CUDA_GRAPHS`` set to ``value`` for the block (each DecodeBatch reads it)."""
    before = os.environ.get(captured.SWITCH)
    os.environ[captured.SWITCH] = value
    try:
        yield
    finally:
        if before is None:
            del os.environ[captured.SWITCH]
        else:
            os.environ[captured.SWITCH] = before


def run(checkpoints: Path, repeats: int, schemes: list[str]) -> dict[str, Any]:
    device, dtype = bench_device()
    results: dict[str, Any] = {
        "device": device,
        "dtype": str(dtype).removeprefix("torch."),
        "threads": torch.get_num_threads(),
        "prompt_tokens": PROMPT_TOKENS,
        "new_tokens": NEW_TOKENS,
        "sizes": {},
    }
    for size_name, fields in model_sizes(checkpoints).items():
        configs = {
            scheme: ModelConfig.from_dict({**fields, "positional": {"scheme": scheme}})
            for scheme in schemes
        }
        # GPT-2's exact layout (learned positions, biases everywhere) for the reference ratio,
        # timed in the same rounds as transformers' generate.
        gpt2_layout = ModelConfig.from_dict({**fields, **GPT2_LAYOUT})
        configs["learned+bias"] = gpt2_layout
        rates, reference = {}, {}
        for b in BATCHES:
            runs: dict[str, Callable[[], object]] = {
                name: our_decode(config, b) for name, config in configs.items()
            }
            theirs = transformers_decode(gpt2_layout, b)
            if theirs is not None:
                runs[TRANSFORMERS] = theirs
            rates[b] = time_interleaved(runs, b, repeats)
            reference[f"batch_{b}"] = rates[b].pop(TRANSFORMERS, None)
        rows = {name: {f"batch_{b}": rates[b][name] for b in BATCHES} for name in configs}
        for name, row in rows.items():
            print(size_name, name, {k: round(v) for k, v in row.items()}, flush=True)
        print(size_name, TRANSFORMERS, reference, flush=True)
        results["sizes"][size_name] = {"config": fields, "ours": rows, "transformers": reference}
    results["rope_batch_1_one_thread"] = rope_on_one_thread(checkpoints, repeats)
    results["cuda_graphs"] = graphs_on_and_off(checkpoints, repeats)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/decode.json"))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--schemes", nargs="+", default=list(SCHEMES))
    args = parser.parse_args()
    results = run(args.checkpoints, args.repeats, args.schemes)
    write_json_atomic(args.out, results)


if __name__ == "__main__":
    main()
