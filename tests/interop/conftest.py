"""The model tests' fixtures, for the doors' tests too (tests/model/conftest.py)."""

from tests.model.conftest import tiny_tokenizer  # noqa: F401
