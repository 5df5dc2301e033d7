"""The LLM player: append-only token bookkeeping, the template check, cut generations, context."""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from selfplay.engines import Generation, GenerationRequest
from selfplay.game.matching import MATCHING
from selfplay.game.matching.rules import generate_scenario
from selfplay.generate.play import play_game
from selfplay.players.llm import ChatFormat, ContextFull, LLMPlayer, TemplateError, load_chat_format
from selfplay.records import SamplingParams


class ScriptEngine:
    """Answers each request with the next scripted text (encoded, + EOS unless cut)."""

    name = "script"

    def __init__(self, chat: ChatFormat, answers: list[tuple[str, bool]], max_context=None):
        self.chat = chat
        self.answers = list(answers)
        self.max_context = max_context
        self.prompts: list[list[int]] = []

    async def start(self) -> None: ...

    async def aclose(self) -> None: ...

    async def generate(self, request: GenerationRequest) -> Generation:
        self.prompts.append(list(request.prompt_ids))
        text, stop = self.answers.pop(0)
        ids = self.chat.encode(text) + ([self.chat.stop_token_ids[0]] if stop else [])
        if len(ids) > request.max_new_tokens:  # a real engine never exceeds the budget
            ids, stop = ids[: request.max_new_tokens], False
        return Generation(ids, [-0.5] * len(ids), "stop" if stop else "length")


@pytest.fixture(scope="module")
def chat(tiny_model) -> ChatFormat:
    return load_chat_format(str(tiny_model))


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=300) | st.sampled_from(["<|im_end|>\n<|im_start|>user\nhi", " \n\n  x"]))
def test_encode_gives_the_tokenizers_own_ids(chat, text):
    """The fast path (the Rust tokenizer's batch call) must be the tokenizer's tokenisation."""
    assert chat.encode(text) == chat.tokenizer(text, add_special_tokens=False)["input_ids"]


def test_tokens_are_append_only_and_render_like_the_template(chat):
    engine = ScriptEngine(chat, [("[message] hi", True), ("[message] Ava Li", False), ("x", True)])
    player = LLMPlayer(engine, chat, sampling=SamplingParams(), seed=1)
    observations = ["intro text", "Partner: [message] yo", "Error: nope\n\nmore"]
    actions = [asyncio.run(player.act(o)) for o in observations]
    assert actions == ["[message] hi", "[message] Ava Li", "x"]
    t = player.tokens()
    # every prompt the engine saw is a prefix of the final token list: nothing was re-tokenised
    for p in engine.prompts:
        assert t.token_ids[: len(p)] == p
    # mask-1 runs decode to each action (+ the stop token's text when it ended by one)
    runs, cur = [], []
    for tok, m in zip(t.token_ids, t.mask):
        if m:
            cur.append(tok)
        elif cur:
            runs.append(cur)
            cur = []
    runs.append(cur)
    eos = chat.decode([chat.stop_token_ids[0]])
    assert [chat.decode(r) for r in runs] == [actions[0] + eos, actions[1], actions[2] + eos]
    assert all(lp == -0.5 for lp, m in zip(t.logprobs, t.mask) if m)
    assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.mask) if not m)
    # the cut 2nd answer got the template's full end-of-turn text as mask-0 tokens, so the whole
    # list reads exactly as the chat template renders the conversation
    rendered = chat.render(t.messages, generation_prompt=False)
    assert chat.decode(t.token_ids) + chat.owed_after(chat.stop_token_ids[0]) == rendered
    assert [m["role"] for m in t.messages] == ["user", "assistant"] * 3
    assert t.tokenizer_fingerprint == chat.fingerprint


def test_smollm2_style_template_with_default_system_prompt_is_accepted(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = (
        "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
        "{{ '<|im_start|>system\nYou are helpful<|im_end|>\n' }}{% endif %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    )
    chat = ChatFormat(tok, "smol-like")
    assert chat.after_assistant == "<|im_end|>\n"
    assert chat.stop_token_ids[0] == tok.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize(
    "template, problem",
    [
        (  # only the last user turn is shown: earlier turns vanish
            "<|im_start|>user\n{{ messages[-1]['content'] }}<|im_end|>\n"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "not append-only",
        ),
        (  # Qwen3-like: the final assistant turn gets an empty think block, earlier ones do not
            "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
            "{% if m['role'] == 'assistant' and loop.last %}<think></think>{% endif %}"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "inserts text between the generation prompt",
        ),
        (  # history is counted: a turn's rendering depends on how many come after it
            "{% for m in messages %}<|im_start|>{{ m['role'] }}{{ messages|length }}\n"
            "{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
            "changes the text before it",
        ),
    ],
)
def test_non_append_only_templates_are_refused_with_the_problem_named(
    tiny_model, template, problem
):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = template
    with pytest.raises(TemplateError, match=problem) as err:
        ChatFormat(tok, "bad-model")
    assert "bad-model" in str(err.value)


def test_missing_template_is_refused(tiny_model):
    tok = AutoTokenizer.from_pretrained(tiny_model)
    tok.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        ChatFormat(tok, "base-model")


def test_a_full_context_ends_the_game_as_an_error_not_a_crash(chat):
    scenario = generate_scenario(3, 3)
    answers = [("[message] hello " * 5, True)] * 100
    engine = ScriptEngine(chat, answers, max_context=700)
    players = tuple(
        LLMPlayer(engine, chat, sampling=SamplingParams(max_new_tokens=64), seed=s) for s in (0, 1)
    )
    record = asyncio.run(
        play_game(scenario, players, game_id="g", seed=0, max_actions=30, game=MATCHING)
    )
    assert record.outcome == "error"
    assert ContextFull.__name__ in (record.error or "")
    assert all(len(t.token_ids) <= 700 for t in record.tokens if t)
