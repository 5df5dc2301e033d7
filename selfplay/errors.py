"""``UserError``: the one base class of errors a user can fix (a path, an option, a busy folder).

Every stage raises a subclass whose message says what is wrong and what to do; the CLI turns any
of them into one line and exit code 1, and turns anything else into one line that says how to
see the traceback (``selfplay -v``). Subclasses keep their older bases (``ValueError``,
``RuntimeError``) so existing ``except`` clauses still catch them.

``first_problem(e)`` is a pydantic ``ValidationError`` as one phrase (its first field, what is
wrong, the value found), for messages that name a file: never pydantic's multi-line dump.

``EngineFailure`` lives here too, so engines, players and the game loop share it without
importing one another (``selfplay.engines`` and ``selfplay.generate.play`` re-export it).
"""


class UserError(Exception):
    """An error the user can fix; its message says how."""


def first_problem(e) -> str:
    """``field a.b: what is wrong (found: value)`` for a pydantic ``ValidationError``'s first
    error, and how many more there are."""
    errors = e.errors()
    err = errors[0]
    field = ".".join(str(x) for x in err.get("loc", ())) or "(the whole value)"
    found = repr(err.get("input"))
    found = found if len(found) <= 60 else found[:57] + "..."
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"field {field}: {err['msg'].removeprefix('Value error, ')} (found: {found}){more}"


class EngineFailure(UserError, RuntimeError):
    """An engine could not serve a request after its retries (dead server, timeout).

    Raised by players; fatal for the run, not just for the game, so the runner stops cleanly.
    """
