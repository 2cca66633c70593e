"""The machine's bound on decode speed: the matrix products of one decode step, timed alone,
and the true bound of the step's work against the machine's measured peak and bandwidth.

A decode step of B sequences multiplies [B, d_in] by every linear layer's weight and, per layer
and head, one query by the cached keys and the attention weights by the cached values. Timing just
those products at their exact shapes gives the step's per-call time (each product is still one
torch call, with its dispatch), hence a bound on tokens/s that a measured rate can be held against.

The true bound (``roofline``) has no call in it: a step must do its FLOPs (2 per multiply-add of
those products) and read its bytes (every weight once, each row's cached keys and values, its
embedding row), so it takes at least max(FLOPs ÷ peak, bytes ÷ bandwidth). The peak is a large
square product's GFLOP/s; the bandwidth is that of reading a buffer as large as the step's
footprint (weights + cache: a few MB sit in the CPU's caches, which is what a decode step reads
from), and the DRAM figure of a 256 MiB buffer goes with it.

    python -m bench.bound --out bench/results/bound.json
"""

from __future__ import annotations

import argparse
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.benchmark import Timer

from bench.decode import BATCHES, NEW_TOKENS, PROMPT_TOKENS, model_sizes
from model.config import ModelConfig
from model.files import write_json_atomic
from model.transformer import Transformer

CONTEXT = PROMPT_TOKENS + NEW_TOKENS // 2  # the decode benchmark's mean context
SQUARE = {"cpu": 1024, "cuda": 8192}
DRAM_BYTES = 256 * 2**20  # far past any CPU cache: a read of it streams from memory


class Product(NamedTuple):
    """[batch, m, k] @ [batch, k, n], done ``count`` times per decode step."""

    batch: int
    m: int
    k: int
    n: int
    count: int

    @property
    def flops(self) -> int:
        return 2 * self.batch * self.m * self.k * self.n

    def __str__(self) -> str:
        stack = f"{self.batch}×" if self.batch > 1 else ""
        return f"{stack}[{self.m},{self.k}]·[{self.k},{self.n}]"


def step_products(model: Transformer, batch: int, context: int) -> list[Product]:
    """The matrix products of one decode step of ``batch`` sequences at ``context`` tokens."""
    linears = Counter(
        (module.in_features, module.out_features)
        for module in model.modules()
        if isinstance(module, nn.Linear)
    )
    products = [Product(1, batch, d_in, d_out, count) for (d_in, d_out), count in linears.items()]
    config = model.config
    heads, head_dim = batch * config.n_heads, config.head_dim
    products.append(Product(heads, 1, head_dim, context, config.n_layers))  # q · Kᵀ
    products.append(Product(heads, 1, context, head_dim, config.n_layers))  # weights · V
    return products


def flops_per_token(model: Transformer, context: int = CONTEXT) -> int:
    """FLOPs of one token's decode step: 2 × parameters touched + the attention products."""
    return sum(p.flops * p.count for p in step_products(model, 1, context))


def step_bytes(model: Transformer, batch: int, context: int, element: int) -> dict[str, int]:
    """Bytes one decode step of ``batch`` rows at ``context`` cached tokens must read, with
    ``element`` bytes per value: every weight once (a tied embedding counted once, and only its
    ``batch`` rows when it is not also the unembedding), and each row's keys and values."""
    config = model.config
    weights = sum(
        module.weight.numel() for module in model.modules() if isinstance(module, nn.Linear)
    )
    norms = sum(
        parameter.numel()
        for name, parameter in model.named_parameters()
        if "norm" in name or name.endswith("bias")
    )
    embedding_rows = 0 if config.tie_embeddings else batch * config.d_model
    kv = 2 * config.n_layers * config.key_value_heads * config.head_dim * context * batch
    return {"weights": element * (weights + norms + embedding_rows), "cache": element * kv}


def read_gbs(size: int, device: str, dtype: torch.dtype, min_time: float) -> float:
    """GB/s of reading a buffer of ``size`` bytes (one sum over it, repeated: a buffer that
    fits in a cache is read from that cache)."""
    element = torch.empty(0, dtype=dtype).element_size()
    buffer = torch.randn(max(size // element, 1), device=device).to(dtype)
    return buffer.numel() * element / seconds_per_call(lambda: buffer.sum(), min_time) / 1e9


def roofline(
    model: Transformer,
    batch: int,
    device: str,
    dtype: torch.dtype,
    peak_gflops: float,
    min_time: float,
) -> dict[str, Any]:
    """The true bound of one decode step: its FLOPs at the square peak, or its bytes at the
    bandwidth of a read as large as its footprint, whichever takes longer."""
    element = torch.empty(0, dtype=dtype).element_size()
    flops = sum(p.flops * p.count for p in step_products(model, batch, CONTEXT))
    read = step_bytes(model, batch, CONTEXT, element)
    footprint = read["weights"] + read["cache"]
    bandwidth = read_gbs(footprint, device, dtype, min_time)
    seconds = max(flops / (peak_gflops * 1e9), footprint / (bandwidth * 1e9))
    return {
        "flops_per_token": flops / batch,
        "bytes_per_token": footprint / batch,
        "footprint_bytes": footprint,
        "read_gbs": bandwidth,
        "bound_by": "bytes" if footprint / bandwidth > flops / peak_gflops else "flops",
        "step_ms": 1000 * seconds,
        "tokens_per_s": batch / seconds,
    }


def seconds_per_call(work: Callable[[], object], min_time: float) -> float:
    """Best seconds of ``work()`` at torch's thread count: a bound takes the fastest block, not
    the typical one. Timer warms up, and synchronises CUDA itself."""
    timer = Timer("work()", globals={"work": work}, num_threads=torch.get_num_threads())
    return min(timer.blocked_autorange(min_run_time=min_time).times)


def time_product(product: Product, device: str, dtype: torch.dtype, min_time: float) -> float:
    """Seconds of one ``product``: ``F.linear`` for a layer (as the model runs it), else bmm."""
    make = {"device": device, "dtype": dtype}
    if product.batch == 1:
        x = torch.randn(product.m, product.k, **make)
        weight = torch.randn(product.n, product.k, **make)  # nn.Linear stores [out, in]
        return seconds_per_call(lambda: F.linear(x, weight), min_time)
    a = torch.randn(product.batch, product.m, product.k, **make)
    b = torch.randn(product.batch, product.k, product.n, **make)
    return seconds_per_call(lambda: torch.bmm(a, b), min_time)


def step_bound(
    model: Transformer, batch: int, device: str, dtype: torch.dtype, min_time: float
) -> dict[str, Any]:
    """One decode step's product time and the tokens/s it allows."""
    rows, step = [], 0.0
    for product in step_products(model, batch, CONTEXT):
        seconds = time_product(product, device, dtype, min_time)
        step += seconds * product.count
        gflops = product.flops / seconds / 1e9
        rows.append({"shape": str(product), "count": product.count, "gflops": gflops})
    return {"step_ms": 1000 * step, "bound_tokens_per_s": batch / step, "products": rows}


def square_gflops(device: str, dtype: torch.dtype, min_time: float) -> dict[str, float]:
    size = SQUARE[device]
    a, b = (torch.randn(size, size, device=device, dtype=dtype) for _ in range(2))
    return {"size": size, "gflops": 2 * size**3 / seconds_per_call(lambda: a @ b, min_time) / 1e9}


def devices() -> list[tuple[str, torch.dtype]]:
    """CPU in fp32 (where bench.decode runs), and CUDA in bfloat16 (what the server uses) if any."""
    found = [("cpu", torch.float32)]
    if torch.cuda.is_available():
        found.append(("cuda", torch.bfloat16))
    return found


def run(checkpoints: Path, min_time: float = 0.5) -> dict[str, Any]:
    """FLOPs per token of each benchmarked size, and per device its matmul bound."""
    models = {
        name: Transformer(ModelConfig.from_dict({**fields, "positional": {"scheme": "rope"}}))
        for name, fields in model_sizes(checkpoints).items()
    }
    results: dict[str, Any] = {
        "context": CONTEXT,
        "flops_per_token": {name: flops_per_token(model) for name, model in models.items()},
        "devices": {},
    }
    for device, dtype in devices():
        key = f"{device} {str(dtype).removeprefix('torch.')}"
        square = square_gflops(device, dtype, min_time)
        steps = {
            name: {
                f"batch_{b}": {
                    **step_bound(model, b, device, dtype, min_time),
                    "roofline": roofline(model, b, device, dtype, square["gflops"], min_time),
                }
                for b in BATCHES
            }
            for name, model in models.items()
        }
        dram = read_gbs(DRAM_BYTES, device, dtype, min_time)
        results["devices"][key] = {"square": square, "dram_read_gbs": dram, "steps": steps}
        print("bound", key, square, f"DRAM read {dram:.1f} GB/s", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/bound.json"))
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds timed per product")
    args = parser.parse_args()
    write_json_atomic(args.out, run(args.checkpoints, args.min_time))


if __name__ == "__main__":
    main()
