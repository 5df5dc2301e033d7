"""The loop (``selfplay iterate``): warm start, then generate -> convert -> train per round, each
model evaluated on held-out scenarios; resumable from the run's manifest.

``iterate(IterateConfig) -> Run`` is the entry point (``loop.py``: the run's table of stages and its
layout). ``config.py`` holds the options and what a resume must keep, ``resume.py`` the manifest on
disk and which rows of the table are done, ``stages.py`` a round's stages and the runner of any row,
``heldout.py`` the warm start and the held-out evaluation, ``child.py`` the child process each heavy
stage runs in, ``track.py`` the round's metrics, ``warm_start.py`` behaviour cloning (``selfplay
sft``, the warm start), ``report.py`` the run's REPORT.md and plots.
"""

from selfplay.iterate.config import IterateConfig

__all__ = ["IterateConfig", "iterate"]


def __getattr__(name: str):
    if name == "iterate":
        from selfplay.iterate.loop import iterate

        return iterate
    raise AttributeError(name)
