"""Offline GRPO with verl: training rows (parquet) -> verl updates -> a Hugging Face checkpoint.

``train(TrainConfig(...)) -> TrainResult`` is the library entry point (``selfplay train`` and
``selfplay iterate`` call it); ``selfplay.train.batch`` holds the pure row -> tensor functions.
"""

from selfplay.train.config import TrainConfig

__all__ = ["TrainConfig", "TrainResult", "train"]


def __getattr__(name: str):
    # the trainer imports torch and verl; keep `import selfplay.train` light for the CLI
    if name in ("train", "TrainResult"):
        from selfplay.train import trainer

        return getattr(trainer, name)
    raise AttributeError(name)
