"""Fixtures shared by every test package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import model.cpu as cpu
import model.kernels as kernels
from tests.server.conftest import build_checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random checkpoints of every scheme, built once for the server and client tests."""
    folder = tmp_path_factory.mktemp("checkpoints")
    build_checkpoints(folder)
    return folder


@pytest.fixture(params=cpu.runnable())
def every_isa(request: pytest.FixtureRequest) -> Iterator[str]:
    """Each kernel variant this CPU runs (``model.kernels``: avx512, avx2 and scalar on an
    AVX-512 machine; avx2 and scalar on an AVX2 one), active in turn for the test."""
    with kernels.using(request.param):
        yield request.param
