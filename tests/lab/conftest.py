"""The model tests' fixtures, for the lab's tests too (tests/model/conftest.py)."""

from tests.model.conftest import tiny_tokenizer  # noqa: F401
