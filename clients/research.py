"""A research client for an ``ordinal serve`` server: traces, score parts, activation patching,
logit attribution and surprisal as numpy arrays whose axes have names.

    from clients.research import Client

    client = Client()  # $ORDINAL_URL, else http://127.0.0.1:$ORDINAL_PORT, else :8000
    parts = client.score_parts("rope", "ROMEO: But, soft!", layer=1, head=0).parts
    parts.sel(part="position").values  # [T] the positional part of each key's score
    parts.coords["key"]  # [T] each key's distance from the query

Only HTTP is spoken here (no import of ``model``, ``server`` or torch), so the module runs
against any server it can reach. Every result keeps the JSON it came from (``.response``), so a
field this module does not turn into an array is still there. docs/research.ipynb draws one
figure of each kind with it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

from clients.stream import ServerError as StreamServerError
from clients.stream import default_url

Prompt = str | Sequence[int]  # text (the server puts <|bos|> first) or token ids, used as given
PARTS = ("score", "content", "position")
TERMS = ("token_token", "token_position", "position_token", "position_position")


@dataclass(frozen=True, eq=False)
class Named:
    """An array whose axes have names: ``values`` is indexed by ``dims`` in order, and
    ``coords[dim]`` labels each index along that axis (token texts, distances, part names).

    ``attrs`` holds the response's scalars that go with the array (a target token, a logit);
    ``response`` is the whole JSON answer it was read from.
    """

    values: np.ndarray
    dims: tuple[str, ...]
    coords: Mapping[str, list[Any] | np.ndarray]
    attrs: dict[str, Any] = field(default_factory=dict)
    response: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if self.values.ndim != len(self.dims):
            raise ValueError(f"{self.values.ndim}-d values for dims {self.dims}")
        for dim, labels in self.coords.items():
            size = self.values.shape[self.axis(dim)]
            if len(labels) != size:
                raise ValueError(f"{len(labels)} labels for {dim!r}, whose axis has {size}")

    @property
    def shape(self) -> dict[str, int]:
        return dict(zip(self.dims, self.values.shape, strict=True))

    def axis(self, dim: str) -> int:
        if dim not in self.dims:
            raise KeyError(f"no axis {dim!r}: the axes are {self.dims}")
        return self.dims.index(dim)

    def isel(self, **indices: int) -> Named:
        """The array at these indices, their axes dropped: ``isel(stream=-1)``."""
        values, dims, coords = self.values, list(self.dims), dict(self.coords)
        for dim, index in indices.items():
            if dim not in dims:
                raise KeyError(f"no axis {dim!r}: the axes are {tuple(dims)}")
            values = np.take(values, index, axis=dims.index(dim))
            dims.remove(dim)
            coords.pop(dim, None)
        return Named(values, tuple(dims), coords, self.attrs, self.response)

    def sel(self, **labels: Any) -> Named:
        """The array at the index whose label is each one given: ``sel(part="content")``. A
        label that is missing, or that labels several indices, is a KeyError (use ``isel``)."""
        indices = {}
        for dim, label in labels.items():
            found = [i for i, each in enumerate(self.coords[dim]) if each == label]
            if len(found) != 1:
                raise KeyError(f"{label!r} labels {len(found)} indices of {dim!r}, not one")
            indices[dim] = found[0]
        return self.isel(**indices)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        return np.asarray(self.values, dtype=dtype)

    def __repr__(self) -> str:
        axes = ", ".join(f"{dim}: {size}" for dim, size in self.shape.items())
        return f"Named({axes}; {self.values.dtype}; attrs {sorted(self.attrs)})"


@dataclass(frozen=True, eq=False)
class ScoreParts:
    """One head's pre-softmax scores of the last query against every key, split into what
    depends on content and what on position (``score_parts`` of ``POST /v1/trace``).

    ``parts``: ("part", "key") [3, T], parts score, content, position (NaN where the split does
    not exist here: ``note`` says why), keys labelled by their distance from the query.
    ``frequencies``: ("pair", "key") [pairs, T], rope's score as each rotation pair's share (they
    sum to the score), pairs labelled by their frequency in radians per position; None unless
    ``kind`` is "rotation". ``terms``: ("term", "key") [4, T], the four dot products of an added
    vector's scheme at layer 0 (token·token is the content); None elsewhere.
    """

    parts: Named
    frequencies: Named | None
    terms: Named | None
    kind: str  # the scheme's kind: rotation, bias, data-dependent, added, or none
    note: str
    response: dict[str, Any] = field(repr=False)


class ServerError(StreamServerError):
    """The server answered an error status: ``status``, and its ``message``, ``type``, ``param``
    (the request field at fault) and ``code``."""

    def __init__(self, status: int, error: dict[str, Any]) -> None:
        self.status = status
        self.message = str(error.get("message") or "")
        self.type, self.param, self.code = error.get("type"), error.get("param"), error.get("code")
        about = f" (param {self.param})" if self.param else ""
        super().__init__(f"server error {status}{about}: {self.message}")


class ServerUnreachable(ConnectionError):
    """Nothing answered at the client's URL (no server, or the wrong port)."""


class Client:
    """HTTP calls to one server; ``url`` and ``api_key`` default to ``$ORDINAL_URL`` (see
    :func:`clients.stream.default_url`) and ``$ORDINAL_API_KEY``; ``timeout``: seconds one answer
    may take (a 128-token patch takes a few). Use it in a ``with`` block, or ``close()`` it."""

    def __init__(
        self,
        url: str | None = None,
        api_key: str | None = None,
        timeout: float = 120.0,
    ) -> None:
        self.url = (url or default_url()).rstrip("/")
        api_key = api_key if api_key is not None else os.environ.get("ORDINAL_API_KEY")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.url,
            headers=headers,
            timeout=httpx.Timeout(timeout, connect=10.0),
        )

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """The JSON answer to ``method path`` with ``body``; a :class:`ServerError` on an error
        status, :class:`ServerUnreachable` when nothing listens at the URL."""
        try:
            response = self._http.request(method, path, json=body)
        except httpx.ConnectError as error:
            raise ServerUnreachable(f"cannot reach the server at {self.url}: {error}") from error
        if response.is_error:
            try:
                detail = response.json().get("error")
            except ValueError:  # not JSON: a proxy's HTML page, say
                detail = None
            if not isinstance(detail, dict):
                detail = {"message": response.text.strip() or response.reason_phrase}
            raise ServerError(response.status_code, detail)
        return response.json()

    def models(self) -> dict[str, dict[str, Any]]:
        """Each served model's ``GET /v1/models`` entry by name (``scheme``, ``context_length``:
        the trained length, ``max_context``: the longest prompt it takes, ...)."""
        entries: list[dict[str, Any]] = self.request("GET", "/v1/models")["data"]
        return {entry["id"]: entry for entry in entries}

    def tokenize(self, model: str, text: str) -> list[int]:
        """The ids ``model`` reads ``text`` as, <|bos|> first: cut them to a length, or edit
        one, and pass them as a prompt."""
        answer = self.request("POST", "/v1/tokenize", {"model": model, "prompt": text})
        ids: list[int] = answer["tokens"]
        return ids

    def trace(self, model: str, prompt: Prompt, **fields: Any) -> dict[str, Any]:
        """``POST /v1/trace``'s whole JSON; ``fields`` are the request's others (``attention``,
        ``ablate``, ``drop_positional``, ``logit_lens``, ``score_parts``, ...)."""
        body = {"model": model, "prompt": _ids(prompt), **fields}
        answer: dict[str, Any] = self.request("POST", "/v1/trace", body)
        return answer

    def score_parts(
        self, model: str, prompt: Prompt, layer: int, head: int, **fields: Any
    ) -> ScoreParts:
        """Head ``head`` of layer ``layer``: the last query's score of each key, split into
        content and position (see :class:`ScoreParts`). ``fields`` go to the trace as they are
        (an intervention, say); the attention weights are left out unless asked for."""
        fields = {"attention": False, **fields, "score_parts": {"layer": layer, "head": head}}
        response = self.trace(model, prompt, **fields)
        split = response["score_parts"]
        key = {"key": np.asarray(split["distance"])}
        rows = [_floats(split[part], len(split["score"])) for part in PARTS]
        parts = Named(np.stack(rows), ("part", "key"), {"part": list(PARTS), **key}, {}, response)
        frequencies = terms = None
        if split.get("frequencies") is not None:
            pairs = {"pair": np.asarray(split["frequency"], dtype=float)}
            values = np.asarray(split["frequencies"], dtype=float)
            frequencies = Named(values, ("pair", "key"), {**pairs, **key}, {}, response)
        if split.get("terms") is not None:
            values = np.asarray([split["terms"][term] for term in TERMS], dtype=float)
            terms = Named(values, ("term", "key"), {"term": list(TERMS), **key}, {}, response)
        note = split.get("note") or ""
        return ScoreParts(parts, frequencies, terms, split["kind"], note, response)

    def patch(
        self, model: str, clean: Prompt, corrupted: Prompt, target: int | None = None
    ) -> Named:
        """``POST /v1/patch``: ("stream", "position") [layers + 1, T], the share of the
        target's logit that patching that residual stream at that position from the clean run
        into the corrupted one restores (1 at the last stream's last position). Streams are
        labelled by name (embedding, layer 0, ...), positions by the clean tokens' text;
        ``attrs``: target, clean_logit, corrupted_logit."""
        body: dict[str, Any] = {"model": model, "clean": _ids(clean), "corrupted": _ids(corrupted)}
        if target is not None:
            body["target"] = target
        response = self.request("POST", "/v1/patch", body)
        coords = {
            "stream": list(response["streams"]),
            "position": [token["text"] for token in response["clean_tokens"]],
        }
        attrs = {name: response[name] for name in ("target", "clean_logit", "corrupted_logit")}
        values = np.asarray(response["effect"], dtype=float)
        return Named(values, ("stream", "position"), coords, attrs, response)

    def attribution(
        self, model: str, prompt: Prompt, target: int | None = None, **fields: Any
    ) -> Named:
        """The target's logit at the last position as the sum of what each part wrote into the
        residual stream: ("part",) labelled embedding, position, L0.H0 ... L0.mlp ..., bias (the
        parts a model has). ``attrs``: token (the target, default the argmax) and logit."""
        fields = {"attention": False, **fields, "attribution": True}
        if target is not None:
            fields["target"] = target
        response = self.trace(model, prompt, **fields)
        split = response["attribution"]
        names = [part["name"] for part in split["parts"]]
        values = np.asarray([part["value"] for part in split["parts"]], dtype=float)
        attrs = {"token": split["token"], "logit": split["logit"]}
        return Named(values, ("part",), {"part": names}, attrs, response)

    def surprisal(self, model: str, text: Prompt) -> Named:
        """−log₂ p(token | what precedes it) of every token of ``text``, scored by
        ``/v1/completions`` (echo, logprobs, no new tokens): ("position",) [T] in bits, NaN at
        <|bos|>; ``attrs["tokens"]``: each token's text."""
        body = {"model": model, "prompt": _ids(text), "max_tokens": 0, "echo": True, "logprobs": 0}
        response = self.request("POST", "/v1/completions", body)
        logprobs = response["choices"][0]["logprobs"]
        natural = _floats(logprobs["token_logprobs"], len(logprobs["tokens"]))
        bits = -natural / math.log(2)
        coords = {"position": np.arange(len(bits))}
        return Named(bits, ("position",), coords, {"tokens": logprobs["tokens"]}, response)


def _ids(prompt: Prompt) -> str | list[int]:
    """A prompt as JSON takes it: a tuple or array of ids becomes a list."""
    return prompt if isinstance(prompt, str) else [int(token) for token in prompt]


def _floats(values: Sequence[float | None] | None, length: int) -> np.ndarray:
    """[length] float64, NaN where the server sent null (or nothing at all)."""
    if values is None:
        return np.full(length, np.nan)
    return np.asarray([np.nan if value is None else value for value in values], dtype=float)
