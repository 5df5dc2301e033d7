"""Statistics of the written rows in constant memory: reward moments and exact histograms of the
token lengths, for nearest-rank percentiles."""

from __future__ import annotations

import itertools
import math
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel

LengthKind = Literal["total", "prompt", "response", "own"]


class LengthStats(BaseModel):
    """Nearest-rank percentiles of a per-row token count over the written rows."""

    mean: float = 0.0
    p50: int = 0
    p90: int = 0
    p99: int = 0
    max: int = 0


class RewardStats(BaseModel):
    """The reward over the written rows (population std)."""

    mean: float = 0.0
    std: float = 0.0
    min: float = 0.0
    max: float = 0.0


def _ones_per_list(lists: pa.ListArray) -> np.ndarray:
    """How many values of each list of a 0/1 list array are 1. One count per list: a sum over
    the whole batch at once would first cast every int8 value to a new int64 array."""
    offsets = lists.offsets.to_numpy().tolist()
    values = lists.values.to_numpy()
    return np.fromiter(
        (np.count_nonzero(values[a:b]) for a, b in itertools.pairwise(offsets)),
        np.int64,
        len(lists),
    )


class Stats:
    """Reward moments and token-length histograms of the written rows (constant memory)."""

    def __init__(self, max_length: int) -> None:
        self.n, self.total, self.total_sq = 0, 0.0, 0.0
        self.lo, self.hi = math.inf, -math.inf
        self._hists: dict[LengthKind, _Hist] = {
            k: _Hist(max_length) for k in ("total", "prompt", "response", "own")
        }

    def add(self, batch: pa.RecordBatch) -> None:
        r = batch["reward"].to_numpy().astype(np.float64)
        self.n += len(r)
        self.total += float(r.sum())
        self.total_sq += float((r * r).sum())
        self.lo = min(self.lo, float(r.min()))
        self.hi = max(self.hi, float(r.max()))
        prompt = pc.list_value_length(batch["prompt_ids"]).to_numpy()
        response = pc.list_value_length(batch["response_ids"]).to_numpy()
        own = _ones_per_list(batch["response_mask"])
        self._hists["prompt"].add(prompt)
        self._hists["response"].add(response)
        self._hists["total"].add(prompt + response)
        self._hists["own"].add(own)

    def reward(self) -> RewardStats:
        if self.n == 0:
            return RewardStats()
        mean = self.total / self.n
        var = max(self.total_sq / self.n - mean * mean, 0.0)
        return RewardStats(
            mean=round(mean, 6), std=round(math.sqrt(var), 6), min=self.lo, max=self.hi
        )

    def length(self, kind: LengthKind) -> LengthStats:
        """Prompt + response ("total"), prompt, response or mask-1 ("own") tokens per row."""
        return self._hists[kind].stats()


class _Hist:
    """Exact counts of a bounded non-negative integer, for percentiles in constant memory."""

    def __init__(self, size: int) -> None:
        self.counts = np.zeros(size + 1, dtype=np.int64)

    def add(self, values: np.ndarray) -> None:
        self.counts += np.bincount(values, minlength=len(self.counts))[: len(self.counts)]

    def stats(self) -> LengthStats:
        n = int(self.counts.sum())
        if n == 0:
            return LengthStats()
        cum = np.cumsum(self.counts)
        values = np.arange(len(self.counts))

        def pct(p: float) -> int:
            return int(np.searchsorted(cum, math.ceil(p / 100 * n)))

        return LengthStats(
            mean=round(float((self.counts * values).sum()) / n, 2),
            p50=pct(50),
            p90=pct(90),
            p99=pct(99),
            max=int(values[self.counts > 0].max()),
        )


def summary_table(s, title: str):
    """A rich table of a convert run's ``ConvertSummary`` (what ``selfplay convert`` prints)."""
    from rich.table import Table

    table = Table(title=title)
    table.add_column("")
    table.add_column("value", justify="right")
    rows = {
        "games read": s.games_read,
        "lines skipped": s.lines_skipped,
        "rows written (train / val)": f"{s.rows_written} ({s.rows_train} / {s.rows_val})",
        "groups written (train / val)": f"{s.groups_written} ({s.groups_train} / {s.groups_val})",
        "degenerate groups dropped": (
            f"{s.groups_degenerate_dropped} ({s.rows_in_degenerate_groups_dropped} rows)"
        ),
        "singleton groups dropped": s.groups_singleton_dropped,
        f"rows over {s.max_length} tokens dropped": s.rows_dropped_over_max_length,
        "rows without own tokens dropped": s.rows_dropped_no_own_tokens,
        "reward mean / std": f"{s.reward.mean:.4f} / {s.reward.std:.4f}",
        "tokens p50 / p90 / p99 / max": (
            f"{s.length_total.p50} / {s.length_total.p90} / {s.length_total.p99} / "
            f"{s.length_total.max}"
        ),
        "games/s": f"{s.games_per_second:.0f}",
    }
    for key, value in rows.items():
        table.add_row(key, str(value))
    return table
