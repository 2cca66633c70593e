"""Train one tiny model on one task with one scheme and seed, then score it at several lengths.

Every entry (``lab.tasks.entries``: each scheme, and recipes such as DroPE's) gets the same model
(``SuiteSettings.model``), the same batches (drawn from the seed and the step) and the same test
sequences (drawn from the length alone); only ``positional`` differs. The optimiser and its
schedule are ``ordinal train``'s (``lab.train.build_optimizers`` / ``set_learning_rates``: Muon
for the blocks' matrices and AdamW for the rest, as the shipped preset, warmup then cosine). The
loss and the score count the answer tokens only: the rest of a task's sequence is noise or
structure that no model could, or need, predict.

Table schemes (learned, mds, lowrank) get a table of max(multiples) × L rows, and training only
ever reaches rows 0..L−2 (a sequence of L tokens is L−1 inputs, each predicting the next): the
later rows keep their initial values, which is the seeds' claim ("a learned table cannot go past
its last trained row") put to the test, rather than a crash.
``mds`` fills rows 0..L−1 with P_MDS of the task's training sequences (as ``ordinal train``
does with the corpus), and its rows past L stay the placeholder the scheme starts with.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from lab.geometry.corpus import measure_corpus
from lab.geometry.metrics import classical_mds
from lab.tasks.base import Task, TaskBatch, derive_seed
from lab.tasks.entries import ENTRIES
from lab.train import build_optimizers, copy_weights_but_positional, set_learning_rates
from model.config import PRESETS, ModelConfig, TrainConfig
from model.positional import SCHEMES, MdsPositions
from model.transformer import Transformer

# The streams seeds are drawn from: training batches (per run seed and step), test sequences
# (per length: the same for every scheme and seed), and the sequences mds measures.
TRAIN_STREAM, TEST_STREAM, GEOMETRY_STREAM = 0, 1, 2
GEOMETRY_SEQUENCES = 2048

# Two layers are the fewest in which an induction head (recall, copy) can form. RMSNorm, not
# LayerNorm: LayerNorm subtracts each vector's mean, which removes integer's p·(1, …, 1)
# exactly and would make integer the same model as none.
TASK_MODEL: dict[str, Any] = {
    "d_model": 64,
    "n_layers": 2,
    "n_heads": 4,
    "d_ff": 256,
    "dropout": 0.0,
    "norm": "rmsnorm",
    "mlp": "gelu",
    "bias": False,
    "tie_embeddings": True,
    "qk_norm": False,
}
TASK_TRAIN = TrainConfig(
    steps=1000, batch_size=32, optimizer="muon", lr=3e-3, min_lr=3e-4, warmup_steps=100
)
# The suite's own settings of TrainConfig (the rest is TrainConfig's defaults, unused here:
# evaluation and saving happen once, after training).
TRAIN_FIELDS: tuple[str, ...] = ("steps", "batch_size", "optimizer", "lr", "muon_lr")
TRAIN_FIELDS += ("muon_momentum", "min_lr", "warmup_steps", "weight_decay", "grad_clip")


@dataclass(frozen=True)
class SuiteSettings:
    """What one result depends on besides the scheme, task and seed: the training length L, the
    test lengths (multiples of L), the number of test sequences per length, the architecture and
    the recipe. A result is reused only when its settings are these (``ordinal tasks --reuse``)."""

    length: int = 32
    multiples: tuple[int, ...] = (1, 2, 4)
    test_sequences: int = 256
    model: dict[str, Any] = field(default_factory=lambda: dict(TASK_MODEL))
    train: TrainConfig = TASK_TRAIN

    def to_dict(self) -> dict[str, Any]:
        train = dataclasses.asdict(self.train)
        return {
            "length": self.length,
            "multiples": list(self.multiples),
            "test_sequences": self.test_sequences,
            "model": dict(self.model),
            "positional": {
                scheme: parameters
                for scheme in SCHEMES
                if (parameters := scheme_parameters(scheme, self.length))
            },
            "train": {name: train[name] for name in TRAIN_FIELDS},
        }

    @property
    def test_lengths(self) -> list[int]:
        return [multiple * self.length for multiple in self.multiples]

    def up_to(self, longest: int) -> SuiteSettings:
        """These settings tested at 1L, 2L, … doubling up to ``longest`` L (one of LONGEST)."""
        assert longest in LONGEST
        return dataclasses.replace(
            self, multiples=tuple(1 << k for k in range(longest.bit_length()))
        )


# The longest test of a run (``ordinal tasks --longest``): 4L by default, or also 8L, which
# doubles the longest test's cost (attention is quadratic in it).
LONGEST, DEFAULT_LONGEST = (4, 8), 4


# The suite's two budgets: the full run (`ordinal tasks`, the default) and `--quick`, which runs
# the whole pipeline in seconds (the test suite does) on a one-layer model trained a few steps.
SUITES = {
    "full": SuiteSettings(),
    "quick": SuiteSettings(
        length=20,
        test_sequences=16,
        model={**TASK_MODEL, "d_model": 32, "d_ff": 64, "n_layers": 1},
        train=dataclasses.replace(TASK_TRAIN, steps=4, batch_size=4, warmup_steps=2),
    ),
}


def suite_name(settings: dict[str, Any]) -> str | None:
    """Which of SUITES made a result with ``settings`` (its to_dict(), seeds aside), at any of
    the LONGEST tests, if any."""
    bare = {key: value for key, value in settings.items() if key != "seeds"}
    return next(
        (
            name
            for name, suite in SUITES.items()
            for longest in LONGEST
            if suite.up_to(longest).to_dict() == bare
        ),
        None,
    )


def scheme_parameters(scheme: str, length: int) -> dict[str, Any]:
    """``scheme``'s parameters: the v2 checkpoints' (sinusoidal's scale, the tables' ranks; the
    suite's results were measured with them, so the shipped alibi's ×4 slopes are not used),
    but integer's scale. The shipped raw p (scale 1) swamps the token embeddings so far that
    integer learned nothing at L (flip-flop: 0.52, chance 0.52); in units of L (scale 1/L) it
    learned flip-flop (0.85) and is still what the seeds describe, unbounded past L, so their
    claim about it can be tested."""
    parameters = dict(PRESETS["v2"].positional.get(scheme, {}))
    if scheme == "integer":
        parameters["scale"] = 1 / length
    return parameters


def model_config(name: str, task: Task, settings: SuiteSettings) -> ModelConfig:
    """The suite's architecture for ``task`` with entry ``name``'s scheme and parameters."""
    entry = ENTRIES[name]
    positional = {
        **scheme_parameters(entry.scheme, settings.length),
        **entry.parameters,
        "scheme": entry.scheme,
    }
    return ModelConfig.from_dict(
        {
            **settings.model,
            "vocab_size": task.vocab_size,
            "context_length": settings.length,
            "max_positions": max(settings.test_lengths),
            "positional": positional,
        }
    )


def answer_loss(model: Transformer, batch: TaskBatch) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens of ``batch`` [N, T], each predicted from the
    tokens before it."""
    logits = model(batch.tokens[:, :-1])  # [N, T−1, V]: position t predicts token t+1
    scored = batch.answers[:, 1:]
    return F.cross_entropy(logits[scored], batch.tokens[:, 1:][scored])


def install_task_geometry(model: Transformer, task: Task, length: int, seed: int) -> None:
    """For ``mds``: rows 0..length−1 of the fixed table become P_MDS of the task's training
    sequences (their positional token distributions under the Hellinger metric); the rows past
    them, which training never reaches, keep their placeholder values."""
    if not isinstance(model.positional, MdsPositions):
        return
    sequences = task.generate(derive_seed(GEOMETRY_STREAM, seed), length, GEOMETRY_SEQUENCES)
    geometry = measure_corpus(task.name, sequences.tokens, task.vocab_size, None, seed)
    rank = min(model.positional.params.rank, length)
    coordinates = classical_mds(geometry.hellinger, rank=rank).positions  # [length, r ≤ rank]
    table = model.positional.coordinates.clone()  # [max_positions, rank]
    table[:length] = 0.0
    table[:length, : coordinates.shape[1]] = torch.from_numpy(coordinates).float()
    model.positional.set_coordinates(table)


def train_model(name: str, task: Task, seed: int, settings: SuiteSettings) -> Transformer:
    """A model of entry ``name`` trained on ``task`` at length L from ``seed`` (weights and
    batches), then for an entry ``continued_as`` another scheme (DroPE) moved to it and trained
    on with the next batches; returned in eval mode."""
    entry = ENTRIES[name]
    torch.manual_seed(seed)
    model = Transformer(model_config(name, task, settings))
    install_task_geometry(model, task, settings.length, seed)
    optimise(model, task, seed, settings, settings.train, first_step=0)
    if entry.continued_as is not None:
        scheme = entry.continued_as
        positional = {**scheme_parameters(scheme, settings.length), "scheme": scheme}
        continued = Transformer(model.config.replace(positional=positional))
        copy_weights_but_positional(continued, model, f"{name}'s first phase")
        recalibration = entry.recalibration_recipe(settings.train)
        optimise(continued, task, seed, settings, recalibration, first_step=settings.train.steps)
        model = continued
    return model.eval()


def optimise(
    model: Transformer,
    task: Task,
    seed: int,
    settings: SuiteSettings,
    recipe: TrainConfig,
    first_step: int,
) -> None:
    """``recipe.steps`` steps of ``model`` on the batches of steps first_step, first_step + 1, …
    of ``seed``'s stream, with a fresh optimiser on ``recipe``'s schedule."""
    model.train()
    optimizers = build_optimizers(model, recipe, torch.device("cpu"))
    for step in range(recipe.steps):
        set_learning_rates(optimizers, recipe, step)
        batch = task.generate(
            derive_seed(TRAIN_STREAM, seed, first_step + step), settings.length, recipe.batch_size
        )
        answer_loss(model, batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.grad_clip)
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)


def evaluation_batch(task: Task, length: int, count: int) -> TaskBatch:
    """The test sequences of ``length``: the same for every scheme and seed."""
    return task.generate(derive_seed(TEST_STREAM, length), length, count)


@torch.no_grad()
def score(model: Transformer, batch: TaskBatch, chunk: int = 64) -> list[int]:
    """How many answers of ``batch`` [N, T] the greedy prediction of ``model`` gets right, per
    position → [T] (position 0 is never an answer: nothing precedes it)."""
    correct = torch.zeros(batch.tokens.shape[1], dtype=torch.long)
    for start in range(0, len(batch.tokens), chunk):
        tokens = batch.tokens[start : start + chunk]
        scored = batch.answers[start : start + chunk, 1:]
        predicted = model(tokens[:, :-1]).argmax(dim=-1)  # [n, T−1]
        correct[1:] += ((predicted == tokens[:, 1:]) & scored).sum(dim=0)
    return correct.tolist()


def majority_accuracy(batch: TaskBatch) -> float:
    """Chance: the accuracy of always answering the most common answer of ``batch`` (what a
    model learns from the answers alone, without reading the sequence)."""
    answers = batch.tokens[batch.answers]
    return float(np.bincount(answers.numpy()).max() / len(answers))


def run_seed(name: str, task: Task, seed: int, settings: SuiteSettings) -> dict[str, list[int]]:
    """Train one model of entry ``name`` and score it at every test length → {str(T): correct
    per position [T]}."""
    model = train_model(name, task, seed, settings)
    return {
        str(length): score(model, evaluation_batch(task, length, settings.test_sequences))
        for length in settings.test_lengths
    }
