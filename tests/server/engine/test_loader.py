"""Loading in the engine process (``server.engine.loader``), without a process: each model loads or
fails on its own, rope variants share their base's weights, and each model's context limit."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest
import torch

from model.kernels import argmax as argmax_kernel
from model.kernels import decode_step
from model.kernels import draw as draw_kernel
from server.engine.loader import LoadedModel, context_limit, load_all, warm_up
from server.messages import EngineConfig, ModelFailed
from tests.model.conftest import random_model
from tests.server.conftest import CONTEXT_LENGTH, MAX_POSITIONS, engine_config, tiny_model

VARIANTS = ["yarn4", "ntk4"]


def config_for(folders: dict[str, Path], root: Path) -> EngineConfig:
    return engine_config(folders, root, VARIANTS)


def test_variants_share_the_weights_and_a_broken_checkpoint_fails_alone(
    checkpoints: Path, tmp_path: Path
) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    folders = {"rope": checkpoints / "rope", "broken": broken, "alibi": checkpoints / "alibi"}
    results = list(load_all(config_for(folders, tmp_path)))

    failed = [r for r in results if isinstance(r, ModelFailed)]
    assert [f.name for f in failed] == ["broken"]
    assert str(tmp_path) not in failed[0].message  # paths relative to the checkpoints folder
    loaded = {r.name: r for r in results if isinstance(r, LoadedModel)}
    assert list(loaded) == ["rope", "rope+yarn4", "rope+ntk4", "alibi"]  # variants of rope only
    base = loaded["rope"].model
    for variant in VARIANTS:
        model = loaded[f"rope+{variant}"].model
        assert loaded[f"rope+{variant}"].info().base == "rope"
        for (name, ours), (_, theirs) in zip(
            model.state_dict().items(), base.state_dict().items(), strict=True
        ):
            assert ours.data_ptr() == theirs.data_ptr(), (variant, name)
        assert model.positional is not base.positional
        assert model.config.positional["scaling"] == variant[:-1]


@pytest.mark.parametrize(
    ("scheme", "configured", "expected"),
    [
        ("rope", None, 4 * CONTEXT_LENGTH),
        ("rope", 1000, 1000),
        ("alibi", 50, 50),
        ("learned", None, MAX_POSITIONS),
        ("lowrank", 1000, MAX_POSITIONS),  # never past the table
        ("mds", 10, 10),
        ("binary", None, 4 * CONTEXT_LENGTH),
        ("binary", 1000, 2**8),  # 8 bits count 256 positions
    ],
)
def test_context_limit(scheme: str, configured: int | None, expected: int) -> None:
    assert context_limit(tiny_model(scheme, 300, seed=0), configured) == expected


def test_the_warm_up_runs_a_cached_one_token_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode-step kernel is built on the loader thread, before the model serves: built in
    a request's step instead (half a minute), it would stall the engine past its watchdog."""
    asked: list[tuple[int, ...]] = []
    applies = decode_step.applies

    def spy(model: object, tokens: torch.Tensor) -> bool:
        asked.append(tuple(tokens.shape))
        return applies(model, tokens)  # type: ignore[arg-type]

    monkeypatch.setattr(decode_step, "applies", spy)
    warm_up(random_model("rope"))
    assert (1, 1) in asked  # one row, one token: the decode step's shape


@pytest.mark.parametrize("kernel", [argmax_kernel, draw_kernel], ids=["greedy", "tempered"])
def test_the_warm_up_draws_with_each_draw_kernel(
    monkeypatch: pytest.MonkeyPatch, kernel: ModuleType
) -> None:
    """The argmax and the draw kernels too are built before the model serves: built in the
    first greedy or sampled request's step (23 s for the draw kernel), one held the engine past
    its watchdog, which killed it mid-build and left the build's lock to the next one."""
    asked: list[tuple[int, ...]] = []
    applies = kernel.applies

    def spy(x: torch.Tensor) -> bool:
        asked.append(tuple(x.shape))
        return applies(x)

    monkeypatch.setattr(kernel, "applies", spy)
    model = random_model("rope")
    warm_up(model)
    assert asked == [(1, model.config.vocab_size)]
