"""server/engine/explain.py on the shipped checkpoints: each split of an attention score adds
back up to the score the model used, each attribution to the served logit, and activation
patching restores what it should (all of it at the last stream's last position, none where
the two runs already agree)."""

from __future__ import annotations

import math
import time
from functools import cache
from pathlib import Path

import pytest
import torch

from model.checkpoint import load_checkpoint
from model.positional.t5 import relative_position_bucket
from model.sampling_params import SamplingParams
from model.transformer import Intervention, ResidualPatch
from server.engine.explain import ERASED_NOTE, MIXED_NOTE, patch_effects
from server.engine.loader import LoadedModel, prepare
from server.engine.trace import trace_document

SHIPPED = Path(__file__).resolve().parents[3] / "checkpoints"
MODELS = sorted(path.name for path in SHIPPED.iterdir() if (path / "config.json").is_file())
POSITION_TERMS = ("token_position", "position_token", "position_position")
PROMPT = "ROMEO: What light through yonder window breaks? It is the east, and Juliet"


@cache
def served(name: str) -> LoadedModel:
    model, tokenizer = load_checkpoint(SHIPPED / name, torch.device("cpu"), "float32")
    return prepare(name, name, model, tokenizer, None, time.perf_counter())


def prompt_ids(loaded: LoadedModel, text: str = PROMPT) -> list[int]:
    return [loaded.bos, *loaded.tokenizer.encode(text).ids]


def traced(name: str, **changes: object) -> dict:
    loaded = served(name)
    args: dict = {"attention": True, "top": 3, "limit": 256, **changes}
    return trace_document(loaded, prompt_ids(loaded), SamplingParams(), **args)


def close(values: list[float], expected: list[float] | torch.Tensor, atol: float) -> bool:
    return torch.allclose(torch.tensor(values), torch.as_tensor(expected).float(), atol=atol)


@pytest.mark.parametrize("name", MODELS)
def test_every_split_adds_up_to_the_score_the_softmax_took(name: str) -> None:
    layers = served(name).model.config.n_layers
    for layer, head in ((0, 1), (layers - 1, 3)):
        trace = traced(name, score_parts=(layer, head))
        parts = trace["score_parts"]
        score = torch.tensor(parts["score"])
        # the score is the one the model used: its softmax (or the weights a scheme puts in
        # its place: stick-breaking's) is the recorded attention row
        weights = trace["attention"][layer][head][-1]
        allowed = torch.ones(1, 1, 1, len(score), dtype=torch.bool)
        expected = served(name).model.positional.attention_weights(score[None, None, None], allowed)
        assert close(list(weights), expected.flatten(), atol=1e-3)
        assert parts["distance"] == list(range(len(score) - 1, -1, -1))
        if parts["content"] is None:  # added vectors past layer 0: no exact split
            assert parts["kind"] == "added" and layer > 0 and parts["note"] == MIXED_NOTE
            continue
        content, position = torch.tensor(parts["content"]), torch.tensor(parts["position"])
        assert close(parts["score"], content + position, atol=1e-4)
        if parts["kind"] == "rotation":
            shares = torch.tensor(parts["frequencies"])  # [pairs, T]
            assert close(parts["score"], shares.sum(0), atol=1e-4)
            assert len(parts["frequency"]) == shares.shape[0]
        if parts["kind"] == "added":
            assert close(parts["score"], sum(map(torch.tensor, parts["terms"].values())), 1e-4)
            assert close(parts["content"], parts["terms"]["token_token"], atol=0)
        if parts["kind"] in ("none", "weights"):  # stick-breaking: no position in its scores
            assert not position.any()
        elif name == "integer" and layer == 0:  # p·(1, 1, …, 1): LayerNorm removes the mean
            assert ERASED_NOTE in parts["note"]
            assert not any(any(parts["terms"][term]) for term in POSITION_TERMS)
        else:  # every other scheme with a signal moves some score
            assert position.abs().max() > 1e-3


def test_alibis_position_part_is_minus_slope_times_distance_exactly() -> None:
    slopes = served("alibi").model.positional.slopes.flatten()
    for head in range(4):
        parts = traced("alibi", score_parts=(2, head), attention=False)["score_parts"]
        distance = torch.tensor(parts["distance"], dtype=torch.float32)
        assert torch.equal(torch.tensor(parts["position"]), -slopes[head] * distance)


def test_t5s_position_part_is_its_bucket_bias_exactly() -> None:
    scheme = served("t5").model.positional
    parts = traced("t5", score_parts=(1, 2), attention=False)["score_parts"]
    distance = torch.tensor(parts["distance"])
    buckets = relative_position_bucket(
        distance, scheme.params.num_buckets, scheme.params.max_distance
    )
    assert torch.equal(torch.tensor(parts["position"]), scheme.bias_table[buckets, 2])


def test_ropes_fastest_pair_turns_by_its_frequency_and_prope_leaves_a_quarter_unrotated() -> None:
    rope = traced("rope", score_parts=(0, 0), attention=False)["score_parts"]
    prope = traced("prope", score_parts=(0, 0), attention=False)["score_parts"]
    assert rope["frequency"][0] == pytest.approx(1.0)  # θ_0 = base⁰: one radian a position
    assert all(f > 0 for f in rope["frequency"])
    head_dim = served("rope").model.config.head_dim
    assert len(rope["frequencies"]) == head_dim // 2 == len(prope["frequencies"])
    assert prope["frequency"].count(0.0) == head_dim // 8  # a quarter of the pairs (0.75 kept)


def test_a_dropped_layer_is_all_content() -> None:
    parts = traced("rope", score_parts=(1, 0), drop_positional=[1])["score_parts"]
    assert parts["kind"] == "none" and not any(parts["position"])


@pytest.mark.parametrize("name", MODELS)
def test_the_attribution_parts_sum_to_the_served_logit(name: str) -> None:
    trace = traced(name, attention=False, attribution=True)
    attribution = trace["attribution"]
    total = sum(part["value"] for part in attribution["parts"])
    assert total == pytest.approx(attribution["logit"], abs=1e-3)
    names = [part["name"] for part in attribution["parts"]]
    config = served(name).model.config
    assert len([n for n in names if ".H" in n]) == config.n_layers * config.n_heads
    assert ("position" in names) == (served(name).model.positional.kind == "added")
    # the default target is the most probable next token, the one the greedy stage keeps
    assert attribution["token"]["id"] == trace["next_token"]["stages"][0]["top"][0]["id"]
    chosen = traced(name, attention=False, attribution=True, target=7)["attribution"]
    assert chosen["token"]["id"] == 7
    assert sum(part["value"] for part in chosen["parts"]) == pytest.approx(
        chosen["logit"], abs=1e-3
    )


CLEAN = "ROMEO: Good night, good night! Parting is such sweet sorrow"
CORRUPTED = "HAMLET: Good night, good night! Parting is such sweet sorrow"


@pytest.mark.parametrize("name", ["rope", "alibi", "learned", "fox", "none"])
def test_patching_the_last_stream_restores_everything_and_a_shared_token_nothing(
    name: str,
) -> None:
    loaded = served(name)
    clean, corrupted = prompt_ids(loaded, CLEAN), prompt_ids(loaded, CORRUPTED)
    assert len(clean) == len(corrupted) and clean != corrupted
    last, layers = len(clean) - 1, loaded.model.config.n_layers
    shared = next(p for p in range(1, len(clean)) if clean[p] == corrupted[p])
    sites = [(layers, last), (0, shared), (layers, 1)]
    answer = patch_effects(loaded.model, loaded.vocab, clean, corrupted, None, sites)
    restored, unchanged, early = answer["effect"]
    assert restored == pytest.approx(1.0, abs=1e-4)
    assert unchanged == pytest.approx(0.0, abs=1e-4)  # the same embedding: nothing patched
    assert early == pytest.approx(0.0, abs=1e-4)  # a last layer's early position: no later read
    assert abs(answer["clean_logit"] - answer["corrupted_logit"]) > 1e-3
    empty = patch_effects(loaded.model, loaded.vocab, clean, corrupted, None, [])
    assert empty["effect"] == [] and empty["target"] == answer["target"]


def test_a_residual_patch_writes_only_its_rows_and_positions() -> None:
    model = served("rope").model
    tokens = torch.tensor([prompt_ids(served("rope"))] * 3)
    with torch.inference_mode():
        plain = model.traced_forward(tokens)
        values = torch.randn(2, model.config.d_model)
        # row 0 patched before layer 2 at position 4, row 2 after the last layer at position 6
        patch = ResidualPatch(torch.tensor([2, -1, 4]), torch.tensor([4, 0, 6]), values[[0, 0, 1]])
        patched = model.traced_forward(tokens, intervention=Intervention(patch=patch))
        expected = model.unembed(values[1])
    assert torch.equal(patched[1], plain[1])  # stream -1: no such stream, nothing written
    assert torch.equal(patched[0, :4], plain[0, :4]) and not torch.equal(patched[0], plain[0])
    assert torch.equal(patched[2, :6], plain[2, :6]) and torch.equal(patched[2, 7:], plain[2, 7:])
    assert torch.allclose(patched[2, 6], expected, atol=1e-5)
    assert math.isfinite(float(patched.sum()))
