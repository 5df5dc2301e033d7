"""``scoped_env``: the one save-and-restore of the process environment (tracking, the in-process
trainer)."""

from __future__ import annotations

import os

import pytest

from selfplay.environ import scoped_env


def test_scoped_env_sets_values_and_restores_every_variable_it_saved(monkeypatch):
    monkeypatch.setenv("SELFPLAY_T_KEPT", "before")
    monkeypatch.delenv("SELFPLAY_T_NEW", raising=False)
    monkeypatch.setenv("SELFPLAY_T_WRITTEN", "old")
    monkeypatch.delenv("SELFPLAY_T_ADDED", raising=False)
    with (
        pytest.raises(RuntimeError, match="inside"),
        scoped_env(
            {"SELFPLAY_T_KEPT": "during", "SELFPLAY_T_NEW": "x"},
            keys=("SELFPLAY_T_WRITTEN", "SELFPLAY_T_ADDED"),
        ),
    ):
        assert (os.environ["SELFPLAY_T_KEPT"], os.environ["SELFPLAY_T_NEW"]) == ("during", "x")
        os.environ["SELFPLAY_T_WRITTEN"] = "by the block"  # what verl does to MASTER_PORT
        os.environ["SELFPLAY_T_ADDED"] = "by the block"
        raise RuntimeError("inside")  # an error in the block restores too
    assert os.environ["SELFPLAY_T_KEPT"] == "before"
    assert os.environ["SELFPLAY_T_WRITTEN"] == "old"
    assert "SELFPLAY_T_NEW" not in os.environ and "SELFPLAY_T_ADDED" not in os.environ


def test_the_trackers_and_the_trainer_share_it():
    from selfplay import tracking
    from selfplay.train import workers

    assert tracking.scoped_env is scoped_env and workers.scoped_env is scoped_env
