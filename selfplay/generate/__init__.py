"""The generate stage (``selfplay generate``): games played through an engine into games.jsonl.

``run_generate(GenerateConfig, EngineConfig) -> GenerateResult`` is the entry point
(``runner.py``). ``config.py`` holds the options, ``play.py`` one game between two players,
``rollout.py`` the one rollout path (plans, seating, many games at once) that eval and iterate's
held-out evaluation share, ``teacher.py`` the teacher games a warm start clones.
"""

from selfplay.generate.config import GenerateConfig, GenerateOptions, PlayOptions

__all__ = ["GenerateConfig", "GenerateOptions", "GenerateResult", "PlayOptions", "run_generate"]


def __getattr__(name: str):
    # the runner imports the engines' configs and players; keep `import selfplay.generate` light
    if name in ("run_generate", "GenerateResult"):
        from selfplay.generate import runner

        return getattr(runner, name)
    raise AttributeError(name)
