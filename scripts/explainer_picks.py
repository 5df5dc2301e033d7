"""Does a model that cloned `scripted:explainer` pick well, and does it copy its picks? For each
game with a picks message ("Highest first: BLEU: Ava Li (116), ..."): are the picks the explainer's
own from the same dialogue (each the largest free value), is the first pick the largest known
value, and is the next proposal exactly the picks? Reads games.jsonl files (or .jsonl.gz, as
docs/runs/*/heldout/ publishes them) and prints one row per file.

    python scripts/explainer_picks.py docs/runs/learn-explain/heldout/warm_start.jsonl.gz \
        docs/runs/learn-explain/heldout/final.jsonl.gz
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Iterable

from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS
from selfplay.game.matching.scripted import PICKS, Explainer, parse_picks
from selfplay.records import GameRecord, iter_game_records

_TAG = "[message]"


def pick_stats(records: Iterable[GameRecord]) -> Counter[str]:
    """Counts: games, with_picks (a valid message with parseable picks), picks_greedy (the pairs
    the explainer would pick after the same messages), first_largest (the first pick is the
    largest value the speaker knows or was told), proposed (a later valid proposal),
    proposal_copies (that proposal is exactly the picks)."""
    c: Counter[str] = Counter()
    for g in records:
        c["games"] += 1
        actions = g.actions
        at = next(
            (
                i
                for i, a in enumerate(actions)
                if a.valid and a.kind == "message" and PICKS in a.text
            ),
            None,
        )
        picks = None if at is None else parse_picks(actions[at].text, g.scenario.n)
        if picks is None:
            continue
        c["with_picks"] += 1
        speaker = actions[at].seat
        ref = Explainer(g.scenario, speaker)
        for a in actions[:at]:
            if a.valid and a.kind == "message" and a.seat != speaker:
                ref.observe("message", a.text.replace(_TAG, "", 1).strip())
        steps = ref.greedy()
        c["picks_greedy"] += picks == sorted((r, p) for r, p, _ in steps)
        r0, p0, _ = steps[0]
        first = actions[at].text.split(PICKS, 1)[1].split(",")[0].strip()
        c["first_largest"] += first.startswith(f"{PAPERS_SHORT[p0]}: {REVIEWERS[r0]}")
        later = next((a for a in actions[at + 1 :] if a.valid and a.proposal), None)
        if later is not None:
            c["proposed"] += 1
            c["proposal_copies"] += sorted(map(tuple, later.proposal)) == picks
    return c


def _share(k: int, of: int) -> str:
    return f"{k} of {of} ({k / of:.2f})" if of else "-"


def main(paths: list[str]) -> None:
    print("| games file | games | with picks | picks = explainer's | first = largest | copied |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        c = pick_stats(iter_game_records(path))
        n = c["with_picks"]
        print(
            f"| {path} | {c['games']} | {n} | {_share(c['picks_greedy'], n)} "
            f"| {_share(c['first_largest'], n)} | {_share(c['proposal_copies'], c['proposed'])} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
