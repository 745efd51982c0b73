"""Fault tests share the trainer's packed byte tokens (tests/fixtures/trainer_data.py)."""

from fixtures.trainer_data import byte_tokens  # noqa: F401
