"""Scripted players (table-driven) and the scripted `selfplay eval` command."""

from __future__ import annotations

import asyncio
import json

import pytest
from typer.testing import CliRunner

from selfplay.cli import app
from selfplay.evaluate.scripted import evaluate_scripted, play_scripted
from selfplay.game.matching import MATCHING
from selfplay.game.matching.prompts import intro
from selfplay.game.matching.rules import (
    PAPERS_SHORT,
    REVIEWERS,
    generate_scenario,
    mentions,
    parse_proposal,
)
from selfplay.game.matching.scripted import (
    Shy,
    format_values,
    make_scripted,
    parse_values,
    partner_events,
)

SCENARIO = generate_scenario(42)


def _act(player, observation: str) -> str:
    return asyncio.run(player.act(observation))


def test_values_round_trip():
    view = SCENARIO.view(0)
    text = format_values(view, range(8))
    known = {(r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v is not None}
    assert parse_values(text, 8) == known


def test_values_parse_from_the_cooperative_message():
    """The first reviewer after "My known scores:" is read too (it used to be dropped)."""
    view = SCENARIO.view(0)
    known = {(r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v is not None}
    message = "My known scores: " + format_values(view, range(8))
    assert parse_values(message, 8) == known


def test_cooperative_pair_agrees_on_small_tables():
    """With every value heard, two cooperative seats settle on 3x3 (they ran out of actions)."""
    result = evaluate_scripted(MATCHING, ("cooperative", "cooperative"), num_games=100, seed=7, n=3)
    assert result.summary.agreement_rate == 1.0
    assert result.summary.reward_mean >= 0.9


def test_partner_events_split_and_strip_choices():
    obs = "Partner: [message] hi there\n\nPartner: [propose] Proposal:\nBLEU: Ava Li\n"
    obs += "You can output one of these choices: [accept] or [reject]"
    assert partner_events(obs) == [
        ("message", "hi there"),
        ("propose", "Proposal:\nBLEU: Ava Li"),
    ]


def _shy_reply(question: str) -> str:
    shy = Shy(SCENARIO, 1)
    _act(shy, intro(SCENARIO, 1))
    return _act(shy, f"Partner: [message] {question}")


def _known_and_unknown(seat: int) -> tuple[tuple[int, int], tuple[int, int]]:
    view = SCENARIO.view(seat)
    cells = [(r, p) for r in range(8) for p in range(8)]
    known = next(c for c in cells if view[c[0]][c[1]] is not None)
    unknown = next(c for c in cells if view[c[0]][c[1]] is None)
    return known, unknown


@pytest.mark.parametrize(
    ("template", "expect"),
    [
        ("What is the score for {r} on {p}?", "value"),
        ("how good is {first} for {p}?", "value"),
        ("{last} and {p}: your number please", "value"),
        ("What do you know?", "vague"),
        ("Which reviewers look good to you?", "vague"),
        ("What about {r}?", "vague"),
        ("I think we should go.", "okay"),
        ("{r} is great on {p} and BLEU, right?", "vague"),
    ],
)
def test_shy_answers_only_direct_questions(template, expect):
    from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS

    (r, p), _ = _known_and_unknown(1)
    if PAPERS_SHORT[p] == "BLEU":  # keep the two-paper row a two-paper question
        template = template.replace("BLEU", "SWAG")
    name = REVIEWERS[r]
    first, last = name.split()
    reply = _shy_reply(template.format(r=name, first=first, last=last, p=PAPERS_SHORT[p]))
    assert reply.startswith("[message] ")
    value = SCENARIO.view(1)[r][p]
    if expect == "value":
        assert reply.endswith(f": {value}.")
    elif expect == "vague":
        assert "Hard to say" in reply and str(value) not in reply
    else:
        assert reply == "[message] Okay."


def test_shy_says_when_it_does_not_know():
    from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS

    _, (r, p) = _known_and_unknown(1)
    reply = _shy_reply(f"What is {REVIEWERS[r]}'s score on {PAPERS_SHORT[p]}?")
    assert "don't know" in reply


def test_shy_never_volunteers_and_judges_by_own_view():
    shy = Shy(SCENARIO, 0)
    assert _act(shy, intro(SCENARIO, 0)) == "[message] Hello."
    best = "[propose] Proposal:\n" + "\n".join(
        f"{p}: {r}" for r, p in _named(SCENARIO.best_assignment)
    )
    assert _act(shy, f"Partner: {best}\nYou can output one of these choices") in (
        "[accept]",
        "[reject]",
    )


def test_shy_strict_rejects_what_shy_accepts_between_its_two_bars():
    """shy-strict is shy with a bar of 0.9 instead of 0.8: a proposal worth between 0.8 and 0.9 of
    the best either can see is accepted by shy and rejected by shy-strict, one above 0.9 by both;
    asked directly, both answer alike."""
    import itertools

    import numpy as np

    from selfplay.game.matching.rules import best_assignment, format_proposal
    from selfplay.game.matching.scripted_base import assignment_value, expected_table

    seen = set()
    for seed in range(60):
        s = generate_scenario(seed, 3)
        own = expected_table(s.view(1))
        best = best_assignment(own)[1]  # the bar's base, as shy computes it
        for perm in itertools.permutations(range(3)):
            pairs = list(enumerate(perm))
            share = assignment_value(own, pairs) / best
            if share <= 0.8 or np.isclose(share, 0.9):  # below both bars, or on shy-strict's
                continue
            move = "Partner: [propose] " + format_proposal(pairs, s.n)
            shy, strict = make_scripted("shy", s, 1), make_scripted("shy-strict", s, 1)
            assert strict.name == "shy-strict" and shy.name == "shy"
            for player in (shy, strict):
                _act(player, intro(s, 1))
            got = (_act(shy, move), _act(strict, move))
            want = ("[accept]", "[reject]") if share < 0.9 else ("[accept]", "[accept]")
            assert got == want, (seed, perm, share)
            seen.add(want)
    assert seen == {("[accept]", "[reject]"), ("[accept]", "[accept]")}
    question = f"Partner: [message] What is the score for {REVIEWERS[0]} on {PAPERS_SHORT[1]}?"
    replies = set()
    for name in ("shy", "shy-strict"):
        player = make_scripted(name, SCENARIO, 1)
        _act(player, intro(SCENARIO, 1))
        replies.add(_act(player, question))
    assert len(replies) == 1 and "Ava Li on" in replies.pop()


def _named(pairs):
    from selfplay.game.matching.rules import PAPERS_SHORT, REVIEWERS

    return [(REVIEWERS[r], PAPERS_SHORT[p]) for r, p in sorted(pairs, key=lambda x: x[1])]


def test_no_talk_proposes_at_once_and_accepts_anything():
    p = make_scripted("no-talk", SCENARIO, 0)
    first = _act(p, intro(SCENARIO, 0))
    assert first.startswith("[propose] ")
    parse_proposal(first.removeprefix("[propose] "))
    assert _act(p, "Partner: " + first) == "[accept]"


def test_random_proposals_are_valid_and_seeded():
    a = [_act(make_scripted("random", SCENARIO, 0, seed=5), "") for _ in range(2)]
    assert a[0] == a[1]
    parse_proposal(a[0].removeprefix("[propose] "))


def test_cooperative_shares_then_proposes_merged_best():
    coop = make_scripted("cooperative", SCENARIO, 0)
    first = _act(coop, intro(SCENARIO, 0))
    assert first.startswith("[message] My known scores:")
    partner_text = format_values(SCENARIO.view(1), range(8))
    second = _act(coop, f"Partner: [message] My known scores: {partner_text}")
    assert second.startswith("[propose] ")


def test_unknown_scripted_name_is_a_clear_error():
    with pytest.raises(ValueError, match="unknown scripted player 'greedy'"):
        make_scripted("greedy", SCENARIO, 0)


def test_baselines_order():
    coop = evaluate_scripted(MATCHING, ("cooperative", "cooperative"), num_games=60, seed=7)
    no_talk = evaluate_scripted(MATCHING, ("no-talk", "no-talk"), num_games=60, seed=7)
    rand = evaluate_scripted(MATCHING, ("random", "random"), num_games=60, seed=7)
    assert coop.summary.reward_mean >= 0.95
    assert no_talk.summary.reward_mean < 0.85
    assert rand.summary.reward_mean < no_talk.summary.reward_mean
    assert coop.summary.invalid_action_rate == 0.0


def test_scripted_games_are_deterministic():
    a = play_scripted(MATCHING, ("random", "cooperative"), num_games=5, seed=3)
    b = play_scripted(MATCHING, ("random", "cooperative"), num_games=5, seed=3)

    def strip(r):
        return r.model_dump_json(exclude={"timings"})

    assert [strip(r) for r in a] == [strip(r) for r in b]


def test_eval_cli_writes_documented_keys(tmp_path):
    out = tmp_path / "eval.json"
    result = CliRunner().invoke(
        app,
        [
            "eval",
            "--players",
            "cooperative,no-talk",
            "--num-games",
            "10",
            "--seed",
            "1",
            "--out",
            str(out),
        ],
    )
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    from selfplay.metrics import GameSummary

    assert data["players"] == ["cooperative", "no-talk"] and data["seed"] == 1
    assert {"num_games", "n", "max_actions"} <= set(data)
    assert set(GameSummary.model_fields) - {"partner"} <= set(data)  # the typed summary, whole
    assert data["games"] == 10
    assert data["reward_ci_low"] <= data["reward_mean"] <= data["reward_ci_high"]


def test_eval_cli_rejects_unknown_player():
    result = CliRunner().invoke(app, ["eval", "--players", "cooperative,greedy"])
    assert result.exit_code == 1
    assert "--players must be two of" in result.output


def test_inquisitive_asks_the_shy_partner_and_scores_far_above_cooperative():
    inq = evaluate_scripted(MATCHING, ("inquisitive", "shy"), num_games=60, seed=7, n=3)
    coop = evaluate_scripted(MATCHING, ("cooperative", "shy"), num_games=60, seed=7, n=3)
    assert (
        inq.summary.direct_questions_per_game >= 2 and coop.summary.direct_questions_per_game == 0
    )
    assert inq.summary.reward_mean >= 0.8 > 0.5 > coop.summary.reward_mean
    assert inq.summary.invalid_action_rate == 0.0


def test_inquisitive_questions_name_one_cell_it_does_not_know_and_it_answers_questions():
    player = make_scripted("inquisitive", SCENARIO, 0)
    first = _act(player, intro(SCENARIO, 0))
    assert first.startswith("[message] What is the score for ")
    reviewers, papers = mentions(first, 8)
    assert len(reviewers) == len(papers) == 1  # what the shy partner answers
    (r,), (p,) = reviewers, papers
    assert SCENARIO.view(0)[r][p] is not None  # the first: a known cell, to learn the scale ratio
    second = _act(player, f"Partner: [message] {REVIEWERS[r]} on {PAPERS_SHORT[p]}: 7.")
    (r2,), (p2,) = mentions(second, 8)
    assert SCENARIO.view(0)[r2][p2] is None  # then cells it does not know
    asked = f"Partner: [message] What is the score for {REVIEWERS[r]} on {PAPERS_SHORT[p]}?"
    reply = _act(player, asked)
    assert f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}: {SCENARIO.view(0)[r][p]}." in reply


def test_cooperative_answers_a_proposal_before_sharing_its_values():
    """Facing a proposal on its first turn (no-talk proposes at once), cooperative must accept or
    reject: a message there is invalid, and three of them used to end every such game."""
    from selfplay.evaluate.scripted import evaluate_scripted

    s = evaluate_scripted(MATCHING, ("no-talk", "cooperative"), num_games=30, seed=7, n=3)
    assert s.summary.invalid_action_rate == 0.0 and s.summary.agreement_rate > 0.8


def test_explainer_picks_the_largest_free_value_first_and_its_partner_copies_the_picks():
    """explainer + explainer: values, values, the first seat's picks (each the largest value, own
    or stated, whose reviewer and paper are free), the other seat's proposal of exactly those
    pairs, accept; greedy on raw values scores between no-talk and cooperative."""
    from selfplay.game.matching.scripted import (
        SCRIPTED_NAMES,
        Explainer,
        format_picks,
        parse_picks,
    )

    for seed in range(40):
        (g,) = play_scripted(MATCHING, ("explainer", "explainer"), num_games=1, seed=seed, n=3)
        kinds = [a.kind for a in g.actions]
        assert kinds == ["message", "message", "message", "propose", "accept"], g.actions
        s = g.scenario
        known = {}
        for seat in (1, 0):  # seat 0 picks: its own values win a cell both know
            known.update({(r, p): v for r, row in enumerate(s.view(seat))
                          for p, v in enumerate(row) if v is not None})  # fmt: skip
        picks, rows, cols = [], set(), set()
        for (r, p), v in sorted(known.items(), key=lambda kv: (-kv[1], kv[0])):
            if r not in rows and p not in cols:
                picks.append((r, p, v))
                rows.add(r)
                cols.add(p)
        assert g.actions[2].text.startswith("[message] " + format_picks(picks))
        assert sorted(g.actions[3].proposal) == parse_picks(g.actions[2].text, 3)
        assert sorted(g.actions[3].proposal) == sorted(parse_proposal(g.actions[3].text[10:], 3))
    assert parse_picks("Highest first: BLEU: Ava Li (3), Electra: Ava Li", 3) is None
    assert Explainer.name in SCRIPTED_NAMES
    score = {
        name: evaluate_scripted(
            MATCHING, (name, name), num_games=60, seed=3, n=3
        ).summary.reward_mean
        for name in ("explainer", "cooperative", "no-talk")
    }
    assert score["no-talk"] + 0.03 < score["explainer"] < score["cooperative"]


def test_explainer_picks_script_counts_greedy_picks_and_copies():
    """scripts/explainer_picks.py: the explainer's own games score every count; the same games
    with each picks message reversed (the smallest value first) keep their copies' count only
    where the proposal still equals the picks, and no first pick is the largest."""
    import importlib.util
    from pathlib import Path

    from selfplay.game.matching.scripted import PICKS

    path = Path(__file__).parents[1] / "scripts" / "explainer_picks.py"
    spec = importlib.util.spec_from_file_location("explainer_picks", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    games = play_scripted(MATCHING, ("explainer", "explainer"), num_games=20, seed=5, n=3)
    c = mod.pick_stats(games)
    assert c["games"] == c["with_picks"] == c["picks_greedy"] == c["first_largest"] == 20
    assert c["proposal_copies"] == c["proposed"] == 20

    def reverse(a):
        if PICKS not in a.text:
            return a
        head, items = a.text.split(PICKS)
        return a.model_copy(update={"text": head + PICKS + ", ".join(items.split(", ")[::-1])})

    flipped = [g.model_copy(update={"actions": [reverse(a) for a in g.actions]}) for g in games]
    c = mod.pick_stats(flipped)
    assert c["with_picks"] == c["picks_greedy"] == c["proposal_copies"] == 20  # same pairs
    assert c["first_largest"] == 0


def test_asker_asks_its_unknown_cells_then_picks_from_the_answers_and_proposes_the_picks():
    """asker + shy: direct questions about the cells the asker does not know, in table order, at
    most 2(n - 1); then picks over its own values and shy's answers (greedy_picks); then a
    proposal of exactly those pairs. picker plays the same without the questions. With 20 actions
    and every proposal new (``rules.best_untried`` exact), the questions cost more actions than
    they earn against shy (the learning audit's finding; before the fix asking looked worth
    +0.03 because picker re-proposed rejected assignments)."""
    from selfplay.game.matching.scripted import format_picks, greedy_picks, parse_picks

    for seed in range(20):
        (g,) = play_scripted(
            MATCHING, ("asker", "shy"), num_games=1, seed=seed, n=3, max_actions=20
        )
        s = g.scenario
        view, theirs = s.view(0), s.view(1)
        unknown = [(r, p) for r in range(3) for p in range(3) if view[r][p] is None][:4]
        asked = [a.text for a in g.actions[0 : 2 * len(unknown) : 2]]
        assert asked == [
            f"[message] What is the score for {REVIEWERS[r]} on {PAPERS_SHORT[p]}?"
            for r, p in unknown
        ]
        answers = {(r, p): theirs[r][p] for r, p in unknown if theirs[r][p] is not None}
        picks = g.actions[2 * len(unknown)]
        assert picks.text == "[message] " + format_picks(greedy_picks(view, answers))
        proposal = g.actions[2 * len(unknown) + 2]
        assert sorted(proposal.proposal) == parse_picks(picks.text, 3)
        (p,) = play_scripted(
            MATCHING, ("picker", "shy"), num_games=1, seed=seed, n=3, max_actions=20
        )
        assert p.actions[0].text == "[message] " + format_picks(greedy_picks(view, {}))
        assert not any("?" in a.text for a in p.actions)
    score = {
        name: evaluate_scripted(
            MATCHING, (name, "shy"), num_games=60, seed=7, n=3, max_actions=20
        ).summary
        for name in ("asker", "picker")
    }
    assert score["asker"].direct_questions_per_game > 3 and score["picker"].questions_per_game == 0
    assert score["asker"].reward_mean < score["picker"].reward_mean
