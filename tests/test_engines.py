"""Engines: the hf engine's batching and sampling, the SGLang client against the stand-in server
(launched through a fake ``sglang.launch_server`` or attached by URL), the OpenAI chat client."""

from __future__ import annotations

import asyncio
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import ClassVar

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from selfplay.engines import (
    EngineFailure,
    EngineRequestError,
    GenerationRequest,
    HFEngineConfig,
    SGLangEngineConfig,
    open_engine,
)
from selfplay.engines.openai import OpenAIEngine, OpenAIEngineConfig
from selfplay.engines.sglang import SGLangEngine
from selfplay.engines.synthetic import SyntheticEngine
from tests.servers import free_port, running, serve, wait_healthy
from tests.sglang_standin import install_fake_sglang

TESTS = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def hf(hf_test_config):
    return open_engine(hf_test_config)  # SELFPLAY_TEST_DEVICE=cuda: on a GPU (conftest)


def prompt(engine, text: str) -> list[int]:
    return engine.tokenizer(f"<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n")[
        "input_ids"
    ]


def run(coro):
    return asyncio.run(coro)


async def gather_close(engine, requests):
    try:
        return await asyncio.gather(*(engine.generate(r) for r in requests))
    finally:
        await engine.aclose()


def fresh(hf, **config):
    """A new engine object over the same loaded model (each asyncio.run needs its own batcher,
    each engine its own prefix cache); ``config`` overrides fields of the engine's config."""
    from selfplay.engines.hf import HFEngine

    return HFEngine(hf.config.model_copy(update=config), model=hf.model, tokenizer=hf.tokenizer)


# ---------------------------------------------------------------------------------------------
# hf


def full_forward_logprobs(model, prompt_ids, gen, temperature: float = 1.0) -> list[float]:
    """The sampled tokens' log-probs by one forward pass over the whole sequence, no cache."""
    full = torch.tensor([list(prompt_ids) + gen.token_ids], device=model.device)
    with torch.no_grad():
        logp = torch.log_softmax(model(full).logits[0].float() / temperature, -1)
    n = len(prompt_ids)
    return [logp[n - 1 + j, t].item() for j, t in enumerate(gen.token_ids)]


@pytest.mark.parametrize("prefix_cache_tokens", [0, 65536])
def test_hf_batch_matches_single_requests_and_a_full_forward(hf, prefix_cache_tokens):
    hf = fresh(hf, prefix_cache_tokens=prefix_cache_tokens)
    texts = ["hi", "a much longer prompt about Ava Li and BLEU and GloVe", "Proposal:"]
    reqs = [GenerationRequest(prompt(hf, t), max_new_tokens=12, temperature=0.0) for t in texts]
    batched = run(gather_close(fresh(hf), reqs))
    for req, gen in zip(reqs, batched):
        (single,) = run(gather_close(fresh(hf), [req]))
        assert gen.token_ids == single.token_ids  # left padding does not change the answer
        assert gen.finish_reason in ("stop", "length")
        assert len(gen.logprobs) == len(gen.token_ids)
        ref = full_forward_logprobs(hf.model, req.prompt_ids, gen)
        assert max(abs(a - b) for a, b in zip(ref, gen.logprobs)) < 1e-4


def extend(req: GenerationRequest, gen, delta: list[int], **kw) -> GenerationRequest:
    """The conversation's next request: prompt + sampled ids + the partner's delta tokens."""
    return replace(req, prompt_ids=[*req.prompt_ids, *gen.token_ids, *delta], **kw)


async def converse(engine, first: list[GenerationRequest], deltas: list[list[list[int]]]):
    """Play conversations turn by turn, all rows of a turn in one batch; every turn's
    (request, generation) pairs."""
    turns, reqs = [], first
    try:
        for turn_deltas in [*deltas, None]:
            gens = await asyncio.gather(*(engine.generate(r) for r in reqs))
            turns.append(list(zip(reqs, gens)))
            if turn_deltas is not None:
                reqs = [extend(r, g, d) for r, g, d in zip(reqs, gens, turn_deltas)]
    finally:
        await engine.aclose()
    return turns


def assert_same_generations(got, want, tol: float = 1e-4) -> None:
    assert got.token_ids == want.token_ids and got.finish_reason == want.finish_reason
    assert max(abs(a - b) for a, b in zip(got.logprobs, want.logprobs)) < tol


def test_hf_prefix_cache_multi_turn_matches_the_cache_off(hf):
    """Three conversations of four turns with deltas of different lengths: greedy tokens are
    the same with the prefix cache as without, log-probs within 1e-4 (also of a full forward),
    and every turn after the first reuses its conversation's KV."""
    stops = (hf.tokenizer.eos_token_id,)
    first = [
        GenerationRequest(prompt(hf, t), max_new_tokens=m, temperature=0.0, stop_token_ids=stops)
        for t, m in (("hi", 9), ("a longer prompt about Ava Li and BLEU", 5), ("Proposal:", 14))
    ]
    words = ["[message] Sofia Patel on GloVe is 122", "[reject]", "Partner: Error: propose"]
    deltas = [[prompt(hf, words[(t + k) % 3]) for k in range(3)] for t in range(3)]
    on, off = fresh(hf, prefix_cache_tokens=65536), fresh(hf, prefix_cache_tokens=0)
    with_cache, without = run(converse(on, first, deltas)), run(converse(off, first, deltas))
    for turn_on, turn_off in zip(with_cache, without):
        for (req, got), (req_off, want) in zip(turn_on, turn_off):
            assert req.prompt_ids == req_off.prompt_ids
            assert_same_generations(got, want)
            ref = full_forward_logprobs(hf.model, req.prompt_ids, got)
            assert max(abs(a - b) for a, b in zip(ref, got.logprobs)) < 1e-4
    # each later turn reuses the previous prompt and all its sampled ids but the last
    assert on.reused_tokens == sum(
        len(req.prompt_ids) + len(gen.token_ids) - 1
        for turn in with_cache[:-1]
        for req, gen in turn
    )
    assert off.reused_tokens == 0 and off.prefix_cache is None
    assert len(on.prefix_cache) == 3  # one entry per conversation: extended entries are dropped


def test_hf_prefix_cache_mixed_batch_matches_single_requests_without_cache(hf):
    """One batch of a long hit, a short hit, a hit on the whole prompt (reused but its last
    token), a miss, a sampled hit, and sampled copies of the long hit's and the miss's prompts
    (prefilled once); each row equals the same request run alone, cache off."""
    eos = (hf.tokenizer.eos_token_id,)
    ask = [
        GenerationRequest(prompt(hf, t), max_new_tokens=m, temperature=0.0, stop_token_ids=eos)
        for t, m in (("hi", 10), ("Ava Li and BLEU and GloVe, " * 4, 3), ("x", 6), ("y", 7))
    ]
    engine = fresh(hf)

    async def go():
        try:
            first = await asyncio.gather(*(engine.generate(r) for r in ask))
            mixed = [
                extend(ask[0], first[0], prompt(hf, "[message] what do you know? " * 3)),
                extend(ask[1], first[1], prompt(hf, "ok")[:2]),
                replace(ask[2], prompt_ids=[*ask[2].prompt_ids, *first[2].token_ids[:-1]]),
                GenerationRequest(prompt(hf, "a new game"), 11, temperature=0.0),
                extend(ask[3], first[3], [5], temperature=0.9, seed=3, max_new_tokens=12),
            ]
            mixed += [replace(mixed[0], temperature=0.8, seed=4), replace(mixed[3], seed=5)]
            assert engine.reused_tokens == 0
            return first, mixed, await asyncio.gather(*(engine.generate(r) for r in mixed))
        finally:
            await engine.aclose()

    first, mixed, gens = run(go())
    assert engine._batcher.batches == 2  # the mixed requests really shared one batch
    kept = [len(r.prompt_ids) + len(g.token_ids) - 1 for r, g in zip(ask, first)]
    assert engine.reused_tokens == kept[0] + kept[1] + (kept[2] - 1) + kept[3]
    prompts = [r.prompt_ids for r in ask] + list({tuple(r.prompt_ids) for r in mixed})
    assert engine.prefilled_tokens + engine.reused_tokens == sum(map(len, prompts))
    off = fresh(hf, prefix_cache_tokens=0)
    for req, got in zip(mixed, gens):
        (want,) = run(gather_close(fresh(off), [req]))
        assert_same_generations(got, want)


def test_hf_prompts_that_start_alike_share_one_prefill_of_their_common_prefix(hf):
    """Four first turns of one scenario (the same rules and table, then each game's own first
    message), one of another, and an unrelated prompt in one batch: the common prefix is
    prefilled once, every row equals the same request run alone with the cache off, and the
    prefix stays kept for a later game of the scenario."""
    from selfplay.engines.hf_prefill import MIN_SHARED_PREFIX, common_prefix

    eos = (hf.tokenizer.eos_token_id,)
    rules = "You review papers. Table: Ava Li on BLEU 320, Sofia Patel on GloVe 122. " * 3

    def ask(text: str, **kw) -> GenerationRequest:
        return GenerationRequest(
            prompt(hf, text), max_new_tokens=6, temperature=0.0, stop_token_ids=eos, **kw
        )

    reqs = [ask(rules + m) for m in ("hello", "what is yours?", "[propose] A", "x" * 20)]
    reqs += [ask("Another scenario, table: Noah on ELMo 3. " * 4 + "hi"), ask("unrelated")]
    reqs.append(replace(reqs[1], temperature=0.9, seed=2))  # a copy: prefilled once anyway
    engine = fresh(hf)
    gens = run(gather_close(engine, reqs))
    unique = [r.prompt_ids for r in reqs[:-1]]
    shared = min(common_prefix(unique[0], u) for u in unique[1:4])
    assert shared >= MIN_SHARED_PREFIX
    assert engine._batcher.batches == 1
    assert engine.prefilled_tokens + engine.reused_tokens == sum(map(len, unique))
    assert engine.reused_tokens == 3 * shared  # three of the four reused the one prefill
    off = fresh(hf, prefix_cache_tokens=0)
    for req, got in zip(reqs, gens):
        (want,) = run(gather_close(fresh(off), [req]))
        assert_same_generations(got, want)
    # a later game of the scenario finds the kept prefix (shared entries are not taken away)
    later = fresh(hf)
    later.prefix_cache = engine.prefix_cache
    (gen,) = run(gather_close(later, [ask(rules + "a later game")]))
    assert later.reused_tokens >= shared - 2  # (the tokenizer may merge across the cut)
    (want,) = run(gather_close(fresh(off), [ask(rules + "a later game")]))
    assert_same_generations(gen, want)


def test_hf_rows_far_longer_than_the_rest_are_prefilled_apart(hf):
    """Continuing turns (a few new tokens each) and one first turn of many tokens in one batch:
    the short rows are not padded to the long one, and every row equals the same request run
    alone with the cache off."""
    eos = (hf.tokenizer.eos_token_id,)
    first = [
        GenerationRequest(prompt(hf, f"game {i}"), 4, temperature=0.0, stop_token_ids=eos)
        for i in range(6)
    ]
    engine = fresh(hf)

    async def go():
        try:
            gens = await asyncio.gather(*(engine.generate(r) for r in first))
            nxt = [extend(r, g, prompt(hf, "[reject]")) for r, g in zip(first, gens)]
            nxt.append(GenerationRequest(prompt(hf, "Ava Li on BLEU is 320. " * 12), 4, 0.0))
            slots = engine.prefill_slots
            return nxt, await asyncio.gather(*(engine.generate(r) for r in nxt)), slots
        finally:
            await engine.aclose()

    nxt, gens, before = run(go())
    short = len(prompt(hf, "[reject]")) + 4
    long_row = len(nxt[-1].prompt_ids)
    # padded to the long row, the batch would compute 7 x long_row positions
    assert engine.prefill_slots - before <= long_row + 6 * short + 7 < 7 * long_row / 2
    off = fresh(hf, prefix_cache_tokens=0)
    for req, got in zip(nxt, gens):
        (want,) = run(gather_close(fresh(off), [req]))
        assert_same_generations(got, want)


def test_hf_requests_join_a_running_batch_and_match_single_requests(hf):
    """Games' next turns join the batch that is still decoding a long row (instead of waiting
    for it to end): a turn that joins equals the same request run alone with the cache off, so
    does the long row around which the batch was rebuilt, and the joins really happened."""
    long_req = GenerationRequest(prompt(hf, "tell a long story"), 160, temperature=0.0)
    starts = [
        GenerationRequest(prompt(hf, f"game {i}"), 3, temperature=0.8, seed=i) for i in range(3)
    ]
    engine = fresh(hf)
    long_gen, games = games_beside_a_long_row(hf, engine, long_req, starts, budget=3)
    assert len(long_gen.token_ids) == 160
    assert engine._batcher.joined >= 3  # later turns joined the long row's batch
    assert engine._batcher.batches < 1 + 3  # fewer batches than turns a game played
    assert_each_as_alone(hf, [(long_req, long_gen), *(pair for g in games for pair in g)])


def games_beside_a_long_row(hf, engine, long_req, starts, *, budget: int, turns: int = 4):
    """``long_req`` and games of ``turns`` turns from ``starts`` played at once on ``engine``
    (later turns' budgets ``budget``, ``budget + 1``, ...): the long generation, and each
    game's (request, generation) pairs."""

    async def game(req: GenerationRequest):
        out = []
        for t in range(turns):
            gen = await engine.generate(req)
            out.append((req, gen))
            req = extend(req, gen, prompt(hf, f"[message] turn {t}"), max_new_tokens=budget + t)
        return out

    async def go():
        try:
            return await asyncio.gather(engine.generate(long_req), *(game(r) for r in starts))
        finally:
            await engine.aclose()

    long_gen, *games = run(go())
    return long_gen, games


def assert_each_as_alone(hf, pairs) -> None:
    """Each (request, generation) equals the request run alone with the prefix cache off."""
    off = fresh(hf, prefix_cache_tokens=0)
    for req, got in pairs:
        (want,) = run(gather_close(fresh(off), [req]))
        assert_same_generations(got, want)


def test_hf_batches_that_share_a_prefix_attend_to_it_once_and_match_single_requests(hf):
    """Games that all start with the same rules (as a recipe's do): their batches keep those
    tokens in the first columns, decoding steps attend to them once for all rows (the CPU's
    cascade attention), later turns join running batches with the shared columns kept, and
    every turn equals the same request run alone with the cache off."""
    from selfplay.engines.hf_cpu import MIN_CASCADE_PREFIX

    rules = "Rules: assign reviewers to papers; Ava Li on BLEU 320, Sofia Patel on GloVe 122. " * 4
    long_req = GenerationRequest(prompt(hf, rules + "tell a long story"), 120, temperature=0.0)
    starts = [
        GenerationRequest(prompt(hf, rules + f"game {i}"), 4, temperature=0.8, seed=i)
        for i in range(4)
    ]
    engine = fresh(hf)
    cpu = engine.device.type == "cpu"  # the cascade is the CPU's; a GPU keeps the plain layout
    assert engine._shared_layout == cpu  # the tiny Qwen2 passes it down (test_decode_attention)
    long_gen, games = games_beside_a_long_row(hf, engine, long_req, starts, budget=4)
    shared = common_prefix_len([long_req.prompt_ids, *(r.prompt_ids for r in starts)])
    assert shared >= MIN_CASCADE_PREFIX
    assert (engine.shared_decode_steps > 0) == cpu and engine._batcher.joined >= 3
    # (the requests alone: no kept KV, so no shared columns either)
    assert_each_as_alone(hf, [(long_req, long_gen), *(pair for g in games for pair in g)])


def common_prefix_len(seqs) -> int:
    from selfplay.engines.hf_prefill import common_prefix

    seqs = [tuple(s) for s in seqs]
    return common_prefix(min(seqs), max(seqs))


def test_shared_prefix_groups_and_length_buckets():
    from selfplay.engines.hf_prefill import MIN_SHARED_PREFIX, length_buckets, shared_prefix_groups

    base, other = tuple(range(100)), tuple(range(1000, 1100))
    sys_prompt = tuple(range(5000, 5000 + MIN_SHARED_PREFIX))
    prompts = sorted(
        [(*sys_prompt, *base, k) for k in (1, 2, 3)]
        + [(*sys_prompt, *other, k) for k in (1, 2)]
        + [(7,) * 50]
    )
    groups = shared_prefix_groups(prompts)
    # two runs of one scenario each (saving 2 x 132 + 1 x 132 tokens), not one run over the
    # system prompt that all five share (4 x 32)
    assert [(b - a, n) for a, b, n in groups] == [(3, 132), (2, 132)]
    assert all(len(set(p[:n] for p in prompts[a:b])) == 1 for a, b, n in groups)
    assert shared_prefix_groups([base, base[:MIN_SHARED_PREFIX]]) == []  # keeps one own token
    assert shared_prefix_groups([(*base[:40], 1), (*base[:40], 2)]) == [(0, 2, 40)]
    assert length_buckets([400, 390, 60, 55, 40, 20]) == [(0, 2), (2, 6)]
    assert length_buckets([60, 40, 10]) == [(0, 3)]  # spares 50 positions: not worth a pass
    assert length_buckets([]) == []


def test_prefix_cache_takes_the_longest_prefix_and_evicts_within_its_budget():
    from selfplay.engines.hf import PrefixCache

    def kv(n: int):
        return torch.arange(n, dtype=torch.float32).reshape(1, 1, 1, n, 1).expand(2, 2, 3, n, 4)

    cache = PrefixCache(budget_tokens=10)
    cache.put((1, 2), kv(2))
    cache.put((1, 2, 3, 4), kv(4))
    cache.put((9, 9, 9), kv(3))
    assert (len(cache), cache.tokens) == (3, 9)
    assert cache.take([7, 1, 2, 3, 4, 5]) is None  # a prefix, not any substring
    assert cache.take([1, 2, 3, 5]).shape[-2] == 2  # (1, 2, 3, 4) does not start it
    assert cache.take([1, 2, 3, 4, 5]).shape[-2] == 4  # the longest one ...
    assert cache.take([1, 2, 3, 4, 5]) is None  # ... is taken away: its conversation moved on
    assert cache.take([9, 9, 9])[0, 0, 0, :, 0].tolist() == [0, 1]  # never the whole prompt
    cache.put((1,), kv(1))
    cache.put((2,) * 4, kv(4))
    cache.put((3,) * 4, kv(4))
    cache.put((4,) * 3, kv(3))  # 12 tokens > 10: the least recently kept go first
    assert (len(cache), cache.tokens) == (2, 7)
    assert cache.take([2] * 5) is None and cache.take([3] * 5) is not None
    cache.put((5,) * 11, kv(11))  # longer than the whole budget: not kept, nothing evicted
    assert (len(cache), cache.tokens) == (1, 3)


def test_hf_prefix_cache_budget_defaults_to_a_share_of_free_memory(hf, monkeypatch):
    from selfplay.engines import hf_kv

    c = hf.model.config
    heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    per_token = 2 * c.num_hidden_layers * heads * head_dim * hf.model.dtype.itemsize
    monkeypatch.setattr(hf_kv, "available_memory", lambda device: 64 * 2**30)
    assert fresh(hf, prefix_cache_tokens=None).prefix_cache.budget_tokens == (
        16 * 2**30 // per_token
    )
    monkeypatch.setattr(hf_kv, "available_memory", lambda device: 2**20)
    assert fresh(hf, prefix_cache_tokens=None).prefix_cache.budget_tokens == 65536  # the floor
    monkeypatch.setattr(hf_kv, "available_memory", lambda device: None)
    assert fresh(hf, prefix_cache_tokens=None).prefix_cache.budget_tokens == 65536
    assert fresh(hf, prefix_cache_tokens=1000).prefix_cache.budget_tokens == 1000
    assert fresh(hf, prefix_cache_tokens=0).prefix_cache is None


def test_hf_prefix_cache_memory_stays_within_its_budget(hf):
    """Many conversations through an engine whose budget holds about two of them."""
    reqs = [GenerationRequest(prompt(hf, f"game {i}"), 6, temperature=0.0) for i in range(6)]
    size = len(reqs[0].prompt_ids) + 5
    engine = fresh(hf, prefix_cache_tokens=2 * size + 1)
    deltas = [[[7, 8]] * len(reqs)] * 2
    run(converse(engine, reqs, deltas))
    assert engine.reused_tokens > 0 and 0 < engine.prefix_cache.tokens <= 2 * size + 1
    assert len(engine.prefix_cache) <= 2


def test_hf_engine_keeps_its_last_model_only_in_a_stage_child(tiny_model, tmp_path, monkeypatch):
    """Where KEEP_MODEL_ENV is set (iterate's stage child) an engine of the same weights takes
    the model the last one loaded; a folder rewritten since, another dtype, or the variable
    unset load it again."""
    import shutil

    from selfplay.engines import KEEP_MODEL_ENV
    from selfplay.engines import hf as hf_module

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    monkeypatch.setattr(hf_module, "_kept", None)

    def engine(dtype="fp32"):
        return hf_module.HFEngine(HFEngineConfig(model=str(model), device="cpu", dtype=dtype))

    monkeypatch.delenv(KEEP_MODEL_ENV, raising=False)
    assert engine().model is not engine().model
    monkeypatch.setenv(KEEP_MODEL_ENV, "1")
    first = engine()
    assert engine().model is first.model and engine().tokenizer is first.tokenizer
    assert engine("bf16").model is not first.model  # the kept one is replaced, not added
    again = engine()
    assert again.model is not first.model and engine().model is again.model
    (model / "README.md").write_text("a model card written since")
    assert engine().model is again.model
    weights = model / "model.safetensors"
    os.utime(weights, ns=(weights.stat().st_atime_ns, weights.stat().st_mtime_ns + 10**9))
    assert engine().model is not again.model  # new weights in place: loaded again


def test_hf_counts_its_decoding_steps_rows_and_kv_read(hf):
    """The counters the roofline benchmark's decode-aware limit reads: one request of M tokens
    (no stop token) takes M - 1 decoding passes (the first token comes from the prefill), each
    of one row reading every position so far."""
    ids = prompt(hf, "count")
    engine = fresh(hf, prefix_cache_tokens=0)
    request = GenerationRequest(ids, max_new_tokens=9, stop_token_ids=())
    (gen,) = run(gather_close(engine, [request]))
    m, p = len(gen.token_ids), len(ids)
    assert m == 9 and engine.decode_steps == engine.decode_rows == m - 1
    assert engine.decode_batches == {1: m - 1}
    assert engine.decode_kv_slots == sum(p + j for j in range(1, m))
    assert engine.decode_kv_by_rows == {1: engine.decode_kv_slots}


def test_weight_major_linears_compute_each_linear_layer_to_float_rounding():
    """The CPU engine's linear layers (W @ x^T up to WEIGHT_MAJOR_MAX_ROWS rows): the same
    product as F.linear, with and without bias, for 1-D to 3-D inputs; more rows and other
    dtypes are F.linear itself."""
    from selfplay.engines.hf_cpu import WEIGHT_MAJOR_MAX_ROWS, weight_major_linears

    torch.manual_seed(0)
    layers = torch.nn.ModuleList([torch.nn.Linear(24, 40), torch.nn.Linear(24, 40, bias=False)])
    half = torch.nn.Linear(24, 40).to(torch.bfloat16)
    weight_major_linears(torch.nn.ModuleList([*layers, half]))
    assert all("forward" in m.__dict__ for m in layers) and "forward" not in half.__dict__
    shapes = [(24,), (1, 24), (5, 24), (2, 7, 24), (WEIGHT_MAJOR_MAX_ROWS + 1, 24)]
    with torch.inference_mode():
        for layer in layers:
            for shape in shapes:
                x = torch.randn(shape)
                want = torch.nn.functional.linear(x, layer.weight, layer.bias)
                got = layer(x)
                assert got.shape == want.shape and got.is_contiguous()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
                if shape[0] > WEIGHT_MAJOR_MAX_ROWS:
                    assert torch.equal(got, want)  # F.linear itself
                elif len(shape) > 1:  # the other layout: other rounding (not bit-equal here)
                    manual = torch.mm(layer.weight, x.reshape(-1, 24).t()).t()
                    bias = 0 if layer.bias is None else layer.bias
                    assert torch.equal(got.reshape(-1, 40), manual + bias)


def test_fused_projections_hand_each_sibling_its_own_product_in_any_call_order():
    """q, k, v (and gate, up) as one product: each sibling gets what its own layer computes,
    whatever order the siblings are called in; another input, more rows than
    WEIGHT_MAJOR_MAX_ROWS or the switch off fall back to the layer's own product; the weights
    are views of one stacked tensor (no extra memory)."""
    from selfplay.engines import hf_cpu

    torch.manual_seed(0)
    block = torch.nn.Module()
    for name, out in (("q_proj", 16), ("k_proj", 8), ("v_proj", 8)):
        setattr(block, name, torch.nn.Linear(24, out))
    mlp = torch.nn.Module()
    mlp.gate_proj, mlp.up_proj = torch.nn.Linear(24, 40, bias=False), torch.nn.Linear(24, 40, False)
    model = torch.nn.ModuleList([block, mlp])
    before = {n: (m.weight.clone(), m.bias) for n, m in model.named_modules() if n.count(".")}
    hf_cpu.weight_major_linears(model)
    hf_cpu.fuse_projections(model)
    assert block.k_proj.weight.untyped_storage().data_ptr() == (
        block.q_proj.weight.untyped_storage().data_ptr()
    )

    def want(name, x):
        w, _ = before[name]
        b = dict(model.named_modules())[name].bias
        return torch.nn.functional.linear(x, w, b)

    x, other = torch.randn(2, 3, 24), torch.randn(2, 3, 24)
    with torch.inference_mode():
        for order in (["0.q_proj", "0.v_proj", "0.k_proj"], ["1.gate_proj", "1.up_proj"]):
            mods = dict(model.named_modules())
            first, *rest = order
            torch.testing.assert_close(mods[first](x), want(first, x), rtol=1e-5, atol=1e-5)
            for name in rest:
                got = mods[name](x)
                assert got.shape == want(name, x).shape and got.is_contiguous()
                torch.testing.assert_close(got, want(name, x), rtol=1e-5, atol=1e-5)
                torch.testing.assert_close(mods[name](other), want(name, other))  # not kept
        big = torch.randn(hf_cpu.WEIGHT_MAJOR_MAX_ROWS + 1, 24)
        block.q_proj(big)
        assert torch.equal(block.k_proj(big), want("0.k_proj", big))
        hf_cpu.FUSED_PROJECTIONS = False
        try:
            block.q_proj(x)
            torch.testing.assert_close(block.v_proj(x), want("0.v_proj", x))
        finally:
            hf_cpu.FUSED_PROJECTIONS = True


def test_hf_engine_on_cpu_runs_its_linear_layers_weight_major(hf):
    if hf.device.type != "cpu":
        pytest.skip("a CPU layout")
    linears = [m for m in hf.model.modules() if isinstance(m, torch.nn.Linear)]
    assert linears and all("forward" in m.__dict__ for m in linears)


def test_hf_sampling_seed_temperature_and_logprob_convention(hf):
    ids = prompt(hf, "hello")
    a, b, c = run(
        gather_close(
            fresh(hf),
            [
                GenerationRequest(ids, max_new_tokens=16, temperature=0.7, seed=1),
                GenerationRequest(ids, max_new_tokens=16, temperature=0.7, seed=1),
                GenerationRequest(ids, max_new_tokens=16, temperature=0.7, seed=2),
            ],
        )
    )
    assert a.token_ids == b.token_ids
    assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a.logprobs, b.logprobs))
    assert a.token_ids != c.token_ids  # one seed per request: a GRPO group does not collapse
    ref = full_forward_logprobs(hf.model, ids, a, temperature=0.7)
    assert max(abs(x - y) for x, y in zip(ref, a.logprobs)) < 1e-4
    # top_p -> 0 keeps only the most likely token: the same as greedy
    (g,) = run(gather_close(fresh(hf), [GenerationRequest(ids, 8, temperature=0.0)]))
    (p,) = run(gather_close(fresh(hf), [GenerationRequest(ids, 8, temperature=1.0, top_p=1e-6)]))
    assert p.token_ids == g.token_ids


def test_hf_stop_tokens_are_kept_and_context_limit_is_a_request_error(hf):
    ids = prompt(hf, "stop")
    every = tuple(range(len(hf.tokenizer)))
    (gen,) = run(gather_close(fresh(hf), [GenerationRequest(ids, 8, stop_token_ids=every)]))
    assert gen.finish_reason == "stop" and len(gen.token_ids) == 1 and len(gen.logprobs) == 1
    engine = fresh(hf)
    engine.max_context = len(ids)
    with pytest.raises(EngineRequestError, match="no room"):
        run(gather_close(engine, [GenerationRequest(ids, 8)]))


def test_a_cpu_engine_runs_its_torch_work_on_one_thread(hf, monkeypatch):
    """A CPU engine's start-up and every batch run on the process's engine thread (one OpenMP
    pool: ``batching.engine_thread``), not on the caller's thread nor on whichever thread
    asyncio's executor hands out; work sent there from the engine thread itself runs inline
    (an engine built while another is, as the dtype measurement does), and an error comes back
    to the caller."""
    import threading

    from selfplay.engines import batching
    from selfplay.engines.hf import HFEngine

    if hf.device.type != "cpu":
        pytest.skip("a CPU engine's thread")
    seen = []
    setup, batch = HFEngine._setup, HFEngine._run_batch
    monkeypatch.setattr(
        HFEngine, "_setup", lambda *a: seen.append(threading.get_ident()) or setup(*a)
    )
    monkeypatch.setattr(
        HFEngine, "_run_batch", lambda *a: seen.append(threading.get_ident()) or batch(*a)
    )
    engine = fresh(hf)
    ids = [prompt(hf, t) for t in ("one", "two")]
    for _ in range(2):  # two event loops, two batches: the same thread
        run(gather_close(fresh(hf), [GenerationRequest(x, max_new_tokens=3) for x in ids]))
    assert len(seen) >= 5 and len(set(seen)) == 1  # 3 start-ups, a batch or more a run
    assert seen[0] == batching._engine_thread_id != threading.get_ident()
    assert engine._batcher._executor is batching.engine_thread()
    assert (
        batching.on_engine_thread(lambda: batching.on_engine_thread(threading.get_ident)) == seen[0]
    )
    with pytest.raises(ZeroDivisionError):
        batching.on_engine_thread(lambda: 1 / 0)


def test_batcher_gathers_concurrent_requests_into_one_batch():
    engine = SyntheticEngine([5, 6, 7], latency_s=0.05)
    reqs = [GenerationRequest([1, 2], max_new_tokens=8, stop_token_ids=(7,)) for _ in range(50)]
    gens = run(gather_close(engine, reqs))
    assert engine.batches == 1
    assert all(g.token_ids == [5, 6, 7] and g.finish_reason == "stop" for g in gens)
    engine = SyntheticEngine([5, 6, 7], latency_s=0.0)
    (g,) = run(gather_close(engine, [GenerationRequest([1], max_new_tokens=2)]))
    assert g.token_ids == [5, 6] and g.finish_reason == "length"


def test_batcher_fails_the_requests_a_running_batch_took_when_it_breaks():
    """A batch that took waiting requests in (``take_waiting``) and then broke: the requests it
    took hear the engine's failure like the batch's own; none is left hanging."""
    from selfplay.engines.batching import Batcher

    def run_batch(requests, replies):
        while batcher.waiting < 2:  # the later requests arrive while this batch runs
            time.sleep(0.01)
        taken, _ = batcher.take_waiting(2)
        assert len(taken) == 2
        raise RuntimeError("device lost")

    batcher = Batcher(run_batch, max_batch_size=8, name="test engine")

    async def go():
        first = asyncio.ensure_future(batcher.submit(GenerationRequest([1], 2)))
        await asyncio.sleep(0.05)  # the first batch is running
        later = [asyncio.ensure_future(batcher.submit(GenerationRequest([2], 2))) for _ in "ab"]
        try:
            return await asyncio.wait_for(
                asyncio.gather(first, *later, return_exceptions=True), timeout=10
            )
        finally:
            await batcher.aclose()

    results = run(go())
    assert all(isinstance(r, EngineFailure) and "device lost" in str(r) for r in results)
    assert (batcher.batches, batcher.joined) == (1, 2)


# ---------------------------------------------------------------------------------------------
# sglang client against the stand-in


@pytest.fixture(scope="module")
def standin(tiny_model):
    with running([str(TESTS / "sglang_standin.py"), "--model-path", str(tiny_model)]) as url:
        yield url


def attach(url: str, model: str, **kw) -> SGLangEngine:
    return SGLangEngine(SGLangEngineConfig(model=model, url=url, **kw))


async def start_generate_close(engine, requests):
    await engine.start()
    return await gather_close(engine, requests)


def test_sglang_client_is_token_exact_with_the_hf_engine(standin, hf, tiny_model):
    ids = prompt(hf, "hello there")
    stops = (hf.tokenizer.eos_token_id,)
    reqs = [
        GenerationRequest(ids, max_new_tokens=20, temperature=0.7, seed=s, stop_token_ids=stops)
        for s in range(4)
    ]
    engine = attach(standin, str(tiny_model))

    async def go():
        await engine.start()
        await engine.load_weights(str(tiny_model))  # the stand-in only records it
        return await gather_close(engine, reqs)

    remote = run(go())
    assert engine.max_context == hf.max_context  # read from /v1/models
    local = run(gather_close(fresh(hf), reqs))
    for r, loc in zip(remote, local):
        assert r.token_ids == loc.token_ids
        assert all(math.isclose(a, b, abs_tol=1e-4) for a, b in zip(r.logprobs, loc.logprobs))
        assert r.finish_reason == loc.finish_reason


def test_sglang_payload_and_response_parsing():
    engine = attach("http://127.0.0.1:9", "m")
    body = engine.payload(GenerationRequest([1, 2], 5, 0.5, 0.9, seed=3, stop_token_ids=(2,)))
    assert body == {
        "input_ids": [1, 2],
        "sampling_params": {
            "max_new_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "stop_token_ids": [2],
            "sampling_seed": 3,
        },
        "return_logprob": True,
    }
    answer = {
        "text": "x",
        "output_ids": [99, 7, 8],  # some versions put prompt ids here: never read
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 8},
            "completion_tokens": 2,
            "prompt_tokens": 2,
            "output_token_logprobs": [[-0.5, 7, None], [-0.1, 8, None]],
        },
    }
    gen = SGLangEngine.parse(answer)
    assert gen.token_ids == [7, 8] and gen.logprobs == [-0.5, -0.1]
    assert gen.finish_reason == "stop"
    answer["meta_info"]["completion_tokens"] = 3
    with pytest.raises(EngineFailure, match="completion"):
        SGLangEngine.parse(answer)
    with pytest.raises(EngineFailure, match="return_logprob"):
        SGLangEngine.parse({"text": "x", "meta_info": {}})


def test_sglang_bad_request_is_a_request_error(standin, tiny_model, monkeypatch):
    engine = attach(standin, str(tiny_model))
    real = engine.payload

    def with_unknown_key(request):
        body = real(request)
        body["sampling_params"]["no_such_key"] = 1
        return body

    async def go():
        await engine.start()
        monkeypatch.setattr(engine, "payload", with_unknown_key)
        return await gather_close(engine, [GenerationRequest([1, 2, 3], 4)])

    with pytest.raises(EngineRequestError, match="400"):
        run(go())
    # the same refusal at start-up (the probe request) fails the run once, with the reason
    engine = attach(standin, str(tiny_model))
    monkeypatch.setattr(engine, "payload", with_unknown_key)
    with pytest.raises(EngineFailure, match="refused a probe request: HTTP 400"):
        run(start_generate_close(engine, []))


def test_sglang_unreachable_url_fails_clearly():
    """An attached URL that refuses connections fails at once, not after the health timeout."""
    engine = attach(f"http://127.0.0.1:{free_port()}", "m", startup_timeout_s=600.0)

    async def go():
        try:
            await engine.start()
        finally:
            await engine.aclose()

    started = time.monotonic()
    with pytest.raises(EngineFailure, match="nothing answers at"):
        run(go())
    assert time.monotonic() - started < 30


def test_sglang_launch_health_dies_and_shuts_down(tiny_model, tmp_path, monkeypatch):
    """Launch through `python -m sglang.launch_server` (the stand-in), then a crash mid-run."""
    monkeypatch.setenv("PYTHONPATH", str(install_fake_sglang(tmp_path / "fake")))
    pid_file = tmp_path / "server.pid"
    config = SGLangEngineConfig(
        model=str(tiny_model),
        python=sys.executable,
        port=free_port(),
        extra_args=("--die-after", "4", "--pid-file", str(pid_file)),  # the probe + 3
        log_path=str(tmp_path / "sglang.log"),
        retries=2,
        backoff_s=0.05,
        startup_timeout_s=120,
    )
    engine = open_engine(config)
    assert engine.command()[:3] == [sys.executable, "-m", "sglang.launch_server"]
    req = GenerationRequest([1, 2, 3], max_new_tokens=4, seed=0)

    async def go():
        await engine.start()
        try:
            ok = [await engine.generate(req) for _ in range(3)]
            assert all(len(g.token_ids) == len(g.logprobs) > 0 for g in ok)
            with pytest.raises(EngineFailure, match="exited with code 1"):
                await engine.generate(req)
        finally:
            await engine.aclose()

    run(go())
    assert engine.process is not None and engine.process.poll() is not None
    pid = int(pid_file.read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sglang_launch_with_a_missing_python_fails_clearly(tiny_model):
    with pytest.raises(EngineFailure, match="sglang installed"):
        open_engine(SGLangEngineConfig(model=str(tiny_model), python="/no/such/python"))


# ---------------------------------------------------------------------------------------------
# openai


def test_openai_chat_retries_and_never_leaks_the_key(monkeypatch, caplog):
    secret = "sk-test-SECRET-123"
    monkeypatch.setenv("MY_KEY", secret)
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request)
        assert request.headers["authorization"] == f"Bearer {secret}"
        if len(calls) == 1:
            return httpx.Response(429, headers={"retry-after": "0"}, json={"error": {}})
        if b"bad" in request.content:
            return httpx.Response(400, json={"error": {"message": "bad request"}})
        return httpx.Response(
            200, json={"choices": [{"message": {"content": "[accept]"}, "finish_reason": "stop"}]}
        )

    config = OpenAIEngineConfig(model="gpt-x", api_key_env="MY_KEY", backoff_s=0.0)
    engine = OpenAIEngine(config, transport=httpx.MockTransport(handler))

    async def go():
        try:
            text, finish = await engine.chat([{"role": "user", "content": "hi"}])
            assert (text, finish) == ("[accept]", "stop")
            with pytest.raises(EngineRequestError) as err:
                await engine.chat([{"role": "user", "content": "bad"}])
            return str(err.value)
        finally:
            await engine.aclose()

    message = run(go())
    assert len(calls) == 3
    assert secret not in message and secret not in repr(engine) and secret not in caplog.text
    assert secret not in config.model_dump_json()


def test_openai_gives_up_after_retries():
    engine = OpenAIEngine(
        OpenAIEngineConfig(model="m", retries=1, backoff_s=0.0),
        transport=httpx.MockTransport(lambda r: httpx.Response(503)),
    )

    async def go():
        try:
            await engine.chat([{"role": "user", "content": "hi"}])
        finally:
            await engine.aclose()

    with pytest.raises(EngineFailure, match="failed 2 times"):
        run(go())


def test_a_router_in_front_of_two_workers_serves_and_reloads_both(tiny_model, hf, tmp_path):
    """Scale-out: one URL (a router) in front of two SGLang servers. Generation goes through the
    router to both; a weight reload is sent to every worker the router lists."""
    procs = []
    try:
        workers = []
        for _ in range(2):
            url, proc = serve([str(TESTS / "sglang_standin.py"), "--model-path", str(tiny_model)])
            procs.append(proc)
            wait_healthy(url, proc)
            workers.append(url)
        router, proc = serve([str(TESTS / "router_standin.py"), "--workers", ",".join(workers)])
        procs.append(proc)
        wait_healthy(router, proc)
        ids = prompt(hf, "hello there")
        stops = (hf.tokenizer.eos_token_id,)
        reqs = [
            GenerationRequest(ids, max_new_tokens=8, temperature=0.7, seed=s, stop_token_ids=stops)
            for s in range(4)
        ]
        engine = attach(router, str(tiny_model))
        new = str(tmp_path / "round_1")

        async def go():
            await engine.start()
            assert await engine.worker_urls() == workers
            await engine.load_weights(new)
            return await gather_close(engine, reqs)

        remote = run(go())
        local = run(gather_close(fresh(hf), reqs))
        assert [r.token_ids for r in remote] == [r.token_ids for r in local]
        routed = httpx.get(f"{router}/routed").json()
        assert all(n >= 2 for n in routed.values())  # both workers served (probe + requests)
        for w in workers:  # the reload reached each worker
            assert httpx.get(f"{w}/model_info").json()["model_path"] == new
        assert engine.name == new
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


# --- the registry: engines are looked up by kind, opened by their config's path -----------------


class _EchoConfig(HFEngineConfig):
    engine: ClassVar[str] = "tests.test_engines:_EchoEngine"


class _EchoEngine:
    def __init__(self, config) -> None:
        self.config = config


def test_engines_are_registered_by_kind_and_opened_by_their_path(monkeypatch):
    from selfplay import engines

    assert engines.ENGINE_KINDS == ("hf", "sglang", "vllm")
    assert engines.engine_config_class("sglang") is SGLangEngineConfig
    assert engines.engine_config_class("vllm") is engines.VLLMEngineConfig
    with pytest.raises(ValueError, match="unknown engine 'trt'; engines: hf, sglang, vllm"):
        engines.engine_config_class("trt")
    config = _EchoConfig(model="m")
    with pytest.raises(ValueError, match="unknown engine config _EchoConfig"):
        open_engine(config)  # not registered
    monkeypatch.setattr(engines, "ENGINE_CONFIGS", (*engines.ENGINE_CONFIGS, _EchoConfig))
    engine = open_engine(config)
    assert type(engine).__name__ == "_EchoEngine" and engine.config is config


def test_hf_sampler_is_the_inverse_cdf_of_the_softmax_and_reports_its_log_softmax():
    """The engine's sampler (few passes over the logits) draws what inverse-CDF sampling of
    softmax(logits / T) with the same uniform draws picks (in vocabulary order; with top-p,
    over the kept head in descending order), greedy at T 0, and reports log-softmax(logits / T)
    of the sampled token before the top-p cut."""
    from selfplay.engines.hf_decode import _sample

    g = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(6, 500, generator=g)
    u = torch.rand(6, generator=g)
    for temps, top_p in (
        ([1.0] * 6, [1.0] * 6),
        ([0.7, 1.0, 0.0, 1.3, 1.0, 0.5], [1.0] * 6),
        ([0.7, 1.0, 0.0, 1.3, 1.0, 0.5], [0.9, 1.0, 1.0, 0.5, 0.99, 1e-6]),
    ):
        t, p = torch.tensor(temps), torch.tensor(top_p)
        tok, lp = _sample(logits, t, p, u)
        for b in range(6):
            if t[b] == 0:
                assert tok[b] == logits[b].argmax()
                want = torch.log_softmax(logits[b], -1)
            else:
                want = torch.log_softmax(logits[b] / t[b], -1)
                # the CDF in vocabulary order; where any row cuts top-p, in descending order
                probs, order = want.exp(), torch.arange(500)
                if bool((p < 1).any()):
                    probs, order = probs.sort(descending=True)
                keep = probs.cumsum(0) - probs <= p[b]  # the top-p head (all where p is 1)
                cdf = (probs * keep).cumsum(0)
                pick = int(torch.searchsorted(cdf, u[b] * cdf[-1], right=True).clamp(max=499))
                assert tok[b] == order[pick]
            torch.testing.assert_close(lp[b], want[tok[b]], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("vocab", [5000, 4999])
def test_the_sampling_kernel_draws_what_torchs_sampler_draws(vocab):
    """The compiled sampler (``hf_native.sample_rows``, one pass a row) draws the engine's torch
    sampler's tokens at the same uniform draws (temperatures 1, below and above it, greedy; a
    draw of 0 and one near 1; tokens ruled out at -inf; a vocabulary past the last block of 8)
    and reports the same log-softmax, to 1e-5; a draw a hair below 1 gets a token with weight
    (where the two sums' rounding may pick neighbours)."""
    import shutil

    from selfplay.engines import hf_native
    from selfplay.engines.hf_decode import _sample

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here: the engine samples by torch's ops")
    lib = hf_native.kernel()
    assert lib is not None
    g = torch.Generator().manual_seed(vocab)
    logits = 3 * torch.randn(8, vocab + 7, generator=g)[:, :vocab]  # rows strided
    logits[2, : vocab // 2] = float("-inf")
    temps = torch.tensor([1.0, 0.7, 0.0, 1.3, 1.0, 0.5, 1.0, 2.0])
    u = torch.rand(8, generator=g)
    u[0], u[1] = 0.0, 0.999
    got = hf_native.sample_rows(lib, logits, temps, u)
    want = _sample(logits, temps, torch.ones(8), u)
    assert torch.equal(got[0], want[0])
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-5)
    assert got[0][2] >= vocab // 2  # never a ruled-out token
    ref = hf_native.sampling_reference(logits, temps, u)
    assert torch.equal(got[0], ref[0])
    assert hf_native.sample_rows(lib, logits.double(), temps, u) is None
    # a draw at the CDF's top, where the two sums' rounding may differ: a token with weight
    edge = torch.full((8,), 1 - 2**-24)
    warm = temps.clamp(min=0.5)
    tok = hf_native.sample_rows(lib, logits, warm, edge)[0]
    assert (logits.gather(1, tok[:, None]) > float("-inf")).all()
    cdf = torch.softmax(logits / warm[:, None], dim=-1).cumsum(-1)
    assert (cdf.gather(1, tok[:, None]) >= 1 - 1e-4).all()  # at the top of the CDF


def test_hf_samples_by_the_kernel_without_top_p_and_by_torch_with_it(hf, monkeypatch):
    """A decoding step samples its rows by the compiled sampler unless a row cuts top-p, and
    what it generates is torch's sampler's token for token."""
    from selfplay.engines import hf_native

    if hf_native.kernel() is None:
        pytest.skip("the compiled kernels are off here")
    calls = []
    sample = hf_native.sample_rows
    monkeypatch.setattr(hf_native, "sample_rows", lambda *a: calls.append(1) or sample(*a))
    ids = [prompt(hf, t) for t in ("one", "two more", "and three")]
    reqs = [
        GenerationRequest(x, max_new_tokens=12, temperature=1.0, seed=i) for i, x in enumerate(ids)
    ]
    native = run(gather_close(fresh(hf), reqs))
    assert len(calls) >= 12
    monkeypatch.setattr(hf_native, "NATIVE_SAMPLE", False)
    by_torch = run(gather_close(fresh(hf), reqs))
    assert [g.token_ids for g in native] == [g.token_ids for g in by_torch]
    for a, b in zip(native, by_torch):
        assert all(math.isclose(x, y, abs_tol=1e-5) for x, y in zip(a.logprobs, b.logprobs))
    calls.clear()
    monkeypatch.setattr(hf_native, "NATIVE_SAMPLE", True)
    run(gather_close(fresh(hf), [replace(r, top_p=0.9) for r in reqs]))
    assert not calls


def test_hf_finished_rows_leave_the_batch_at_once_and_the_rest_are_unchanged(hf):
    """Rows that finish at different steps leave the batch when they finish (the last live rows
    move into their places), so decoding computes only live rows: one row a step for each token
    after the first (which the prefill gives); every row equals the same request run alone."""
    reqs = [
        GenerationRequest(prompt(hf, f"row {i}"), max_new_tokens=m, stop_token_ids=(), seed=i)
        for i, m in enumerate((3, 9, 6, 12, 4))
    ]
    engine = fresh(hf)
    gens = run(gather_close(engine, reqs))
    assert [len(g.token_ids) for g in gens] == [3, 9, 6, 12, 4]
    assert engine.decode_rows == sum(len(g.token_ids) - 1 for g in gens)
    assert engine._batcher.batches == 1
    off = fresh(hf, prefix_cache_tokens=0)
    for req, got in zip(reqs, gens):
        (want,) = run(gather_close(fresh(off), [req]))
        assert_same_generations(got, want)


def test_preallocated_layer_moves_rows_into_holes_and_keeps_the_rest():
    from selfplay.engines.hf_kv import PreallocatedLayer

    layer = PreallocatedLayer(capacity=6)
    keys = torch.arange(5 * 2 * 4 * 3, dtype=torch.float32).reshape(5, 2, 4, 3)
    layer.update(keys, -keys)
    layer.move_rows(torch.tensor([3, 4]), torch.tensor([0, 2]), 3)  # rows 0 and 2 finished
    assert layer.keys.shape == (3, 2, 4, 3)
    assert torch.equal(layer.keys, keys[[3, 1, 4]]) and torch.equal(layer.values, -keys[[3, 1, 4]])
    layer.update(torch.ones(3, 2, 1, 3), torch.ones(3, 2, 1, 3))  # decoding goes on after it
    assert layer.keys.shape == (3, 2, 5, 3) and torch.equal(layer.keys[:, :, :4], keys[[3, 1, 4]])


def _span_copies() -> list:
    """The KV copies to test: torch's slice copies (None), and the compiled span copy where this
    machine builds the kernels."""
    from selfplay.engines import hf_native

    copy = hf_native.span_copy()
    return [None] if copy is None else [None, copy]


@settings(max_examples=40, deadline=None)
@given(
    st.integers(2, 9).flatmap(
        lambda n: st.tuples(st.just(n), st.sets(st.integers(0, n - 1), max_size=n - 1))
    ),  # at least a row lives on (the engine drops a batch whose rows all finished)
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_every_layers_rows_move_into_holes_by_either_copy(batch, dtype):
    """A batch's finished rows (holes) take the live rows past the kept ones, in every layer
    (``hf_kv.move_rows``): by torch's indexed copies and by the span copy alike, the kept rows'
    KV whole up to the layer's length, the room cut to the kept rows, decoding after it."""
    from selfplay.engines.hf_kv import PreallocatedLayer, move_rows

    rows, finished = batch
    keep = [b for b in range(rows) if b not in finished]
    n = len(keep)
    holes = [b for b in range(n) if b in finished]
    movers = [b for b in keep if b >= n]
    kv = torch.randn(3, 2, rows, 2, 5, 4).to(dtype)  # [layers, k / v, rows, heads, tokens, dim]
    want = kv[:, :, _order(n, holes, movers)]
    for copy in _span_copies():
        layers = [PreallocatedLayer(capacity=7) for _ in range(3)]
        for layer, (k, v) in zip(layers, kv):
            layer.update(k, v)
        move_rows(layers, movers, holes, n, copy)
        for layer, (k, v) in zip(layers, want):
            assert layer.keys.shape == (n, 2, 5, 4)
            assert torch.equal(layer.keys, k) and torch.equal(layer.values, v)
            layer.update(torch.ones(n, 2, 1, 4, dtype=dtype), torch.ones(n, 2, 1, 4, dtype=dtype))
            assert torch.equal(layer.keys[:, :, :5], k) and (layer.keys[:, :, 5] == 1).all()


def _order(n: int, holes: list[int], movers: list[int]) -> list[int]:
    """Which old row each of the ``n`` kept positions holds after the movers fill the holes."""
    order = list(range(n))
    for hole, mover in zip(holes, movers):
        order[hole] = mover
    return order


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.booleans(), min_size=1, max_size=24).filter(any),
    st.integers(0, 2),
    st.sampled_from([torch.float32, torch.bfloat16]),
)
def test_a_rows_kv_is_its_real_columns_in_order_pads_and_holes_dropped(mask, row, dtype):
    """A finished row's KV for the prefix cache: its columns under mask 1, in order, every
    layer, as a new tensor (the batch's room may be reused); by torch's slice copies and by the
    compiled span copy alike."""
    from transformers import Cache

    from selfplay.engines.hf_kv import PreallocatedLayer, real_runs, row_kv

    width = len(mask)
    cache = Cache(layers=[PreallocatedLayer(width + 2) for _ in range(2)])
    for i, layer in enumerate(cache.layers):
        keys = torch.randn(3, 2, width, 4, generator=torch.Generator().manual_seed(i)).to(dtype)
        layer.update(keys, keys + 100)
    attn = torch.tensor(mask, dtype=torch.long)
    real = [i for i, m in enumerate(mask) if m]
    assert [i for start, end in real_runs(attn) for i in range(start, end)] == real
    want = torch.stack(
        [torch.stack((la.keys[row][:, real], la.values[row][:, real])) for la in cache.layers]
    )
    for copy in _span_copies():
        got = row_kv(cache, row, attn, copy)
        assert torch.equal(got, want)
        storage = got.untyped_storage().data_ptr()
        assert storage != cache.layers[0]._keys.untyped_storage().data_ptr()


def test_the_span_copy_is_never_handed_a_caches_device_memory():
    """A cache off the host (a GPU's; the meta device here) is copied by torch's slices: the
    compiled span copy takes host addresses only."""
    from transformers import Cache

    from selfplay.engines.hf_kv import PreallocatedLayer, padded_layers, row_kv

    def host_only(*spans):
        raise AssertionError("the span copy was handed device memory")

    cache = Cache(layers=[PreallocatedLayer(8) for _ in range(2)])
    for layer in cache.layers:
        layer.update(*torch.empty(2, 3, 2, 5, 4, device="meta"))
    kv = row_kv(cache, 1, torch.tensor([0, 1, 1, 0, 1]), host_only)
    assert kv.shape == (2, 2, 2, 3, 4) and kv.device.type == "meta"
    layers = padded_layers([kv, None], 4, 8, 1, host_only)
    assert len(layers) == 2 and layers[0].keys.shape == (2, 2, 4, 4)


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.one_of(st.none(), st.integers(0, 9)), min_size=1, max_size=5).filter(
        lambda xs: any(x is not None for x in xs)
    ),
    st.integers(0, 3),
    st.booleans(),
)
def test_a_batch_cache_of_kept_rows_is_the_same_by_either_copy(extra, keep, sliced):
    """The batch cache a prefill builds from kept KV (``padded_layers``): each row's shared
    first ``keep`` columns, zeros, then the rest of its kept columns right-aligned to ``past``
    (a row with nothing kept: zeros), every layer; the compiled span copy's the same as torch's
    slice copies, from whole entries and from entries cut short (``PrefixCache.take``'s views)."""
    from selfplay.engines.hf_kv import padded_layers

    g = torch.Generator().manual_seed(len(extra) + keep)
    kept = []
    for n in extra:
        if n is None:
            kept.append(None)
            continue
        kv = torch.randn(3, 2, 2, keep + n + 2, 4, generator=g)  # [layers, 2, heads, tokens, dim]
        kept.append(kv[..., : keep + n + (0 if sliced else 2), :])
    past = max(kv.shape[-2] for kv in kept if kv is not None)
    built = [padded_layers(kept, past, past + 3, keep, copy) for copy in _span_copies()]
    for layers in built:
        assert len(layers) == 3
        for i, layer in enumerate(layers):
            assert layer.keys.shape == (len(kept), 2, past, 4) and layer.capacity == past + 3
            for b, kv in enumerate(kept):
                for j, room in enumerate((layer.keys[b], layer.values[b])):
                    part = None if kv is None else kv[i, j]
                    if part is None:
                        assert (room == 0).all()
                        continue
                    start = past - (part.shape[-2] - keep)
                    assert torch.equal(room[:, :keep], part[:, :keep])
                    assert (room[:, keep:start] == 0).all()
                    assert torch.equal(room[:, start:], part[:, keep:])
