"""DialOp matching: scenario generation, proposal parsing, scoring and the best assignment.

Pure functions over numpy arrays and a frozen pydantic ``Scenario``; no I/O. The rules follow
the DialOp reference ("optimization" game) except where the reference parser is buggy: proposals
here are matched by exact names, one-to-one, every paper exactly once. The ranking of all
assignments (``best_untried``) lives in ``assignments``.
"""

from __future__ import annotations

import re
from functools import cache
from itertools import combinations

import numpy as np
from pydantic import BaseModel, ConfigDict

from selfplay.game.matching.assignments import Pairs
from selfplay.game.matching.assignments import best_untried as best_untried  # its old home

REVIEWERS: tuple[str, ...] = (
    "Ava Li",
    "Daniel Nguyen",
    "Sofia Patel",
    "Andrei Petrov",
    "Morgan Reed",
    "Joseph Santos",
    "Ethan Smith",
    "Noah Wilson",
)
PAPERS: tuple[str, ...] = (
    "BLEU: a Method for Automatic Evaluation of MT",
    "Electra: Pre-training Text Encoders as Discriminators Rather Than Generators",
    "GloVe: Global Vectors for Word Representation",
    "GLUE: A Multi-Task Benchmark and Analysis Platform for Natural Language Understanding",
    "LLaMA: Open and Efficient Foundation Language Models",
    "RoBERTa: A Robustly Optimized BERT Pretraining Approach",
    "QuAC: Question Answering in Context",
    "SWAG: A Large-Scale Adversarial Dataset for Grounded Commonsense Inference",
)
PAPERS_SHORT: tuple[str, ...] = tuple(p.split(":")[0] for p in PAPERS)
# Shorter full titles used by some copies of the reference code; accepted as aliases.
_PAPER_ALIASES: dict[str, int] = {
    "Electra: Pre-training Text Encoders as Discriminators": 1,
    "GLUE: A Multi-Task Benchmark and Analysis Platform for NLU": 3,
    "SWAG: An Adversarial Dataset for Commonsense Inference": 7,
}

MAX_VALUE = 100  # values are integers in [0, MAX_VALUE)
UNKNOWN_VALUE = 50  # cells unknown to both players are overwritten with this
P_KNOWN = 0.4
HARDNESS = 1.25
MAX_TABLES = 10_000
MIN_N, MAX_N = 3, 8
_CHUNK = 1024  # candidate tables drawn per vectorised batch; part of the seed -> scenario mapping


class ProposalError(ValueError):
    """A proposal text that does not name a valid one-to-one assignment; the message says why."""


class Scenario(BaseModel):
    """One game instance: the true table (after the 50-overwrite) and what each seat sees."""

    model_config = ConfigDict(frozen=True)

    id: str
    seed: int | None
    n: int
    table: list[list[int]]
    masks: tuple[list[list[int]], list[list[int]]]
    scales: tuple[float, float]
    best: int
    best_assignment: Pairs
    tables_tried: int = 1
    passed_filter: bool = True

    @property
    def reviewers(self) -> tuple[str, ...]:
        return REVIEWERS[: self.n]

    @property
    def papers(self) -> tuple[str, ...]:
        return PAPERS[: self.n]

    def table_array(self) -> np.ndarray:
        return np.asarray(self.table, dtype=np.int64)

    def view(self, seat: int) -> list[list[int | None]]:
        """What seat 0 or 1 sees: int(true * scale) where known, else None."""
        scale = self.scales[seat]
        return [
            [int(v * scale) if k else None for v, k in zip(row, mrow)]
            for row, mrow in zip(self.table, self.masks[seat])
        ]

    def view_csv(self, seat: int) -> str:
        """The seat's table as the reference renders it: CSV, titles header, empty unknowns."""
        lines = ["," + ",".join(self.papers)]
        for name, row in zip(self.reviewers, self.view(seat)):
            lines.append(name + "," + ",".join("" if v is None else str(v) for v in row))
        return "\n".join(lines)

    def score(self, pairs: Pairs) -> int:
        return score_assignment(self.table, pairs)


def score_assignment(table, pairs: Pairs) -> int:
    """Sum of true-table values over (reviewer, paper) pairs."""
    arr = np.asarray(table)
    return int(sum(int(arr[r, p]) for r, p in pairs))


def best_assignment(table) -> tuple[Pairs, int]:
    """Maximum-weight one-to-one assignment (Hungarian): sorted (reviewer, paper) pairs, value."""
    from scipy.optimize import linear_sum_assignment  # here: scipy.optimize is slow to import

    arr = np.asarray(table)
    rows, cols = linear_sum_assignment(arr, maximize=True)
    pairs = sorted((int(r), int(c)) for r, c in zip(rows, cols))
    return pairs, int(arr[rows, cols].sum())


def estimate_table(view: list[list[int | None]], stated: dict[tuple[int, int], int]) -> np.ndarray:
    """A seat's estimate of the table in its own scale: its known values, the partner's stated
    values converted by the ratio of the two scales (median over cells both know, else the ratio
    of the means), the mean elsewhere."""
    own = np.array([[np.nan if v is None else v for v in row] for row in view], dtype=float)
    theirs = np.full_like(own, np.nan)
    for (r, p), v in stated.items():
        theirs[r, p] = v
    both = np.isfinite(own) & np.isfinite(theirs) & (own > 0)
    if both.any():
        ratio = float(np.median(theirs[both] / own[both]))
    elif np.isfinite(own).any() and np.isfinite(theirs).any():
        ratio = float(np.nanmean(theirs) / max(np.nanmean(own), 1e-9))
    else:
        ratio = 1.0
    merged = np.where(np.isfinite(own), own, theirs / max(ratio, 1e-9))
    fill = np.nanmean(merged) if np.isfinite(merged).any() else 0.0
    return np.where(np.isnan(merged), fill, merged)


def _solo_reward(table: np.ndarray, known: np.ndarray) -> int:
    """Reference solo score: optimum of own known values (50 elsewhere), scored on the truth."""
    from scipy.optimize import linear_sum_assignment

    expected = np.where(known, table, UNKNOWN_VALUE)
    rows, cols = linear_sum_assignment(expected, maximize=True)
    return int(table[rows, cols].sum())


@cache
def _dp_plan(n: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """Per row i: (target subsets of size i+1, their predecessor subsets, the column added)."""
    plan = []
    for i in range(n):
        targets, sources, cols = [], [], []
        for combo in combinations(range(n), i + 1):
            mask = sum(1 << c for c in combo)
            targets.append(mask)
            sources.append([mask ^ (1 << c) for c in combo])
            cols.append(list(combo))
        plan.append((np.array(targets), np.array(sources), np.array(cols)))
    return plan


def _batched_max_assignment(values: np.ndarray) -> np.ndarray:
    """Maximum assignment value of every (n, n) matrix in a (B, n, n) integer batch.

    Subset dynamic programme over columns, vectorised across the batch: exact, no tie issues,
    about 2^(n-1) * n operations per matrix with no per-matrix Python overhead.
    """
    batch, n, _ = values.shape
    by_row = np.ascontiguousarray(
        values.transpose(1, 2, 0)
    )  # (n, n, B): row-gathers are contiguous
    dp = np.empty((1 << n, batch), dtype=values.dtype)
    dp[0] = 0
    for i, (targets, sources, cols) in enumerate(_dp_plan(n)):
        # One 2-D gather per position in the subset beats a single 3-D gather (cache-friendly).
        acc = dp[sources[:, 0]] + by_row[i][cols[:, 0]]
        for k in range(1, i + 1):
            np.maximum(acc, dp[sources[:, k]] + by_row[i][cols[:, k]], out=acc)
        dp[targets] = acc
    return dp[(1 << n) - 1]


def _min_solo_reward(table: np.ndarray, known: np.ndarray) -> np.ndarray:
    """Per table, the lowest true score among all solo-optimal assignments (any tie-break).

    Maximising 1000 * expected - true selects the best expected value first, then the lowest true
    score among ties; true sums are below 1000, so both parts decode exactly.
    """
    expected = np.where(known, table, UNKNOWN_VALUE)
    key = _batched_max_assignment(1000 * expected - table)
    expected_sum = -(-key // 1000)
    return 1000 * expected_sum - key


def generate_scenario(
    seed: int,
    n: int = 8,
    *,
    p_known: float = P_KNOWN,
    hard: bool = True,
    max_tables: int = MAX_TABLES,
) -> Scenario:
    """Draw a scenario deterministically from ``seed``, as the DialOp reference does.

    Values uniform in 0..99; each seat knows each cell with probability ``p_known``; cells
    unknown to both become 50; scales uniform(1, 10). With ``hard`` the table is redrawn until
    each seat's solo optimum scores below best / 1.25, giving up after ``max_tables`` tables (the
    last one is kept).
    The filter is vectorised: an exact batched bound rejects almost every table, and the few
    survivors are checked with the reference's own Hungarian procedure.
    """
    if not MIN_N <= n <= MAX_N:
        raise ValueError(f"table size n must be between {MIN_N} and {MAX_N}, got {n}")
    if max_tables < 1:
        raise ValueError(f"max_tables must be at least 1, got {max_tables}")
    rng = np.random.default_rng(np.random.SeedSequence(seed))
    tried = 0
    while True:
        chunk = min(_CHUNK, max_tables - tried) if hard else 1
        table = rng.integers(0, MAX_VALUE, (chunk, n, n), dtype=np.int32)
        known1 = rng.random((chunk, n, n)) < p_known
        known2 = rng.random((chunk, n, n)) < p_known
        scales = rng.uniform(1.0, 10.0, (chunk, 2))
        table[~known1 & ~known2] = UNKNOWN_VALUE
        chosen, passed = None, False
        if hard:
            # Cheap exact bound first: best <= min(sum of row maxima, sum of column maxima).
            upper = np.minimum(table.max(axis=2).sum(axis=1), table.max(axis=1).sum(axis=1))
            solo1 = _min_solo_reward(table, known1)
            maybe = np.flatnonzero(solo1 * HARDNESS < upper)
            best = _batched_max_assignment(table[maybe])
            keep = solo1[maybe] * HARDNESS < best
            maybe, best = maybe[keep], best[keep]
            keep = _min_solo_reward(table[maybe], known2[maybe]) * HARDNESS < best
            for k, b in zip(maybe[keep], best[keep]):  # the reference's exact check, in draw order
                if (
                    _solo_reward(table[k], known1[k]) * HARDNESS < b
                    and _solo_reward(table[k], known2[k]) * HARDNESS < b
                ):
                    chosen, passed = int(k), True
                    break
        tried_before = tried
        tried += chunk
        if chosen is None and (not hard or tried >= max_tables):
            chosen = chunk - 1
        if chosen is not None:
            return scenario_from_arrays(
                table[chosen],
                (known1[chosen], known2[chosen]),
                (float(scales[chosen, 0]), float(scales[chosen, 1])),
                seed=seed,
                tables_tried=tried_before + chosen + 1,
                passed_filter=passed or not hard,
            )


def scenario_from_arrays(
    table,
    masks,
    scales,
    *,
    seed: int | None = None,
    scenario_id: str | None = None,
    tables_tried: int = 1,
    passed_filter: bool = True,
) -> Scenario:
    """Build a scenario from an explicit true table, two 0/1 masks and two scales.

    Cells unknown to both seats are overwritten with 50 (as generation does); the best assignment
    is computed here.
    """
    arr = np.array(table, dtype=np.int64)
    n = arr.shape[0]
    if arr.shape != (n, n) or not MIN_N <= n <= MAX_N:
        raise ValueError(f"table must be square with size {MIN_N}..{MAX_N}, got shape {arr.shape}")
    m = [np.asarray(mk, dtype=bool) for mk in masks]
    if len(m) != 2 or any(mk.shape != arr.shape for mk in m):
        raise ValueError("masks must be two arrays shaped like the table")
    if len(scales) != 2:
        raise ValueError("scales must be two numbers, one per seat")
    arr[~m[0] & ~m[1]] = UNKNOWN_VALUE
    pairs, best = best_assignment(arr)
    if scenario_id is None:
        scenario_id = f"s{seed}" if seed is not None else "custom"
    return Scenario(
        id=scenario_id,
        seed=seed,
        n=n,
        table=arr.tolist(),
        masks=(m[0].astype(int).tolist(), m[1].astype(int).tolist()),
        scales=(float(scales[0]), float(scales[1])),
        best=best,
        best_assignment=pairs,
        tables_tried=tables_tried,
        passed_filter=passed_filter,
    )


def _norm(name: str) -> str:
    name = name.replace("\u2019", "'").casefold()
    name = re.sub(r"\s+", " ", name).strip()
    return name.strip(" .;,*_\"'`")


@cache
def _name_tables(n: int, roster: tuple[str, ...]) -> tuple[dict[str, int], dict[str, int]]:
    papers: dict[str, int] = {}
    for i, title in enumerate(PAPERS[:n]):
        papers[_norm(title)] = i
        papers[_norm(PAPERS_SHORT[i])] = i
    for title, i in _PAPER_ALIASES.items():
        if i < n:
            papers[_norm(title)] = i
    reviewers = {_norm(r): i for i, r in enumerate(roster[:n])}
    return papers, reviewers


_BULLET = re.compile(r"^\s*(?:[-*\u2022\u2013]|\d+[.)])\s*")
_BREAK = re.compile(r"<br\s*/?>", re.IGNORECASE)


def proposal_lines(text: str) -> list[str]:
    """Split proposal text into non-empty, de-bulleted lines (newlines or <br/>, &emsp; ignored)."""
    text = _BREAK.sub("\n", text).replace("&emsp;", " ").replace("&nbsp;", " ")
    lines = []
    for raw in text.split("\n"):
        line = _BULLET.sub("", raw).strip()
        if line:
            lines.append(line)
    return lines


def parse_proposal(text: str, n: int = 8, *, roster: tuple[str, ...] = REVIEWERS) -> Pairs:
    """Parse "Proposal:" followed by one "Paper: Reviewer" line per paper into sorted pairs.

    ``roster`` is the reviewer list in table order (one human game used a different one).

    Raises ProposalError naming the problem: missing header, wrong line count, malformed line,
    unknown paper or reviewer, a paper or reviewer used twice, a missing paper.
    """
    lines = proposal_lines(text)
    count_error = (
        f"Your proposal must start with 'Proposal:' and have {n} lines, one for each slot."
    )
    if not lines or not lines[0].casefold().startswith("proposal:"):
        raise ProposalError(count_error)
    rest = lines[0][len("proposal:") :].strip()
    body = ([rest] if rest else []) + lines[1:]
    if len(body) != n:
        raise ProposalError(f"{count_error} Found {len(body)} lines.")
    papers, reviewers = _name_tables(n, tuple(roster))
    by_paper: dict[int, int] = {}
    used: dict[int, int] = {}
    for line in body:
        if ":" not in line:
            raise ProposalError(
                f"Each line of your proposal must be of the form Paper: Reviewer (got {line!r})."
            )
        left, right = line.rsplit(":", 1)
        p, r = papers.get(_norm(left)), reviewers.get(_norm(right))
        if p is None and r is None and _norm(left) in reviewers and _norm(right) in papers:
            raise ProposalError(f"Line {line!r} has the reviewer first; write Paper: Reviewer.")
        if p is None:
            raise ProposalError(f"Unknown paper {left.strip()!r} in line {line!r}.")
        if r is None:
            raise ProposalError(f"Unknown reviewer {right.strip()!r} in line {line!r}.")
        if p in by_paper:
            raise ProposalError(f"Paper {PAPERS_SHORT[p]} is assigned twice.")
        if r in used:
            raise ProposalError(f"Reviewer {roster[r]} is assigned to two papers.")
        by_paper[p] = r
        used[r] = p
    return sorted((r, p) for p, r in by_paper.items())


def format_proposal(pairs: Pairs, n: int = 8) -> str:
    """Render pairs as the canonical proposal text (one "Paper: Reviewer" line per paper)."""
    by_paper = {p: r for r, p in pairs}
    return "Proposal:\n" + "\n".join(
        f"{PAPERS_SHORT[p]}: {REVIEWERS[by_paper[p]]}" for p in range(n)
    )


def mentions(text: str, n: int = 8) -> tuple[set[int], set[int]]:
    """Reviewers (full, first or last name) and papers (short title) named in free text."""
    pattern, index = _name_pattern(n)
    reviewers: set[int] = set()
    papers: set[int] = set()
    for m in pattern.finditer(text.casefold()):
        kind, i = index[m.group()]
        (reviewers if kind == "reviewer" else papers).add(i)
    return reviewers, papers


@cache
def _name_pattern(n: int) -> tuple[re.Pattern, dict[str, tuple[str, int]]]:
    """One pattern for every name of an n x n table, and what each matched name stands for.

    Metrics classify every message of every game, so this is built once per n. One scan finds
    all names because no word names two things (checked here): a full name never hides another
    reviewer's or paper's name.
    """
    index: dict[str, tuple[str, int]] = {}
    for i, name in enumerate(REVIEWERS[:n]):
        full = name.casefold()
        for key in (full, *full.split()):
            index[key] = ("reviewer", i)
    for i, short in enumerate(PAPERS_SHORT[:n]):
        index[short.casefold()] = ("paper", i)
    owners: dict[str, set[tuple[str, int]]] = {}
    for key, what in index.items():
        for word in key.split():
            owners.setdefault(word, set()).add(what)
    assert all(len(o) == 1 for o in owners.values()), "a word names two reviewers or papers"
    return re.compile(r"\b(?:" + "|".join(map(re.escape, index)) + r")\b"), index
