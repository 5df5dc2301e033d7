"""``UserError``: the one base class of errors a user can fix (a path, an option, a busy folder).

Every stage raises a subclass whose message says what is wrong and what to do; the CLI turns any
of them into one line and exit code 1, and turns anything else into one line that says how to
see the traceback (``selfplay -v``). Subclasses keep their older bases (``ValueError``,
``RuntimeError``) so existing ``except`` clauses still catch them.

``EngineFailure`` lives here too, so engines, players and the game loop share it without
importing one another (``selfplay.engines`` and ``selfplay.generate.play`` re-export it).
"""


class UserError(Exception):
    """An error the user can fix; its message says how."""


class EngineFailure(UserError, RuntimeError):
    """An engine could not serve a request after its retries (dead server, timeout).

    Raised by players; fatal for the run, not just for the game, so the runner stops cleanly.
    """
