"""A key/value cache, grown on demand up to a fixed most, whose rows may hold sequences of
different lengths.

Slot s of row b holds the key and value of that row's token at position s, so a row's length is
also the position of its next token: positions are derived from the cache, in one place
(``KVCache.positions``). New entries are written in place (slices, or an index_put for ragged
rows); the cache is never concatenated or copied per step, only when it grows (doubling, so a
logarithmic number of times). Rows can be swapped so that a batch's active rows stay at the
front (the service's continuous batching relies on this). A scheme that ``keeps_key_state``
(FoX) also gets one float32 scalar per head per slot, its ``key_state``, kept the same way.
"""

from __future__ import annotations

import math
import mmap
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from model.config import ModelConfig
from model.positional import SCHEMES


class CacheFull(ValueError):
    """A write would go past the most positions per row the cache may hold (``max_length``)."""


class KVCache:
    """Keys and values for ``n_layers`` layers: each [rows, n_kv_heads, length, head_dim].

    ``rows`` × ``max_length`` is the most it holds. With ``reserve`` = (rows, length) only that
    much is allocated at first, and the cache grows when a sequence joins past its rows
    (:meth:`reserve`) or a write goes past its length (:meth:`positions`); :meth:`release`
    shrinks an empty cache back. Growing copies the old allocation into the new one once; a
    server's idle models then hold almost nothing.

    How it grows (``grows_to_most``): on the CPU straight to the most, whose pages take memory
    only once written (:func:`zeros`), so a server grows once and never copies again; elsewhere
    (a GPU's memory is taken when allocated) each dimension that must grow at least doubles.
    """

    def __init__(
        self,
        config: ModelConfig,
        rows: int,
        max_length: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        reserve: tuple[int, int] | None = None,
    ) -> None:
        self.max_rows, self.max_length = rows, max_length
        self._layout = (config.n_layers, config.key_value_heads, config.head_dim, device, dtype)
        self._key_dim = config.key_dim  # the head's width but for PoPE (twice it)
        self._reserve = (rows, max_length) if reserve is None else reserve
        # Doubling, even into such pages, a 64-stream burst grew a server's cache from 32 rows
        # to 64 in one step that copied the 32 rows' keys: 107 ms on this host, which the
        # burst's first tokens waited for (docs/performance-log.md, fifteenth round).
        self.grows_to_most = torch.device(device).type == "cpu"
        self._keeps_state = SCHEMES[config.scheme].keeps_key_state
        # [layers, rows, heads, length] float32 (a cumulative sum runs over it), or empty.
        self.states = torch.empty(0)
        # Lengths live on the host: they decide slicing, and reading them must never sync a GPU.
        self.lengths = torch.zeros(rows, dtype=torch.long)
        self._offsets = torch.arange(max_length)
        self.keys = self.values = torch.empty(0)
        self.generation = 0  # counts allocations: a captured step holds the tensors' addresses
        self._allocate(*self._reserve)

    @property
    def rows(self) -> int:
        return self.max_rows

    @property
    def usage(self) -> float:
        """The fraction of the most the cache can hold (rows × max_length) that holds keys now:
        vLLM's ``kv_cache_usage_perc``, which is a fraction too, despite its name."""
        return int(self.lengths.sum()) / (self.max_rows * self.max_length)

    @property
    def grown(self) -> bool:
        """More is allocated than the first reservation."""
        return self.allocated != self._reserve

    @property
    def allocated(self) -> tuple[int, int]:
        """(rows, length) of the tensors now allocated."""
        return self.keys.shape[1], self.keys.shape[3]

    def _allocate(self, rows: int, length: int, *, keep: bool = True) -> None:
        """New zeroed tensors of ``rows`` × ``length``, holding what fits of the old ones if
        ``keep``; swapped in whole, so the cache never shows a half-made state.

        Zeros, not garbage: slots past a row's length are read (and masked) by attention,
        and a NaN there would survive the mask (0 × NaN).
        """
        layers, heads, head_dim, device, dtype = self._layout
        shape = (layers, rows, heads, length, head_dim)
        keys = zeros((*shape[:-1], self._key_dim), device, dtype)
        values = zeros(shape, device, dtype)
        states = zeros(shape[:-1] if self._keeps_state else (0,), device, torch.float32)
        if keep and self.keys.numel():
            kept = slice(min(rows, self.allocated[0])), slice(min(length, self.allocated[1]))
            for new, old in ((keys, self.keys), (values, self.values), (states, self.states)):
                if old.numel():
                    new[:, kept[0], :, kept[1]] = old[:, kept[0], :, kept[1]]
        self.keys, self.values, self.states = keys, values, states
        self.generation += 1
        self._layer_keys, self._layer_values = keys.unbind(0), values.unbind(0)
        self._layer_states = states.unbind(0) if self._keeps_state else ()

    def reserve(self, rows: int, length: int) -> None:
        """Room for ``rows`` sequences (≤ the most it holds) of ``length`` slots each (CacheFull
        past the most), in one reallocation at most: to the most if ``grows_to_most``, else
        each dimension that must grow at least doubles, so a logarithmic number of them."""
        if length > self.max_length:
            raise CacheFull(
                f"the cache holds {self.max_length} positions per row; this step needs {length}"
            )
        allocated_rows, allocated_length = self.allocated
        if rows <= allocated_rows and length <= allocated_length:
            return
        if self.grows_to_most:
            try:
                self._allocate(self.max_rows, self.max_length)
                return
            except OSError:  # the OS will not map the most at once (more than its memory)
                self.grows_to_most = False
        if rows > allocated_rows:
            allocated_rows = min(self.max_rows, max(rows, 2 * allocated_rows))
        if length > allocated_length:
            allocated_length = min(self.max_length, max(length, 2 * allocated_length))
        self._allocate(allocated_rows, allocated_length)

    def release(self) -> None:
        """Shrink back to the first reservation; only while no row holds a sequence."""
        if self.grown and not bool(self.lengths.any()):
            # One swap of whole tensors, never an empty one in between: another thread (a
            # metrics read) may ask for ``allocated`` at any moment.
            self._allocate(*self._reserve, keep=False)

    def positions(self, rows: slice, n_new: int, new_counts: Tensor | None = None) -> CacheWrite:
        """Plan a write of ``n_new`` tokens per row into ``rows`` (``new_counts`` [B] if ragged).

        Row b's tokens go to slots lengths[b], lengths[b]+1, …; those slots are their positions.
        With ``new_counts``, tokens past a row's count are padding: not written, and given the
        row's last real position so that table-based schemes never see a phantom position.
        Runs once per forward pass, on the host; a decode step costs a handful of small ops
        (and, the few times a write goes past the allocated length, one reallocation).
        """
        start = self.lengths[rows]
        offsets = self._offsets[:n_new]
        positions = start.unsqueeze(1) + offsets  # [B, T]
        if new_counts is None:
            starts = start.tolist()
            key_length = max(starts, default=0) + n_new
            self.make_room(key_length)
            if starts and min(starts) == max(starts):
                return CacheWrite(rows, positions, start + n_new, key_length, starts[0], None)
            valid = torch.ones(positions.shape, dtype=torch.bool)
            end = start + n_new
        else:
            counts = new_counts.cpu()
            # A count above n_new would advance the row's length over never-written slots.
            if counts.shape != start.shape or bool(((counts < 0) | (counts > n_new)).any()):
                raise ValueError(
                    f"new_counts must give each of the {len(start)} rows a count in 0..{n_new}, "
                    f"got {counts.tolist()}"
                )
            last_real = start + (counts - 1).clamp(min=0)
            positions = torch.minimum(positions, last_real.unsqueeze(1))
            end = start + counts
            key_length = int(end.max()) if end.numel() else 0
            self.make_room(key_length)
            valid = offsets.unsqueeze(0) < counts.unsqueeze(1)  # [B, T]
        row_index, token_index = valid.nonzero(as_tuple=True)
        slots = positions[row_index, token_index]
        device = self.keys.device
        scatter = (row_index.to(device), token_index.to(device), slots.to(device))
        return CacheWrite(rows, positions, end, key_length, None, scatter)

    def entries(self, counts: Sequence[int]) -> CacheWrite:
        """Plan a pass of one token per pass row into the first ``len(counts)`` rows: cache row
        b takes ``counts[b]`` ≥ 1 tokens at its next slots, as that many consecutive pass rows
        (the decode kernel's pass: a decode step's rows, one token each, and the prompt chunks
        of the rows after them). ``positions`` [N, 1] and ``slot_rows`` [N], N = sum(counts)."""
        rows = len(counts)
        if not rows or min(counts) < 1:
            raise ValueError(f"every row takes at least one token, got {list(counts)}")
        # Built as lists, three tensors at the end: a decode step's plan is a few dozen
        # entries, where each torch op costs more than the Python.
        starts = self.lengths[:rows].tolist()
        slot_rows = [row for row, count in enumerate(counts) for _ in range(count)]
        positions = [
            slot
            for start, count in zip(starts, counts, strict=True)
            for slot in range(start, start + count)
        ]
        end = [start + count for start, count in zip(starts, counts, strict=True)]
        key_length = max(end)
        self.make_room(key_length)
        return CacheWrite(
            slice(0, rows),
            torch.tensor(positions).unsqueeze(1),
            torch.tensor(end),
            key_length,
            None,
            None,
            torch.tensor(slot_rows),
        )

    def static_plan(self, rows: int, positions: Tensor) -> CacheWrite:
        """The write of a captured decode step (``model.captured``): one token for each of the
        first ``rows`` rows, at ``positions`` [rows, 1] (a buffer on the cache's device, filled
        before each replay), every allocated slot a key (masked past each row's position), so
        that the step's shapes stay fixed until the cache grows. Its caller advances the rows'
        lengths (:meth:`advance`): ``end`` is on the device."""
        index = torch.arange(rows, device=positions.device)
        scatter = (index, torch.zeros_like(index), positions[:, 0])
        return CacheWrite(
            slice(0, rows), positions, positions[:, 0] + 1, self.allocated[1], None, scatter
        )

    def advance(self, rows: int) -> None:
        """The first ``rows`` rows hold one more token (a captured step's write)."""
        self.lengths[:rows] += 1

    def make_room(self, key_length: int) -> None:
        """Allocate ``key_length`` slots per row now (CacheFull past the most), so that the
        writes up to it need no reallocation."""
        self.reserve(0, key_length)

    def write(
        self, layer: int, plan: CacheWrite, keys: Tensor, values: Tensor
    ) -> tuple[Tensor, Tensor]:
        """Store ``keys``/``values`` [B, H, T, hd] for ``layer`` and return the keys and values of
        every slot up to the longest row → each [B, H, key_length, hd] (views, no copy)."""
        return (
            _store(self._layer_keys[layer][plan.rows], plan, keys),
            _store(self._layer_values[layer][plan.rows], plan, values),
        )

    def rewrite_keys(self, layer: int, plan: CacheWrite, keys: Tensor) -> None:
        """Replace the keys of every slot up to ``plan.key_length`` of ``layer`` with ``keys``
        [B, H, key_length, hd]: a scheme that turns the keys already cached (PaTH's
        ``move_keys``), once the pass that turned them has attended."""
        self._layer_keys[layer][plan.rows][:, :, : plan.key_length] = keys

    def write_key_state(self, layer: int, plan: CacheWrite, state: Tensor) -> Tensor:
        """Store the new tokens' key state [B, H, T] for ``layer`` (as :meth:`write` stores
        their keys) and return that of every slot up to the longest row → [B, H, key_length]."""
        if not self._keeps_state:
            raise ValueError("this cache keeps no key state: its scheme has none")
        return _store(self._layer_states[layer][plan.rows], plan, state.float())

    def commit(self, plan: CacheWrite) -> None:
        """Advance the rows' lengths once every layer has been written."""
        self.lengths[plan.rows] = plan.end

    def reset(self, row: int) -> None:
        """Forget row ``row``'s sequence (its slots are simply overwritten later)."""
        self.lengths[row] = 0

    def slots(self, row: int, length: int) -> tuple[Tensor, Tensor, Tensor | None]:
        """Row ``row``'s first ``length`` slots (views, no copy): keys and values, each
        [layers, heads, length, hd], and the key state [layers, heads, length] (None if the
        scheme keeps none)."""
        span = slice(0, length)
        states = self.states[:, row, :, span] if self._keeps_state else None
        return self.keys[:, row, :, span], self.values[:, row, :, span], states

    def fill(
        self, row: int, keys: Tensor, values: Tensor, states: Tensor | None, at: int = 0
    ) -> None:
        """Row ``row`` (reserved, holding ``at`` tokens) holds next the tokens whose ``keys``,
        ``values`` [layers, heads, n, hd] and ``states`` [layers, heads, n] are given (as
        :meth:`slots` gives them): its length becomes ``at`` + n, and its next token takes
        that position."""
        if at != int(self.lengths[row]):
            raise ValueError(f"row {row} holds {int(self.lengths[row])} tokens, not {at}")
        end = at + keys.shape[2]
        self.make_room(end)
        self.keys[:, row, :, at:end] = keys
        self.values[:, row, :, at:end] = values
        if self._keeps_state:
            assert states is not None  # what slots() gave for a cache of the same scheme
            self.states[:, row, :, at:end] = states
        self.lengths[row] = end

    def move_row(self, source: int, target: int) -> None:
        """Copy row ``source`` into row ``target`` (compacts a batch when a sequence leaves)."""
        if source == target:
            return
        length = int(self.lengths[source])
        self.keys[:, target, :, :length] = self.keys[:, source, :, :length]
        self.values[:, target, :, :length] = self.values[:, source, :, :length]
        if self._keeps_state:
            self.states[:, target, :, :length] = self.states[:, source, :, :length]
        self.lengths[target] = length


def zeros(shape: tuple[int, ...], device: torch.device | str, dtype: torch.dtype) -> Tensor:
    """A zeroed tensor of ``shape``; on the CPU, fresh pages from the operating system, which
    read as zeros and take memory only once written (a few at a time, as rows write their
    keys). ``torch.zeros`` writes every byte at once: the step in which a burst of 64 requests
    grew a server's cache from 32 rows to 64 took 100-250 ms, which the burst's first tokens
    waited for (docs/performance-log.md, fifteenth round)."""
    nbytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or nbytes == 0:
        return torch.zeros(shape, device=device, dtype=dtype)
    # Private and anonymous: memory of this process alone, unmapped when the tensor is freed.
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=dtype).view(shape)


def _store(slots: Tensor, plan: CacheWrite, new: Tensor) -> Tensor:
    """Write ``new`` [B, H, T, ...] into one layer's ``slots`` [B, H, length, ...] (a view of
    the cache's rows) where ``plan`` says; return the slots up to its key_length (a view)."""
    if plan.same_start is not None:
        slots[:, :, plan.same_start : plan.same_start + new.shape[2]] = new
    else:
        assert plan.scatter is not None
        row_index, token_index, slot = plan.scatter
        slots[row_index, :, slot] = new[row_index, :, token_index]
    return slots[:, :, : plan.key_length]


@dataclass(frozen=True)
class CacheWrite:
    """Where one forward pass writes: computed once, shared by all layers."""

    rows: slice
    positions: Tensor  # [B, T] position (= slot) of each new token, on the host
    end: Tensor  # [B] row lengths after the write
    key_length: int  # slots every row's queries may look at: the longest row after the write
    same_start: int | None  # the slot all rows start at when they do and none is padded:
    # each layer's write is then one slice
    scatter: tuple[Tensor, Tensor, Tensor] | None  # otherwise (row, token, slot) of every real
    # new token, on the cache's device, for one index_put per layer
    # A pass of one token per pass row where several may fill one cache row (the decode kernel's,
    # KVCache.entries): each pass row's cache row [B] int64, on the host; None: ``rows`` in order.
    slot_rows: Tensor | None = None
