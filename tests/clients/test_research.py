"""clients/research.py against a real ``ordinal serve`` app of tiny random checkpoints, and
docs/research.ipynb executed by nbclient against the same server."""

from __future__ import annotations

import math
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import nbformat
import numpy as np
import pytest
from nbclient import NotebookClient

from clients.research import TERMS, Client, Named, ServerError, ServerUnreachable
from tests.server.conftest import Running, free_socket, running_server, wait_for
from tests.server.conftest import test_settings as server_settings

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "docs" / "research.ipynb"
# One scheme of each kind the notebook and the tests read: rotation, bias, added vectors.
MODELS = ["rope", "alibi", "learned"]
PROMPT = "To be, or not to be, that is the question"
# One word apart, the same length in the tiny tokenizer (and in the shipped one).
CLEAN, CORRUPTED = "ROMEO: I love thee, and thou art my", "ROMEO: I kiss thee, and thou art my"


@pytest.fixture(scope="module")
def server(checkpoints: Path) -> Iterator[Running]:
    settings = server_settings(checkpoints, models=MODELS)
    with running_server(settings, wait_ready=False) as running:
        # Longer than running_server's own wait: on a busy shared machine loading took ~30 s.
        service = running.service
        wait_for(lambda: service.settled, "the models to load", timeout=180)
        assert service.ready, service.health()
        yield running


@pytest.fixture
def client(server: Running) -> Iterator[Client]:
    with Client(server.url) as client:
        yield client


def softmax(scores: np.ndarray) -> np.ndarray:
    weights = np.exp(scores - scores.max())
    return weights / weights.sum()


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("layer", [0, 1])
def test_score_parts_sum_to_the_score_that_the_attention_is_the_softmax_of(
    client: Client, model: str, layer: int
) -> None:
    split = client.score_parts(model, PROMPT, layer=layer, head=1, attention=True)
    length = len(client.tokenize(model, PROMPT))
    parts = split.parts
    assert parts.dims == ("part", "key") and parts.shape == {"part": 3, "key": length}
    assert list(parts.coords["key"]) == list(range(length - 1, -1, -1))
    score, content, position = (parts.sel(part=part).values for part in parts.coords["part"])
    # The last query's weights in the trace of the same request (rounded to 4 digits).
    weights = split.response["attention"][layer][1][-1]
    np.testing.assert_allclose(softmax(score), weights, rtol=1e-3, atol=1e-4)
    if model == "learned" and layer == 1:  # added vectors mix past layer 0: no split
        assert np.isnan(content).all() and np.isnan(position).all() and split.note
    else:
        np.testing.assert_allclose(content + position, score, atol=1e-4)


def test_rope_frequencies_are_its_rotation_and_sum_to_the_score(client: Client) -> None:
    split = client.score_parts("rope", PROMPT, layer=1, head=2)
    assert split.kind == "rotation" and split.terms is None
    pairs = split.frequencies
    assert pairs is not None and pairs.dims == ("pair", "key")
    np.testing.assert_allclose(pairs.values.sum(axis=0), split.parts.isel(part=0).values, atol=1e-4)
    frequency = np.asarray(pairs.coords["pair"])
    assert (np.diff(frequency) < 0).all(), "pair 0 is the fastest"
    # The trace's rotation angle at position 1 is one step of each pair's frequency.
    np.testing.assert_allclose(split.response["rotation"][1], frequency, rtol=1e-5)


def test_alibi_position_part_is_its_bias_linear_in_distance(client: Client) -> None:
    split = client.score_parts("alibi", PROMPT, layer=0, head=3)
    assert split.kind == "bias" and split.frequencies is None and split.terms is None
    position = split.parts.sel(part="position").values
    distance = np.asarray(split.parts.coords["key"])
    slope = position[distance == 1][0]
    assert slope < 0
    np.testing.assert_allclose(position, slope * distance, rtol=1e-5, atol=1e-6)


def test_learned_layer_0_splits_into_four_terms(client: Client) -> None:
    split = client.score_parts("learned", PROMPT, layer=0, head=0)
    assert split.kind == "added" and split.terms is not None
    terms = split.terms
    assert terms.coords["term"] == list(TERMS) and TERMS[0] == "token_token"
    np.testing.assert_allclose(terms.values.sum(axis=0), split.parts.isel(part=0).values, atol=1e-4)
    np.testing.assert_allclose(terms.isel(term=0).values, split.parts.sel(part="content").values)


@pytest.mark.parametrize("field", ["layer", "head"])
def test_a_head_the_model_lacks_is_an_error_naming_the_field(client: Client, field: str) -> None:
    head = {"layer": 1, "head": 0, field: 9}
    with pytest.raises(ServerError) as caught:
        client.score_parts("rope", PROMPT, **head)
    assert caught.value.status == 400 and caught.value.param == "score_parts"
    assert f"score_parts.{field}" in caught.value.message
    assert f"score_parts.{field}" in str(caught.value)


def test_patch_restores_all_at_the_last_stream_and_nothing_before_it(client: Client) -> None:
    effect = client.patch("rope", CLEAN, CORRUPTED)
    clean = client.tokenize("rope", CLEAN)
    assert effect.dims == ("stream", "position")
    assert effect.coords["stream"] == ["embedding", "layer 0", "layer 1"]
    assert effect.coords["position"] == [t["text"] for t in effect.response["clean_tokens"]]
    assert effect.shape == {"stream": 3, "position": len(clean)}
    last = effect.isel(stream=-1).values
    assert last[-1] == pytest.approx(1, abs=1e-4)
    # The last layer's output at an earlier position is read by nothing after it.
    np.testing.assert_allclose(last[:-1], 0, atol=1e-4)
    # The target's clean logit is the one attribution explains.
    target = effect.attrs["target"]["id"]
    explained = client.attribution("rope", CLEAN, target=target)
    assert explained.attrs["logit"] == pytest.approx(effect.attrs["clean_logit"], abs=1e-3)


def test_patch_of_two_lengths_is_an_error_naming_corrupted(client: Client) -> None:
    with pytest.raises(ServerError) as caught:
        client.patch("rope", CLEAN, CORRUPTED + " own")
    assert caught.value.status == 400 and caught.value.param == "corrupted"


@pytest.mark.parametrize("model", ["rope", "learned"])
def test_attribution_parts_sum_to_the_logit_of_the_most_probable_token(
    client: Client, model: str
) -> None:
    parts = client.attribution(model, PROMPT)
    assert parts.dims == ("part",)
    assert parts.values.sum() == pytest.approx(parts.attrs["logit"], abs=1e-3)
    heads = [f"L{layer}.H{head}" for layer in range(2) for head in range(4)]
    names = set(parts.coords["part"])
    assert {"embedding", "L0.mlp", "L1.mlp", *heads} <= names
    assert ("position" in names) == (model == "learned")
    logits = parts.response["next_token"]["stages"][0]
    assert logits["name"] == "logits" and parts.attrs["token"]["id"] == logits["top"][0]["id"]


def test_attribution_of_a_token_outside_the_vocabulary_names_target(client: Client) -> None:
    with pytest.raises(ServerError) as caught:
        client.attribution("rope", PROMPT, target=10**6)
    assert caught.value.status == 400 and caught.value.param == "target"


def test_surprisal_is_each_tokens_logprob_in_bits_as_the_trace_has_it(client: Client) -> None:
    bits = client.surprisal("alibi", PROMPT)
    ids = client.tokenize("alibi", PROMPT)
    assert bits.dims == ("position",) and bits.shape == {"position": len(ids)}
    assert list(bits.coords["position"]) == list(range(len(ids)))
    assert math.isnan(bits.values[0]) and not np.isnan(bits.values[1:]).any()
    logprobs = bits.response["choices"][0]["logprobs"]["token_logprobs"]
    np.testing.assert_allclose(bits.values[1:], -np.asarray(logprobs[1:]) / math.log(2))
    traced = client.trace("alibi", ids, attention=False)["surprisal"]
    np.testing.assert_allclose(bits.values[1:], traced[1:], rtol=1e-3, atol=1e-4)
    assert bits.attrs["tokens"][0] == "<|bos|>"


def test_an_unknown_model_is_an_error_with_the_servers_message(client: Client) -> None:
    with pytest.raises(ServerError) as caught:
        client.surprisal("no-such-model", PROMPT)
    assert caught.value.status == 404 and "no-such-model" in caught.value.message


def test_nothing_listening_is_server_unreachable() -> None:
    sock = free_socket()
    url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    sock.close()  # the port is free again, and nothing listens on it
    with Client(url) as client, pytest.raises(ServerUnreachable, match="cannot reach"):
        client.models()


def test_named_selects_by_label_and_by_index() -> None:
    values = np.arange(6.0).reshape(2, 3)
    named = Named(values, ("stream", "position"), {"stream": ["a", "b"], "position": [5, 6, 6]})
    assert named.sel(stream="b").values.tolist() == [3.0, 4.0, 5.0]
    assert named.sel(stream="b").dims == ("position",)
    assert named.isel(stream=0, position=-1).values == 2.0
    assert np.asarray(named).shape == (2, 3)
    with pytest.raises(KeyError, match="labels 2 indices"):
        named.sel(position=6)
    with pytest.raises(ValueError, match="3 labels"):
        Named(values.T, ("stream", "position"), {"stream": ["a", "b", "c"], "position": [1, 2, 3]})


def test_imports_no_model_server_or_torch() -> None:
    check = (
        "import sys, clients.research; "
        "print(sorted(m for m in ('torch', 'model', 'server') if m in sys.modules))"
    )
    result = subprocess.run(
        [sys.executable, "-c", check], capture_output=True, text=True, cwd=REPO, timeout=60
    )
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr


def test_the_notebook_runs_against_a_server_and_draws_its_figures(
    server: Running, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # The kernel is a child process: it reads the server from the environment it inherits.
    monkeypatch.setenv("ORDINAL_URL", server.url)
    monkeypatch.delenv("MPLBACKEND", raising=False)  # the inline backend draws the PNGs
    # Its connection file and IPython's profile go here, not into a home that may be read-only.
    monkeypatch.setenv("JUPYTER_RUNTIME_DIR", str(tmp_path / "runtime"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert all(not cell.outputs and cell.execution_count is None for cell in code), (
        "commit the notebook without outputs"
    )
    resources = {"metadata": {"path": str(REPO)}}
    NotebookClient(notebook, timeout=120, kernel_name="python3", resources=resources).execute()
    outputs = [output for cell in code for output in cell.outputs]
    errors = [output for output in outputs if output.output_type == "error"]
    assert errors == []
    figures = [output for output in outputs if "image/png" in output.get("data", {})]
    assert len(figures) == 5
