"""The matching game's rules: conformance vectors, the 134 human games, properties, statistics."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from selfplay.game.api import Outcome
from selfplay.game.matching.rules import (
    PAPERS,
    PAPERS_SHORT,
    REVIEWERS,
    ProposalError,
    _batched_max_assignment,
    best_assignment,
    format_proposal,
    generate_scenario,
    mentions,
    parse_proposal,
    scenario_from_arrays,
    score_assignment,
)
from selfplay.game.matching.turns import ERR_EMPTY, ERR_NOTHING_PENDING, ERR_PENDING, Game

# --- conformance vectors (shared/notes/dialop-matching.md) -----------------------------------


def test_vector1_best_assignment_4x4():
    table = [[7, 53, 17, 80], [44, 0, 99, 12], [65, 31, 2, 58], [9, 88, 40, 71]]
    pairs, value = best_assignment(table)
    assert pairs == [(0, 3), (1, 2), (2, 0), (3, 1)]
    assert value == 332


def test_vector2_identity_3x3():
    pairs, value = best_assignment([[10, 0, 0], [0, 10, 0], [0, 0, 1]])
    assert pairs == [(0, 0), (1, 1), (2, 2)]
    assert value == 21


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_vector3_overwrite_and_brute_force_best(seed):
    s = generate_scenario(seed)
    table = np.array(s.table)
    unknown_both = ~np.array(s.masks[0], bool) & ~np.array(s.masks[1], bool)
    assert (table[unknown_both] == 50).all()
    brute = max(table[np.arange(8), list(perm)].sum() for perm in itertools.permutations(range(8)))
    assert s.best == brute
    assert s.score(s.best_assignment) == s.best


def test_vector4_rendering_truncates_and_prints_zero():
    table = np.full((8, 8), 10)
    table[0, :2] = [0, 34]
    mask = np.zeros((8, 8), int)
    mask[0, :2] = 1
    s = scenario_from_arrays(table, (mask, np.ones((8, 8))), (9.434070124084455, 1.0))
    lines = s.view_csv(0).split("\n")
    assert lines[0] == "," + ",".join(PAPERS)
    assert lines[1] == "Ava Li,0,320,,,,,,"
    assert lines[2] == "Daniel Nguyen,,,,,,,,"


def test_lines_view_lists_each_known_cell_as_the_scripted_messages_name_it():
    """matching-lines shows the same table as one line per reviewer in the scripted players'
    message form, so parse_values reads back exactly the seat's known cells; the rules text says
    which cells are unknown, and nothing else of the intro differs from matching's."""
    from selfplay.game import GAMES
    from selfplay.game.matching.scripted import format_values, parse_values

    csv_game, lines_game = GAMES["matching"], GAMES["matching-lines"]
    for seed in range(20):
        s = generate_scenario(seed, 3 + seed % 4)
        for seat in (0, 1):
            view = s.view(seat)
            shown = lines_game.intro(s, seat)
            table = shown.split("Reviewer Paper Similarity Scores:\n")[1].split("\n\n")[0]
            assert table.count("\n") == s.n - 1  # one line per reviewer, known cells or "none"
            known = {
                (r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v is not None
            }
            assert parse_values(table.replace("\n", "; "), s.n) == known
            for line in table.split("\n"):  # a cooperative message's items are copies of lines
                name = line.split(":")[0]
                r = REVIEWERS.index(name)
                assert line == (format_values(view, range(r, r + 1)) or f"{name}: none")
            assert "cells not listed are unknown" in shown and "," + PAPERS[0] not in shown
            assert (
                csv_game.intro(s, seat)
                .replace(s.view_csv(seat), table)
                .replace("empty cells are", "cells not listed are")
                == shown
            )


def test_short_game_differs_from_lines_only_in_the_rules_text_and_is_shorter():
    """matching-short is matching-lines with the five-sentence rules: the table, the start line and
    every scripted decision are the same; the rules still name every tag and the proposal form;
    SmolLM2's tokenizer is not needed to see that the text is at most half as long."""
    from selfplay.evaluate.scripted import evaluate_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import INSTRUCTIONS, SHORT_INSTRUCTIONS

    lines_game, short = GAMES["matching-lines"], GAMES["matching-short"]
    for seed in range(10):
        s = generate_scenario(seed, 3 + seed % 6)
        for seat in (0, 1):
            full_rules = INSTRUCTIONS.format(n=s.n, unknown="cells not listed")
            short_rules = SHORT_INSTRUCTIONS.format(n=s.n, unknown="cells not listed")
            shown = short.intro(s, seat)
            assert shown == lines_game.intro(s, seat).replace(full_rules, short_rules)
            assert shown.startswith(f"Assign {s.n} reviewers to {s.n} papers")
            assert len(short_rules) * 2 <= len(full_rules)
            for tag in (
                "[message]",
                "[propose] Proposal:",
                "Paper: Reviewer",
                "[accept]",
                "[reject]",
            ):
                assert tag in shown
            assert ("You start the conversation." in shown) == (seat == 0)
    for players in (("cooperative", "cooperative"), ("cooperative", "shy")):
        a, b = (
            evaluate_scripted(GAMES[g], players, num_games=20, seed=5, n=3, max_actions=10)
            for g in ("matching-lines", "matching-short")
        )
        assert a.summary.reward_mean == b.summary.reward_mean


def _game(n=8, **kw) -> Game:
    return Game(generate_scenario(11, n), **kw)


def test_vector6_short_proposal_keeps_turn():
    g = _game()
    r = g.step(0, "[propose] Proposal:\nBLEU: Ava Li")
    assert not r.action.valid
    assert "have 8 lines" in r.action.error
    assert r.observations[0][0].startswith("Error: Your proposal must start with 'Proposal:'")
    assert r.observations[1] == []
    assert g.turn == 0 and not r.done


def test_vector7_accept_reject_flow():
    g = _game()
    r = g.step(0, "[accept]")
    assert not r.action.valid and r.action.error == ERR_NOTHING_PENDING and g.turn == 0
    pairs = g.scenario.best_assignment
    assert g.step(0, "[propose] " + format_proposal(pairs)).action.valid
    assert g.turn == 1
    r = g.step(1, "[message] hmm")
    assert not r.action.valid and r.action.error == ERR_PENDING and g.turn == 1
    r = g.step(1, "[reject]")
    assert r.action.valid and not r.done and g.turn == 1 and g.pending is None
    assert r.observations[0] == ["Partner: [reject]"]
    assert g.step(1, "[propose] " + format_proposal(pairs)).action.valid
    r = g.step(0, "[accept]")
    assert r.done and r.outcome is Outcome.ACCEPTED
    assert g.score == g.scenario.best and g.reward == 1.0


# --- human games ------------------------------------------------------------------------------


def test_vector5_first_human_game(human_games):
    game = human_games[0]
    proposal = [a for a in game["action_log"] if a["type"] == "proposal"][-1]
    pairs = parse_proposal(proposal["proposal"])
    assert set(pairs) == {(3, 3), (0, 2), (1, 1), (6, 6), (5, 4), (4, 5), (7, 0), (2, 7)}
    assert score_assignment(game["table"], pairs) == 599
    assert best_assignment(game["table"])[1] == game["best_assignment_reward"] == 599


def _accepted_proposal(game: dict) -> dict:
    log = game["action_log"]
    for i, a in enumerate(log):
        if a["type"] == "proposal_response" and a["response"]["accept"]:
            return next(b for b in reversed(log[:i]) if b["type"] == "proposal")
    raise AssertionError("no accepted proposal")


# Human game 32 was played with another reviewer roster (same table order: by last name).
OTHER_ROSTER = (
    "Olivia Anderson",
    "Lucas Brown",
    "Alexander Hill",
    "Noah Lee",
    "Mason Martin",
    "Ava Thompson",
    "Harper Walker",
    "Isabella Wright",
)


def test_all_human_games_parse_and_score(human_games):
    assert len(human_games) == 134
    rewards = []
    for game in human_games:
        proposal = _accepted_proposal(game)
        roster = OTHER_ROSTER if "Noah Lee" in proposal["proposal"] else REVIEWERS
        pairs = parse_proposal(proposal["proposal"], roster=roster)
        assert sorted(map(tuple, proposal["proposal_ids"])) == pairs
        assert score_assignment(game["table"], pairs) == game["result"]["score"]
        s = scenario_from_arrays(
            game["table"], (game["mask1"], game["mask2"]), (game["scale1"], game["scale2"])
        )
        assert s.best == game["best_assignment_reward"]
        rewards.append(s.score(pairs) / s.best)
    assert np.mean(rewards) == pytest.approx(0.921, abs=0.001)


# --- proposal parsing -------------------------------------------------------------------------

GOOD = "Proposal:\n" + "\n".join(f"{p}: {r}" for p, r in zip(PAPERS_SHORT, REVIEWERS))
IDENTITY = [(i, i) for i in range(8)]


@pytest.mark.parametrize(
    "text",
    [
        GOOD,
        GOOD.replace("\n", "<br/>"),
        GOOD.replace("\n", "<br/>&emsp; - "),
        GOOD.lower(),
        GOOD.replace("\n", "\n  * "),
        "Proposal:\n" + "\n".join(f"{p}: {r}" for p, r in zip(PAPERS, REVIEWERS)),
        "  " + GOOD.replace("\n", "\n\n") + "  \n",
    ],
)
def test_parse_accepts_variants(text):
    assert parse_proposal(text) == IDENTITY


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("BLEU: Ava Li", "must start with 'Proposal:'"),
        (GOOD.rsplit("\n", 1)[0], "have 8 lines"),
        (GOOD.replace("SWAG: Noah Wilson", "SWAG Noah Wilson"), "Paper: Reviewer"),
        (GOOD.replace("SWAG: Noah Wilson", "SWAT: Noah Wilson"), "Unknown paper 'SWAT'"),
        (GOOD.replace("SWAG: Noah Wilson", "SWAG: Noah Wilsen"), "Unknown reviewer 'Noah Wilsen'"),
        (GOOD.replace("SWAG: Noah Wilson", "SWAG: Ava Li"), "Reviewer Ava Li is assigned"),
        (GOOD.replace("SWAG: Noah Wilson", "BLEU: Noah Wilson"), "Paper BLEU is assigned twice"),
        (GOOD.replace("SWAG: Noah Wilson", "Noah Wilson: SWAG"), "reviewer first"),
        (GOOD.replace("SWAG: Noah Wilson", "SWAG: Noah"), "Unknown reviewer"),
    ],
)
def test_parse_errors_name_the_problem(text, needle):
    with pytest.raises(ProposalError, match=None) as e:
        parse_proposal(text)
    assert needle in str(e.value)


def test_parse_small_table():
    text = "Proposal:\nBLEU: Sofia Patel\nElectra: Ava Li\nGloVe: Daniel Nguyen"
    assert parse_proposal(text, 3) == [(0, 1), (1, 2), (2, 0)]
    with pytest.raises(ProposalError, match="Unknown paper"):
        parse_proposal(text.replace("GloVe", "GLUE"), 3)


@settings(max_examples=300, deadline=None)
@given(st.text())
def test_parser_raises_only_proposal_error(text):
    try:
        pairs = parse_proposal(text)
    except ProposalError:
        return
    assert sorted(r for r, _ in pairs) == list(range(8))


_TAGS = st.sampled_from(["[message] ", "[propose] ", "[accept]", "[reject]", "", "[MESSAGE]"])


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(_TAGS, st.text(max_size=40) | st.just(GOOD)), max_size=40))
def test_protocol_never_raises_on_any_text(moves):
    g = Game(generate_scenario(3, 4), max_actions=25, max_invalid=3)
    for tag, body in moves:
        if g.done:
            break
        r = g.step(g.turn, tag + body)
        assert r.action.valid or r.action.error
    assert len(g.actions) <= 25
    if g.done:
        assert g.outcome in (Outcome.ACCEPTED, Outcome.MAX_ACTIONS, Outcome.INVALID)
    assert 0.0 <= g.reward <= 1.0


# --- limits -----------------------------------------------------------------------------------


def test_consecutive_invalid_limit_ends_with_zero():
    g = _game(max_invalid=3)
    g.step(0, "hello")
    g.step(0, "[message]")
    assert not g.done
    r = g.step(0, "[accept]")
    assert r.done and r.outcome is Outcome.INVALID and g.reward == 0.0
    assert [a.error for a in g.actions][1] == ERR_EMPTY


def test_valid_action_resets_invalid_streak():
    g = _game(max_invalid=2, max_actions=100)
    for _ in range(5):
        g.step(g.turn, "oops")
        g.step(g.turn, "[message] hi")
    assert not g.done


def test_max_actions_ends_with_zero():
    g = _game(max_actions=4)
    for _ in range(4):
        r = g.step(g.turn, "[message] hi")
    assert r.done and r.outcome is Outcome.MAX_ACTIONS and g.reward == 0.0


# --- generation -------------------------------------------------------------------------------


def test_same_seed_same_scenario():
    a, b = generate_scenario(123), generate_scenario(123)
    assert a.model_dump_json() == b.model_dump_json()
    assert generate_scenario(124).table != a.table


@pytest.mark.parametrize("n", [3, 4, 5, 6, 7, 8])
def test_sizes(n):
    s = generate_scenario(5, n, max_tables=2000)
    assert len(s.table) == n and all(len(r) == n for r in s.table)
    assert s.reviewers == REVIEWERS[:n]
    assert s.best == best_assignment(s.table)[1]


def test_batched_dp_matches_hungarian():
    rng = np.random.default_rng(0)
    tables = rng.integers(0, 100, (300, 8, 8), dtype=np.int32)
    values = _batched_max_assignment(tables)
    assert [best_assignment(t)[1] for t in tables] == values.tolist()


def test_distribution_over_1000_seeds():
    scenarios = [generate_scenario(seed) for seed in range(1000)]
    m1 = np.array([s.masks[0] for s in scenarios], bool)
    m2 = np.array([s.masks[1] for s in scenarios], bool)
    assert m1.mean() == pytest.approx(0.38, abs=0.02)
    assert m2.mean() == pytest.approx(0.38, abs=0.02)
    assert (m1 | m2).mean() == pytest.approx(0.64, abs=0.02)
    assert np.mean([s.best for s in scenarios]) == pytest.approx(611, abs=10)
    assert np.mean([s.passed_filter for s in scenarios]) >= 0.97
    scales = np.array([s.scales for s in scenarios])
    assert scales.min() >= 1.0 and scales.max() <= 10.0


def _mentions_by_name(text: str, n: int) -> tuple[set[int], set[int]]:
    """The plain definition: one word-bounded search per name."""
    low = text.casefold()

    def named(*words: str) -> bool:
        return any(re.search(rf"\b{re.escape(w.casefold())}\b", low) for w in words)

    return (
        {i for i, r in enumerate(REVIEWERS[:n]) if named(r, *r.split())},
        {i for i, p in enumerate(PAPERS_SHORT[:n]) if named(p)},
    )


_WORDS = [*REVIEWERS, *(w for r in REVIEWERS for w in r.split()), *PAPERS_SHORT, "avalon", "bleus"]


@given(
    st.lists(st.sampled_from(_WORDS) | st.sampled_from([" ", ", ", "?", "'s ", "-", "x"])),
    st.integers(3, 8),
)
def test_mentions_finds_what_a_search_per_name_finds(parts, n):
    text = "".join(parts)
    assert mentions(text, n) == _mentions_by_name(text, n)


def test_ranked_view_lists_the_known_cells_highest_first_and_changes_no_decision():
    """matching-ranked shows each known cell on a line of its own, highest value first, in the
    scripted messages' item form, and its scripted players state their values in that order:
    parse_values reads back exactly the seat's cells (view and message), and every scripted pair
    scores game for game what it scores in matching-lines."""
    from selfplay.evaluate.scripted import evaluate_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.scripted import make_scripted, parse_values

    ranked = GAMES["matching-ranked"]
    for seed in range(20):
        s = generate_scenario(seed, 3 + seed % 4)
        for seat in (0, 1):
            view = s.view(seat)
            known = {
                (r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v is not None
            }
            shown = ranked.intro(s, seat)
            table = shown.split("Reviewer Paper Similarity Scores:\n")[1].split("\n\n")[0]
            lines = table.split("\n")
            assert len(lines) == max(1, len(known))
            assert parse_values(table.replace("\n", "; "), s.n) == known
            values = [int(line.rsplit(" ", 1)[1]) for line in lines if known]
            assert values == sorted(values, reverse=True)
            assert "cells not listed are unknown" in shown
            message = ranked.scripted("cooperative", s, seat).decide()
            if not known:
                assert message == "[message] I know no scores here."
                continue
            assert message.startswith("[message] My known scores, highest first: ")
            assert parse_values(message, s.n) == known
            body = message.split("highest first: ")[1]
            assert body.split("; ") == lines  # the message states the view's lines, in order
            plain = make_scripted("cooperative", s, seat).decide()
            assert plain.startswith("[message] My known scores: ")
            assert parse_values(plain, s.n) == known
    for players in (("explainer", "explainer"), ("cooperative", "cooperative")):
        a, b = (
            evaluate_scripted(GAMES[g], players, num_games=30, seed=3, n=3, max_actions=10)
            for g in ("matching-lines", "matching-ranked")
        )
        assert a.summary.reward_mean == b.summary.reward_mean
        assert a.summary.stated_value_accuracy == b.summary.stated_value_accuracy == 1.0


def test_gaps_view_lists_the_unknown_cells_and_the_askers_questions_copy_them_in_order():
    """matching-gaps is matching-ranked with the seat's unknown cells listed after its known ones,
    one a line in table order, in a direct question's words; scripted:asker's questions against
    shy name exactly the first lines of that list, in order, and every scripted pair scores game
    for game what it scores in matching-ranked (the view changes no decision)."""
    import asyncio

    from selfplay.evaluate.scripted import evaluate_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import GAPS_HEADER, TABLE_HEADER
    from selfplay.game.matching.scripted_ask import QUESTION

    gaps, ranked = GAMES["matching-gaps"], GAMES["matching-ranked"]
    for seed in range(20):
        s = generate_scenario(seed, 3 + seed % 4)
        for seat in (0, 1):
            view = s.view(seat)
            shown = gaps.intro(s, seat)
            table = ranked.intro(s, seat).split(TABLE_HEADER)[1].split("\n\nYou start")[0]
            assert shown.split(TABLE_HEADER)[1].startswith(f"{table}\n\n{GAPS_HEADER}\n")
            assert f'the cells under "{GAPS_HEADER}" are unknown' in shown
            listed = shown.split(GAPS_HEADER + "\n")[1].split("\n\n")[0].split("\n")
            unknown = [
                f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}"
                for r in range(s.n)
                for p in range(s.n)
                if view[r][p] is None
            ]
            assert listed == (unknown or ["none"])
            # the asker's questions, played against shy, copy the list's first lines in order
            asker, shy = gaps.scripted("asker", s, seat), gaps.scripted("shy", s, 1 - seat)
            asked = []
            for _ in range(2 * s.n):
                move = asker.decide()
                asked += [f"{name} on {paper}" for name, paper in QUESTION.findall(move)]
                if not move.startswith("[message]") or "?" not in move:
                    break
                reply = asyncio.run(shy.act(f"Partner: {move}"))
                asker.observe("message", reply.removeprefix("[message] "))
            assert asked == unknown[: len(asked)] and len(asked) == min(len(unknown), 2 * (s.n - 1))
    for players in (("asker", "shy-strict"), ("picker", "shy"), ("cooperative", "cooperative")):
        a, b = (
            evaluate_scripted(GAMES[g], players, num_games=30, seed=3, n=3, max_actions=20)
            for g in ("matching-ranked", "matching-gaps")
        )
        assert a.summary.reward_mean == b.summary.reward_mean


def test_late_asker_asks_only_after_a_rejection_then_proposes_its_picks_with_the_answers():
    """scripted:late-asker against shy-strict: no question before its first proposal is
    rejected; after it, questions about its unknown cells in table order (as asker's), then a
    'Highest first' message over its values and the answers, and a proposal of exactly those
    picks. A game whose first proposal is accepted has no question."""
    from selfplay.evaluate.scripted import play_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import unknown_cells
    from selfplay.game.matching.questions import parse_answers
    from selfplay.game.matching.scripted import greedy_picks, parse_picks
    from selfplay.game.matching.scripted_ask import QUESTION

    game = GAMES["matching-gaps"]
    games = play_scripted(game, ("late-asker", "shy-strict"), num_games=40, seed=5, n=3,
                          max_actions=20)  # fmt: skip
    asked_in = accepted_first = repicked = 0
    for g in games:
        acts = g.actions
        first = next(i for i, a in enumerate(acts) if a.seat == 0 and a.kind == "propose")
        assert not any(QUESTION.findall(a.text) for a in acts[:first] if a.seat == 0)
        questions = [q for a in acts if a.seat == 0 for q in QUESTION.findall(a.text)]
        if first + 1 >= len(acts) or acts[first + 1].kind != "reject":
            accepted_first += 1
            assert questions == []
            continue
        own = g.scenario.view(0)
        unknown = [(REVIEWERS[r], PAPERS_SHORT[p]) for r, p in unknown_cells(own)]
        assert questions == unknown[: len(questions)]
        assert len(questions) == min(len(unknown), 2 * (g.scenario.n - 1))
        if not questions:
            continue
        asked_in += 1
        answers = {}
        for a in acts:
            if a.seat == 1:
                answers.update(parse_answers(a.text, 3))
        expected = sorted((r, p) for r, p, _ in greedy_picks(own, answers))
        said = [i for i, a in enumerate(acts) if i > first and "Highest first" in a.text]
        if expected == sorted(map(tuple, acts[first].proposal)):
            assert said == []  # the answers left the rejected picks: nothing new to say
            continue
        repicked += 1
        assert parse_picks(acts[said[0]].text, 3) == expected
        nxt = next(a for a in acts[said[0] :] if a.seat == 0 and a.kind == "propose")
        assert sorted(map(tuple, nxt.proposal)) == expected
    assert asked_in >= 5 and accepted_first >= 3 and repicked >= 3  # every branch was played


def test_notes_view_shows_the_answers_merged_and_the_askers_picks_read_off_it():
    """matching-notes: after each partner message that answers about a cell the seat does not
    know, the seat is shown its known cells merged with every answer so far, highest first; a
    restated answer shows nothing new; scripted:asker's picks after asking are the greedy walk
    down the last such list; scripted pairs score game for game as on matching-gaps."""
    import asyncio

    from selfplay.evaluate.scripted import evaluate_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import NOTES_HEADER
    from selfplay.game.matching.scripted import parse_picks

    notes, gaps = GAMES["matching-notes"], GAMES["matching-gaps"]
    seen_notes = checked_picks = 0
    for seed in range(12):
        s = generate_scenario(seed, 3 + seed % 2)
        rules = notes.new_game(s, max_actions=30)
        players = (notes.scripted("asker", s, 0), notes.scripted("shy", s, 1))
        shown: list[list[str]] = [[notes.intro(s, 0)], [notes.intro(s, 1)]]
        answers: dict[tuple[int, int], int] = {}
        last_list: list[tuple[int, int, int]] | None = None
        while not rules.done:
            seat = rules.turn
            observation, shown[seat] = "\n\n".join(shown[seat]), []
            text = asyncio.run(players[seat].act(observation))
            if seat == 0 and text.startswith("[message] Highest first") and last_list:
                rows, cols, walk = set(), set(), []
                for r, p, _ in last_list:  # the greedy walk down the list
                    if r not in rows and p not in cols:
                        walk.append((r, p))
                        rows.add(r)
                        cols.add(p)
                if len(walk) == s.n:
                    assert parse_picks(text, s.n) == sorted(walk)
                    checked_picks += 1
            result = rules.step(seat, text)
            for k in (0, 1):
                shown[k].extend(result.observations[k])
            if seat == 1 and result.action.kind == "message":
                view = s.view(0)
                stated = {
                    (REVIEWERS.index(name), PAPERS_SHORT.index(paper)): int(v)
                    for name, paper, v in re.findall(r"(\w+ \w+) on (\w+): (\d+)", text)
                }
                new = {c: v for c, v in stated.items() if view[c[0]][c[1]] is None}
                fresh = {c: v for c, v in new.items() if answers.get(c) != v}
                answers.update(new)
                listed = [o for o in result.observations[0] if o.startswith(NOTES_HEADER)]
                assert len(listed) == (1 if fresh else 0)
                if fresh:
                    seen_notes += 1
                    merged = {
                        (r, p): v for r, row in enumerate(view) for p, v in enumerate(row) if v
                    } | answers
                    last_list = sorted(((r, p, v) for (r, p), v in merged.items()),
                                       key=lambda c: (-c[2], c[0], c[1]))  # fmt: skip
                    lines = listed[0].split("\n")[1:]
                    assert lines == [
                        f"{REVIEWERS[r]}: {PAPERS_SHORT[p]} {v}" for r, p, v in last_list
                    ]
    assert seen_notes >= 10 and checked_picks >= 5
    for players in (("asker", "shy-strict"), ("late-asker", "shy-strict"), ("picker", "shy"),
                    ("cooperative", "cooperative"), ("inquisitive", "shy")):  # fmt: skip
        a, b = (
            evaluate_scripted(g, players, num_games=30, seed=3, n=3, max_actions=20)
            for g in (gaps, notes)
        )
        assert a.summary.reward_mean == b.summary.reward_mean


def test_advice_view_shows_the_best_untried_proposal_and_the_advised_players_copy_it():
    """matching-advice: the table ends with the best proposal by the seat's own values; after a
    partner message stating a value new to the seat or replying to its question, and after the
    partner rejects the seat's proposal, the seat is shown (once it has asked) the cells left to
    ask, then the best proposal by its values and every stated value (in its scale) that it has
    not had rejected; nothing else shows it. The advised players' every proposal is the text of
    the last advice they were shown and every question after the first is the first line left
    to ask; advised never asks, advised-asker asks the gaps list's cells in order,
    advised-late-asker only after a rejection; scripted decisions equal matching-gaps'."""
    import asyncio

    from selfplay.evaluate.scripted import evaluate_scripted
    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import (
        ADVICE_HEADER,
        GAPS_HEADER,
        LEFT_HEADER,
        unknown_cells,
    )
    from selfplay.game.matching.questions import parse_answers
    from selfplay.game.matching.rules import (
        best_assignment,
        best_untried,
        estimate_table,
        parse_proposal,
    )
    from selfplay.game.matching.scripted_ask import QUESTION

    game, gaps = GAMES["matching-advice"], GAMES["matching-gaps"]
    counts = {"answer": 0, "reject": 0, "asked": 0, "left": 0}
    for seed in range(16):
        s = generate_scenario(seed, 3 + seed % 2)
        intro = game.intro(s, 0)
        assert intro.split(ADVICE_HEADER)[0].rstrip() == gaps.intro(s, 0).split("\n\nYou")[0]
        assert GAPS_HEADER in intro and "\n\nYou start" in intro and LEFT_HEADER not in intro
        first = parse_proposal(intro.split(ADVICE_HEADER + "\n")[1].split("\n\n")[0], s.n)
        assert first == best_untried(estimate_table(s.view(0), {}), [])
        name = ("advised", "advised-asker", "advised-late-asker")[seed % 3]
        partner = ("shy-strict", "shy")[seed % 2]
        rules = game.new_game(s, max_actions=24)
        players = (game.scripted(name, s, 0), game.scripted(partner, s, 1))
        shown: list[list[str]] = [[game.intro(s, 0)], [game.intro(s, 1)]]
        advice = intro.split(ADVICE_HEADER + "\n")[1].split("\n\n")[0]
        left: list[str] | None = None
        stated: dict[tuple[int, int], int] = {}
        rejected: list = []
        asked: list[tuple[int, int]] = []
        questions: list[str] = []
        unknown = unknown_cells(s.view(0))
        asks_before: list = []
        while not rules.done:
            seat = rules.turn
            observation, shown[seat] = "\n\n".join(shown[seat]), []
            text = asyncio.run(players[seat].act(observation))
            if seat == 0 and text.startswith("[propose]"):
                assert text == "[propose] " + advice
            asks = QUESTION.findall(text) if seat == 0 else []
            if asks:
                if left is not None:
                    assert f"{asks[0][0]} on {asks[0][1]}" == left[0]
                    counts["left"] += 1
                questions += [f"{r} on {p}" for r, p in asks]
                asked += [(REVIEWERS.index(r), PAPERS_SHORT.index(p)) for r, p in asks]
            result = rules.step(seat, text)
            for k in (0, 1):
                shown[k].extend(result.observations[k])
            told = [o for o in result.observations[0] if ADVICE_HEADER in o]
            kind = result.action.kind
            new = {}
            if seat == 1 and kind == "message":
                new = {c: v for c, v in parse_answers(text, s.n).items() if stated.get(c) != v}
                stated.update(new)
            if seat == 1 and kind == "reject":
                rejected.append(parse_proposal(advice, s.n))
                counts["reject"] += 1
            replied = seat == 1 and kind == "message" and bool(asks_before)
            assert len(told) == (1 if new or replied or (seat == 1 and kind == "reject") else 0)
            if told:
                counts["answer"] += bool(new)
                block, advice = told[0].split(ADVICE_HEADER + "\n")
                if asked:
                    lines = block.strip().split("\n")
                    assert lines[0] == LEFT_HEADER
                    budget = 2 * (s.n - 1) - len(asked)
                    want = [c for c in unknown if c not in asked and c not in stated][:budget]
                    left = lines[1:]
                    assert left == (
                        [f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}" for r, p in want] or ["none"]
                    )
                else:
                    assert block == ""
                pairs = parse_proposal(advice, s.n)
                estimate = estimate_table(s.view(0), stated)
                assert pairs not in rejected
                assert pairs == best_untried(estimate, rejected)
                if not rejected:  # a maximum of the estimate (ties may differ from Hungarian's)
                    best = best_assignment(estimate)[0]
                    value = sum(estimate[r, p] for r, p in pairs)
                    assert value == pytest.approx(sum(estimate[r, p] for r, p in best))
            if seat == 0:
                asks_before = asks
        order = [f"{REVIEWERS[r]} on {PAPERS_SHORT[p]}" for r, p in unknown]
        if name == "advised":
            assert questions == []
        else:
            assert questions == order[: len(questions)]
            counts["asked"] += bool(questions)
    assert counts["answer"] >= 5 and counts["reject"] >= 3 and counts["asked"] >= 4
    assert counts["left"] >= 10
    for players in (("advised-asker", "shy-strict"), ("advised-late-asker", "shy"),
                    ("advised", "shy-strict"), ("asker", "shy")):  # fmt: skip
        a, b = (
            evaluate_scripted(g, players, num_games=30, seed=3, n=3, max_actions=20)
            for g in (gaps, game)
        )
        assert a.summary.reward_mean == b.summary.reward_mean


@settings(max_examples=60, deadline=None)
@given(st.integers(3, 8), st.integers(0, 2**32 - 1), st.data())
def test_ranked_assignments_are_all_best_first_and_best_untried_is_exact(n, seed, data):
    """Up to 5x5 the ranking enumerates all n! assignments; above, Murty's k-best gives the same
    values in the same order (checked against enumeration by forcing it on small tables);
    ``best_untried`` is the first assignment not rejected, never a rejected one, and None once
    every assignment was rejected."""
    import math

    from selfplay.game.matching.assignments import best_untried, murty_ranking, ranked_assignments

    rng = np.random.default_rng(seed)
    estimate = rng.integers(0, 6, (n, n)).astype(float)  # small values: many ties
    k = min(math.factorial(n), 40)
    ranked = list(itertools.islice(ranked_assignments(estimate), k))
    values = [v for v, _ in ranked]
    assert values == sorted(values, reverse=True)
    assert len({tuple(p) for _, p in ranked}) == k
    for v, pairs in ranked:
        assert sorted(r for r, _ in pairs) == sorted(p for _, p in pairs) == list(range(n))
        assert v == sum(estimate[r, p] for r, p in pairs)
    if n <= 5:
        murty = list(murty_ranking(estimate))
        assert len(murty) == math.factorial(n) == len(list(ranked_assignments(estimate)))
        assert [v for v, _ in murty] == [v for v, _ in ranked_assignments(estimate)]
    rejected = [pairs for _, pairs in ranked[: data.draw(st.integers(0, k - 1))]]
    rejected = data.draw(st.permutations(rejected))
    chosen = best_untried(estimate, rejected)
    assert chosen not in rejected
    assert sum(estimate[r, p] for r, p in chosen) == values[len(rejected)]
    if n <= 4:
        assert best_untried(estimate, [p for _, p in ranked_assignments(estimate)]) is None


@pytest.mark.parametrize("view", ["matching-advice", "matching-gaps", "matching"])
def test_no_view_or_scripted_player_offers_a_rejected_proposal_again(view):
    """Over many scenarios and every scripted player beside every partner that rejects: the
    advice a seat is shown is never one of its rejected proposals, and a scripted player that
    proposes from the best untried assignment never proposes a rejected one again (proposer,
    advised, advised-asker, inquisitive, asker; the others propose by other rules)."""
    import asyncio

    from selfplay.game import GAMES
    from selfplay.game.matching.prompts import ADVICE_HEADER, ADVICE_NONE
    from selfplay.game.matching.rules import parse_proposal
    from selfplay.game.matching.scripted import SCRIPTED_NAMES

    game = GAMES[view]
    untried = {"proposer", "advised", "advised-asker", "advised-late-asker", "inquisitive"}
    checked = {"advice": 0, "repeat": 0, "rejections": 0}
    for seed in range(12):
        s = generate_scenario(1000 + seed, 3 + seed % 2)
        for name in SCRIPTED_NAMES:
            for partner in ("shy-strict", "shy", "random"):
                players = (game.scripted(name, s, 0, seed=seed), game.scripted(partner, s, 1))
                rules = game.new_game(s, max_actions=24)
                shown: list[list[str]] = [[game.intro(s, 0)], [game.intro(s, 1)]]
                proposed: list = [None, None]
                rejected: list[list] = [[], []]
                while not rules.done:
                    seat = rules.turn
                    observation, shown[seat] = "\n\n".join(shown[seat]), []
                    text = asyncio.run(players[seat].act(observation))
                    result = rules.step(seat, text)
                    kind = result.action.kind
                    if kind == "propose" and result.action.valid:
                        pairs = parse_proposal(text.split("]", 1)[1], s.n)
                        if name in untried and seat == 0:
                            assert pairs not in rejected[0], (name, partner, s.id)
                            checked["repeat"] += 1
                        proposed[seat] = pairs
                    if kind == "reject" and proposed[1 - seat] is not None:
                        rejected[1 - seat].append(proposed[1 - seat])
                        checked["rejections"] += 1
                    for k in (0, 1):
                        shown[k].extend(result.observations[k])
                        for o in result.observations[k]:
                            if ADVICE_HEADER not in o:
                                continue
                            advice = o.split(ADVICE_HEADER + "\n")[1].split("\n\n")[0]
                            checked["advice"] += 1
                            if advice != ADVICE_NONE:
                                assert parse_proposal(advice, s.n) not in rejected[k]
    assert checked["repeat"] > 100 and checked["rejections"] > 50
    assert (checked["advice"] > 100) == (view == "matching-advice")


def test_a_proposal_cap_ends_the_game_with_no_deal_at_the_last_rejection():
    """matching-cap2: the rules say the cap; the responder to the last allowed proposal is told
    so; rejecting it ends the game with NO_DEAL and reward 0; accepting it scores as usual; the
    uncapped game plays on. Scripted play: the capped reward equals the uncapped game's when it
    agreed within 2 proposals, else 0."""
    from selfplay.evaluate.scripted import play_scripted
    from selfplay.game import GAMES
    from selfplay.game.api import Outcome
    from selfplay.game.matching.turns import LAST_PROPOSAL

    capped, plain = GAMES["matching-cap2"], GAMES["matching"]
    s = generate_scenario(5, 3)
    assert "at most 2 proposals" in capped.intro(s, 0)
    assert "at most 2 proposals" not in plain.intro(s, 0)
    assert capped.intro(s, 0).endswith(plain.intro(s, 0).split("Scores:")[1])
    a = format_proposal([(0, 0), (1, 1), (2, 2)], 3)
    b = format_proposal([(0, 1), (1, 0), (2, 2)], 3)
    for game, ends in ((capped, True), (plain, False)):
        rules = game.new_game(s)
        first = rules.step(0, "[propose] " + a)
        assert LAST_PROPOSAL not in "\n".join(first.observations[1])
        rules.step(1, "[reject]")
        rules.step(1, "[propose] " + b)  # the rejecting seat keeps the turn
        last = rules.step(0, "[reject]")
        assert last.done is ends and rules.reward == 0
        assert (last.outcome is Outcome.NO_DEAL) is ends
    rules = capped.new_game(s)
    rules.step(0, "[propose] " + a)
    rules.step(1, "[reject]")
    shown = rules.step(1, "[propose] " + b).observations[0]
    assert any(LAST_PROPOSAL in o for o in shown)
    assert rules.step(0, "[accept]").outcome is Outcome.ACCEPTED
    assert rules.reward == s.score([(0, 1), (1, 0), (2, 2)]) / s.best
    games = {
        g.name: play_scripted(g, ("proposer", "shy"), num_games=24, seed=3, n=3, max_actions=30)
        for g in (capped, plain)
    }
    advice = GAMES["matching-advice-cap2"]
    assert "at most 2 proposals" in advice.intro(s, 0) and advice.new_game(s).max_proposals == 2
    for c, p in zip(games["matching-cap2"], games["matching"]):
        proposals = sum(x.kind == "propose" and x.valid for x in p.actions)
        agreed = p.outcome == "accepted" and proposals <= 2
        assert c.reward == (p.reward if agreed else 0.0)
        assert c.outcome == (p.outcome if proposals <= 2 else "no_deal")


def test_advised_beside_shy_strict_agrees_once_no_rejected_proposal_comes_back():
    """The learning audit's case: advised beside shy-strict on matching-advice (3x3, 20 actions,
    eval seed 1001, 96 games) looped on re-shown rejected proposals; with the exact view every
    game agrees (at least 0.97), and no game proposes a rejected assignment again."""
    from selfplay.evaluate.scripted import play_scripted
    from selfplay.game import GAMES

    games = play_scripted(
        GAMES["matching-advice"], ("advised", "shy-strict"), num_games=96, seed=1001, n=3,
        max_actions=20,
    )  # fmt: skip
    assert sum(g.outcome == "accepted" for g in games) / 96 >= 0.97
    for g in games:
        proposals = [tuple(a.proposal) for a in g.actions if a.kind == "propose" and a.valid]
        assert len(proposals) == len(set(proposals))
