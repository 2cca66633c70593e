"""``ordinal train``: train one checkpoint on the Shakespeare corpus, the same way for every scheme.

Every scheme gets the same model size, tokenizer, data order, token budget and seed, so the
shipped checkpoints compare fairly: only ``positional`` differs. AdamW with linear warmup and
cosine decay, gradient clipping and accumulation; periodic validation; a tqdm bar with loss and
tokens/s; resumable from the last saved state (``--resume``); the checkpoint folder and the
metrics JSON are written atomically. Runs on CPU by default, and unchanged under ``torchrun``
(DistributedDataParallel; gloo on CPU, NCCL on GPUs, one process per device): each rank takes its
slice of the same global batch, and the loss is the mean over the global batch's scored tokens,
so N processes follow one process's loss curve to float rounding (dropout aside: each process
draws its own masks, so compare with ``dropout`` 0). The options are ``ordinal train``'s
(ordinal.py): that module restates ``TrainConfig``'s defaults and ``DEFAULT_MODEL``'s sizes so
its ``--help`` needs no torch, and tests/server/test_cli.py checks that both agree.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tqdm import tqdm

from model.checkpoint import save_checkpoint
from model.config import ConfigError, ModelConfig, write_json_atomic
from model.corpus import load_corpus
from model.data import (
    IGNORE_INDEX,
    TrainingSequences,
    boundary_sequences,
    encode_documents,
    validation_stream,
)
from model.geometry.corpus import measure_corpus
from model.geometry.metrics import classical_mds
from model.tokenizer import (
    SpecialIds,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)
from model.transformer import Transformer

METRICS_FILE = "metrics.json"
STATE_FILE = "state.pt"

# The shipped architecture: what `ordinal train --scheme NAME` builds unless told otherwise.
DEFAULT_MODEL = {
    "vocab_size": 2048,
    "d_model": 128,
    "n_layers": 4,
    "n_heads": 4,
    "d_ff": 512,
    "context_length": 128,
    "max_positions": 128,
    "dropout": 0.1,
    "norm": "layernorm",
    "mlp": "gelu",
    "bias": False,
    "tie_embeddings": True,
}

# Per-scheme parameters of the shipped checkpoints (anything not listed uses the defaults).
# Sinusoidal is scaled so its entries start with the spread of the learned table (std 0.02)
# rather than swamping token embeddings 35-fold; integer and binary stay the seeds' raw baselines.
DEFAULT_POSITIONAL: dict[str, dict[str, Any]] = {
    "sinusoidal": {"scale": 0.028},
    "mds": {"rank": 32},
    "lowrank": {"rank": 32},
}


# ModelConfig fields that `ordinal train` also takes as flags (--d-model 192, ...).
MODEL_SIZE_FLAGS = (
    "d_model",
    "n_layers",
    "n_heads",
    "d_ff",
    "context_length",
    "max_positions",
    "vocab_size",
)


# Smallest valid value of the TrainConfig counts that must be positive (all others: 0).
_TRAIN_MINIMUM = {
    "steps": 1,
    "batch_size": 1,
    "grad_accum": 1,
    "eval_every": 1,
    "eval_windows": 1,
    "save_every": 1,
}


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation settings; the defaults are the shipped recipe."""

    steps: int = 2000
    batch_size: int = 32
    grad_accum: int = 1
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 500
    eval_windows: int = 64
    save_every: int = 500
    seed: int = 1337
    threads: int = 0  # 0 = torch's default

    def __post_init__(self) -> None:
        # A wrong type or range would otherwise surface as a TypeError or ZeroDivisionError
        # only after the corpus has been encoded.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            integer = field.type == "int"
            if isinstance(value, bool) or not isinstance(value, int if integer else (int, float)):
                kind = "an integer" if integer else "a number"
                raise ConfigError(f"train.{field.name} must be {kind}, got {value!r}")
            smallest = _TRAIN_MINIMUM.get(field.name, 0)
            if field.name != "seed" and value < smallest:
                raise ConfigError(f"train.{field.name} must be ≥ {smallest}, got {value!r}")
        if self.lr <= 0:
            raise ConfigError(f"train.lr must be positive, got {self.lr!r}")

    def lr_at(self, step: int) -> float:
        """Linear warmup to ``lr``, then cosine decay to ``min_lr`` at the last step."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.min_lr + 0.5 * (self.lr - self.min_lr) * (1 + math.cos(math.pi * progress))


def read_config_file(path: Path) -> dict[str, dict[str, Any]]:
    """The --config file: a JSON object whose only keys are "model" and "train", each an object."""
    try:
        file = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path} is not valid JSON: {error}") from None
    if not isinstance(file, dict):
        raise ConfigError(f'{path} must hold a JSON object {{"model": {{...}}, "train": {{...}}}}')
    unknown = set(file) - {"model", "train"}
    if unknown:
        raise ConfigError(f"{path}: unknown section(s) {sorted(unknown)}; valid: model, train")
    for section, value in file.items():
        if not isinstance(value, dict):
            raise ConfigError(f'{path}: "{section}" must be a JSON object, got {value!r}')
    return file


def configs_from_args(args: argparse.Namespace) -> tuple[ModelConfig, TrainConfig]:
    """Defaults, then the --config file, then individual flags."""
    file = read_config_file(args.config) if args.config else {}
    model_fields = {**DEFAULT_MODEL, **file.get("model", {})}
    for source, value in [
        ("the config file's model.positional", model_fields.get("positional", {})),
        ("--positional", args.positional or {}),
    ]:
        if not isinstance(value, dict):
            raise ConfigError(f"{source} must be a JSON object, got {value!r}")
    positional = {**DEFAULT_POSITIONAL.get(args.scheme, {}), **(args.positional or {})}
    model_fields["positional"] = {
        **model_fields.get("positional", {}),
        **positional,
        "scheme": args.scheme,
    }
    for name in MODEL_SIZE_FLAGS:
        if getattr(args, name) is not None:
            model_fields[name] = getattr(args, name)
    model_fields["max_positions"] = max(
        model_fields["max_positions"], model_fields["context_length"]
    )
    train_fields = dict(file.get("train", {}))
    for field in dataclasses.fields(TrainConfig):
        if getattr(args, field.name) is not None:
            train_fields[field.name] = getattr(args, field.name)
    valid = {field.name for field in dataclasses.fields(TrainConfig)}
    if set(train_fields) - valid:
        raise ConfigError(
            f"unknown train setting(s) {sorted(set(train_fields) - valid)}; valid: {sorted(valid)}"
        )
    return ModelConfig.from_dict(model_fields), TrainConfig(**train_fields)


def prepare_tokenizer(path: Path, vocab_size: int):
    """Load the shared tokenizer, training it on the training split the first time."""
    if path.exists():
        return load_tokenizer(path)
    tokenizer = train_tokenizer(load_corpus().train, vocab_size)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_tokenizer(tokenizer, path)
    return tokenizer


def install_corpus_geometry(
    model: Transformer, documents: list[list[int]], special: SpecialIds, seed: int
) -> None:
    """For ``mds``: fill the fixed table with P_MDS of the training split's positional statistics.

    One sequence starts at every training document, as in training, so μ_i is the distribution
    of the token at position i of a training sequence (padding excluded).
    """
    if model.config.scheme != "mds":
        return
    n = model.config.max_positions
    inputs = boundary_sequences(documents, n, special)
    geometry = measure_corpus("shakespeare", inputs, model.config.vocab_size, special.pad, seed)
    coordinates = classical_mds(geometry.hellinger, rank=model.positional.params.rank).positions
    model.positional.set_coordinates(torch.from_numpy(coordinates).float())


@torch.no_grad()
def validation_loss(
    model: Transformer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    device: torch.device,
    batch_size: int = 32,
) -> float:
    """Mean next-token loss in nats over the non-ignored targets of ``inputs`` [N, T]."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for start in range(0, len(inputs), batch_size):
        x = inputs[start : start + batch_size].to(device)
        y = targets[start : start + batch_size].to(device)
        logits = model(x)
        total += F.cross_entropy(
            logits.flatten(0, 1).float(), y.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
        ).item()
        count += int((y != IGNORE_INDEX).sum())
    model.train(was_training)
    return total / max(count, 1)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Train per ``args`` (``ordinal train``'s options, ordinal.py); returns the metrics written
    beside the checkpoint.

    Under ``torchrun`` (``WORLD_SIZE`` set) each process joins the process group (gloo on CPU,
    NCCL on CUDA), wraps the model in DistributedDataParallel and trains on its slice of every
    global batch; rank 0 alone prints and saves.
    """
    model_config, train_config = configs_from_args(args)
    device = resolve_device(args.device)
    if "WORLD_SIZE" not in os.environ:
        return _train(args, model_config, train_config, device, rank=0, world=1)
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        return _train(
            args, model_config, train_config, device, dist.get_rank(), dist.get_world_size()
        )
    finally:
        dist.destroy_process_group()


def resolve_device(name: str) -> torch.device:
    """``auto`` → cuda when available, else cpu; any other name as given."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _global_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    """``value`` summed over every process (itself when there is one)."""
    if world > 1:
        dist.all_reduce(value)
    return value


def _train(
    args: argparse.Namespace,
    model_config: ModelConfig,
    train_config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """The training loop of ``run``, in process ``rank`` of ``world``."""
    if train_config.batch_size % world:
        raise ConfigError(
            f"batch_size ({train_config.batch_size}) must divide by the number of "
            f"processes ({world})"
        )
    if train_config.threads:
        torch.set_num_threads(train_config.threads)
    torch.manual_seed(train_config.seed)

    tokenizer = prepare_tokenizer(args.tokenizer, model_config.vocab_size)
    corpus = load_corpus()
    documents = encode_documents(tokenizer, corpus.train)
    special = special_ids(tokenizer)
    sequences = TrainingSequences(
        documents, model_config.context_length, train_config.seed, special
    )
    val_inputs, val_targets = validation_stream(tokenizer, corpus.validation).windows(
        model_config.context_length
    )
    val_inputs = val_inputs[: train_config.eval_windows]
    val_targets = val_targets[: train_config.eval_windows]

    model = Transformer(model_config)
    install_corpus_geometry(model, documents, special, train_config.seed)
    model.to(device)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "positional" not in n]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 or "positional" in n]
    optimizer = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": train_config.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=train_config.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    trainable: torch.nn.Module = model
    if world > 1:
        trainable = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )

    state_dir = args.state_dir or Path("runs") / args.out.name
    state_path = state_dir / STATE_FILE
    metrics: dict[str, Any] = {
        "scheme": model_config.scheme,
        "model": model_config.to_dict(),
        "train": dataclasses.asdict(train_config),
        "train_loss": [],
        "val_loss": [],
        "tokens_seen": 0,
        "wall_seconds": 0.0,
    }
    start_step = 0
    if args.resume and state_path.exists():
        state = torch.load(state_path, map_location=device, weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        metrics, start_step = state["metrics"], state["step"]
        torch.set_rng_state(state["rng"])  # dropout masks continue as in an uninterrupted run

    tokens_per_step = (
        train_config.batch_size * train_config.grad_accum * model_config.context_length
    )
    micro_batch = train_config.batch_size // world
    progress = tqdm(
        range(start_step, train_config.steps),
        initial=start_step,
        total=train_config.steps,
        disable=rank != 0,
        desc=model_config.scheme,
        mininterval=2.0,
    )
    model.train()
    clock = time.perf_counter()
    wall_before = metrics["wall_seconds"]
    for step in progress:
        for group in optimizer.param_groups:
            group["lr"] = train_config.lr_at(step)
        step_loss = torch.zeros((), dtype=torch.float64, device=device)
        for micro in range(train_config.grad_accum):
            inputs, targets = sequences.batch(
                step * train_config.grad_accum + micro, train_config.batch_size
            )
            inputs = inputs[rank * micro_batch : (rank + 1) * micro_batch].to(device)
            targets = targets[rank * micro_batch : (rank + 1) * micro_batch].to(device)
            # The mean over the global batch's scored tokens, whatever share each process has:
            # DDP averages the gradients of `world` processes, so each scales its sum by world.
            scored = _global_sum((targets != IGNORE_INDEX).sum(), world).clamp(min=1)
            logits = trainable(inputs)
            loss_sum = F.cross_entropy(
                logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            )
            (loss_sum * world / scored / train_config.grad_accum).backward()
            step_loss += loss_sum.detach().double() / scored / train_config.grad_accum
        torch.nn.utils.clip_grad_norm_(model.parameters(), train_config.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_loss_value = _global_sum(step_loss, world).item()

        metrics["tokens_seen"] += tokens_per_step
        metrics["wall_seconds"] = wall_before + time.perf_counter() - clock
        metrics["train_loss"].append([step + 1, round(step_loss_value, 4)])
        progress.set_postfix(
            loss=f"{step_loss_value:.3f}",
            tok_s=f"{metrics['tokens_seen'] / max(metrics['wall_seconds'], 1e-9):.0f}",
            refresh=False,
        )
        last = step + 1 in (train_config.steps, args.stop_at)
        if (step + 1) % train_config.eval_every == 0 or last:
            # Every process holds the same weights, so each scores the same windows alike.
            val = validation_loss(model, val_inputs, val_targets, device)
            metrics["val_loss"].append([step + 1, round(val, 4)])
            if rank == 0:
                progress.write(f"step {step + 1}: val loss {val:.4f}")
        if rank == 0 and ((step + 1) % train_config.save_every == 0 or last):
            metrics["tokens_per_second"] = metrics["tokens_seen"] / metrics["wall_seconds"]
            metrics["step"] = step + 1
            save_checkpoint(args.out, model, tokenizer, dtype=args.storage_dtype)
            write_json_atomic(args.out / METRICS_FILE, metrics)
            _save_state(state_path, model, optimizer, metrics, step + 1)
        if step + 1 == args.stop_at:
            break
    return metrics


def _save_state(
    path: Path,
    model: Transformer,
    optimizer: torch.optim.Optimizer,
    metrics: dict[str, Any],
    step: int,
) -> None:
    """Full-precision weights, optimizer moments and progress, written atomically."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    torch.save(
        {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "metrics": metrics,
            "step": step,
            "rng": torch.get_rng_state(),
        },
        tmp,
    )
    os.replace(tmp, path)
