"""The HF engine's prefill: a batch of prompts fed through the model, each after the KV kept
for its start.

A prefix KV cache (SGLang's radix cache, kept simple) spares re-prefilling a conversation: a
seat's next prompt is its previous prompt + the sampled ids + new delta tokens, and prefill is
what batching helps least on CPU. A finished row's KV (prompt + generated ids but the last, the
tokens that went through the model) is kept under those ids; a request whose prompt starts with a
kept sequence takes it and prefills only the rest. In a batch each row's reused KV is left-padded
to the longest one and the new tokens are left-padded after it:

    row with a hit:  [pad pad c0 c1 c2 | pad s0 s1]     c: reused KV, s: tokens prefilled now
    row with a miss: [pad pad pad pad pad | s0 s1 s2]

The 2-D attention mask is 0 on every pad, so the hole in the middle is never attended to (the
causal mask compares indices, which keep the order of a row's real tokens), and position ids
are passed explicitly, counting each row's real tokens. Where the engine decodes with a shared
prefix (``_shared_layout``: the CPU's cascade attention), the tokens that every prompt of the
batch starts with, and every row has kept, stay in the first columns and the padding goes after
them, so that those columns hold the same tokens in every row:

    shared prefix p: [p0 p1 | pad c2 c3 | pad s0 s1]
                     [p0 p1 | c2 c3 c4 | pad pad s0]

A pass's linear layers compute its real tokens alone (``hf_cpu.real_tokens``): the padding's
outputs are zeros, which no real token attends to. (A 4-row pass of 740 real tokens in 1,200
slots: 2.4-2.9 -> 1.9-2.3 s; 16 rows, 960 in 1,440: 2.6 -> 2.4 s; SmolLM2-135M, fp32, the AVX2
EPYC, alternating.)

Reused KV equals a full prefill's up to float rounding (it was computed in another batch), not
bit for bit.

Two more passes keep a batch's prefill from computing what it need not (prefix cache on):
- prompts without a kept prefix that start alike (a seat's first turn in the games of one
  scenario: the same rules and table, then each game's own first message) share one prefill of
  their common prefix, which is also kept (not taken away) for the group's later arrivals;
- rows far longer than the rest (a first turn beside continuing turns) are prefilled apart,
  in buckets of similar length, so that the short rows are not padded to them.
Both were measured on 64 warm-started self-play games (benchmarks/bench_generate.py part e).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch
from transformers import Cache, DynamicCache

from selfplay.engines import hf_cpu, hf_native
from selfplay.engines.hf_cpu import MIN_CASCADE_PREFIX
from selfplay.engines.hf_kv import (
    PreallocatedLayer,
    PrefixCache,
    kv_length,
    padded_layers,
    row_kv,
)

# Shorter common prefixes are not worth a pass of their own, nor are long rows prefilled apart
# if that spares the others fewer padded positions.
MIN_SHARED_PREFIX = 32
MIN_SPARED_SLOTS = 512


class Prefill:
    """The prefill half of ``HFEngine`` (a base class: the engine sets ``model``, ``device``,
    ``prefix_cache`` (None: off), ``_pad_id``, ``_cache_layers`` (0: transformers' own cache)
    and the counters ``prefilled_tokens``, ``reused_tokens``, ``prefill_slots``)."""

    model: torch.nn.Module
    device: torch.device
    prefix_cache: PrefixCache | None
    prefilled_tokens: int
    reused_tokens: int
    prefill_slots: int
    _pad_id: int
    _cache_layers: int
    _shared_layout: bool

    def _prefill(
        self, prompts: list[tuple[int, ...]], room: int
    ) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Feed the prompts through the model, each after its longest kept prefix (the layout of
        the module docstring): (cache, last logits, attention mask, last positions) per prompt,
        and how many first columns every row shares. ``room``: the tokens that decoding may
        add."""
        kept: list[torch.Tensor | None] = [None] * len(prompts)
        if self.prefix_cache is not None:
            kept = [self.prefix_cache.take(p) for p in prompts]
            self.reused_tokens += sum(kv_length(kv) for kv in kept)
            kept = self._share_prefixes(prompts, kept)
            kept = self._prefill_long_rows_apart(prompts, kept)
        self.prefilled_tokens += sum(len(p) - kv_length(kv) for p, kv in zip(prompts, kept))
        cache, logits, attn, positions, shared = self._forward(prompts, kept, room)
        return cache, logits, attn, positions[:, -1], shared

    def _forward(
        self, seqs: Sequence[Sequence[int]], kept: list[torch.Tensor | None], room: int
    ) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """One padded pass over ``seqs``, each after its kept KV: (cache with room for ``room``
        more tokens, last logits, attention mask, positions of the new tokens, first columns
        shared by every row)."""
        dev = self.device
        n = len(seqs)
        reused = [kv_length(kv) for kv in kept]
        new = [len(p) - c for p, c in zip(seqs, reused)]
        past, width = max(reused), max(new)
        shared = shared_columns(seqs, reused) if self._shared_layout else 0
        self.prefill_slots += n * width
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((n, past + width), dtype=torch.long)
        attn[:, :shared] = 1
        for i, p in enumerate(seqs):
            ids[i, width - new[i] :] = torch.tensor(p[reused[i] :])
            attn[i, past - reused[i] + shared : past] = 1
            attn[i, past + width - new[i] :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = self._batch_cache(kept, past, past + width + room, shared)
        kernel = hf_native.prefill_attention(self.model.dtype) if dev.type == "cpu" else None
        extra = {} if kernel is None else {hf_cpu.PREFILL_KERNEL: kernel}
        with hf_cpu.real_tokens(attn[:, past:]):  # the linear layers skip the padding
            out = self.model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=positions,
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=1,
                **extra,
            )
        return cache, out.logits[:, -1, :], attn, positions, shared

    def _kv_of(
        self, seqs: Sequence[Sequence[int]], kept: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Each sequence's KV over all its tokens (one pass, its kept KV reused)."""
        cache, _, attn, _, _ = self._forward(seqs, kept, 0)
        copy = hf_native.span_copy()
        return [row_kv(cache, b, attn[b], copy) for b in range(len(seqs))]

    def _share_prefixes(
        self, prompts: list[tuple[int, ...]], kept: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Prompts with nothing kept that start alike get their common prefix's KV from one
        pass; each prefix is kept in the prefix cache for later prompts that start with it."""
        assert self.prefix_cache is not None
        misses = sorted((i for i, kv in enumerate(kept) if kv is None), key=prompts.__getitem__)
        groups = shared_prefix_groups([prompts[i] for i in misses])
        if not groups:
            return kept
        prefixes = [prompts[misses[a]][:length] for a, _, length in groups]
        kvs = self._kv_of(prefixes, [None] * len(prefixes))
        kept = list(kept)
        for (a, b, length), prefix, kv in zip(groups, prefixes, kvs):
            for j in range(a, b):
                kept[misses[j]] = kv
            self.prefilled_tokens += length
            self.reused_tokens += length * (b - a - 1)
            self.prefix_cache.put(prefix, kv, shared=True)
        return kept

    def _prefill_long_rows_apart(
        self, prompts: list[tuple[int, ...]], kept: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Rows whose new tokens are many times the others' get their KV (all of the prompt
        but its last token) from passes of their own, rows of similar length together."""
        new = [len(p) - kv_length(kv) for p, kv in zip(prompts, kept)]
        order = sorted(range(len(prompts)), key=new.__getitem__, reverse=True)
        buckets = length_buckets([new[i] for i in order])
        if len(buckets) < 2:
            return kept
        kept = list(kept)
        for a, b in buckets[:-1]:  # the shortest rows stay for the batch's own pass
            rows = order[a:b]
            kvs = self._kv_of([prompts[i][:-1] for i in rows], [kept[i] for i in rows])
            for i, kv in zip(rows, kvs):
                self.prefilled_tokens += new[i] - 1
                kept[i] = kv
        return kept

    def _batch_cache(
        self, kept: list[torch.Tensor | None], past: int, capacity: int, shared: int
    ) -> Cache:
        """The batch's KV cache, room for ``capacity`` tokens, each row's kept KV padded to
        ``past`` tokens (zeros) after its first ``shared`` (left-padded where 0); a plain
        DynamicCache for models with other layers."""
        if not self._cache_layers:
            return DynamicCache(config=self.model.config)
        if not past:
            return Cache(layers=[PreallocatedLayer(capacity) for _ in range(self._cache_layers)])
        return Cache(layers=padded_layers(kept, past, capacity, shared, hf_native.span_copy()))


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def shared_prefix_groups(prompts: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """Runs of sorted ``prompts`` to prefill one common prefix for: ``(start, end, length)``,
    chosen to save the most tokens (a run of k prompts sharing L tokens saves (k - 1) L; each
    prompt keeps at least one token of its own). Only prefixes of ``MIN_SHARED_PREFIX`` tokens
    or more count."""
    m = len(prompts)
    if m < 2:
        return []
    adjacent = [common_prefix(a, b) for a, b in itertools.pairwise(prompts)]
    best = [0] * (m + 1)  # best[j]: tokens saved over the first j prompts
    choice: list[tuple[int, int] | None] = [None] * (m + 1)
    for j in range(1, m + 1):
        best[j], choice[j] = best[j - 1], None
        shared, shortest = len(prompts[j - 1]), len(prompts[j - 1])
        for i in range(j - 2, -1, -1):  # the run prompts[i:j]
            shared = min(shared, adjacent[i])
            shortest = min(shortest, len(prompts[i]))
            length = min(shared, shortest - 1)
            if length < MIN_SHARED_PREFIX:
                break
            if best[i] + (j - i - 1) * length > best[j]:
                best[j], choice[j] = best[i] + (j - i - 1) * length, (i, length)
    groups, j = [], m
    while j > 0:
        if choice[j] is None:
            j -= 1
            continue
        i, length = choice[j]
        groups.append((i, j, length))
        j = i
    return groups[::-1]


def shared_columns(seqs: Sequence[Sequence[int]], reused: list[int]) -> int:
    """How many first tokens every sequence starts with and every row has kept KV for (0 where
    fewer than the cascade attention's ``MIN_CASCADE_PREFIX``, or for a single row)."""
    if len(seqs) < 2:
        return 0
    ordered = [tuple(s) for s in seqs]  # the least and the greatest share what all share
    shared = min(common_prefix(min(ordered), max(ordered)), *reused)
    return shared if shared >= MIN_CASCADE_PREFIX else 0


def length_buckets(new: list[int]) -> list[tuple[int, int]]:
    """Split rows sorted by new tokens (longest first) into runs ``(start, end)`` whose padding
    stays small: a run ends before a row with less than half its longest row's tokens, where
    that spares the rows left ``MIN_SPARED_SLOTS`` padded positions or more (a pass of its own
    and a copy of its rows' KV cost about that)."""
    buckets, start = [], 0
    for i in range(1, len(new)):
        spared = (len(new) - i) * (new[start] - new[i])
        if 2 * new[i] < new[start] and spared >= MIN_SPARED_SLOTS:
            buckets.append((start, i))
            start = i
    if new:
        buckets.append((start, len(new)))
    return buckets
