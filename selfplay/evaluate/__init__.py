"""The evaluate stage (``selfplay eval``): models beside baselines and humans on held-out scenarios.

``run_eval(EvalConfig) -> EvalResult`` is the entry point (``run.py``). ``config.py`` holds what
an evaluation is asked and returns (eval.json), ``scripted.py`` the scripted pairs
(``--players``), ``human.py`` the human reference row, ``report.py`` eval.md and its plots.
"""

from selfplay.evaluate.config import EvalConfig, EvalResult, ModelSpec

__all__ = ["EvalConfig", "EvalResult", "ModelSpec", "run_eval"]


def __getattr__(name: str):
    if name == "run_eval":
        from selfplay.evaluate.run import run_eval

        return run_eval
    raise AttributeError(name)
