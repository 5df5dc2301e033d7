"""The LLM player: one append-only token list per (game, seat), over any token engine.

The seat's list holds exactly what its model saw and produced: the ids the model generated
(mask 1, with their behaviour log-probs, the stop token included) and, for everything else, the
chat-template *delta* tokens (mask 0): the first prompt, then after each generation the rest of
the template's end-of-turn text, the next user turn and the generation prompt. The seat's own
history is never re-tokenised, so training sees the very ids that were sampled.

``ChatFormat`` checks once, at start-up, that the model's chat template renders our message
pattern (user, assistant, user, ...) append-only, and raises ``TemplateError`` naming the problem
when it does not (a template that rewrites earlier turns cannot be extended token by token).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from selfplay.engines import Engine, EngineFailure, GenerationRequest
from selfplay.errors import UserError
from selfplay.records import SamplingParams, SeatConfig, SeatTokens
from selfplay.seeds import derive_seed as derive_seed  # re-export: it lived here

log = logging.getLogger(__name__)

# Placeholders for the template probe; private-use characters no template will touch.
_U1, _A1, _U2 = "\ue000U1\ue001", "\ue000A1\ue001", "\ue000U2\ue001"
_PROBE = [  # a realistic conversation the composed rendering must reproduce exactly
    "You are an area chair.\n\nReviewer Paper Similarity Scores:\n,BLEU,Electra\nAva Li,,320\n",
    "[message] Hi! I know Ava Li on Electra: 320. What do you know?",
    "Partner: [message] Ava Li on BLEU is 45.\n\nError: something",
    "[propose] Proposal:\nBLEU: Ava Li\nElectra: Daniel Nguyen",
    "Partner: [reject]\nYou can output one of these choices: [accept] or [reject]",
]


class TemplateError(UserError, ValueError):
    """The model's chat template cannot be extended append-only for our message pattern."""


class ContextFull(RuntimeError):
    """The seat's conversation no longer fits the model's context: the game ends as an error."""


class ChatFormat:
    """A tokenizer's chat template, decomposed into append-only pieces (checked at start-up)."""

    def __init__(
        self, tokenizer, model_name: str = "model", eos_token_ids: Sequence[int] = ()
    ) -> None:
        from selfplay.models import tokenizer_fingerprint

        self.tokenizer = tokenizer
        self.model_name = model_name
        self._backend = getattr(tokenizer, "backend_tokenizer", None)  # fast tokenizers only
        if not getattr(tokenizer, "chat_template", None):
            raise TemplateError(
                f"the tokenizer of {model_name} has no chat template; use an instruct/chat model "
                "or a tokenizer directory with chat_template set"
            )
        first = self.render([_user(_U1)], generation_prompt=True)
        with_answer = self.render([_user(_U1), _assistant(_A1)], generation_prompt=False)
        two_turns = self.render([_user(_U1), _assistant(_A1), _user(_U2)], generation_prompt=True)
        if not with_answer.startswith(first):
            raise self._error(
                "adding the assistant's answer changes the text before it (the generation prompt "
                "is not the start of the rendered assistant turn)",
                first,
                with_answer,
            )
        rest = with_answer[len(first) :]
        if not rest.startswith(_A1):
            raise self._error(
                "the template inserts text between the generation prompt and the assistant's "
                f"answer ({rest[: rest.find(_A1)]!r}), which the model did not generate",
                first + _A1,
                with_answer,
            )
        # what the template writes after an assistant's content (e.g. "<|im_end|>\n")
        self.after_assistant = rest[len(_A1) :]
        if not two_turns.startswith(with_answer):
            raise self._error(
                "rendering a later user turn changes the earlier assistant turn (the template "
                "rewrites history, e.g. strips reasoning or treats the last turn specially)",
                with_answer,
                two_turns,
            )
        user_turn = two_turns[len(with_answer) :]
        if user_turn.count(_U2) != 1:
            raise TemplateError(
                f"the chat template of {model_name} does not render a user turn's content "
                "verbatim; it cannot be extended append-only"
            )
        self._user_pre, self._user_post = user_turn.split(_U2)
        self._check_probe()
        self.stop_token_ids = self._stop_ids(eos_token_ids)
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        # what each stop token leaves of the template's end-of-turn text (cached per stop id)
        self._owed: dict[int, str] = {}

    # -- rendering -----------------------------------------------------------------------------

    def render(self, messages: list[dict[str, str]], *, generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=generation_prompt
        )

    def first_prompt(self, observation: str) -> str:
        return self.render([_user(observation)], generation_prompt=True)

    def user_turn(self, observation: str) -> str:
        """A user turn plus the generation prompt, as the template renders it after an answer."""
        return self._user_pre + observation + self._user_post

    def owed_after(self, stop_id: int | None) -> str:
        """Template text still owed after a generation that ended with ``stop_id`` (None: cut)."""
        if stop_id is None:
            return self.after_assistant
        owed = self._owed.get(stop_id)
        if owed is None:
            text = self.decode([stop_id])
            owed = (
                self.after_assistant[len(text) :]
                if text and self.after_assistant.startswith(text)
                else self.after_assistant
            )
            self._owed[stop_id] = owed
        return owed

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            # The Rust tokenizer itself: same ids, less overhead. Its batch call without offsets
            # is ~20% faster than encode() even for one text, and every action of every game
            # waits for one encode on the event loop.
            return self._backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        """Exact text of ids: special tokens kept, no clean-up of spaces."""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=False)
        return self.tokenizer.decode(
            ids, skip_special_tokens=False, clean_up_tokenization_spaces=False
        )

    # -- start-up checks -------------------------------------------------------------------------

    def _check_probe(self) -> None:
        messages = [_user(c) if i % 2 == 0 else _assistant(c) for i, c in enumerate(_PROBE)]
        composed = self.first_prompt(messages[0]["content"])
        for i in range(1, len(messages), 2):
            composed += messages[i]["content"] + self.after_assistant
            composed += self.user_turn(messages[i + 1]["content"])
            full = self.render(messages[: i + 2], generation_prompt=True)
            if full != composed:
                raise self._error(
                    f"a conversation of {i + 2} messages does not render as the turns appended "
                    "one by one",
                    composed,
                    full,
                )

    def _stop_ids(self, eos_token_ids: Sequence[int]) -> tuple[int, ...]:
        """The template's end-of-turn token, then the model's EOS ids (tokenizer's as fallback)."""
        ids = [int(i) for i in eos_token_ids]
        if not ids and self.tokenizer.eos_token_id is not None:
            ids.append(int(self.tokenizer.eos_token_id))
        end = self.encode(self.after_assistant) if self.after_assistant else []
        if end and end[0] in self.tokenizer.all_special_ids:
            ids.insert(0, end[0])  # e.g. <|im_end|>: the token that ends an assistant turn
        return tuple(dict.fromkeys(int(i) for i in ids))

    def _error(self, problem: str, expected: str, got: str) -> TemplateError:
        k = next(
            (i for i, (a, b) in enumerate(zip(expected, got)) if a != b),
            min(len(expected), len(got)),
        )
        return TemplateError(
            f"the chat template of {self.model_name} is not append-only for the pattern "
            f"user, assistant, user, ...: {problem}. First difference at character {k}: "
            f"expected {expected[k : k + 40]!r}, got {got[k : k + 40]!r}. Use a model whose "
            "template renders each turn independently (ChatML, Llama 3, SmolLM2 do)."
        )


def load_chat_format(model: str, tokenizer=None) -> ChatFormat:
    """The ChatFormat of a model directory or HF id (tokenizer and generation config only)."""
    from transformers import AutoTokenizer, GenerationConfig

    tokenizer = tokenizer or AutoTokenizer.from_pretrained(model)
    try:
        eos = GenerationConfig.from_pretrained(model).eos_token_id
    except OSError:  # no generation_config.json: the tokenizer's EOS is all we know
        eos = None
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    return ChatFormat(tokenizer, model, eos_ids)


def _user(content: str) -> dict[str, str]:
    return {"role": "user", "content": content}


def _assistant(content: str) -> dict[str, str]:
    return {"role": "assistant", "content": content}


class SeatLog:
    """One seat's append-only token list, as its model saw and produced it.

    ``prompt_delta`` gives the template tokens of the next observation (the first prompt, or the
    owed end of the last answer plus the next user turn); ``add_prompt`` appends them (mask 0) and
    ``add_own`` appends the seat's own tokens (mask 1, with their log-probs). The LLM player and
    the teacher player (behaviour cloning) keep their seats' tokens through it, so a cloned seat is
    recorded exactly as a generating seat would be.
    """

    def __init__(self, chat: ChatFormat) -> None:
        self.chat = chat
        self.ids: list[int] = []
        self.mask: list[int] = []
        self.logprobs: list[float] = []
        self.messages: list[dict[str, str]] = []
        self._owed: str | None = None  # template text owed after our last answer

    def prompt_delta(self, observation: str) -> list[int]:
        text = (
            self.chat.first_prompt(observation)
            if self._owed is None
            else self._owed + self.chat.user_turn(observation)
        )
        return self.chat.encode(text)

    def add_prompt(self, delta: list[int], observation: str) -> None:
        self.ids.extend(delta)
        self.mask.extend([0] * len(delta))
        self.logprobs.extend([0.0] * len(delta))
        self.messages.append(_user(observation))

    def add_own(self, ids: list[int], logprobs: list[float], *, stopped: bool) -> str:
        """Append a turn's own ids (ending with a stop token when ``stopped``); return its text."""
        body = ids[:-1] if stopped else ids
        action = self.chat.decode(body)
        self._owed = self.chat.owed_after(ids[-1] if stopped else None)
        self.ids.extend(ids)
        self.mask.extend([1] * len(ids))
        self.logprobs.extend(logprobs)  # floats, as the Generation contract says
        self.messages.append(_assistant(action))
        return action

    def tokens(self) -> SeatTokens:
        # aligned by construction (every extend above adds to all three lists): skip the O(n)
        # validation here; records are validated when they are read back
        return SeatTokens.model_construct(
            token_ids=list(self.ids),
            mask=list(self.mask),
            logprobs=list(self.logprobs),
            messages=list(self.messages),
            tokenizer_fingerprint=self.chat.fingerprint,
        )


class LLMPlayer:
    """A seat played by a language model through a token engine."""

    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        *,
        sampling: SamplingParams,
        seed: int,
        name: str | None = None,
        trained: bool = True,
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.seed = seed
        self.sampling = sampling.model_copy(update={"seed": seed})
        self.config = SeatConfig(
            kind="llm", name=name or engine.name, trained=trained, sampling=self.sampling
        )
        self.log = SeatLog(chat)
        self._turn = 0
        self.generated = 0

    async def act(self, observation: str) -> str:
        delta = self.log.prompt_delta(observation)
        max_new = self.sampling.max_new_tokens
        limit = self.engine.max_context
        if limit is not None:
            used = len(self.log.ids)
            max_new = min(max_new, limit - used - len(delta))
            if max_new < 1:  # checked before appending: the list stays what the model saw
                raise ContextFull(
                    f"the conversation ({used + len(delta)} tokens with the new turn) "
                    f"fills the model's context ({limit} tokens)"
                )
        self.log.add_prompt(delta, observation)
        gen = await self.engine.generate(
            GenerationRequest(
                prompt_ids=self.log.ids,
                max_new_tokens=max_new,
                temperature=self.sampling.temperature,
                top_p=self.sampling.top_p,
                seed=derive_seed(self.seed, self._turn),
                stop_token_ids=self.chat.stop_token_ids,
            )
        )
        self._turn += 1
        if gen.finish_reason == "abort":
            raise EngineFailure("the engine aborted a request (was it shut down or reloaded?)")
        ids = list(gen.token_ids)
        if len(gen.logprobs) != len(ids):
            raise EngineFailure(
                f"the engine returned {len(ids)} tokens but {len(gen.logprobs)} log-probs"
            )
        stopped = bool(ids) and gen.finish_reason == "stop" and ids[-1] in self.chat.stop_token_ids
        self.generated += len(ids)
        return self.log.add_own(ids, gen.logprobs, stopped=stopped)

    def tokens(self) -> SeatTokens:
        return self.log.tokens()
