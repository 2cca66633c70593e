"""The machine's bound on decode speed: the matrix products of one decode step, timed alone.

A decode step of B sequences multiplies [B, d_in] by every linear layer's weight and, per layer
and head, one query by the cached keys and the attention weights by the cached values. Timing just
those products at their exact shapes gives the step's overhead-free time, hence an upper bound on
tokens/s that a measured rate can be held against. FLOPs per token (2 per multiply-add of those
products at batch 1) and a large square product's GFLOP/s (the machine's practical peak) go with it.

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
        steps = {
            name: {f"batch_{b}": step_bound(model, b, device, dtype, min_time) for b in BATCHES}
            for name, model in models.items()
        }
        results["devices"][key] = {"square": square_gflops(device, dtype, min_time), "steps": steps}
        print("bound", key, results["devices"][key]["square"], flush=True)
    return results


def fraction_of_bound(tokens_per_s: float, bound_tokens_per_s: float) -> float:
    """How much of the overhead-free rate a measured rate reaches (1.0 = all of it)."""
    return tokens_per_s / bound_tokens_per_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoints", type=Path, default=Path("checkpoints"))
    parser.add_argument("--out", type=Path, default=Path("bench/results/bound.json"))
    parser.add_argument("--min-time", type=float, default=0.5, help="seconds timed per product")
    args = parser.parse_args()
    write_json_atomic(args.out, run(args.checkpoints, args.min_time))


if __name__ == "__main__":
    main()
