"""bench.bound's true bound counts what a decode step must read: every weight once and each
row's cached keys and values (checked against the model's parameters and a real cache)."""

from __future__ import annotations

from bench.bound import CONTEXT, step_bytes
from model.cache import KVCache
from tests.model.conftest import random_model


def test_a_step_reads_each_weight_once_and_every_rows_cache() -> None:
    model = random_model("rope")  # tied embedding, no positional parameters
    for batch in (1, 3):
        read = step_bytes(model, batch, CONTEXT, element=4)
        assert read["weights"] == 4 * model.num_parameters()
        cache = KVCache(model.config, batch, CONTEXT)
        assert read["cache"] == (cache.keys.numel() + cache.values.numel()) * 4


def test_an_untied_embedding_adds_only_the_rows_it_looks_up() -> None:
    model = random_model("rope", tie_embeddings=False)
    embedding = model.token_embedding.weight.numel()
    for batch in (1, 3):
        read = step_bytes(model, batch, CONTEXT, element=2)
        rows = batch * model.config.d_model
        assert read["weights"] == 2 * (model.num_parameters() - embedding + rows)
