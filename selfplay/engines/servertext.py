"""Text that came from a server, made safe to show, log or store: secrets out first, then cut.

A server may echo what it was sent, the API key included (an error text quoting the request, a
proxy's debug page). ``redact`` blanks out each secret and every piece of it of ``FRAGMENT``
characters or more, wherever it stands, so a key cut in half by a later truncation, or masked by
the server down to its head or tail, leaves nothing usable. ``server_text`` redacts, then cuts:
cutting first could leave part of a key that no longer matches the whole.
"""

from __future__ import annotations

from collections.abc import Iterable

FRAGMENT = 8  # shorter pieces ("sk-proj") are common to every key, so they reveal nothing
BLANK = "***"


def redact(text: str, secrets: Iterable[str | None]) -> str:
    """``text`` with each secret, and every run of its ``FRAGMENT``-character pieces, as ``***``."""
    hidden = bytearray(len(text))
    for secret in secrets:
        if not secret:
            continue
        width = min(FRAGMENT, len(secret))
        pieces = {secret[i : i + width] for i in range(len(secret) - width + 1)}
        for i in range(len(text) - width + 1):
            if text[i : i + width] in pieces:
                hidden[i : i + width] = b"\x01" * width
    if not any(hidden):
        return text
    out: list[str] = []
    for i, ch in enumerate(text):
        if not hidden[i]:
            out.append(ch)
        elif i == 0 or not hidden[i - 1]:
            out.append(BLANK)
    return "".join(out)


def server_text(text: str, limit: int, secrets: Iterable[str | None] = ()) -> str:
    """The first ``limit`` characters of ``text`` after ``redact``, marked ``...`` when cut."""
    secrets = [s for s in secrets if s]
    # Redact a head of the text long enough that what a cut at its end could hide (a piece of
    # a secret shorter than FRAGMENT) lies past the first ``limit`` characters once redacted:
    # a body of megabytes costs no more than its head.
    margin = FRAGMENT + len(BLANK)
    n = limit + margin + max((len(s) for s in secrets), default=0)
    while True:
        shown = redact(text[:n], secrets)
        if n >= len(text) or len(shown) >= limit + margin:
            break
        n *= 2
    return shown if len(shown) <= limit and n >= len(text) else shown[:limit] + "..."
