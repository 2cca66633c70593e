"""The decode backend is chosen once per model, device and kernel variant (model.backend): the
CPU kernel exactly for the models it can run, declared by each scheme, never by its name; the
torch blocks, with a logged reason, for everything else. The sampler's fields likewise: each one
is applied by a path or refused, never drawn past."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

import model.backend as backend
import model.kernels as kernels
from model.backend import Backend, backend_of
from model.cache import KVCache
from model.kernels import decode_step
from model.positional import SCHEMES
from model.positional.base import KernelBias, LayerBias
from model.positional.fox import ForgettingPositions
from model.sampling import _PATHS, ADJUSTMENTS, _path
from model.sampling_params import HOW_TO_DRAW, NEUTRAL, SamplingParams
from tests.model.conftest import random_model, random_tokens

# Schemes the kernel refuses by declaring so: irope's schedule rotates some layers only, and the
# kernel applies one rotation to every layer.
# stick-breaking's weights are not the kernel's softmax; PoPE's keys are twice a head's width
TORCH_ONLY = {"irope", "stickbreaking", "pope", "path", "pathfox"}


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_registered_scheme_declares_what_the_kernel_computes(scheme: str) -> None:
    """The registry: a scheme whose signal is a pass's (vector, rotation, bias) takes the
    kernel as it is; a data-dependent one only by naming its own bias (fox's, cope's); one the
    kernel cannot run says None."""
    cls = SCHEMES[scheme]
    if scheme in TORCH_ONLY:
        assert cls.kernel_bias is None
    elif cls.data_dependent:
        assert cls.kernel_bias in (KernelBias.FORGETTING, KernelBias.CONTEXTUAL)
    else:
        assert cls.kernel_bias is KernelBias.PASS


@pytest.mark.usefixtures("every_isa")
@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_every_scheme_decodes_on_the_kernel_where_its_variant_is_built(scheme: str) -> None:
    model = random_model(scheme, seed=1).eval()
    if scheme in TORCH_ONLY:
        assert backend.choose(model).why.endswith(
            "declares no kernel bias (PositionalScheme.kernel_bias)"
        )
        assert backend_of(model) is Backend.TORCH
        return
    assert backend_of(model) is Backend.CPU_KERNEL
    with kernels.using(None):  # ORDINAL_CPU_ISA=torch: chosen again for the other variant
        assert backend_of(model) is Backend.TORCH


class Unknown(ForgettingPositions):
    """A new data-dependent scheme whose class says nothing of the kernel: its bias is its own."""

    name = "unknown"

    def layer_bias(self, *args: object, **kwargs: object) -> LayerBias | None:
        return None


def test_a_scheme_that_declares_nothing_decodes_in_torch_with_a_logged_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert Unknown.kernel_bias is None  # __init_subclass__: data-dependent, nothing named
    model = random_model("fox", seed=2).eval()
    model.positional.__class__ = Unknown
    with caplog.at_level(logging.INFO, logger="ordinal.backend"):
        assert backend_of(model) is Backend.TORCH
    assert "declares no kernel bias" in caplog.text
    assert not decode_step.applies(model, torch.zeros(2, 1, dtype=torch.long))


@pytest.mark.parametrize(
    ("change", "why"),
    [
        (lambda m: m.to(torch.bfloat16), "torch.bfloat16 weights"),
        (lambda m: setattr(m, "config", dataclasses.replace(m.config, qk_norm=True)), "QK-norm"),
    ],
    ids=["bfloat16", "qk-norm"],
)
def test_a_model_the_kernel_cannot_run_decodes_in_torch(change: object, why: str) -> None:
    model = random_model("rope", seed=3).eval()
    change(model)  # type: ignore[operator]
    choice = backend.choose(model)
    assert choice.backend is Backend.TORCH and why in choice.why


def test_the_backend_is_chosen_once_not_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    model = random_model("rope", seed=4).eval()
    calls: list[object] = []
    choose = backend.choose
    monkeypatch.setattr(backend, "choose", lambda m: calls.append(m) or choose(m))
    cache = KVCache(model.config, rows=2, max_length=16)
    tokens = random_tokens(2, 1, seed=1)
    with torch.inference_mode():
        for _ in range(5):
            tokens = model(tokens, cache, last_only=True).argmax(-1, keepdim=True)
    assert len(calls) == 1


def test_every_sampling_field_is_neutral_able_or_says_how_to_draw() -> None:
    """A field added to SamplingParams must say what leaves the distribution as it is."""
    fields = {field.name for field in dataclasses.fields(SamplingParams)}
    assert fields == set(NEUTRAL) | set(HOW_TO_DRAW)
    for name, off in NEUTRAL.items():
        assert getattr(SamplingParams(), name) == off  # the default leaves it as it is


def test_every_sampling_field_is_applied_by_some_path() -> None:
    applied = set().union(*_PATHS.values()) | ADJUSTMENTS
    assert applied == set(NEUTRAL)


def test_a_field_no_path_applies_is_refused_not_drawn_past(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(NEUTRAL, "temperature", 1.0)  # as if "temperature" were a new filter
    with pytest.raises(ValueError, match="no sampling path applies temperature"):
        _path(SamplingParams(temperature=0.7))
    assert _path(SamplingParams(temperature=0.0)) == "greedy"
    assert _path(SamplingParams(temperature=1.0)) == "temperature only"
