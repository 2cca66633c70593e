"""``/v1/trace``'s score_parts and attribution, and ``POST /v1/patch``, over HTTP against the
tiny checkpoints: what each response holds, the 400s naming the field, and a flood of patches
that leaves eight streams their pace. The properties on the shipped checkpoints are in
tests/server/engine/test_explain.py."""

from __future__ import annotations

import threading
import time
from collections import Counter

import httpx
import numpy as np
import pytest

from server.api.explain import changed_sites
from server.api.schemas import MAX_PATCH_TOKENS
from tests.server.conftest import SCHEME_SETTINGS, Running
from tests.server.test_fair_share import GAP_P99, STREAM, STREAMS, gaps_beside

PROMPT = "To be, or not to be, that is the question"


def error_of(response: httpx.Response, status: int = 400) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


@pytest.mark.parametrize("scheme", sorted(SCHEME_SETTINGS))
def test_a_trace_splits_a_heads_scores_and_the_next_tokens_logit(
    client: httpx.Client, scheme: str
) -> None:
    body = {"model": scheme, "prompt": PROMPT, "attention": False, "attribution": True}
    trace = client.post("/v1/trace", json=body | {"score_parts": {"layer": 0, "head": 3}})
    assert trace.status_code == 200, trace.text
    answer = trace.json()
    parts, attribution = answer["score_parts"], answer["attribution"]
    assert (parts["layer"], parts["head"], parts["query"]) == (0, 3, len(answer["tokens"]) - 1)
    score = np.array(parts["score"], dtype=float)  # NaN: a key irope's window masks
    seen = ~np.isnan(score)
    position = np.array(parts["position"], dtype=float)
    assert np.allclose(np.array(parts["content"])[seen] + position[seen], score[seen], atol=1e-4)
    assert np.array_equal(np.isnan(position), ~seen)
    if parts["frequencies"] is not None:
        shares = np.sum(parts["frequencies"], axis=0)
        assert np.allclose(shares[seen], score[seen], atol=1e-4)
    total = sum(part["value"] for part in attribution["parts"])
    assert total == pytest.approx(attribution["logit"], abs=1e-3)
    plain = client.post("/v1/trace", json={"model": scheme, "prompt": PROMPT, "attention": False})
    assert plain.json()["score_parts"] is None and plain.json()["attribution"] is None


@pytest.mark.parametrize(
    ("changes", "param", "says"),
    [
        ({"score_parts": {"layer": 2, "head": 0}}, "score_parts", "score_parts.layer is 2"),
        ({"score_parts": {"layer": 0, "head": 4}}, "score_parts", "score_parts.head is 4"),
        ({"target": 3}, "target", "attribution: true"),
        ({"attribution": True, "target": 10**6}, "target", "outside"),
    ],
)
def test_a_bad_head_or_target_is_a_400_naming_it(
    client: httpx.Client, changes: dict, param: str, says: str
) -> None:
    body = {"model": "rope", "prompt": PROMPT, "attention": False, **changes}
    error = error_of(client.post("/v1/trace", json=body))
    assert error["param"] == param and says in error["message"], error


CLEAN = [0, 5, 6, 7, 8, 9, 10, 11]
CORRUPTED = [0, 5, 12, 7, 8, 9, 10, 11]


def test_a_patch_restores_all_at_the_last_stream_and_nothing_before_the_change(
    client: httpx.Client,
) -> None:
    response = client.post(
        "/v1/patch", json={"model": "rope", "clean": CLEAN, "corrupted": CORRUPTED}
    )
    assert response.status_code == 200, response.text
    patch = response.json()
    effect = np.array(patch["effect"])
    assert patch["streams"] == ["embedding", "layer 0", "layer 1"]
    assert effect.shape == (3, len(CLEAN))
    assert effect[-1, -1] == pytest.approx(1.0, abs=1e-4)
    assert not effect[:, :2].any()  # before the change both runs carry the same streams
    assert not effect[0, 3:].any()  # and so do the embeddings of the tokens they share
    assert effect[0, 2] != 0 and patch["clean_logit"] != patch["corrupted_logit"]
    assert [token["id"] for token in patch["corrupted_tokens"]] == CORRUPTED
    chosen = client.post(
        "/v1/patch", json={"model": "rope", "clean": CLEAN, "corrupted": CORRUPTED, "target": 9}
    ).json()
    assert chosen["target"]["id"] == 9 and chosen["effect"][-1][-1] == pytest.approx(1, abs=1e-4)


def test_the_sites_left_out_are_those_where_both_runs_agree() -> None:
    assert changed_sites([0, 1, 2, 3], [0, 1, 9, 3], 2) == [
        (0, 2),
        *((stream, position) for stream in (1, 2) for position in (2, 3)),
    ]
    assert changed_sites([0, 1], [0, 1], 4) == []


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"clean": "To be", "corrupted": "To be, or not"}, "corrupted", "same length"),
        ({"clean": CLEAN, "corrupted": CLEAN}, "corrupted", "the same tokens"),
        ({"clean": [0] + [5] * MAX_PATCH_TOKENS, "corrupted": CORRUPTED}, "clean", "128"),
        ({"clean": CLEAN, "corrupted": CORRUPTED, "target": 10**6}, "target", "outside"),
        ({"clean": CLEAN, "corrupted": [0, 10**6]}, "corrupted", "vocabulary"),
        ({"clean": CLEAN}, "corrupted", "Field required"),
    ],
)
def test_bad_patches_are_400s_naming_the_field(
    client: httpx.Client, body: dict, param: str, says: str
) -> None:
    error = error_of(client.post("/v1/patch", json={"model": "rope", **body}))
    assert error["param"] == param and says in error["message"], error


def test_a_patch_flood_leaves_eight_streams_their_pace(server: Running) -> None:
    statuses: Counter[int] = Counter()
    clean = [0] + [5, 6, 7] * 42  # 127 tokens: the longest patch, 2 × 126 + 1 sites
    corrupted = [0, 9, *clean[2:]]
    body = {"model": "rope", "clean": clean, "corrupted": corrupted}

    def flood(stop: threading.Event) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as client:
            deadline = time.monotonic() + 30
            while not stop.is_set() and time.monotonic() < deadline:
                response = client.post("/v1/patch", json=body)
                statuses[response.status_code] += 1
                if response.status_code == 429:
                    stop.wait(float(response.headers["retry-after"]))

    gaps, tokens = gaps_beside(server.url, flood, attackers=12)
    assert tokens == STREAMS * STREAM["max_tokens"]
    assert statuses[200] >= 4 and statuses[429] > 0
    assert set(statuses) == {200, 429}
    assert np.percentile(gaps, 99) < GAP_P99, f"p99 {np.percentile(gaps, 99):.3f} s"
