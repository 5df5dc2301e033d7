"""Who sits across from the model: `--partner self|scripted:NAME|openai:MODEL`, `--policy-seat`.

``parse_partner`` turns the option into one typed spec (``SelfPlay``, ``ScriptedPartner`` or
``OpenAIPartner``) that callers ``match`` on; ``stored_partner`` gives a spec's form stored in
configs and snapshots: ``None`` for self-play, the bare scripted name (``"shy"``, as before the
prefix existed, so older run folders still resume) or ``"openai:MODEL"``. A bare scripted name is
accepted as an alias of ``scripted:NAME``.

``PartnerField`` is the type of a config's ``partner``: it parses the text once, against the
config's ``game`` (declared before it), holds the spec, and is stored in the canonical form; so
code past the configs matches on ``config.partner`` and never parses it again.

The ``check_*`` helpers are the field validators shared by every config that carries partner
options (generate, iterate, eval); each raises a ``ValueError`` that says how to fix the option.
An API key is never an option: only the *name* of the environment variable that holds it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainSerializer,
    PlainValidator,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
)

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


def stored_partner(spec: PartnerSpec) -> str | None:
    """A spec's stored (canonical) form: None (self-play), a bare scripted name, ``openai:MODEL``;
    ``parse_partner`` reads it back to an equal spec."""
    match spec:
        case SelfPlay():
            return None
        case ScriptedPartner(name=name):
            return name
        case OpenAIPartner(model=model):
            return f"openai:{model}"


def _resolve_partner(value: Any, info: ValidationInfo) -> Any:
    """A partner field's validator: a spec stays, a text is parsed against the game of the model
    (its ``game`` field); where the game was refused (it says so) the value is left as it is."""
    if isinstance(value, SelfPlay | ScriptedPartner | OpenAIPartner):
        return value
    if value is not None and not isinstance(value, str):
        raise ValueError(f"a partner is {PARTNER_FORMS}, not {value!r}")
    from selfplay.game import game_of

    game = game_of(info)
    return value if game is None else parse_partner(value, game.scripted_names)


# A config field holding the partner spec; given as text (or a spec), stored canonical.
PartnerField = Annotated[
    PartnerSpec,
    PlainValidator(_resolve_partner),
    PlainSerializer(stored_partner, return_type=str | None),
    WithJsonSchema({"anyOf": [{"type": "string"}, {"type": "null"}]}),
]


def policy_seat_index(policy_seat: int) -> int:
    """``--policy-seat 1|2`` -> the seat index the model plays (0 moves first)."""
    return policy_seat - 1


# -- shared field validators (``partner`` is validated first, into its spec) ---------------------


def check_policy_seat(policy_seat: int, partner: PartnerSpec) -> int:
    if policy_seat != 1 and isinstance(partner, SelfPlay):
        raise ValueError(
            "the model plays both seats in self-play; --policy-seat 2 needs a --partner"
        )
    return policy_seat


def check_api_only(value, partner: PartnerSpec, option: str):
    """Options that only mean something for an ``openai:MODEL`` partner."""
    if value is not None and not isinstance(partner, OpenAIPartner):
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

    # the spec; stored canonical (see above): None for self-play, a scripted name, "openai:MODEL"
    partner: PartnerField = Field(
        None,
        validate_default=True,
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

    @field_validator("policy_seat")
    @classmethod
    def _policy_seat(cls, v: int, info: ValidationInfo) -> int:
        partner = info.data.get("partner")
        return check_policy_seat(v, partner) if isinstance(partner, PartnerSpec) else v

    @field_validator("partner_base_url", "partner_max_calls")
    @classmethod
    def _api_only(cls, v, info: ValidationInfo):
        partner = info.data.get("partner")
        if not isinstance(partner, PartnerSpec):  # refused, or its game was
            return v
        option = "--" + str(info.field_name).replace("_", "-")
        return check_api_only(v, partner, option)

    @field_validator("partner_key_env")
    @classmethod
    def _key_env(cls, v: str) -> str:
        return check_key_env(v)
