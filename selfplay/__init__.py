"""selfplay: self-play reinforcement learning for language models on cooperative dialogue games."""

__version__ = "0.1.0"
