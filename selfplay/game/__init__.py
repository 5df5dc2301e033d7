"""The DialOp paper-reviewer matching game: pure rules, no I/O, no engines, no torch."""

from selfplay.game.matching import (
    PAPERS,
    PAPERS_SHORT,
    REVIEWERS,
    ProposalError,
    Scenario,
    best_assignment,
    generate_scenario,
    parse_proposal,
    scenario_from_arrays,
    score_assignment,
)
from selfplay.game.protocol import Action, Game, Outcome, StepResult

__all__ = [
    "PAPERS",
    "PAPERS_SHORT",
    "REVIEWERS",
    "Action",
    "Game",
    "Outcome",
    "ProposalError",
    "Scenario",
    "StepResult",
    "best_assignment",
    "generate_scenario",
    "parse_proposal",
    "scenario_from_arrays",
    "score_assignment",
]
