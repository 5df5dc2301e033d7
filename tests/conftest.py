"""Shared fixtures: a tiny offline model (built once per session) and the human games."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
HUMAN_GAMES = SHARED / "dialop-data" / "optimization.jsonl"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + offline BPE tokenizer with a ChatML template (no hub)."""
    from selfplay.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny_qwen2")


@pytest.fixture(scope="session")
def human_games() -> list[dict]:
    if not HUMAN_GAMES.exists():
        pytest.skip("../shared/dialop-data is not beside the project")
    return [json.loads(line) for line in HUMAN_GAMES.read_text().splitlines() if line.strip()]
