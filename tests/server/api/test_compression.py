"""Responses are gzip-compressed when the client accepts it (a trace is megabytes of JSON), and
server-sent event streams are not: each event must reach the client when it is sent."""

from __future__ import annotations

import base64
import gzip

import httpx
import numpy as np

from tests.server.test_trace import PROMPT


def test_a_trace_is_compressed_and_decodes_to_the_same_json(client: httpx.Client) -> None:
    body = {"model": "rope", "prompt": PROMPT}
    with client.stream("POST", "/v1/trace", json=body, headers={"Accept-Encoding": "gzip"}) as r:
        raw = b"".join(r.iter_raw())
        assert r.status_code == 200 and r.headers["content-encoding"] == "gzip"
    plain = client.post("/v1/trace", json=body, headers={"Accept-Encoding": "identity"})
    assert "content-encoding" not in plain.headers
    assert gzip.decompress(raw) == plain.content
    assert len(raw) < len(plain.content) / 2


def test_a_stream_is_not_compressed_and_arrives_event_by_event(client: httpx.Client) -> None:
    body = {"model": "rope", "prompt": PROMPT, "max_tokens": 8, "stream": True}
    headers = {"Accept-Encoding": "gzip"}
    with client.stream("POST", "/v1/completions", json=body, headers=headers) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "content-encoding" not in response.headers
        first = next(chunk for chunk in response.iter_raw() if chunk)
    assert first.startswith(b"data: ")  # plain text as sent, not a gzip stream being buffered


def test_uint8_attention_is_the_lists_quantised(client: httpx.Client) -> None:
    body = {"model": "alibi", "prompt": PROMPT}
    lists = client.post("/v1/trace", json=body).json()
    packed = client.post("/v1/trace", json={**body, "attention_encoding": "uint8"}).json()
    assert packed["attention"] is None and lists["attention_uint8"] is None
    levels = np.frombuffer(base64.b64decode(packed["attention_uint8"]), dtype=np.uint8)
    # row-major lower triangles: layer, head, then query q's keys 0..q
    flat = [w for layer in lists["attention"] for head in layer for row in head for w in row]
    assert levels.shape == (len(flat),)
    np.testing.assert_allclose(levels / 255, flat, atol=0.5 / 255 + 1e-3 * 0.5, rtol=0)
    assert levels.max() > 128  # not all zeros: some weight is large
