"""Players: given what their seat was just shown, return the seat's next action text.

The ``Player`` protocol lives on the seat floor (``selfplay.seats``, below every game) and is
re-exported here. ``llm.py``: the token-exact LLM seat; ``teacher.py``: a scripted or human seat
recorded as the model's own turns; ``api.py``: the API chat partner; ``partners.py``: the
``--partner`` spec.
"""

from selfplay.seats import Player

__all__ = ["Player"]
