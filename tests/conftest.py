"""Fixtures shared by every test package."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.server.conftest import build_checkpoints


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random checkpoints of every scheme, built once for the server and client tests."""
    folder = tmp_path_factory.mktemp("checkpoints")
    build_checkpoints(folder)
    return folder
