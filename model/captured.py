"""Decode steps replayed from CUDA graphs.

On a GPU a small model's decode step is bound by launches, not arithmetic: some 180 kernels of a
few microseconds each, every one launched from Python. A CUDA graph records the step's kernels
once and replays them with one launch. A graph fixes shapes and addresses, so a captured step

- covers a *bucket* of rows, the power of two at or above the decoding rows (capped at the
  batch's most). The rows past the decoding ones (a row still prefilling, or an empty one) are
  padding: each writes its key at its own next free slot, past its sequence, where it is masked
  until that row's own next token overwrites it, so no sequence is disturbed;
- attends over every slot the cache has allocated, masked past each row's position (rather
  than up to the longest row), so one graph serves every step until the cache grows;
- reads its tokens from the batch's input buffer and its positions from a device buffer that
  is filled before each replay; positions are checked against the scheme's range on the host.

Graphs are kept per (row bucket, allocated length) and dropped whenever the cache reallocates
(``KVCache.generation``); all of them share one memory pool, since one step's logits are used
before the next replay. A scheme whose step depends on the pass (rope's dynamic scaling), or a
capture that fails, decodes eagerly, as on a CPU. ``ORDINAL_CUDA_GRAPHS=0`` turns graphs off.

Off a GPU, ``replay=False`` runs the same fixed-shape step eagerly: the tests check on any
machine that it decodes as the ordinary step does, and only the recording itself needs CUDA.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from model.backend import GRAPHS_SWITCH, graphs_wanted
from model.cache import KVCache
from model.transformer import Transformer

if TYPE_CHECKING:
    from torch.cuda import _POOL_HANDLE

logger = logging.getLogger("ordinal.captured")

SWITCH = GRAPHS_SWITCH  # "0": every decode step eager
wanted = graphs_wanted  # whether decode steps on a device are captured by default (model.backend)


def row_bucket(rows: int, most: int) -> int:
    """The rows a captured step covers for ``rows`` decoding rows: the next power of two, at
    most ``most``."""
    return min(most, 1 << (rows - 1).bit_length())


@dataclass(frozen=True)
class _Step:
    run: Callable[[], Tensor]  # one step → logits [bucket, V]
    # What the recorded kernels read and nothing else holds (the plan's index tensors, the
    # scheme's tables): a graph keeps addresses, not tensors, so these must outlive it.
    kept: tuple[object, ...]


class CapturedDecode:
    """Decode steps of ``model`` over the first rows of ``cache``, fed ``tokens`` (the batch's
    [max_rows] input buffer on the model's device), replayed from CUDA graphs (``replay``) or
    run eagerly at the same fixed shapes."""

    def __init__(
        self, model: Transformer, cache: KVCache, tokens: Tensor, *, replay: bool = True
    ) -> None:
        self.model, self.cache, self.tokens, self.replay = model, cache, tokens, replay
        self.positions = torch.zeros(cache.max_rows, 1, dtype=torch.long, device=tokens.device)
        self.steps: dict[tuple[int, int], _Step] = {}
        self.generation = cache.generation
        self.pool = self._new_pool()
        # Why steps run eagerly instead, once known (then for good).
        self.failure: str | None = None
        if not model.positional.prefix_stable:
            self.failure = (
                "the scheme's cached entries depend on each pass (rope's dynamic scaling, "
                "PaTH's turned keys)"
            )
        elif model.training:
            self.failure = "the model is training (dropout)"

    def _new_pool(self) -> _POOL_HANDLE | None:
        """A memory pool for the graphs recorded from now on (None when nothing is recorded)."""
        return torch.cuda.graph_pool_handle() if self.replay else None

    def logits(self, rows: int) -> Tensor | None:
        """One decode step of the first ``rows`` rows, each fed its token in ``tokens`` →
        logits [rows, V] (valid until the next step), with the rows' lengths advanced; or None,
        changing nothing, where this step must run eagerly (the caller then runs it)."""
        if self.failure is not None:
            return None
        cache = self.cache
        bucket = row_bucket(rows, cache.max_rows)
        lengths = cache.lengths[:bucket]
        needed = int(lengths.max()) + 1
        limit = self.model.positional.max_positions
        if needed > cache.max_length or (limit is not None and needed > limit):
            return None  # the eager step raises the error this deserves
        cache.reserve(bucket, needed)
        if cache.generation != self.generation:  # new tensors: the recorded addresses are stale
            self.steps.clear()
            self.generation = cache.generation
            # A pool whose graphs are all gone is released; capturing into its handle again
            # trips an assertion in torch's allocator (seen on torch 2.11), so take a new one.
            self.pool = self._new_pool()
        self.positions[:bucket, 0].copy_(lengths)
        key = (bucket, cache.allocated[1])
        step = self.steps.get(key)
        if step is None:
            step = self._capture(bucket)
            if step is None:
                return None
            self.steps[key] = step
        logits = step.run()
        cache.advance(rows)
        return logits[:rows]

    def _capture(self, bucket: int) -> _Step | None:
        """The fixed-shape step over ``bucket`` rows at the cache's allocated length, recorded
        as a CUDA graph when ``replay``; None (and eager from now on) if recording fails."""
        model, cache = self.model, self.cache
        tables = model.positional.reserve(cache.max_length, self.tokens.device)
        plan = cache.static_plan(bucket, self.positions[:bucket])
        tokens = self.tokens[:bucket].unsqueeze(1)

        def eager() -> Tensor:
            return model(tokens, cache, plan=plan, last_only=True)

        if not self.replay:
            return _Step(eager, (plan, tables))
        try:
            # Warm-up on a side stream, as torch asks before a capture. It makes the very writes
            # the replay makes (this step's keys at these positions), so running it is harmless.
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                eager()
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # thread_local: a model loading in another thread may use the GPU meanwhile.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                logits = eager()
        except RuntimeError as error:
            self.failure = f"capturing a step failed: {error}"
            logger.warning("%s: decoding eagerly", self.failure)
            return None

        def replay() -> Tensor:
            graph.replay()
            return logits

        return _Step(replay, (plan, tokens, tables))
