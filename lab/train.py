"""``ordinal train``: train one checkpoint on the Shakespeare corpus (or, with ``--data``, on your
own text: ``lab.text_corpus``), the same way for every scheme.

Every scheme gets the same model size, tokenizer, data order, token budget and seed, so the shipped
checkpoints compare fairly: only ``positional`` differs. The recipe is a named preset
(``model.config.PRESETS``; ``--preset``, default ``shipped``), then the ``--config`` file, then
individual flags. AdamW, or Muon for the blocks' matrices with AdamW for the rest; linear warmup
and cosine decay (or warmup-stable-decay), optionally a tail average of the weights read out at the
end (``WeightAverage``), gradient clipping and accumulation; periodic validation; a tqdm bar with
loss and tokens/s; resumable from the last saved state (``--resume``); the checkpoint folder, the
metrics JSON and the state are written atomically, the folder where ``model.files.check_output``
allows (checked before the run starts: a checkpoint is replaced, anything else only with
``--force``, never what the run reads). ``--init CHECKPOINT`` starts from a trained
checkpoint's weights (and tokenizer), all but its positional scheme's: with ``--scheme none`` that
is DroPE (Gelberg et al. 2025: train with rope, remove it, recalibrate briefly), and metrics.json
records the origin (``init``). Runs on CPU by default, and unchanged under ``torchrun``
(DistributedDataParallel; gloo on CPU, NCCL on GPUs, one process per device): each rank takes its
slice of the same global batch, and the loss is the mean over the global batch's scored tokens, so
N processes follow one process's loss curve to float rounding (dropout aside: each process draws
its own masks, so compare with ``dropout`` 0). The options are ``ordinal train``'s (ordinal.py):
that module restates ``TrainConfig``'s defaults and the shipped preset's sizes so its ``--help``
needs no torch, and tests/server/test_cli.py checks that both agree.
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import functools
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from tokenizers import Tokenizer
from torch import Tensor
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.profiler import record_function
from tqdm import tqdm

from lab.corpus import Corpus, load_corpus
from lab.data import (
    IGNORE_INDEX,
    TokenStream,
    TrainingSequences,
    boundary_sequences,
    encode_stream,
    first_windows,
    line_break_ids,
)
from lab.geometry.corpus import measure_corpus
from lab.geometry.metrics import classical_mds
from lab.pieces import Piece, PieceSource
from lab.text_corpus import TextSource, open_text_corpus
from model.checkpoint import (
    TOKENIZER_FILE,
    WEIGHTS_FILE,
    check_weights,
    load_checkpoint,
    save_checkpoint,
)
from model.config import (
    DEFAULT_PRESET,
    MODEL_SIZE_FLAGS,
    PRESETS,
    ConfigError,
    ModelConfig,
    TrainConfig,
    preset,
)
from model.device import resolve_device
from model.files import CHECKPOINT, EVAL_FILE, METRICS_FILE, check_output, write_atomic
from model.positional import MdsPositions
from model.tokenizer import (
    SpecialIds,
    load_tokenizer,
    save_tokenizer,
    special_ids,
    train_tokenizer,
)
from model.transformer import Transformer

# TrainConfig lives in model.config
__all__ = ["TrainConfig", "TrainingRun", "configs_from_args", "run"]

# inputs [B, T], targets [B, T] → the summed loss over the scored targets (see summed_loss).
LossSum = Callable[[Tensor, Tensor], Tensor]

DEFAULT_TOKENIZER = Path("runs/tokenizer.json")  # shared by the Shakespeare runs
STATE_FILE = "state.pt"

# The shipped architecture and per-scheme parameters (the `shipped` preset), by their old names.
DEFAULT_MODEL: dict[str, Any] = dict(PRESETS[DEFAULT_PRESET].model)
DEFAULT_POSITIONAL: dict[str, dict[str, Any]] = {
    scheme: dict(params) for scheme, params in PRESETS[DEFAULT_PRESET].positional.items()
}


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
    """The preset (``--preset``), then the --config file, then individual flags."""
    recipe = preset(getattr(args, "preset", None) or DEFAULT_PRESET)
    file = read_config_file(args.config) if args.config else {}
    model_fields = {**recipe.model, **file.get("model", {})}
    file_positional = model_fields.pop("positional", {})
    for source, value in [
        ("the config file's model.positional", file_positional),
        ("--positional", args.positional or {}),
    ]:
        if not isinstance(value, dict):
            raise ConfigError(f"{source} must be a JSON object, got {value!r}")
    model_fields["positional"] = {
        **recipe.positional.get(args.scheme, {}),
        **file_positional,
        **(args.positional or {}),
        "scheme": args.scheme,
    }
    for name in MODEL_SIZE_FLAGS:
        if getattr(args, name) is not None:
            model_fields[name] = getattr(args, name)
    model_fields["max_positions"] = max(
        model_fields["max_positions"], model_fields["context_length"]
    )
    train_fields = {**dataclasses.asdict(recipe.train), **file.get("train", {})}
    for field in dataclasses.fields(TrainConfig):
        if getattr(args, field.name, None) is not None:
            train_fields[field.name] = getattr(args, field.name)
    return ModelConfig.from_dict(model_fields), TrainConfig.from_dict(train_fields)


def start_from_checkpoint(model: Transformer, folder: Path) -> dict[str, Any]:
    """Copy every weight of the checkpoint at ``folder`` into ``model`` but its positional
    scheme's (``model`` keeps its own scheme, as initialised); the two must have the same
    architecture otherwise. Returns the origin metrics.json records: the checkpoint, its scheme,
    its weights' SHA-256 and what its own training cost (the budget of the base)."""
    source = load_checkpoint(folder, device="cpu").model
    copy_weights_but_positional(model, source, f"--init {folder}")
    base_metrics_path = folder / METRICS_FILE
    base = json.loads(base_metrics_path.read_text()) if base_metrics_path.is_file() else {}
    return {
        "checkpoint": str(folder),
        "scheme": source.config.scheme,
        "positional": source.config.positional,
        "sha256": check_weights(folder / WEIGHTS_FILE, source.config),
        **{key: base[key] for key in ("step", "tokens_seen", "wall_seconds") if key in base},
    }


def copy_weights_but_positional(model: Transformer, source: Transformer, what: str) -> None:
    """Copy every weight of ``source`` into ``model`` but its positional scheme's (``model``
    keeps its own, as initialised): DroPE's step, from a checkpoint (``--init``) or in memory
    (the task suite's ``drope``). The architectures must agree otherwise; ``what`` names the
    source in the error."""
    ours, theirs = model.config.to_dict(), source.config.to_dict()
    for name in ours.keys() - {"positional", "dtype"}:
        if ours[name] != theirs[name]:
            raise ConfigError(
                f"{what}: its {name} is {theirs[name]!r} but this run's is "
                f"{ours[name]!r} (only the positional scheme may differ)"
            )
    weights = {
        name: tensor
        for name, tensor in source.state_dict().items()
        if not name.startswith("positional.")
    }
    missing, unexpected = model.load_state_dict(weights, strict=False)  # the same architecture
    assert not unexpected and all(name.startswith("positional.") for name in missing)


def training_corpus(data: Path | None) -> Corpus | TextSource:
    """The Shakespeare corpus, or with ``data`` (``--data``) the user's own text, streamed."""
    return load_corpus() if data is None else open_text_corpus(data)


def prepare_tokenizer(
    path: Path | None,
    vocab_size: int,
    corpus: PieceSource | None = None,
    progress: bool = False,
) -> Tokenizer:
    """Load the shared tokenizer at ``path``, training it on the training split the first time
    (the Shakespeare corpus's unless ``corpus``). Without a path the tokenizer is trained on
    ``corpus`` afresh and kept only in the checkpoint (BPE training is deterministic, so runs
    on the same text share it). ``progress``: a bar over the text read, and a note when the
    text held fewer distinct tokens than ``vocab_size``."""
    if path is not None and path.exists():
        return load_tokenizer(path)
    source = corpus or load_corpus()
    with tqdm(
        total=source.characters_of("train"),
        desc="learning the tokenizer",
        unit="char",
        unit_scale=True,
        disable=not progress,
        mininterval=1.0,
    ) as bar:
        tokenizer = train_tokenizer(_counted(source.pieces("train"), bar), vocab_size)
    if progress and tokenizer.get_vocab_size() < vocab_size:
        print(
            f"note: the text holds only {tokenizer.get_vocab_size()} distinct tokens for the "
            f"{vocab_size} asked (it repeats itself): the rest of the vocabulary stays unused",
            file=sys.stderr,
        )
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        save_tokenizer(tokenizer, path)
    return tokenizer


def _counted(pieces: Iterable[Piece], bar: tqdm) -> Iterator[str]:
    """The text of each piece, the bar moved on by its characters."""
    for piece in pieces:
        bar.update(len(piece.text))
        yield piece.text


def install_corpus_geometry(
    model: Transformer, documents: TokenStream, special: SpecialIds, seed: int
) -> None:
    """For ``mds``: fill the fixed table with P_MDS of the training split's positional statistics.

    One sequence starts at every training document, as in training, so μ_i is the distribution
    of the token at position i of a training sequence (padding excluded).
    """
    if not isinstance(model.positional, MdsPositions):
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
    state = args.state_dir or Path("runs") / args.out.name
    replacing = check_output(
        args.out,
        CHECKPOINT,
        sources=read_paths(args),
        kept=[state],
        force=getattr(args, "force", False),
    )
    if replacing and not args.resume and int(os.environ.get("RANK", 0)) == 0:
        print(
            f"note: {args.out} is replaced by this run's checkpoint at its first save (without "
            f"its {EVAL_FILE} or {METRICS_FILE})",
            file=sys.stderr,
        )
    device = resolve_device(args.device)
    if train_config.compile and not can_compile_for(device):
        # The shipped recipe compiles; a machine without a C++ compiler still trains it, slower.
        print(
            f"note: torch.compile on CPU needs a C++ compiler ({cpu_compiler()} not found); "
            "training uncompiled: the same recipe, slower",
            file=sys.stderr,
        )
        train_config = train_config.replace(compile=False)
    keep_freed_memory()
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


def read_paths(args: argparse.Namespace) -> list[Path]:
    """What a run reads, so never its ``--out``: the checkpoint it starts from, its text, its
    tokenizer and recipe (a save swaps the whole folder, so an OUT holding one of them would
    delete it). Its resumable state folder is kept too, but may hold the OUT (train's
    check_output)."""
    init, data = getattr(args, "init", None), getattr(args, "data", None)
    tokenizer = args.tokenizer or (DEFAULT_TOKENIZER if data is None and init is None else None)
    return [path for path in (init, data, tokenizer, args.config) if path is not None]


def cpu_compiler() -> str:
    """The C++ compiler torch.compile's CPU backend (Inductor) calls: $CXX, or its default."""
    return os.environ.get("CXX") or ("clang++" if sys.platform == "darwin" else "g++")


def can_compile_for(device: torch.device) -> bool:
    """Whether torch.compile can build kernels for ``device`` here: on a CPU it needs a C++
    compiler on the PATH (GPU kernels come from Triton, which torch brings)."""
    return device.type != "cpu" or shutil.which(cpu_compiler()) is not None


def _global_sum(value: torch.Tensor, world: int) -> torch.Tensor:
    """``value`` summed over every process (itself when there is one)."""
    if world > 1:
        dist.all_reduce(value)
    return value


@dataclass(frozen=True)
class TrainingData:
    """What a run trains and validates on: the shared tokenizer, the encoded training documents,
    the training sampler and the first ``eval_windows`` validation windows; ``source`` is what
    metrics.json records of the corpus."""

    tokenizer: Tokenizer
    documents: TokenStream
    special: SpecialIds
    sequences: TrainingSequences
    val_inputs: torch.Tensor
    val_targets: torch.Tensor
    source: dict[str, Any]


def load_training_data(
    tokenizer_path: Path | None,
    model_config: ModelConfig,
    train_config: TrainConfig,
    data: Path | None = None,
    progress: bool = False,
) -> TrainingData:
    """Tokenizer (trained the first time), training sampler and validation windows, of the
    Shakespeare corpus or of the text at ``data``.

    The sampler sees the training documents only; ``sequence_starts="line"`` lets its
    sequences start at any line of a document (speech) as well as at its start. No tokenizer
    path: ``runs/tokenizer.json`` for Shakespeare, one trained on ``data`` for that. The text
    is streamed (``lab.pieces``): what is held of it is the encoded training stream and one
    batch being encoded (``lab.data.encode_stream``), and only as much of the validation
    split is encoded as ``eval_windows`` windows take. ``progress``: bars on stderr while the
    tokenizer learns and the text is encoded.
    """
    corpus = training_corpus(data)
    if tokenizer_path is None and data is None:
        tokenizer_path = DEFAULT_TOKENIZER
    tokenizer = prepare_tokenizer(tokenizer_path, model_config.vocab_size, corpus, progress)
    documents = encode_stream(
        tokenizer,
        corpus.pieces("train"),
        characters=corpus.characters_of("train"),
        progress="tokenizing" if progress else None,
    )
    special = special_ids(tokenizer)
    line_breaks = line_break_ids(tokenizer) if train_config.sequence_starts == "line" else None
    sequences = TrainingSequences(
        documents, model_config.context_length, train_config.seed, special, line_breaks
    )
    val_inputs, val_targets = first_windows(
        tokenizer,
        corpus.pieces("validation"),
        model_config.context_length,
        train_config.eval_windows,
    )
    return TrainingData(
        tokenizer,
        documents,
        special,
        sequences,
        val_inputs,
        val_targets,
        corpus.metadata() if isinstance(corpus, TextSource) else {"corpus": "shakespeare"},
    )


class WeightAverage:
    """The tail average of the weights (``TrainConfig.ema_decay``, ``ema_start``): after every
    step done past ``ema_start_step`` (s), a ← d·a + (1 − d)·θ, the first such step copying θ,
    so after step n it is d^(n−s−1)·θ_(s+1) + (1 − d)·Σ_(t=s+2..n) d^(n−t)·θ_t. Parameters only:
    the buffers are fixed (rope's frequencies, mds's table). torch's ``AveragedModel`` keeps it;
    ``read_out`` puts it into the model at the end of training."""

    def __init__(self, model: torch.nn.Module, train_config: TrainConfig) -> None:
        self.start_step = train_config.ema_start_step
        self.averaged = AveragedModel(
            model, multi_avg_fn=get_ema_multi_avg_fn(train_config.ema_decay), use_buffers=False
        )

    def update(self, model: torch.nn.Module, done: int) -> None:
        """Step ``done`` (counted from 1) has just updated ``model``."""
        if done > self.start_step:
            self.averaged.update_parameters(model)

    @torch.no_grad()
    def read_out(self, model: torch.nn.Module) -> None:
        """Replace ``model``'s parameters by their average (a no-op before it started)."""
        if int(self.averaged.n_averaged) == 0:
            return
        for parameter, average in zip(
            model.parameters(), self.averaged.module.parameters(), strict=True
        ):
            parameter.copy_(average)


def build_optimizers(
    model: Transformer, train_config: TrainConfig, device: torch.device
) -> list[torch.optim.Optimizer]:
    """AdamW (β 0.9/0.95) over every parameter, or with ``optimizer="muon"`` Muon over the
    blocks' weight matrices and AdamW over the rest (embedding, gains, biases, positional).

    Weight decay applies to matrices and the embedding, never to gains, biases or positional
    parameters. Each parameter group keeps its peak rate in ``peak_lr`` for the schedule.
    """
    matrices, decayed, other = [], [], []
    for name, parameter in model.named_parameters():
        if train_config.optimizer == "muon" and parameter.dim() == 2 and name.startswith("blocks."):
            matrices.append(parameter)
        elif parameter.dim() >= 2 and "positional" not in name and "norm" not in name:
            decayed.append(parameter)
        else:
            other.append(parameter)
    adamw = torch.optim.AdamW(
        [
            {"params": decayed, "weight_decay": train_config.weight_decay},
            {"params": other, "weight_decay": 0.0},
        ],
        lr=train_config.lr,
        betas=(0.9, 0.95),
        fused=device.type == "cuda",
    )
    optimizers: list[torch.optim.Optimizer] = [adamw]
    if matrices:
        optimizers.append(
            torch.optim.Muon(
                matrices,
                lr=train_config.muon_lr,
                weight_decay=train_config.weight_decay,
                momentum=train_config.muon_momentum,
            )
        )
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["peak_lr"] = group["lr"]
    return optimizers


def set_learning_rates(
    optimizers: list[torch.optim.Optimizer], train_config: TrainConfig, step: int
) -> None:
    """Every group on the same warmup-and-cosine shape, scaled to its own peak rate."""
    scale = train_config.lr_at(step) / train_config.lr
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            group["lr"] = group["peak_lr"] * scale


def _train(
    args: argparse.Namespace,
    model_config: ModelConfig,
    train_config: TrainConfig,
    device: torch.device,
    rank: int,
    world: int,
) -> dict[str, Any]:
    """The training loop of ``run``, in process ``rank`` of ``world``: one optimisation step at
    a time, validating every ``eval_every`` steps and saving every ``save_every`` (and both at
    the last step or ``--stop-at``)."""
    session = TrainingRun.start(args, model_config, train_config, device, rank, world)
    progress = _Progress.start(session, resume=args.resume)
    for step in progress.bar:
        done = step + 1
        progress.record_step(done, session.optimise(step))
        last = done in (train_config.steps, args.stop_at)
        if done == train_config.steps and session.average is not None:
            session.average.read_out(session.model)  # what is validated and saved at the end
        if done % train_config.eval_every == 0 or last:
            progress.record_validation(done, session.validate())
        if rank == 0 and (done % train_config.save_every == 0 or last):
            session.save(progress.metrics, done)
        if last:
            break
    return progress.metrics


def _prepare_process(train_config: TrainConfig, world: int) -> None:
    """Check that the global batch splits over the processes; set the thread count and seed."""
    if train_config.batch_size % world:
        raise ConfigError(
            f"batch_size ({train_config.batch_size}) must divide by the number of "
            f"processes ({world})"
        )
    if train_config.threads:
        torch.set_num_threads(train_config.threads)
    torch.manual_seed(train_config.seed)


# mallopt(3) parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_memory() -> None:
    """Have the C library keep the memory that tensors free for the next ones, for the rest of
    the process (``run`` calls it: the setting is process-wide). A training step allocates and
    frees the same large tensors every time (the logits alone, [B·T, V] floats, are 33 MB in
    the shipped recipe); glibc serves blocks that large with mmap and unmaps them when freed,
    so every step page-faults them in again (docs/performance.md: "The training step"). With
    no mmap and no trimming below 1 GiB they come from the heap and stay there. Values are
    unchanged: torch aligns every tensor to 64 bytes either way. A no-op where the C library
    has no mallopt (not glibc)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is not None:
        mallopt(_M_MMAP_MAX, 0)
        mallopt(_M_TRIM_THRESHOLD, 1 << 30)


class _Progress:
    """The run's metrics as they grow (what metrics.json holds) and the tqdm bar over the steps
    still to run, which shows the latest loss and tokens/s (rank 0 only)."""

    def __init__(self, metrics: dict[str, Any], first_step: int, session: TrainingRun) -> None:
        model_config, train_config = session.model.config, session.train_config
        self.metrics = metrics
        self.bar = tqdm(
            range(first_step, train_config.steps),
            initial=first_step,
            total=train_config.steps,
            disable=session.rank != 0,
            desc=model_config.scheme,
            mininterval=2.0,
        )
        self._tokens_per_step = (
            train_config.batch_size * train_config.grad_accum * model_config.context_length
        )
        self._wall_before = metrics["wall_seconds"]  # of the run this one resumes
        self._clock = time.perf_counter()

    @classmethod
    def start(cls, session: TrainingRun, resume: bool) -> _Progress:
        """Progress so far: from the saved state with ``resume`` (when there is one), else new."""
        if resume and session.state_path.exists():
            metrics, first_step = _load_state(
                session.state_path,
                session.model,
                session.optimizers,
                session.average,
                session.device,
            )
            return cls(metrics, first_step, session)
        metrics = _fresh_metrics(session.model.config, session.train_config)
        metrics["data"] = session.data.source
        if session.origin is not None:
            metrics["init"] = session.origin
        return cls(metrics, 0, session)

    def record_step(self, step: int, loss: float) -> None:
        """Step ``step`` (counted from 1) is done with mean training loss ``loss``."""
        metrics = self.metrics
        metrics["tokens_seen"] += self._tokens_per_step
        metrics["wall_seconds"] = self._wall_before + time.perf_counter() - self._clock
        metrics["train_loss"].append([step, round(loss, 4)])
        tokens_per_second = metrics["tokens_seen"] / max(metrics["wall_seconds"], 1e-9)
        self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_second:.0f}", refresh=False)

    def record_validation(self, step: int, loss: float) -> None:
        """Validation at step ``step`` gave ``loss``; the wall time reached by then is kept
        beside it (``wall_at_validation``), so a run's pace can be read afterwards: on a shared
        machine the whole run's mean hides where it slowed."""
        metrics = self.metrics
        metrics["val_loss"].append([step, round(loss, 4)])
        paces = metrics.setdefault("wall_at_validation", [])  # absent from older runs' state
        previous_step, previous_wall = paces[-1] if paces else (0, 0.0)
        paces.append([step, metrics["wall_seconds"]])  # unrounded: never past wall_seconds
        if not self.bar.disable:  # rank 0 (tqdm's write prints even for a disabled bar)
            elapsed = metrics["wall_seconds"] - previous_wall
            pace = (step - previous_step) / elapsed if elapsed > 0 else float("nan")
            self.bar.write(
                f"step {step}: val loss {loss:.4f} ({pace:.2f} steps/s since step {previous_step})"
            )


@dataclass(frozen=True)
class TrainingRun:
    """One process's training run: its data, model (DDP-wrapped as ``trainable`` under
    torchrun), optimisers and where it saves."""

    args: argparse.Namespace
    train_config: TrainConfig
    device: torch.device
    rank: int
    world: int
    data: TrainingData
    model: Transformer
    trainable: torch.nn.Module
    loss_sum: LossSum  # summed_loss of trainable, compiled with train_config.compile
    optimizers: list[torch.optim.Optimizer]
    state_path: Path
    origin: dict[str, Any] | None  # with --init, where the weights came from
    average: WeightAverage | None  # with ema_decay > 0

    @classmethod
    def start(
        cls,
        args: argparse.Namespace,
        model_config: ModelConfig,
        train_config: TrainConfig,
        device: torch.device,
        rank: int,
        world: int,
    ) -> TrainingRun:
        """Set up process ``rank`` of ``world`` (threads, seed), then its data, model and
        optimisers: everything ``optimise`` needs."""
        _prepare_process(train_config, world)
        init = getattr(args, "init", None)
        model = Transformer(model_config)
        # Before the text is read: tokenizing a large one takes minutes, a mismatch no time.
        origin = start_from_checkpoint(model, init) if init else None
        tokenizer = init / TOKENIZER_FILE if init else args.tokenizer  # the ids it was trained on
        data = load_training_data(
            tokenizer, model_config, train_config, getattr(args, "data", None), rank == 0
        )
        if rank == 0 and "split" in data.source:
            print(f"{data.source['path']}: {data.source['split']}", file=sys.stderr)
        install_corpus_geometry(model, data.documents, data.special, train_config.seed)
        model.to(device).train()
        trainable: torch.nn.Module = model
        if world > 1:
            trainable = torch.nn.parallel.DistributedDataParallel(
                model, device_ids=[device] if device.type == "cuda" else None
            )
        loss_sum: Callable[..., Tensor] = functools.partial(
            summed_loss, trainable, autocast=train_config.precision == "bfloat16"
        )
        if train_config.compile:
            loss_sum = torch.compile(loss_sum)
        state_path = (args.state_dir or Path("runs") / args.out.name) / STATE_FILE
        optimizers = build_optimizers(model, train_config, device)
        average = WeightAverage(model, train_config) if train_config.ema_decay > 0 else None
        return cls(
            args=args,
            train_config=train_config,
            device=device,
            rank=rank,
            world=world,
            data=data,
            model=model,
            trainable=trainable,
            loss_sum=loss_sum,
            optimizers=optimizers,
            state_path=state_path,
            origin=origin,
            average=average,
        )

    def optimise(self, step: int) -> float:
        """One optimisation step on step ``step``'s global batch; returns its mean loss."""
        set_learning_rates(self.optimizers, self.train_config, step)
        loss = _train_step(
            self.loss_sum,
            self.data.sequences,
            self.train_config,
            step,
            self.rank,
            self.world,
            self.device,
        )
        with record_function("clip"):
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.train_config.grad_clip)
        for optimizer in self.optimizers:  # the profiler labels these Optimizer.step#NAME.step
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if self.average is not None:
            self.average.update(self.model, step + 1)
        return loss

    def validate(self) -> float:
        """Loss on the first validation windows (every process holds the same weights, so each
        scores them alike)."""
        return validation_loss(self.model, self.data.val_inputs, self.data.val_targets, self.device)

    def save(self, metrics: dict[str, Any], step: int) -> None:
        """The checkpoint folder with its metrics.json (one atomic swap: the metrics never lag
        the weights), then the resumable state, atomically."""
        metrics["tokens_per_second"] = metrics["tokens_seen"] / metrics["wall_seconds"]
        metrics["step"] = step
        save_checkpoint(
            self.args.out,
            self.model,
            self.data.tokenizer,
            dtype=self.args.storage_dtype,
            json_files={METRICS_FILE: metrics},
        )
        _save_state(self.state_path, self.model, self.optimizers, self.average, metrics, step)


def _fresh_metrics(model_config: ModelConfig, train_config: TrainConfig) -> dict[str, Any]:
    return {
        "scheme": model_config.scheme,
        "model": model_config.to_dict(),
        "train": dataclasses.asdict(train_config),
        "train_loss": [],
        "val_loss": [],
        "wall_at_validation": [],  # [step, wall seconds then]: the run's pace
        "tokens_seen": 0,
        "wall_seconds": 0.0,
    }


def summed_loss(
    trainable: torch.nn.Module, inputs: Tensor, targets: Tensor, autocast: bool = False
) -> Tensor:
    """Summed next-token loss of ``trainable`` on ``inputs`` [B, T] over the scored ``targets``
    [B, T] (float32 scalar): the part of a step that ``TrainConfig.compile`` compiles.
    ``autocast`` runs the forward in bfloat16 (``TrainConfig.precision``); the loss is taken
    over float32 logits either way."""
    with torch.autocast(inputs.device.type, dtype=torch.bfloat16, enabled=autocast):
        logits = trainable(inputs)
    return F.cross_entropy(
        logits.float().flatten(0, 1),
        targets.flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def _train_step(
    loss_sum: LossSum,
    sequences: TrainingSequences,
    train_config: TrainConfig,
    step: int,
    rank: int,
    world: int,
    device: torch.device,
) -> float:
    """Forward and backward over step ``step``'s global batch (this process's slice of each
    micro-batch); returns the global batch's mean loss. Gradients are left for the optimiser."""
    micro_batch = train_config.batch_size // world
    step_loss = torch.zeros((), dtype=torch.float64, device=device)
    for micro in range(train_config.grad_accum):
        with record_function("batch"):
            inputs, targets = sequences.batch(
                step * train_config.grad_accum + micro, train_config.batch_size
            )
            inputs = inputs[rank * micro_batch : (rank + 1) * micro_batch].to(device)
            targets = targets[rank * micro_batch : (rank + 1) * micro_batch].to(device)
            # The mean over the global batch's scored tokens, whatever share each process has:
            # DDP averages the gradients of `world` processes, so each scales its sum by world.
            scored = _global_sum((targets != IGNORE_INDEX).sum(), world).clamp(min=1)
        with record_function("forward"):
            summed = loss_sum(inputs, targets)
        with record_function("backward"):
            (summed * world / scored / train_config.grad_accum).backward()
        step_loss += summed.detach().double() / scored / train_config.grad_accum
    return _global_sum(step_loss, world).item()


def _save_state(
    path: Path,
    model: Transformer,
    optimizers: list[torch.optim.Optimizer],
    average: WeightAverage | None,
    metrics: dict[str, Any],
    step: int,
) -> None:
    """Full-precision weights, optimizer moments, the weight average and progress, written
    atomically."""
    state = {
        "model": model.state_dict(),
        "optimizers": [optimizer.state_dict() for optimizer in optimizers],
        "metrics": metrics,
        "step": step,
        "rng": torch.get_rng_state(),
    }
    if average is not None:
        state["average"] = average.averaged.state_dict()
    write_atomic(path, lambda staging: torch.save(state, staging))


def _load_state(
    path: Path,
    model: Transformer,
    optimizers: list[torch.optim.Optimizer],
    average: WeightAverage | None,
    device: torch.device,
) -> tuple[dict[str, Any], int]:
    """Restore what :func:`_save_state` wrote; returns the metrics so far and the next step."""
    state = torch.load(path, map_location=device, weights_only=False)
    saved = state["optimizers"] if "optimizers" in state else [state["optimizer"]]  # older runs
    if len(saved) != len(optimizers):
        raise ConfigError(
            f"{path} holds {len(saved)} optimizer state(s), this recipe has {len(optimizers)}: "
            "resume with the optimizer the run started with"
        )
    model.load_state_dict(state["model"])
    for optimizer, optimizer_state in zip(optimizers, saved, strict=True):
        optimizer.load_state_dict(optimizer_state)
    if average is not None and "average" in state:
        average.averaged.load_state_dict(state["average"])
    torch.set_rng_state(state["rng"])  # dropout masks continue as in an uninterrupted run
    return state["metrics"], state["step"]
