"""The what-was-learned panel (evaluate.learned): identity with scripted players, the asking
split by each scenario's value of asking, and the first turn's probability of asking."""

from __future__ import annotations

import math

from selfplay.evaluate.learned import asking_split, first_decision, identity, panel
from selfplay.evaluate.scripted import play_scripted
from selfplay.game import get_game
from selfplay.records import append_records
from selfplay.seats import SeatConfig, SeatTokens

GAME = get_game("matching-advice-cap2")


def _games(name: str, n: int = 24):
    games = play_scripted(GAME, (name, "shy-strict"), num_games=n, seed=5, n=3, max_actions=20)
    return {g.scenario_id: g for g in games}


def test_identity_and_the_asking_split_read_what_a_policy_does(tmp_path):
    """A policy plays like itself in every game and like another only where their moves agree;
    advised-asker asks first everywhere (share 1.0 in both halves of the split), proposer
    nowhere; the panel names each comparison, its paired difference and the identity count."""
    proposer, asker, advised = _games("proposer"), _games("advised-asker"), _games("advised")
    assert identity(proposer, proposer) == (24, 24)
    same, n = identity(asker, proposer)
    assert n == 24 and same == 0  # one asks first, the other proposes first
    split = asking_split(asker, proposer, asker)
    pays, rest = split.scenarios
    assert pays + rest == 24 and pays > 0
    assert split.first_asks == (1.0, 1.0) and min(split.questions) > 0
    quiet = asking_split(proposer, proposer, asker)
    assert quiet.first_asks == (0.0, 0.0) and quiet.questions == (0.0, 0.0)
    files = {}
    for name, games in (("proposer", proposer), ("advised-asker", asker), ("advised", advised)):
        files[name] = tmp_path / f"{name}.jsonl"
        append_records(files[name], list(games.values()))
    md = "\n".join(panel(files["advised-asker"], files["advised"], files, "test"))
    assert "What the model learned (test split)" in md
    assert "| scripted advised-asker | 24 | +0.000 [+0.000, +0.000] | 24 of 24 games |" in md
    assert "| start | 24 |" in md and "asking pays (" in md


def test_first_decision_is_the_tag_tokens_probability(tiny_model):
    """p(ask) is the product of the first turn's tag tokens' probabilities after [message] and
    one minus it after [propose]; None without tokens or a tag."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model)
    (game,) = play_scripted(GAME, ("proposer", "shy"), num_games=1, seed=1, n=3)
    prompt = tok.encode("Your table: Ava Li on BLEU")
    for tag, ask in (("[message] What is the score?", True), ("[propose] Proposal:", False)):
        reply = tok.encode(tag)
        logprobs = [-0.1 * (i + 1) for i in range(len(reply))]
        tokens = SeatTokens(
            token_ids=prompt + reply,
            mask=[0] * len(prompt) + [1] * len(reply),
            logprobs=[0.0] * len(prompt) + logprobs,
        )
        record = game.model_copy(
            update={
                "tokens": (tokens, None),
                "seats": (SeatConfig(kind="llm", name=str(tiny_model)), game.seats[1]),
            }
        )
        n_tag = next(k for k in range(1, len(reply) + 1) if "]" in tok.decode(reply[:k]))
        p = math.exp(sum(logprobs[:n_tag]))
        assert math.isclose(first_decision(record, tok), p if ask else 1 - p)
        assert math.isclose(first_decision(record), p if ask else 1 - p)  # its own tokenizer
    assert first_decision(game) is None
