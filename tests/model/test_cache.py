"""KVCache on its own: where each write lands, what it returns, and how rows are refused, moved
and reset, checked slot by slot against keys and values written by hand.

tests/model/test_transformer.py checks the same cache through the model (cached decoding equals
a full forward pass); these tests pin the bookkeeping that those comparisons rely on.
"""

from __future__ import annotations

import errno
import mmap
from typing import Any

import psutil
import pytest
import torch

import model.cache
from model.cache import CacheFull, CacheWrite, KVCache
from tests.model.conftest import tiny_config

CONFIG = tiny_config("rope")  # 2 layers, 4 heads of 8 dims
LAYERS, HEADS, HEAD_DIM = CONFIG.n_layers, CONFIG.n_heads, CONFIG.head_dim


def entries(batch: int, length: int, offset: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values [batch, heads, length, head_dim] in which no number repeats (and none is
    0, the value of a never-written slot); ``offset`` keeps separate calls apart."""
    count = batch * HEADS * length * HEAD_DIM
    keys = torch.arange(count, dtype=torch.float32).view(batch, HEADS, length, HEAD_DIM) + offset
    return keys, -keys


def write_every_layer(
    cache: KVCache, plan: CacheWrite, keys: torch.Tensor, values: torch.Tensor
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """What one forward pass does: write each layer (layer l's entries shifted by 10⁶·l, so the
    layers differ), then commit. Returns each layer's (keys, values) as ``write`` gave them."""
    seen = [
        cache.write(layer, plan, keys + 1e6 * layer, values - 1e6 * layer)
        for layer in range(LAYERS)
    ]
    cache.commit(plan)
    return seen


def test_a_new_cache_is_empty_and_allocated_as_asked() -> None:
    cache = KVCache(CONFIG, 3, 10)
    assert cache.rows == 3 and cache.max_length == 10
    assert cache.keys.shape == cache.values.shape == (LAYERS, 3, HEADS, 10, HEAD_DIM)
    assert not cache.keys.any() and not cache.values.any()
    assert cache.lengths.tolist() == [0, 0, 0]
    doubles = KVCache(CONFIG, 1, 4, dtype=torch.float64)
    assert doubles.keys.dtype == doubles.values.dtype == torch.float64
    elsewhere = KVCache(CONFIG, 1, 4, device="meta")
    assert elsewhere.keys.device.type == elsewhere.values.device.type == "meta"
    assert elsewhere.lengths.device.type == "cpu"  # lengths stay on the host


def test_rows_at_one_length_write_one_slice_and_see_every_slot_so_far() -> None:
    cache = KVCache(CONFIG, 3, 10)
    plan = cache.positions(slice(0, 3), 4)
    assert plan.positions.tolist() == [[0, 1, 2, 3]] * 3
    assert (plan.same_start, plan.scatter, plan.key_length) == (0, None, 4)
    assert plan.end.tolist() == [4, 4, 4]
    keys, values = entries(3, 4)
    first = write_every_layer(cache, plan, keys, values)
    for layer, (seen_keys, seen_values) in enumerate(first):
        assert torch.equal(seen_keys, keys + 1e6 * layer)
        assert torch.equal(seen_values, values - 1e6 * layer)
    assert cache.lengths.tolist() == [4, 4, 4]

    plan = cache.positions(slice(0, 3), 2)  # the next chunk continues at slot 4
    assert plan.positions.tolist() == [[4, 5]] * 3
    assert (plan.same_start, plan.key_length) == (4, 6)
    more_keys, more_values = entries(3, 2, offset=1e4)
    for layer, (seen_keys, seen_values) in enumerate(
        write_every_layer(cache, plan, more_keys, more_values)
    ):
        assert torch.equal(seen_keys, torch.cat((keys, more_keys), dim=2) + 1e6 * layer)
        assert torch.equal(seen_values, torch.cat((values, more_values), dim=2) - 1e6 * layer)
    assert not cache.keys[:, :, :, 6:].any() and not cache.values[:, :, :, 6:].any()


def test_lengths_advance_only_at_commit() -> None:
    cache = KVCache(CONFIG, 2, 8)
    plan = cache.positions(slice(0, 2), 3)
    cache.write(0, plan, *entries(2, 3))
    assert cache.lengths.tolist() == [0, 0]
    cache.commit(plan)
    assert cache.lengths.tolist() == [3, 3]


def test_rows_at_different_lengths_write_each_token_at_its_own_slot() -> None:
    cache = KVCache(CONFIG, 3, 10)
    cache.lengths[:] = torch.tensor([2, 5, 0])
    plan = cache.positions(slice(0, 3), 2)
    assert plan.positions.tolist() == [[2, 3], [5, 6], [0, 1]]
    assert plan.same_start is None and plan.scatter is not None
    assert plan.key_length == 7 and plan.end.tolist() == [4, 7, 2]
    keys, values = entries(3, 2)
    seen = write_every_layer(cache, plan, keys, values)
    for layer, (seen_keys, seen_values) in enumerate(seen):
        assert seen_keys.shape == seen_values.shape == (3, HEADS, 7, HEAD_DIM)
        for row, start in enumerate([2, 5, 0]):
            stored = cache.keys[layer, row, :, start : start + 2]
            assert torch.equal(stored, keys[row] + 1e6 * layer)
            assert torch.equal(
                cache.values[layer, row, :, start : start + 2], values[row] - 1e6 * layer
            )
            assert torch.equal(seen_keys[row, :, start : start + 2], stored)
            assert cache.keys[layer, row].count_nonzero() == stored.numel()  # nothing else written
    assert cache.lengths.tolist() == [4, 7, 2]


def test_entries_give_each_token_a_pass_row_at_its_rows_next_slots() -> None:
    """The decode kernel's plan: row b's counts[b] tokens as consecutive pass rows, each at the
    row's next slot; the lengths advance at commit, to each row's end."""
    cache = KVCache(CONFIG, 4, 10)
    cache.lengths[:] = torch.tensor([2, 5, 0, 7])
    plan = cache.entries([1, 1, 3])
    assert plan.slot_rows is not None and plan.slot_rows.tolist() == [0, 1, 2, 2, 2]
    assert plan.positions.tolist() == [[2], [5], [0], [1], [2]]
    assert plan.key_length == 6 and plan.end.tolist() == [3, 6, 3]
    cache.commit(plan)
    assert cache.lengths.tolist() == [3, 6, 3, 7]  # the row after them is left alone


@pytest.mark.parametrize("counts", [[], [1, 0], [2, -1]])
def test_entries_take_at_least_one_token_a_row(counts: list[int]) -> None:
    cache = KVCache(CONFIG, 2, 8)
    with pytest.raises(ValueError, match="at least one token"):
        cache.entries(counts)


def test_ragged_counts_write_only_real_tokens_and_pad_with_the_last_real_position() -> None:
    """Row 0 brings 3 tokens, row 1 none, row 2 one: padding is not written, keeps the row's last
    real position (never a phantom position past it), and does not advance the length."""
    cache = KVCache(CONFIG, 3, 10)
    cache.lengths[:] = torch.tensor([3, 1, 4])
    plan = cache.positions(slice(0, 3), 3, torch.tensor([3, 0, 1]))
    assert plan.positions.tolist() == [[3, 4, 5], [1, 1, 1], [4, 4, 4]]
    assert plan.same_start is None
    assert plan.end.tolist() == [6, 1, 5] and plan.key_length == 6
    keys, values = entries(3, 3)
    write_every_layer(cache, plan, keys, values)
    for layer in range(LAYERS):
        assert torch.equal(cache.keys[layer, 0, :, 3:6], keys[0] + 1e6 * layer)
        assert torch.equal(cache.values[layer, 0, :, 3:6], values[0] - 1e6 * layer)
        assert not cache.keys[layer, 1].any()
        assert torch.equal(cache.keys[layer, 2, :, 4], keys[2, :, 0] + 1e6 * layer)
        assert cache.keys[layer, 2].count_nonzero() == HEADS * HEAD_DIM
    assert cache.lengths.tolist() == [6, 1, 5]


def test_counts_on_rows_at_one_length_still_leave_the_padding_out() -> None:
    cache = KVCache(CONFIG, 2, 6)
    plan = cache.positions(slice(0, 2), 3, torch.tensor([3, 1]))
    assert plan.same_start is None and plan.positions.tolist() == [[0, 1, 2], [0, 0, 0]]
    keys, values = entries(2, 3)
    write_every_layer(cache, plan, keys, values)
    assert cache.keys[0, 1].count_nonzero() == HEADS * HEAD_DIM
    assert cache.lengths.tolist() == [3, 1]


@pytest.mark.parametrize("counts", [[-1, 2, 0], [1, 4, 0], [1, 2]])
def test_counts_must_give_every_row_between_none_and_all_new_tokens(counts: list[int]) -> None:
    cache = KVCache(CONFIG, 3, 10)
    with pytest.raises(
        ValueError, match=r"new_counts must give each of the 3 rows a count in 0\.\.3"
    ):
        cache.positions(slice(0, 3), 3, torch.tensor(counts))
    plan = cache.positions(slice(0, 3), 3, torch.tensor([0, 3, 0]))  # the limits are allowed
    assert plan.end.tolist() == [0, 3, 0]


def test_a_write_past_the_end_is_refused_before_anything_changes() -> None:
    cache = KVCache(CONFIG, 2, 10)
    write_every_layer(cache, cache.positions(slice(0, 2), 8), *entries(2, 8))
    keys = cache.keys.clone()
    with pytest.raises(CacheFull, match="holds 10 positions per row; this step needs 11"):
        cache.positions(slice(0, 2), 3)
    with pytest.raises(CacheFull, match="this step needs 11"):  # only row 1 goes past the end
        cache.positions(slice(0, 2), 3, torch.tensor([2, 3]))
    cache.lengths[0] = 5
    with pytest.raises(CacheFull, match="this step needs 11"):  # rows at different lengths
        cache.positions(slice(0, 2), 3)
    assert cache.lengths.tolist() == [5, 8] and torch.equal(cache.keys, keys)
    assert cache.positions(slice(0, 2), 2).key_length == 10  # exactly full is fine
    assert cache.positions(slice(0, 2), 3, torch.tensor([3, 2])).key_length == 10


def test_a_slice_of_rows_leaves_the_other_rows_alone() -> None:
    cache = KVCache(CONFIG, 4, 8)
    cache.lengths[:] = torch.tensor([1, 2, 2, 3])
    for counts in (None, torch.tensor([2, 1])):  # one slice, then scattered
        plan = cache.positions(slice(1, 3), 2, counts)
        assert plan.positions.shape == (2, 2)
        write_every_layer(cache, plan, *entries(2, 2))
    assert cache.lengths.tolist() == [1, 6, 5, 3]
    assert not cache.keys[:, [0, 3]].any() and not cache.values[:, [0, 3]].any()


def test_write_returns_views_of_the_cache() -> None:
    cache = KVCache(CONFIG, 2, 8)
    seen_keys, seen_values = cache.write(1, cache.positions(slice(0, 2), 3), *entries(2, 3))
    cache.keys[1, 0, 0, 0, 0] = 123.0
    cache.values[1, 0, 0, 0, 0] = 456.0
    assert seen_keys[0, 0, 0, 0] == 123.0 and seen_values[0, 0, 0, 0] == 456.0


def test_scatter_indices_live_on_the_cache_device_and_positions_on_the_host() -> None:
    cache = KVCache(CONFIG, 2, 8, device="meta")
    cache.lengths[:] = torch.tensor([1, 3])
    for plan in (
        cache.positions(slice(0, 2), 2),
        cache.positions(slice(0, 2), 2, torch.tensor([2, 1])),
    ):
        assert plan.scatter is not None
        assert [index.device.type for index in plan.scatter] == ["meta"] * 3
        assert plan.positions.device.type == plan.end.device.type == "cpu"


def test_move_row_copies_every_layer_and_the_length() -> None:
    """The shorter row 2 moves over the longer row 0 (as when a batch is compacted)."""
    cache = KVCache(CONFIG, 3, 6)
    write_every_layer(cache, cache.positions(slice(0, 1), 5), *entries(1, 5))
    moved_keys, moved_values = entries(1, 2, offset=1e4)
    write_every_layer(cache, cache.positions(slice(2, 3), 2), moved_keys, moved_values)
    source_keys, source_values = cache.keys[:, 2].clone(), cache.values[:, 2].clone()
    cache.move_row(2, 0)
    assert cache.lengths.tolist() == [2, 0, 2]
    assert torch.equal(cache.keys[:, 0, :, :2], source_keys[:, :, :2])
    assert torch.equal(cache.values[:, 0, :, :2], source_values[:, :, :2])
    assert torch.equal(cache.keys[:, 2], source_keys) and torch.equal(
        cache.values[:, 2], source_values
    )
    assert cache.positions(slice(0, 1), 1).positions.tolist() == [[2]]  # row 0 continues at 2
    before = cache.keys.clone()
    cache.move_row(1, 1)  # onto itself: nothing happens
    assert torch.equal(cache.keys, before) and cache.lengths.tolist() == [2, 0, 2]


def test_reset_empties_one_row() -> None:
    cache = KVCache(CONFIG, 3, 6)
    write_every_layer(cache, cache.positions(slice(0, 3), 4), *entries(3, 4))
    cache.reset(1)
    assert cache.lengths.tolist() == [4, 0, 4]
    plan = cache.positions(slice(0, 3), 1)
    assert plan.positions.tolist() == [[4], [0], [4]]  # row 1 starts again at position 0


def test_an_empty_batch_plans_nothing_and_never_fills_the_cache() -> None:
    cache = KVCache(CONFIG, 2, 4)
    plan = cache.positions(slice(0, 0), 4)  # as many tokens as the cache holds
    assert plan.positions.shape == (0, 4) and plan.key_length == 4
    ragged = cache.positions(slice(0, 0), 4, torch.zeros(0, dtype=torch.long))
    assert ragged.positions.shape == (0, 4) and ragged.key_length == 0  # the longest of no rows
    assert cache.lengths.tolist() == [0, 0]


def test_a_growing_cache_holds_what_a_full_one_holds_and_shrinks_when_empty() -> None:
    full = KVCache(CONFIG, 4, 12)
    growing = KVCache(CONFIG, 4, 12, reserve=(1, 2))
    assert growing.allocated == (1, 2) and growing.rows == 4
    assert growing.keys.shape == (LAYERS, 1, HEADS, 2, HEAD_DIM)
    seen = {}
    for step, (rows, length) in enumerate([(1, 3), (3, 1), (3, 4), (4, 1)]):
        growing.reserve(rows, 0)
        keys, values = entries(rows, length, offset=1000.0 * step)
        for name, cache in (("full", full), ("growing", growing)):
            plan = cache.positions(slice(0, rows), length)
            seen[name] = write_every_layer(cache, plan, keys, values)
        for (full_keys, full_values), (grown_keys, grown_values) in zip(
            seen["full"], seen["growing"], strict=True
        ):
            assert torch.equal(full_keys, grown_keys) and torch.equal(full_values, grown_values)
    assert growing.allocated == (4, 12)  # rows 1 → 3 → 4; length 2 → 4 → 8 → 12 (the most)
    assert torch.equal(growing.lengths, full.lengths)
    with pytest.raises(CacheFull):
        growing.positions(slice(0, 1), 4)  # 9 + 4 positions: past the most it holds
    growing.release()  # rows still hold sequences: nothing is dropped
    assert growing.allocated == (4, 12)
    for row in range(4):
        growing.reset(row)
    growing.release()
    assert growing.allocated == (1, 2) and not growing.keys.any()


def test_reserve_grows_rows_and_length_together_in_one_reallocation() -> None:
    """Where memory is taken when allocated (a GPU's policy, checked here on the CPU), each
    dimension that must grow at least doubles (up to the most), both in one reallocation that
    keeps what the rows hold; a reservation that fits changes nothing."""
    cache = KVCache(CONFIG, 8, 40, reserve=(1, 4))
    cache.grows_to_most = False
    keys, values = entries(1, 3)
    write_every_layer(cache, cache.positions(slice(0, 1), 3), keys, values)
    generation = cache.generation
    cache.reserve(1, 4)
    assert cache.generation == generation
    cache.reserve(3, 5)  # rows past double, length doubled
    assert cache.allocated == (3, 8) and cache.generation == generation + 1
    cache.reserve(4, 30)  # rows doubled, length past double
    assert cache.allocated == (6, 30) and cache.generation == generation + 2
    for layer in range(LAYERS):
        assert torch.equal(cache.keys[layer, 0, :, :3], keys[0] + 1e6 * layer)
        assert torch.equal(cache.values[layer, 0, :, :3], values[0] - 1e6 * layer)
    assert not cache.keys[:, 1:].any() and not cache.keys[:, :, :, 3:].any()
    cache.reserve(7, 31)
    assert cache.allocated == (8, 40)  # doubling stops at the most
    with pytest.raises(CacheFull):
        cache.reserve(1, 41)


def test_on_the_cpu_the_first_growth_goes_to_the_most_keeping_what_the_rows_hold() -> None:
    cache = KVCache(CONFIG, 8, 40, reserve=(1, 4))
    assert cache.grows_to_most
    keys, values = entries(1, 3)
    write_every_layer(cache, cache.positions(slice(0, 1), 3), keys, values)
    generation = cache.generation
    cache.reserve(2, 4)
    assert cache.allocated == (8, 40) and cache.generation == generation + 1
    cache.reserve(8, 40)  # no growth ever after
    assert cache.generation == generation + 1
    for layer in range(LAYERS):
        assert torch.equal(cache.keys[layer, 0, :, :3], keys[0] + 1e6 * layer)
        assert torch.equal(cache.values[layer, 0, :, :3], values[0] - 1e6 * layer)
    assert not cache.keys[:, 1:].any() and not cache.keys[:, :, :, 3:].any()


def test_a_most_the_os_will_not_map_is_grown_to_by_doubling(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A cache whose most is more than the machine's memory (a large model's long context): the
    OS refuses to map it at once, and the cache doubles instead, as on a GPU."""
    cache = KVCache(CONFIG, 8, 40, reserve=(1, 4))
    most = cache.keys.element_size() * LAYERS * 8 * HEADS * 40 * HEAD_DIM
    real_mmap = mmap.mmap

    def refusing(fileno: int, length: int, **kwargs: Any) -> mmap.mmap:
        if length >= most:
            raise OSError(errno.ENOMEM, "Cannot allocate memory")
        return real_mmap(fileno, length, **kwargs)

    monkeypatch.setattr(mmap, "mmap", refusing)
    keys, values = entries(1, 3)
    write_every_layer(cache, cache.positions(slice(0, 1), 3), keys, values)
    cache.reserve(3, 5)
    assert cache.allocated == (3, 8) and not cache.grows_to_most
    assert torch.equal(cache.keys[0, 0, :, :3], keys[0])


def test_a_growth_on_the_cpu_takes_memory_only_where_rows_are_written() -> None:
    """The grown tensors are fresh pages that read as zeros and take memory only once written
    (model.cache.zeros): a growth to the most costs the copy of what the cache held, not the
    zeroing of everything it may hold."""
    process = psutil.Process()
    cache = KVCache(CONFIG, 64, 4096, reserve=(1, 4))
    most = 2 * cache.keys.element_size() * LAYERS * 64 * HEADS * 4096 * HEAD_DIM  # 128 MiB
    before = process.memory_info().rss
    cache.reserve(64, 4096)
    assert cache.allocated == (64, 4096)
    assert process.memory_info().rss - before < most / 16
    keys, values = entries(1, 4096)
    write_every_layer(cache, cache.positions(slice(0, 1), 4096), keys, values)
    row = most / 64  # keys and values of one row: now resident
    assert row <= process.memory_info().rss - before < most / 8
    assert torch.equal(cache.keys[1, 0], keys[0] + 1e6)
    assert not cache.keys[:, 1:].any() and not cache.values[:, 1:].any()


def test_a_key_state_is_kept_like_the_keys_through_writes_growth_and_moves() -> None:
    """FoX's per-head scalar per slot: written where the plan says (ragged rows too), returned
    for every slot so far, kept when the cache grows, moved with its row; no other scheme's
    cache holds one."""
    cache = KVCache(tiny_config("fox"), 3, 12, reserve=(1, 2))
    cache.grows_to_most = False  # growing twice, as on a GPU
    assert cache.states.shape == (LAYERS, 1, HEADS, 2)
    assert KVCache(CONFIG, 3, 12).states.numel() == 0
    with pytest.raises(ValueError, match="no key state"):
        KVCache(CONFIG, 3, 12).write_key_state(0, cache.positions(slice(0, 1), 1), torch.ones(1))
    cache.reserve(3, 0)
    written = torch.zeros(3, HEADS, 12)
    for counts in ([3, 1, 5], [1, 1, 1], [2, 4, 0]):
        start = cache.lengths.clone()
        plan = cache.positions(slice(0, 3), max(counts), torch.tensor(counts))
        state = torch.randn(3, HEADS, max(counts))
        for layer in range(LAYERS):
            seen = cache.write_key_state(layer, plan, state + layer)
            assert seen.shape == (3, HEADS, plan.key_length)
        cache.commit(plan)
        for row, count in enumerate(counts):
            written[row, :, start[row] : start[row] + count] = state[row, :, :count]
        for row, length in enumerate(cache.lengths.tolist()):
            for layer in range(LAYERS):
                got = cache.states[layer, row, :, :length]
                assert torch.equal(got, written[row, :, :length] + layer)
    assert cache.allocated == (3, 10)  # grown from 1 × 2: rows 1 → 3, length 2 → 5 → 10
    cache.move_row(2, 0)
    for layer in range(LAYERS):  # row 0 now holds what row 2 held (not the other way round)
        assert torch.equal(cache.states[layer, 0, :, :5], written[2, :, :5] + layer)


@pytest.mark.parametrize("scheme", ["rope", "fox"])
def test_a_row_filled_from_another_cache_holds_what_it_held_and_continues_after_it(
    scheme: str,
) -> None:
    """``slots`` gives a row's first slots (views), ``fill`` puts them in an empty row of a
    growing cache (the prefix cache's copy): same keys, values and key states, the row's
    length set, the next write at the next position, the other rows untouched."""
    config = tiny_config(scheme)
    source, target = KVCache(config, 2, 12), KVCache(config, 3, 12, reserve=(3, 2))
    keys, values = entries(2, 7)
    plan = source.positions(slice(0, 2), 7)
    write_every_layer(source, plan, keys, values)
    if scheme == "fox":
        for layer in range(LAYERS):
            source.write_key_state(layer, plan, keys[..., 0] + layer)
    kept_keys, kept_values, kept_states = source.slots(1, 5)
    assert kept_keys.shape == (LAYERS, HEADS, 5, HEAD_DIM)
    assert kept_keys.data_ptr() == source.keys[:, 1].data_ptr()  # a view, no copy
    assert (kept_states is None) == (scheme != "fox")
    target.fill(2, kept_keys, kept_values, kept_states)
    assert target.lengths.tolist() == [0, 0, 5]
    assert target.allocated[1] >= 5  # grown to hold them
    assert torch.equal(target.keys[:, 2, :, :5], source.keys[:, 1, :, :5])
    assert torch.equal(target.values[:, 2, :, :5], source.values[:, 1, :, :5])
    assert not target.keys[:, :2].any() and not target.values[:, :2].any()
    if scheme == "fox":
        assert torch.equal(target.states[:, 2, :, :5], source.states[:, 1, :, :5])
    assert target.positions(slice(2, 3), 2).positions.tolist() == [[5, 6]]
    target.make_room(12)
    assert target.allocated == (3, 12)
    with pytest.raises(CacheFull):
        target.make_room(13)


def test_allocated_can_be_read_at_every_moment_of_a_shrink(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine's metrics (another thread) read ``allocated`` whenever they like: a shrink
    must swap whole tensors, never leave an empty one behind for that read to trip on."""
    cache = KVCache(CONFIG, 4, 12, reserve=(1, 2))
    cache.reserve(4, 0)
    cache.positions(slice(0, 4), 6)  # grown to (4, 12); nothing committed, so it may shrink
    assert cache.grown and not cache.lengths.any()
    seen_during: list[tuple[int, int]] = []
    zeros = model.cache.zeros

    def reading_zeros(*args: Any) -> torch.Tensor:
        seen_during.append(cache.allocated)  # what the other thread would see right now
        return zeros(*args)

    monkeypatch.setattr(model.cache, "zeros", reading_zeros)
    cache.release()
    monkeypatch.undo()
    assert seen_during and set(seen_during) == {(4, 12)}
    assert cache.allocated == (1, 2) and not cache.keys.any()
