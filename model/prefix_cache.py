"""Automatic prefix caching: the keys and values of recent prompts, kept in blocks for the next
prompt that begins with the same tokens.

A prompt is cut into blocks of ``block`` tokens (16, vLLM's default); block i is named by a
digest chained over every token before its end (:func:`block_digests`), so equal names mean
equal prefixes, and a block is reused only after all the blocks before it. The kept blocks sit
in one pool per tensor ([layers, heads, blocks·block, head_dim]: block s is the s-th run of
``block`` slots, laid out as the KV cache's rows are; grown by doubling up to
``capacity_tokens``), evicted least recently used first. A block's parent is touched after it
on every use, so eviction takes the ends of chains before their beginnings.

The KV cache keeps each row's sequence in contiguous slots, so a hit is a copy: the held
blocks are copied into the joining row's first slots (:meth:`PrefixCache.load`), and the row's
prefill starts after them. Positions of a prefix never change, so the copy is what a new pass
would compute, for every scheme whose ``prefix_stable`` says so (all but rope's dynamic
scaling, see ``model.positional.base``); a prompt's last token is always computed, since its
logits are the first draw.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import torch

from model.cache import KVCache, zeros
from model.config import ModelConfig
from model.positional import SCHEMES

BLOCK = 16  # tokens per block, as vLLM's


def block_digests(prompt_ids: list[int], block: int = BLOCK) -> list[bytes]:
    """One digest per full block of ``prompt_ids``: the i-th names tokens [0, (i+1)·block)."""
    digests, parent = [], b""
    for start in range(0, len(prompt_ids) - block + 1, block):
        tokens = array("q", prompt_ids[start : start + block]).tobytes()
        parent = hashlib.blake2b(parent + tokens, digest_size=16).digest()
        digests.append(parent)
    return digests


class PrefixCache:
    """At most ``capacity_tokens`` (rounded down to blocks) of kept prompt keys and values of
    one model."""

    def __init__(
        self,
        config: ModelConfig,
        capacity_tokens: int,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        block: int = BLOCK,
    ) -> None:
        self.block = block
        self.capacity = capacity_tokens // block  # blocks
        self._layout = (config.n_layers, config.key_value_heads, config.head_dim, device, dtype)
        self._key_dim = config.key_dim  # the head's width but for PoPE (twice it)
        self._keeps_state = SCHEMES[config.scheme].keeps_key_state
        self._slots: OrderedDict[bytes, int] = OrderedDict()  # digest → pool slot, LRU first
        self._free: list[int] = []
        # [layers, heads, slots·block, hd] (states: no hd, float32); empty until first stored
        self.keys = self.values = self.states = torch.empty(0)
        self._within = torch.arange(block)

    @property
    def allocated_tokens(self) -> int:
        return self.keys.shape[2] if self.keys.numel() else 0

    def match(self, digests: list[bytes], prompt_length: int) -> int:
        """How many of the prompt's first tokens are held: its leading held blocks, but never
        the whole prompt (the last token is fed, for the logits of the first draw)."""
        held = 0
        for digest in digests:
            if digest not in self._slots:
                break
            held += 1
        return max(0, min(held * self.block, prompt_length - 1))

    def load(self, digests: list[bytes], length: int, cache: KVCache, row: int) -> None:
        """Copy the held keys and values of the prompt's first ``length`` tokens (≤ what
        :meth:`match` said) into the empty cache row ``row``."""
        used = digests[: -(-length // self.block)]
        self._touch(used)
        # Runs of blocks that sit in consecutive pool slots are copied as one slice each,
        # straight into the row (a chain stored at once is one run).
        for first, slot, count in _runs([self._slots[digest] for digest in used]):
            start, end = first * self.block, min(length, (first + count) * self.block)
            pool = slice(slot * self.block, slot * self.block + end - start)
            states = self.states[:, :, pool] if self._keeps_state else None
            cache.fill(row, self.keys[:, :, pool], self.values[:, :, pool], states, at=start)

    def store(self, digests: list[bytes], cache: KVCache, row: int) -> None:
        """Keep the full blocks of the prompt whose whole length is in cache row ``row`` (the
        prompt of ``digests``), those not held already; the least recently used make room."""
        if self.capacity == 0:
            return
        held = [digest for digest in digests if digest in self._slots]
        self._touch(held)
        new = [(index, d) for index, d in enumerate(digests) if d not in self._slots]
        new = new[: self.capacity]
        if not new:
            return
        slots = sorted(self._take_slot() for _ in new)  # ascending: one run for load()
        for (_, digest), slot in zip(reversed(new), reversed(slots), strict=True):
            self._slots[digest] = slot  # inserted last to first: the first most recently used
        sources = self._token_slots([index for index, _ in new])  # the row's slots = positions
        targets = self._token_slots(slots)
        keys, values, states = cache.slots(row, len(digests) * self.block)
        for pool, kept in ((self.keys, keys), (self.values, values), (self.states, states)):
            if kept is not None:
                pool.index_copy_(2, targets, kept.index_select(2, sources).to(pool.dtype))

    def _token_slots(self, blocks: list[int]) -> torch.Tensor:
        """The slots of ``blocks`` (block b: slots b·block … b·block + block − 1), in order."""
        starts = torch.tensor(blocks).unsqueeze(1) * self.block
        return (starts + self._within).flatten().to(self.keys.device)

    def _touch(self, digests: list[bytes]) -> None:
        """Mark ``digests`` (a chain's blocks, in prompt order) used now, the first last."""
        for digest in reversed(digests):
            self._slots.move_to_end(digest)

    def _take_slot(self) -> int:
        """A pool slot for a new block: a free one, a new one (the pool doubles up to its
        capacity), or the least recently used block's."""
        if not self._free:
            allocated = self.allocated_tokens // self.block
            if allocated < self.capacity:
                self._grow(min(self.capacity, max(8, 2 * allocated)))
            else:
                _, slot = self._slots.popitem(last=False)
                return slot
        return self._free.pop()

    def _grow(self, blocks: int) -> None:
        """A pool of ``blocks`` blocks, holding the old one's."""
        layers, heads, head_dim, device, dtype = self._layout
        old = self.allocated_tokens // self.block
        shape = (layers, heads, blocks * self.block, head_dim)

        def grown(pool: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
            new = zeros(shape, device, dtype)
            if old:
                new[:, :, : old * self.block] = pool
            return new

        key_shape = (*shape[:-1], self._key_dim)
        self.keys, self.values = (
            grown(self.keys, key_shape, dtype),
            grown(self.values, shape, dtype),
        )
        if self._keeps_state:  # float32, as the cache keeps it
            self.states = grown(self.states, shape[:-1], torch.float32)
        self._free.extend(range(blocks - 1, old - 1, -1))  # pop() takes the lowest first


def _runs(slots: list[int]) -> list[tuple[int, int, int]]:
    """(first index, first slot, length) of each run of consecutive values in ``slots``."""
    runs: list[tuple[int, int, int]] = []
    for index, slot in enumerate(slots):
        if runs and runs[-1][1] + runs[-1][2] == slot:
            first, start, count = runs[-1]
            runs[-1] = (first, start, count + 1)
        else:
            runs.append((index, slot, 1))
    return runs
