"""Shared fixtures: a tiny offline model (built once per session) and the human games."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The whole suite computes in fp32 on every machine (CI's CPU may or may not have native bf16,
# and the dtype rule would pick differently): the rule itself is tested with its probe mocked.
# Set before any test runs, so the commands the tests start as subprocesses inherit it too.
os.environ["SELFPLAY_NATIVE_BF16"] = "0"

# the DialOp human games as the package ships them (selfplay/game/matching/data)
HUMAN_GAMES = Path(__file__).resolve().parents[1] / "selfplay/game/matching/data/optimization.jsonl"


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Qwen2 model + offline BPE tokenizer with a ChatML template (no hub)."""
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    return build_tiny_model(
        tmp_path_factory.mktemp("models") / "tiny_qwen2", corpus=tokenizer_corpus()
    )


@pytest.fixture(scope="session")
def hf_test_config(tiny_model):
    """The hf engine config the engine tests open: on the CPU, or with SELFPLAY_TEST_DEVICE=cuda
    on a GPU (in fp32 there too, so that batched-against-alone comparisons keep their
    tolerances)."""
    from selfplay.engines import HFEngineConfig

    device = os.environ.get("SELFPLAY_TEST_DEVICE", "cpu")
    config = HFEngineConfig(model=str(tiny_model), device=device, max_batch_size=16)
    return config if device == "cpu" else config.model_copy(update={"dtype": "fp32"})


@pytest.fixture(scope="session")
def human_games() -> list[dict]:
    if not HUMAN_GAMES.exists():
        pytest.fail(f"{HUMAN_GAMES} is missing: the package ships the DialOp human games")
    return [json.loads(line) for line in HUMAN_GAMES.read_text().splitlines() if line.strip()]


def _prime(base: Path, out: Path, n: int = 3, steps: int = 100, seed: int = 0) -> Path:
    """Teach the tiny model the move format on n x n tables with a few supervised steps.

    Seat 1's first turn becomes a random full proposal and a pending proposal becomes "[accept]",
    so sampled games reach agreements with different scores: rewards vary within a scenario and
    GRPO groups carry a signal, which a random tiny model (all games invalid) never gives.
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfplay.game.matching.prompts import intro
    from selfplay.game.matching.rules import format_proposal, generate_scenario
    from selfplay.game.matching.turns import PROPOSAL_CHOICES

    tok = AutoTokenizer.from_pretrained(base)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    rng = np.random.default_rng(seed)
    torch.manual_seed(seed)

    def example() -> tuple[list[int], int]:
        s = generate_scenario(int(rng.integers(1 << 30)), n, max_tables=50)
        perm = rng.permutation(n)
        proposal = "[propose] " + format_proposal([(int(r), p) for p, r in enumerate(perm)], n)
        if rng.random() < 0.5:
            user, answer = intro(s, 0), proposal
        else:
            user, answer = f"{intro(s, 1)}\n\nPartner: {proposal}\n{PROPOSAL_CHOICES}", "[accept]"
        prompt = tok.apply_chat_template(
            [{"role": "user", "content": user}], tokenize=False, add_generation_prompt=True
        )
        p_ids = tok(prompt, add_special_tokens=False)["input_ids"]
        a_ids = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        return p_ids + a_ids, len(p_ids)

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model.train()
    for _ in range(steps):
        batch = [example() for _ in range(8)]
        width = max(len(ids) for ids, _ in batch)
        ids = torch.full((len(batch), width), tok.pad_token_id)
        labels = torch.full((len(batch), width), -100)
        attn = torch.zeros((len(batch), width), dtype=torch.long)
        for i, (seq, start) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, start : len(seq)] = torch.tensor(seq[start:])
            attn[i, : len(seq)] = 1
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def primed_model(tiny_model, tmp_path_factory) -> Path:
    """The tiny model after a few supervised steps on valid 3x3 moves (see _prime)."""
    return _prime(tiny_model, tmp_path_factory.mktemp("models") / "primed")
