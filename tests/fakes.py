"""Fake engines and helpers the tests share (one place, imported like code)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from selfplay.engines import Generation, GenerationRequest
from selfplay.game.matching.rules import format_proposal
from selfplay.game.matching.turns import PROPOSAL_CHOICES
from selfplay.players.llm import ChatFormat
from selfplay.training_schema import TRAINING_SCHEMA


class MovesEngine:
    """A token engine that plays valid matching moves: ``first_move``, then a proposal of the
    identity assignment; it accepts any proposal it is shown."""

    max_context = None

    def __init__(
        self,
        chat: ChatFormat,
        n: int = 3,
        *,
        first_move: str = "[message] Hello! What do you know about Ava Li?",
        latency: float = 0.0,
        name: str = "moves",
    ) -> None:
        self.chat, self.n, self.first_move, self.latency, self.name = (
            chat,
            n,
            first_move,
            latency,
            name,
        )
        self.requests = 0
        self.generated_tokens = 0

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> Generation:
        self.requests += 1
        await asyncio.sleep(self.latency)
        text = self.chat.decode(list(request.prompt_ids))
        last_user = text[text.rfind("<|im_start|>user") :]
        spoken = text.count("<|im_start|>assistant") - 1
        if PROPOSAL_CHOICES in last_user:
            action = "[accept]"
        elif spoken:
            action = "[propose] " + format_proposal([(i, i) for i in range(self.n)], self.n)
        else:
            action = self.first_move
        ids = [*self.chat.encode(action), self.chat.stop_token_ids[0]]
        self.generated_tokens += len(ids)
        return Generation(ids, [-0.25] * len(ids), "stop")


def mask_runs(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of mask-1 tokens of a seat's token list, in order (one per own action)."""
    runs, cur = [], []
    for t, m in zip(ids, mask):
        if m:
            cur.append(t)
        elif cur:
            runs.append(cur)
            cur = []
    if cur:
        runs.append(cur)
    return runs


# The API partner stand-in's key variable, key and model name (tests/chat_standin.py).
PARTNER_KEY_ENV = "SELFPLAY_TEST_PARTNER_KEY"
PARTNER_SECRET = "sk-test-SECRET-d41d8cd98f00"
PARTNER_MODEL = "standin-model"


def generate_beside_api_partner(
    model: Path, out: Path, url: str, *, verbose: bool = False, timeout: float = 600
) -> subprocess.CompletedProcess:
    """`selfplay generate` of 2 short 3x3 games, the model in seat 2 beside the API partner
    stand-in at ``url`` (its key in the environment): what the partner fault tests run."""
    cmd = [
        sys.executable, "-m", "selfplay", *(["-v"] if verbose else []), "generate",
        "--model", str(model), "--out", str(out), "--num-games", "2", "--concurrency", "1",
        "--table-size", "3", "--max-new-tokens", "16", "--max-actions", "4",
        "--partner", f"openai:{PARTNER_MODEL}", "--policy-seat", "2",
        "--partner-base-url", url, "--partner-key-env", PARTNER_KEY_ENV,
    ]  # fmt: skip
    env = {**os.environ, PARTNER_KEY_ENV: PARTNER_SECRET, "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


# Training rows written by hand (the train, LoRA, old-log-prob and guided tests share them).


def make_rows(
    specs: list[tuple[int, list[int], list[int], list[int], float]],
    fingerprint: str | None = "fp",
    logprob: float = -1.0,
) -> list[dict]:
    """Training rows from (group, prompt ids, response ids, response mask, reward)."""
    rows = []
    for i, (group, prompt, response, mask, reward) in enumerate(specs):
        rows.append(
            {
                "group_id": group,
                "group_key": f"s{group}",
                "game_id": f"g{i}",
                "scenario_id": f"s{group}",
                "seat": i % 2,
                "round": 0,
                "prompt_ids": prompt,
                "response_ids": response,
                "response_mask": mask,
                "rollout_logprobs": [logprob if m else 0.0 for m in mask],
                "reward": reward,
                "tokenizer_fingerprint": fingerprint,
                "messages": [{"role": "user", "content": "hi"}],
                "data_source": "dialop_matching",
                "prompt": [{"role": "user", "content": "hi"}],
                "reward_model": {"style": "rule", "ground_truth": reward},
                "extra_info": {"index": i, "game_id": f"g{i}", "seat": i % 2},
            }
        )
    return rows


def write_rows(path: Path, rows: list[dict], schema: pa.Schema = TRAINING_SCHEMA) -> Path:
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def simple_specs(groups: int = 2, per_group: int = 4) -> list:
    specs = []
    for g in range(groups):
        for k in range(per_group):
            specs.append(
                (g, [5 + g, 6, 7][: 1 + k % 3], [10 + k, 11, 12, 13, 14], [1, 1, 0, 0, 1], float(k))
            )
    return specs


# CLI subprocesses of the kill-and-resume tests (iterate, expert iteration, guided, faults).

ITERATE_ROUNDS = 2


def iterate_cmd(root: Path, model: Path, name: str) -> list[str]:
    """The reference `selfplay iterate` of the kill and resume tests (2 rounds, tiny model)."""
    return [
        sys.executable, "-m", "selfplay", "iterate",
        "--name", name,
        "--data-root", str(root / "data"),
        "--checkpoint-root", str(root / "checkpoints"),
        "--model", str(model),
        "--iterations", str(ITERATE_ROUNDS),
        "--games-per-iter", "16",
        "--games-per-scenario", "4",
        "--table-size", "3",
        "--temperature", "0.5",
        "--max-new-tokens", "48",
        "--lr", "1e-4",
        "--micro-batch-size", "4",
        "--seed", "3",
        # one game at a time: every request is decoded alone, so sampling does not depend on
        # which games share a padded batch (that moves logits ~1e-6 and can flip a rare token)
        "--concurrency", "1",
        "--eval-scenarios", "3",
        "--logger", "tensorboard,wandb",
        "--keep-checkpoints", "last",
        "--no-report",
    ]  # fmt: skip


def subprocess_env(**extra: str) -> dict[str, str]:
    """The environment of a CLI subprocess: no kill-test hold, offline trackers."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SELFPLAY_HOLD")}
    return {**env, "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "offline", **extra}


def run_ok(cmd: list[str], **env: str) -> subprocess.CompletedProcess:
    """Run a CLI command to its end; it must succeed."""
    res = subprocess.run(
        cmd, env=subprocess_env(**env), capture_output=True, text=True, timeout=900
    )
    assert res.returncode == 0, res.stderr[-3000:]
    return res


def start_killable(cmd: list[str], **env: str) -> subprocess.Popen:
    """Start a CLI command in its own process group, to be killed whole."""
    return subprocess.Popen(
        cmd,
        env=subprocess_env(**env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def kill_when(proc: subprocess.Popen, ready, timeout: float = 600) -> None:
    """SIGKILL ``proc``'s whole group as soon as ``ready()`` holds."""
    deadline = time.time() + timeout
    while not ready():
        assert proc.poll() is None, "the run ended before the kill point"
        assert time.time() < deadline, "kill point never reached"
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def line_count(path: Path) -> int:
    return len(path.read_bytes().splitlines()) if path.exists() else 0
