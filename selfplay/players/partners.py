"""Who sits across from the model: `--partner self|scripted:NAME|openai:MODEL`, `--policy-seat`.

``parse_partner`` turns the option into one typed spec (``SelfPlay``, ``ScriptedPartner`` or
``OpenAIPartner``) that callers ``match`` on; ``canonical_partner`` gives the form stored in configs
and snapshots: ``None`` for self-play, the bare scripted name (``"shy"``, as before the prefix
existed, so older run folders still resume) or ``"openai:MODEL"``. A bare scripted name is
accepted as an alias of ``scripted:NAME``.

The ``check_*`` helpers are the field validators shared by every config that carries partner
options (generate, iterate, eval); each raises a ``ValueError`` that says how to fix the option.
An API key is never an option: only the *name* of the environment variable that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

DEFAULT_KEY_ENV = "OPENAI_API_KEY"
DEFAULT_BASE_URL = "https://api.openai.com/v1"
PARTNER_FORMS = "self, scripted:NAME (one of the game's scripted players) or openai:MODEL"
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class SelfPlay:
    """Both seats are the model (both are trained)."""


@dataclass(frozen=True)
class ScriptedPartner:
    """One of the game's scripted policies (``DialogueGame.scripted``) plays the other seat."""

    name: str


@dataclass(frozen=True)
class OpenAIPartner:
    """A chat model behind an OpenAI-compatible endpoint plays the other seat (shy persona)."""

    model: str


PartnerSpec = SelfPlay | ScriptedPartner | OpenAIPartner


def parse_partner(text: str | None, scripted_names: Sequence[str]) -> PartnerSpec:
    """``None``/``self`` -> SelfPlay; ``scripted:NAME`` or a bare NAME -> ScriptedPartner (NAME
    one of the game's ``scripted_names``); ``openai:MODEL`` -> OpenAIPartner. Raises ValueError
    naming the accepted forms."""
    names = tuple(scripted_names)

    raw = "" if text is None else text.strip()
    if raw in ("", "self"):
        return SelfPlay()
    kind, sep, rest = raw.partition(":")
    if not sep:
        kind, rest = "scripted", raw
    rest = rest.strip()
    match kind.strip().lower():
        case "scripted":
            if rest not in names:
                raise ValueError(
                    f"{rest!r} is not a scripted policy ({', '.join(names)}); a partner "
                    f"is {PARTNER_FORMS}"
                )
            return ScriptedPartner(rest)
        case "openai":
            if not rest:
                raise ValueError("openai:MODEL needs a model name, e.g. openai:gpt-4.1")
            return OpenAIPartner(rest)
        case _:
            raise ValueError(f"unknown partner {raw!r}; use {PARTNER_FORMS}")


def canonical_partner(text: str | None, scripted_names: Sequence[str]) -> str | None:
    """The stored form: None (self-play), a bare scripted name, or ``openai:MODEL``."""
    match parse_partner(text, scripted_names):
        case SelfPlay():
            return None
        case ScriptedPartner(name=name):
            return name
        case OpenAIPartner(model=model):
            return f"openai:{model}"


def policy_seat_index(policy_seat: int) -> int:
    """``--policy-seat 1|2`` -> the seat index the model plays (0 moves first)."""
    return policy_seat - 1


# -- shared field validators (values arrive canonicalised; ``partner`` is validated first) --------


def check_policy_seat(policy_seat: int, partner: str | None) -> int:
    if policy_seat != 1 and partner is None:  # canonical None: self-play
        raise ValueError(
            "the model plays both seats in self-play; --policy-seat 2 needs a --partner"
        )
    return policy_seat


def check_api_only(value, partner: str | None, option: str):
    """Options that only mean something for an ``openai:MODEL`` partner."""
    if value is not None and not (partner or "").startswith("openai:"):  # canonical form
        raise ValueError(
            f"{option} is for openai:MODEL partners; drop it or use --partner openai:MODEL"
        )
    return value


def check_key_env(name: str) -> str:
    # The message never echoes the value: a key pasted here by mistake must not reach a log.
    if not _ENV_NAME.match(name):
        raise ValueError(
            "must be the NAME of an environment variable holding the key (letters, digits, _), "
            "not the key itself"
        )
    return name


class PartnerOptions(BaseModel):
    """The fixed-partner options shared by generate, iterate and eval, checked the same way."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # stored canonical (see above): None for self-play, a scripted name ("shy"), "openai:MODEL"
    partner: str | None = Field(
        None,
        description="Who plays the other seat: self (the default), scripted:NAME (cooperative, "
        "no-talk, shy, random, inquisitive; a bare NAME works too) or openai:MODEL (an "
        "OpenAI-compatible chat model, shy persona).",
    )
    policy_seat: Literal[1, 2] = Field(
        1, description="The model's seat with a partner: 1, or 2 (the partner moves first)."
    )
    partner_base_url: str | None = Field(
        None, description=f"openai partner: the endpoint (default {DEFAULT_BASE_URL})."
    )
    partner_key_env: str = Field(
        DEFAULT_KEY_ENV,
        description="openai partner: NAME of the environment variable with the key (the key "
        "itself is never stored).",
    )
    partner_max_calls: int | None = Field(
        None,
        ge=1,
        description="openai partner: paid calls at most per run, per round in iterate (cached "
        "answers are free).",
    )
    partner_deadline: float = Field(
        300.0,
        gt=0,
        description="openai partner: seconds one answer may take at most, every retry and wait "
        "included (a server that never answers, or drips, fails its game then).",
    )

    @field_validator("partner")
    @classmethod
    def _known_partner(cls, v: str | None, info: ValidationInfo) -> str | None:
        from selfplay.game import game_of

        game = game_of(info)  # the game's own players (None: the game was refused, and said so)
        return v if game is None else canonical_partner(v, game.scripted_names)

    @field_validator("policy_seat")
    @classmethod
    def _policy_seat(cls, v: int, info: ValidationInfo) -> int:
        return check_policy_seat(v, info.data["partner"]) if "partner" in info.data else v

    @field_validator("partner_base_url", "partner_max_calls")
    @classmethod
    def _api_only(cls, v, info: ValidationInfo):
        if "partner" not in info.data:
            return v
        option = "--" + str(info.field_name).replace("_", "-")
        return check_api_only(v, info.data["partner"], option)

    @field_validator("partner_key_env")
    @classmethod
    def _key_env(cls, v: str) -> str:
        return check_key_env(v)
