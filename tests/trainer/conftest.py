"""The trainer tests' fixtures live in tests/fixtures/trainer_data.py (shared with the pretrain stage's
tests); importing the fixture here makes it visible to every test in this folder."""

from fixtures.trainer_data import byte_tokens  # noqa: F401
