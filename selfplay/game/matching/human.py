"""The 134 human DialOp games: the human reference row and behaviour-cloning rows.

``HUMAN`` is the matching game's ``human`` member (``api.HumanData``): ``outcomes`` reads each
logged game's reward (the dataset's score / best assignment), actions and messages for the human
reference row; ``replays`` turns each log into the turns each seat plays through our own rules
(``selfplay sft --human-data`` records them token-exactly under the model's chat format, like a
scripted teacher's). Human logs do not follow our strict protocol, so the replay applies one
documented rendering policy:

- The seat that moved first in the log is seat 1. Player ``p`` of the log sees ``mask{p+1}`` and
  ``scale{p+1}`` (the DialOp reference environment's indexing).
- A run of consecutive actions by one player becomes one turn (our message passes the turn):
  its messages are joined with a space; if the run holds a proposal, the turn is that proposal
  and the run's messages are dropped (counted in ``HumanReplay.dropped_messages``). 113 of the
  134 games have a player message then propose in one run.
- Proposals are written in our canonical form (``[propose] Proposal:`` then ``Paper: Reviewer``
  lines), not the logged HTML; a proposal that does not parse with our reviewer roster (one game
  used another roster) ends the replay there.
- After a reject our rules give the rejecting player the next turn; where the log continues with
  the other player, the replay ends there (the turns before it are still rows).

A replay that ends early is a record that ran out of actions (reward 0); its seats' turns up to
that point are rows like any other (behaviour cloning does not use the reward).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import orjson

from selfplay.errors import UserError
from selfplay.game.api import HumanGame, HumanOutcome


class HumanDataError(UserError, ValueError):
    """The human data file is missing or unreadable."""


def human_turns(game: dict, n: int = 8) -> tuple[list[tuple[int, str]], str | None, int]:
    """(seat, action text) turns of one logged game under the rendering policy, the reason the
    replay stops early (None: it reaches the accept) and the messages dropped."""
    from selfplay.game.matching.rules import ProposalError, format_proposal, parse_proposal

    log = game["action_log"]
    first = log[0]["player"]
    runs: list[tuple[int, list[dict]]] = []
    for a in log:  # an answer to a proposal is a turn of its own (a reject keeps the turn)
        if runs and runs[-1][0] == a["player"] and runs[-1][1][-1]["type"] != "proposal_response":
            runs[-1][1].append(a)
        else:
            runs.append((a["player"], [a]))
    turns: list[tuple[int, str]] = []
    dropped = 0
    expected = 0  # our rules' seat to move
    pending = False  # a proposal awaits an answer
    for player, actions in runs:
        seat = 0 if player == first else 1
        if seat != expected:
            return turns, "the log's next player is not the one our rules give the turn", dropped
        kinds = [a["type"] for a in actions]
        if pending != (kinds[0] == "proposal_response") or kinds.count("proposal_response") > 1:
            return turns, "a proposal answered by anything but accept or reject first", dropped
        pending = False
        if kinds[0] == "proposal_response":
            accept = actions[0]["response"]["accept"]
            turns.append((seat, "[accept]" if accept else "[reject]"))
            if accept:
                return turns, None, dropped
            continue  # the rejecting seat moves again
        if "proposal" in kinds:
            proposal = [a for a in actions if a["type"] == "proposal"][-1]
            dropped += sum(k == "message" for k in kinds)
            try:
                pairs = parse_proposal(proposal["proposal"], n)
            except ProposalError:
                return turns, "a proposal that does not parse with our reviewer roster", dropped
            turns.append((seat, "[propose] " + format_proposal(pairs, n)))
            pending = True
        else:
            text = " ".join(a["message"]["data"].strip() for a in actions)
            turns.append((seat, "[message] " + text))
        expected = 1 - seat
    return turns, "the log ends without an accept", dropped


def load_human_games(path: Path) -> list[dict]:
    if not path.is_file():
        raise HumanDataError(
            f"--human-data {path} does not exist (DialOp's optimization.jsonl; leave the option "
            "out for the copy shipped with selfplay)"
        )
    try:
        return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]
    except orjson.JSONDecodeError as e:
        raise HumanDataError(f"--human-data {path} is not JSONL: {e}") from None


class MatchingHumanGames:
    """The DialOp human games (``dialop-data/optimization.jsonl``, 8x8) behind ``api.HumanData``."""

    # shipped with the package (CDLA-Permissive-2.0: LICENSE.md beside it)
    default_path = Path(__file__).resolve().parent / "data" / "optimization.jsonl"
    table_size = 8  # every game was played on an 8x8 table
    reference = 0.921  # mean normalised reward of the 134 games
    reference_games = 134
    source = (
        "mean normalised reward (score / best assignment) of the 134 human games of DialOp "
        "(Lin et al., 'Decision-Oriented Dialogue for Human-AI Collaboration', "
        "dialop-data/optimization.jsonl, 8x8 tables)"
    )

    def outcomes(self, path: Path) -> list[HumanOutcome]:
        out = []
        for g in load_human_games(path):
            log = g["action_log"]
            out.append(
                HumanOutcome(
                    reward=g["result"]["score"] / g["best_assignment_reward"],
                    actions=len(log),
                    messages=tuple(a["message"]["data"] for a in log if a["type"] == "message"),
                    agreed=any(
                        a["type"] == "proposal_response" and a["response"]["accept"] for a in log
                    ),
                )
            )
        return out

    def replays(self, path: Path) -> Iterator[HumanGame]:
        from selfplay.game.matching.rules import scenario_from_arrays

        for i, game in enumerate(load_human_games(path)):
            first = game["action_log"][0]["player"]
            order = (first, 1 - first)
            scenario = scenario_from_arrays(
                game["table"],
                tuple(game[f"mask{p + 1}"] for p in order),
                tuple(game[f"scale{p + 1}"] for p in order),
                scenario_id=f"human-{i}",
            )
            turns, stopped, dropped = human_turns(game, scenario.n)
            yield HumanGame(scenario, tuple(turns), stopped, dropped)


HUMAN = MatchingHumanGames()
