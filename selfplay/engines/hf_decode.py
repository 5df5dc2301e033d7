"""The HF engine's decoding loop: concurrent requests decoded in padded batches.

Prompts are left-padded into one batch (``hf_prefill``); each decoding step samples every row with
its own temperature, top-p and seeded generator, records log-softmax(logits / temperature) of the
sampled token (before top-p renormalisation, as SGLang reports it), and drops finished rows
from the batch and the KV cache. A row is answered as soon as it finishes, and requests that
arrived since (a game's next turn) join the running batch once they would add half as many rows
again: they are prefilled apart and both batches' KV left-padded into one cache. Identical
prompts in one batch (the games of a GRPO group start alike) are prefilled once.
"""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass

import torch
from transformers import Cache

from selfplay.engines import (
    EngineRequestError,
    Generation,
    GenerationRequest,
    HFEngineConfig,
    hf_cpu,
    hf_native,
    hf_step,
)
from selfplay.engines.batching import Batcher, Reply
from selfplay.engines.hf_cpu import MIN_CASCADE_PREFIX, SHARED_PREFIX, SharedPrefix
from selfplay.engines.hf_kv import PreallocatedLayer, move_rows, pad_left, row_kv
from selfplay.engines.hf_prefill import Prefill, common_prefix


class DecodeLoop(Prefill):
    """The decoding half of ``HFEngine`` (a base class: the engine sets, besides what
    ``Prefill`` names, ``config``, ``tokenizer``, ``max_context``, ``_batcher`` (whose worker
    thread runs ``_run_batch``) and the counters ``generated_tokens``, ``decode_batches``,
    ``decode_kv_by_rows``, ``decode_shared_by_rows`` and ``shared_decode_steps``)."""

    config: HFEngineConfig
    max_context: int | None
    generated_tokens: int
    decode_batches: Counter[int]
    decode_kv_by_rows: Counter[int]
    decode_shared_by_rows: Counter[int]
    shared_decode_steps: int
    _lean: hf_step.LeanDecode | None
    _batcher: Batcher

    def _run_batch(self, requests: list[GenerationRequest], replies: list[Reply]) -> None:
        admitted = self._admit(requests, replies)
        if admitted[0]:
            with torch.inference_mode():
                self._decode(*admitted)

    def _admit(
        self, requests: list[GenerationRequest], replies: list[Reply]
    ) -> tuple[list[GenerationRequest], list[Reply], list[int]]:
        """The requests that fit, their replies and token budgets; the others are answered
        with an error."""
        kept: tuple[list[GenerationRequest], list[Reply], list[int]] = ([], [], [])
        for r, reply in zip(requests, replies):
            room = r.max_new_tokens
            if self.max_context is not None:
                room = min(room, self.max_context - len(r.prompt_ids))
            if not r.prompt_ids or room < 1:
                reply(
                    EngineRequestError(
                        f"prompt of {len(r.prompt_ids)} tokens leaves no room to generate "
                        f"(model context {self.max_context})"
                    )
                )
                continue
            kept[0].append(r)
            kept[1].append(reply)
            kept[2].append(room)
        return kept

    def _decode(
        self, requests: list[GenerationRequest], replies: list[Reply], budget: list[int]
    ) -> None:
        run = self._start(requests, replies, budget)
        while True:
            if self._batcher.stopping.is_set():
                return
            self._sample_step(run)
            if not run.live:
                return  # what waits now starts a batch of its own
            joining = self._waiting_to_join(run.live)
            if joining:
                new = self._admit(*self._batcher.take_waiting(joining))
                if new[0]:
                    more = self._start(*new)
                    self._sample_step(more)
                    if more.live:
                        run = self._merge(run, more)
            run.attn = torch.cat([run.attn, run.attn.new_ones((len(run.active), 1))], dim=1)
            run.last_pos = run.last_pos + 1
            if self.max_context is not None:  # a dead row's position may run past the context
                run.last_pos = run.last_pos.clamp(max=self.max_context - 1)
            rows, read = run.attn.shape[0], run.attn.numel()
            extra = {}
            if run.shared and hf_cpu.CASCADE:  # the shared columns are read once, not per row
                extra[SHARED_PREFIX] = SharedPrefix(run.shared)
                read -= (rows - 1) * run.shared
                self.shared_decode_steps += 1
                self.decode_shared_by_rows[rows] += run.shared
            self.decode_batches[rows] += 1
            self.decode_kv_by_rows[rows] += read
            if self._lean is not None and hf_step.LEAN_DECODE:
                shared = run.shared if extra else 0
                run.logits = self._lean.step(run.tok, run.last_pos, run.cache, run.attn, shared)
                continue
            out = self.model(
                input_ids=run.tok[:, None],
                attention_mask=run.attn,
                position_ids=run.last_pos[:, None],
                past_key_values=run.cache,
                use_cache=True,
                **extra,
            )
            run.logits = out.logits[:, -1, :]

    def _waiting_to_join(self, active: int) -> int:
        """How many waiting requests to take into a running batch of ``active`` rows now (0:
        none). Joining copies the batch's KV cache into a wider one, so requests join when
        they would add half as many rows again (or fill the batch); models whose cache cannot
        be spliced (``plain_cache_layers``) never join."""
        if not self._cache_layers:
            return 0
        joining = min(self._batcher.waiting, self.config.max_batch_size - active)
        return joining if joining >= max(1, active // 2) else 0

    def _start(
        self, requests: list[GenerationRequest], replies: list[Reply], budget: list[int]
    ) -> _Running:
        """Prefill the requests into a new running batch (its first logits ready to sample)."""
        dev = self.device
        # Identical prompts (the games of a GRPO group all start alike) are prefilled once.
        first: dict[tuple[int, ...], int] = {}
        source = [first.setdefault(tuple(r.prompt_ids), len(first)) for r in requests]
        cache, logits, attn, last_pos, shared = self._prefill(list(first), max(budget))
        if len(first) < len(requests):
            index = torch.tensor(source, device=dev)
            cache.batch_select_indices(index)
            logits, attn, last_pos = logits[index], attn[index], last_pos[index]
        return _Running(
            requests=list(requests),
            replies=list(replies),
            budget=list(budget),
            gens=[_generator(r.seed) for r in requests],
            stops=[frozenset(r.stop_token_ids) for r in requests],
            out_ids=[[] for _ in requests],
            out_lp=[[] for _ in requests],
            active=list(range(len(requests))),
            cache=cache,
            logits=logits,
            attn=attn,
            last_pos=last_pos,
            temps=torch.tensor([r.temperature for r in requests], device=dev),
            top_p=torch.tensor([r.top_p for r in requests], device=dev),
            tok=logits.new_zeros(0, dtype=torch.long),
            shared=shared,
            shared_ids=tuple(requests[0].prompt_ids[:shared]),
        )

    def _sample_step(self, run: _Running) -> None:
        """Sample every live row's next token (``run.tok``) and answer the rows that finished
        (their KV kept in the prefix cache), then drop them from the batch. On the engine's own
        cache layers that moves the last live rows into their places (``_fill_holes``: a few
        rows' KV copied); on transformers' cache (other models) a finished row stays, dead (row
        -1), until a quarter of the batch is, since dropping rows there copies the whole KV
        cache (a quarter of a 128-game run when done at every finish), while a dead row costs
        one row of each decoding step."""
        live = run.live_positions()
        u = torch.full((len(run.active),), 0.5)  # a dead row's draw: never used
        u[live] = torch.stack([torch.rand((), generator=run.gens[run.active[b]]) for b in live])
        logits, u = run.logits.float(), u.to(self.device)
        got = None
        lib = hf_native.kernel() if hf_native.NATIVE_SAMPLE and self.device.type == "cpu" else None
        if lib is not None and not bool((run.top_p < 1).any()):
            got = hf_native.sample_rows(lib, logits, run.temps, u)
        tok, lp = got if got is not None else _sample(logits, run.temps, run.top_p, u)
        tok_l, lp_l = tok.tolist(), lp.tolist()
        for b in live:
            row = run.active[b]
            run.out_ids[row].append(tok_l[b])
            run.out_lp[row].append(lp_l[b])
            if tok_l[b] in run.stops[row]:
                reason = "stop"
            elif len(run.out_ids[row]) >= run.budget[row]:
                reason = "length"
            else:
                continue
            if self.prefix_cache is not None:
                fed = (*run.requests[row].prompt_ids, *run.out_ids[row][:-1])
                kv = row_kv(run.cache, b, run.attn[b], hf_native.span_copy())
                self.prefix_cache.put(fed, kv)
            self._finish(row, run.requests, run.replies, run.out_ids, run.out_lp, reason)
            run.active[b] = -1
        run.tok = tok
        keep = run.live_positions()
        dead = len(run.active) - len(keep)
        if not dead:
            return
        if not keep:
            run.active = []
        elif self._cache_layers:
            self._fill_holes(run, keep)
        elif 4 * dead >= len(run.active):
            index = torch.tensor(keep, dtype=torch.long, device=self.device)
            run.cache.batch_select_indices(index)
            self._reorder(run, index)
            run.active = [run.active[b] for b in keep]

    def _fill_holes(self, run: _Running, keep: list[int]) -> None:
        """Drop the dead rows of a batch on the engine's own cache layers: the live rows past the
        first ``len(keep)`` positions move into the dead ones there (their KV alone is copied)
        and the batch is cut to ``len(keep)`` rows."""
        n = len(keep)
        holes = [b for b in range(n) if run.active[b] < 0]
        movers = [b for b in keep if b >= n]
        order = list(range(n))
        for hole, mover in zip(holes, movers):
            order[hole] = mover
        move_rows(run.cache.layers, movers, holes, n, hf_native.span_copy())
        self._reorder(run, torch.tensor(order, dtype=torch.long, device=self.device))
        run.active = [run.active[b] for b in order]

    @staticmethod
    def _reorder(run: _Running, index: torch.Tensor) -> None:
        """The batch's per-position tensors at ``index`` (the cache is the caller's)."""
        run.attn, run.tok = run.attn[index], run.tok[index]
        run.temps, run.top_p = run.temps[index], run.top_p[index]
        run.last_pos = run.last_pos[index]

    def _merge(self, a: _Running, b: _Running) -> _Running:
        """One running batch of ``a``'s live rows then ``b``'s (dead ones dropped): each row's
        KV and mask padded to the longer of the two after the columns both batches share (left-
        padded where they share fewer than ``MIN_CASCADE_PREFIX``), in a cache with room for
        every row's remaining budget."""
        width = max(a.attn.shape[1], b.attn.shape[1])
        keep = common_prefix(a.shared_ids, b.shared_ids)
        keep = keep if keep >= MIN_CASCADE_PREFIX else 0
        live = [torch.tensor(x.live_positions(), device=self.device) for x in (a, b)]
        offset = len(a.requests)
        for name in ("requests", "replies", "budget", "gens", "stops", "out_ids", "out_lp"):
            getattr(a, name).extend(getattr(b, name))
        a.active = [row for row in a.active if row >= 0]
        a.active += [offset + row for row in b.active if row >= 0]
        room = max(a.budget[row] - len(a.out_ids[row]) for row in a.active)
        a.cache = Cache(
            layers=[
                PreallocatedLayer.stacked(
                    [(la, live[0]), (lb, live[1])], width, width + room, keep=keep
                )
                for la, lb in zip(a.cache.layers, b.cache.layers)
            ]
        )
        a.attn = torch.cat(
            [pad_left(x.attn[i], width, dim=1, keep=keep) for x, i in zip((a, b), live)]
        )
        a.shared, a.shared_ids = keep, a.shared_ids[:keep]
        for name in ("last_pos", "temps", "top_p", "tok"):  # (the logits: sampled already)
            setattr(a, name, torch.cat([getattr(x, name)[i] for x, i in zip((a, b), live)]))
        return a

    def _finish(self, row, requests, replies, out_ids, out_lp, reason) -> None:
        self.generated_tokens += len(out_ids[row])
        replies[row](
            Generation(
                token_ids=out_ids[row],
                logprobs=out_lp[row],
                finish_reason=reason,
                text=self.tokenizer.decode(
                    out_ids[row], skip_special_tokens=True, clean_up_tokenization_spaces=False
                ),
                prompt_tokens=len(requests[row].prompt_ids),
            )
        )


@dataclass
class _Running:
    """A batch being decoded. Lists are by row (the order the requests came in, joined ones
    after); ``active`` names the row at each batch position, and the tensors (the KV cache, the
    attention mask, the next logits or sampled tokens, positions, sampling settings) follow the
    batch positions; a finished row's position holds -1 until the batch drops it. The first
    ``shared`` KV columns hold the same tokens (``shared_ids``) in every row (``hf_prefill``'s
    layout; 0: none), which decoding attends to once for all rows."""

    requests: list[GenerationRequest]
    replies: list[Reply]
    budget: list[int]
    gens: list[torch.Generator]
    stops: list[frozenset[int]]
    out_ids: list[list[int]]
    out_lp: list[list[float]]
    active: list[int]
    cache: Cache
    logits: torch.Tensor
    attn: torch.Tensor
    last_pos: torch.Tensor
    temps: torch.Tensor
    top_p: torch.Tensor
    tok: torch.Tensor
    shared: int
    shared_ids: tuple[int, ...]

    def live_positions(self) -> list[int]:
        """Batch positions of the rows still decoding (a finished row stays as -1 until the
        batch is compacted)."""
        return [b for b, row in enumerate(self.active) if row >= 0]

    @property
    def live(self) -> int:
        return len(self.live_positions())


def _generator(seed: int | None):
    g = torch.Generator()
    g.manual_seed(int(seed) % (2**63) if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
    return g


def _sample(logits, temps, top_p, u):
    """Inverse-CDF sampling with per-row temperature and top-p; returns (tokens, logprobs).

    Temperature 0 is greedy (its log-prob is the plain log-softmax). The log-prob is taken before
    the top-p cut, the convention of SGLang and vLLM. Each pass over the ``[rows, vocab]`` logits
    costs a decoding step milliseconds on a CPU, so there are few: the shifted exponentials are
    computed in place of one copy and summed up in place (the CDF), and the log-probs of the
    sampled tokens alone are taken (``x - max - log(sum exp(x - max))``, log-softmax's formula).
    """
    greedy = temps <= 0
    scaled = logits
    if bool((temps != 1).any()):
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    top = scaled.amax(-1, keepdim=True)  # (max with indices took 15x as long at 56 x 49,152)
    weights = (scaled - top).exp_()  # unnormalised probabilities
    total = weights.sum(-1, keepdim=True)
    lse = top + total.log()
    last = weights.shape[1] - 1
    if bool((top_p < 1).any()):
        sorted_p, order = (weights / total).sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p[:, None], 0.0)
        cum = sorted_p.cumsum(-1)
        pick = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True).clamp(max=last)
        tok = order.gather(1, pick)[:, 0]
    else:
        cum = weights.cumsum_(-1)
        tok = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0].clamp(max=last)
    if bool(greedy.any()):
        tok = torch.where(greedy, scaled.argmax(-1), tok)
    return tok, scaled.gather(1, tok[:, None])[:, 0] - lse[:, 0]
