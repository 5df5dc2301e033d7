"""The question detector: a labelled table (the original analysis patterns included)."""

from __future__ import annotations

import math

import pytest

from selfplay.game.matching.questions import classify_question
from selfplay.game.matching.rules import generate_scenario
from selfplay.metrics import question_counts, summarize
from selfplay.records import ActionRecord, GameRecord, SeatConfig

LABELLED = [
    # direct: a question naming a reviewer and a paper
    ("What is Ava Li's score for BLEU?", "direct"),
    ("what do you have for Noah on GloVe", "direct"),
    ("Score for Daniel Nguyen on Electra", "direct"),
    ("What's the affinity between Sofia Patel and SWAG?", "direct"),
    ("affinity between Morgan and LLaMA", "direct"),
    ("How good is Ethan Smith at QuAC?", "direct"),
    ("Do you know Joseph Santos for RoBERTa", "direct"),
    ("Can you tell me Petrov's number for GLUE", "direct"),
    ("Is Ava good for GloVe?", "direct"),
    ("tell me about Wilson and BLEU", "direct"),
    ("I have Ava on BLEU at 320. What about Daniel on Electra?", "direct"),
    ("Any info on Reed for SWAG?", "direct"),
    # general: questions without a reviewer and a paper together
    ("What do you know?", "general"),
    ("Which reviewers look strong to you?", "general"),
    ("Who should take BLEU?", "general"),
    ("How about Ava?", "general"),
    ("Can you share your table?", "general"),
    ("Do you have any high scores?", "general"),
    ("What are your best values", "general"),
    ("Should we propose now?", "general"),
    ("Let me know your strongest matches.", "general"),
    ("Thoughts on QuAC?", "general"),
    ("Could you list what you see for Sofia", "general"),
    ("Are you ready to accept", "general"),
    # not questions
    ("I think Ava Li fits BLEU well.", "none"),
    ("My known scores: Ava Li: BLEU 320, GloVe 122", "none"),
    ("Okay.", "none"),
    ("Sounds good, let's go with that.", "none"),
    ("Noah Wilson is strong on SWAG; Daniel on Electra.", "none"),
    ("Hello partner!", "none"),
    ("I'll propose shortly.", "none"),
    ("That proposal looks great to me.", "none"),
    ("Ethan is my best option for QuAC", "none"),
    ("I don't know the score for Ava Li on BLEU.", "none"),  # the shy partner's answer
]


def test_table_has_enough_rows():
    assert len(LABELLED) >= 30
    assert {label for _, label in LABELLED} == {"direct", "general", "none"}


@pytest.mark.parametrize(("text", "label"), LABELLED)
def test_classify_question(text, label):
    assert classify_question(text) == label


def _record(messages: list[tuple[int, str]], reward: float) -> GameRecord:
    s = generate_scenario(1, 3, max_tables=10)
    seat = SeatConfig(kind="scripted", name="x")
    actions = [
        ActionRecord(seat=st, text=f"[message] {t}", kind="message", valid=True)
        for st, t in messages
    ]
    actions.append(ActionRecord(seat=0, text="[message] ?", kind="message", valid=False))
    return GameRecord(
        game_id="g", scenario_id=s.id, seed=1, scenario=s, seats=(seat, seat),
        actions=actions, outcome="accepted", score=0, reward=reward,
    )  # fmt: skip


def test_counts_per_seat_and_kind_and_correlation():
    a = _record([(0, "Ava on BLEU?"), (1, "What do you know?"), (0, "Fine.")], 0.9)
    b = _record([(1, "Ava Li score for Electra?"), (1, "Daniel for GloVe?")], 0.5)
    c = _record([(0, "Okay.")], 0.1)
    assert question_counts(a) == {
        "seat0_direct": 1, "seat0_general": 0, "seat1_direct": 0, "seat1_general": 1,
    }  # fmt: skip
    assert question_counts(b)["seat1_direct"] == 2
    s = summarize([a, b, c])
    assert s.questions_per_game == pytest.approx(4 / 3)
    assert s.direct_questions_per_game == pytest.approx(1.0)
    assert s.general_questions_per_game == pytest.approx(1 / 3)
    assert s.questions_per_game_seat0 == pytest.approx(1 / 3)
    assert s.questions_per_game_seat1 == pytest.approx(1.0)
    assert -1.0 <= s.question_reward_corr <= 1.0
    assert math.isnan(summarize([c, c]).question_reward_corr)
