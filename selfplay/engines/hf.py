"""transformers in-process engine (CPU or GPU): concurrent requests decoded in padded batches.

Prompts are left-padded into one batch; each decoding step samples every row with its own
temperature, top-p and seeded generator, records log-softmax(logits / temperature) of the
sampled token (before top-p renormalisation, as SGLang reports it), and drops finished rows
from the batch and the KV cache. A row is answered as soon as it finishes, and requests that
arrived since (a game's next turn) join the running batch once they would add half as many rows
again: they are prefilled apart and both batches' KV left-padded into one cache.

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
are passed explicitly, counting each row's real tokens. Reused KV equals a full prefill's up to
float rounding (it was computed in another batch), not bit for bit. Identical prompts in one
batch (the games of a GRPO group start alike) are prefilled once.

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
import logging
import os
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AttentionInterface,
    AutoModelForCausalLM,
    AutoTokenizer,
    Cache,
    DynamicCache,
    DynamicLayer,
)
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from selfplay.engines import (
    KEEP_MODEL_ENV,
    EngineRequestError,
    Generation,
    GenerationRequest,
    HFEngineConfig,
)
from selfplay.engines.batching import Batcher, Reply
from selfplay.hardware import available_memory, resolve_dtype, usable_cores

log = logging.getLogger(__name__)

# Shorter common prefixes are not worth a pass of their own, nor are long rows prefilled apart
# if that spares the others fewer padded positions.
MIN_SHARED_PREFIX = 32
MIN_SPARED_SLOTS = 512


# the last model loaded, kept where KEEP_MODEL_ENV is set (a held-out evaluation and the next
# round's generate in iterate's stage child load it once)
_kept: tuple[tuple, object, object] | None = None  # (key, model, tokenizer)


def _weights_key(path: str, dtype: torch.dtype) -> tuple:
    """What identifies a model's weights: its path, the dtype and, for a local folder, the
    files' sizes and modification times (a folder rewritten in place is loaded again); the model
    card (README.md, which a held-out evaluation annotates) does not count."""
    folder = Path(path)
    files = sorted(f for f in folder.iterdir() if f.suffix != ".md") if folder.is_dir() else []
    return path, dtype, tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files)


def _load(path: str, dtype: torch.dtype, tokenizer):
    """The model (and tokenizer, unless given) at ``path`` in ``dtype``; in a stage child the
    last one loaded is kept for the next engine of the same weights."""
    global _kept
    keep = os.environ.get(KEEP_MODEL_ENV) == "1"
    key = _weights_key(path, dtype) if keep else None
    if _kept is not None and _kept[0] == key:
        log.info("reusing the model %s loaded by an earlier stage in this process", path)
        return _kept[1], tokenizer or _kept[2]
    _kept = None  # the old model goes before the new one loads
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        tokenizer = tokenizer or AutoTokenizer.from_pretrained(path)
    except Exception as e:  # OSError, a corrupt safetensors file, a bad config.json
        raise RuntimeError(
            f"cannot load model {path!r}: {type(e).__name__}: {e}. Pass a local "
            "Hugging Face model directory or an HF model id this machine can download."
        ) from e
    if keep:
        _kept = (key, model, tokenizer)
    return model, tokenizer


class HFEngine:
    """A Hugging Face causal LM behind the ``Engine`` protocol."""

    def __init__(self, config: HFEngineConfig, *, model=None, tokenizer=None) -> None:
        self.config = config
        self.name = config.model
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            threads = config.cpu_threads or usable_cores()
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        # auto: bf16 where the device computes it natively (selfplay.hardware)
        self.dtype = resolve_dtype(config.dtype, str(self.device))
        dtype = torch.bfloat16 if self.dtype == "bf16" else torch.float32
        if model is None:
            model, tokenizer = _load(config.model, dtype, tokenizer)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        self.model = model.to(self.device).eval()
        if self.device.type == "cpu":
            if self.model.config._attn_implementation == "sdpa":
                self.model.set_attn_implementation(_grouped_sdpa())
            _weight_major_linears(self.model)
        self.max_context: int | None = getattr(self.model.config, "max_position_embeddings", None)
        self._pad_id = next(
            (
                i
                for i in (self.tokenizer.pad_token_id, self.tokenizer.eos_token_id, 0)
                if i is not None
            ),
            0,
        )
        self._batcher = Batcher(
            self._run_batch, max_batch_size=config.max_batch_size, name=f"hf engine {self.name}"
        )
        self.generated_tokens = 0
        self.prefilled_tokens = 0  # prompt tokens fed through the model
        self.reused_tokens = 0  # prompt tokens taken from KV computed for another request
        self.prefill_slots = 0  # rows x padded width of every prefill pass: compute, pads included
        # decoding: steps by their rows (dead ones too; matmul speed depends on a step's rows)
        # and the KV positions they read (rows x width), by rows too; decode_steps, decode_rows
        # and decode_kv_slots follow from them
        self.decode_batches: Counter[int] = Counter()
        self.decode_kv_by_rows: Counter[int] = Counter()
        self._cache_layers = _plain_cache_layers(self.model)
        budget = config.prefix_cache_tokens
        if budget is None:
            budget = _auto_prefix_budget(self.model, str(self.device))
        self.prefix_cache = PrefixCache(budget) if budget and self._cache_layers else None

    @property
    def decode_steps(self) -> int:
        return self.decode_batches.total()

    @property
    def decode_kv_slots(self) -> int:
        return self.decode_kv_by_rows.total()

    @property
    def decode_rows(self) -> int:
        return sum(rows * steps for rows, steps in self.decode_batches.items())

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> Generation:
        return await self._batcher.submit(request)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    # -----------------------------------------------------------------------------------------
    # the decoding loop (runs in a worker thread)

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
            self.decode_batches[run.attn.shape[0]] += 1
            self.decode_kv_by_rows[run.attn.shape[0]] += run.attn.numel()
            out = self.model(
                input_ids=run.tok[:, None],
                attention_mask=run.attn,
                position_ids=run.last_pos[:, None],
                past_key_values=run.cache,
                use_cache=True,
            )
            run.logits = out.logits[:, -1, :]

    def _waiting_to_join(self, active: int) -> int:
        """How many waiting requests to take into a running batch of ``active`` rows now (0:
        none). Joining copies the batch's KV cache into a wider one, so requests join when
        they would add half as many rows again (or fill the batch); models whose cache cannot
        be spliced (``_plain_cache_layers``) never join."""
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
        cache, logits, attn, last_pos = self._prefill(list(first), max(budget))
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
        )

    def _sample_step(self, run: _Running) -> None:
        """Sample every live row's next token (``run.tok``) and answer the rows that finished
        (their KV kept in the prefix cache). A finished row stays in the batch, dead (row -1),
        until a quarter of the batch is: dropping rows copies the whole KV cache, which cost a
        quarter of a 128-game run when done at every finish, while a dead row costs one row of
        each decoding step."""
        live = run.live_positions()
        u = torch.full((len(run.active),), 0.5)  # a dead row's draw: never used
        u[live] = torch.stack([torch.rand((), generator=run.gens[run.active[b]]) for b in live])
        tok, lp = _sample(run.logits.float(), run.temps, run.top_p, u.to(self.device))
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
                self.prefix_cache.put(fed, _row_kv(run.cache, b, run.attn[b]))
            self._finish(row, run.requests, run.replies, run.out_ids, run.out_lp, reason)
            run.active[b] = -1
        run.tok = tok
        keep = run.live_positions()
        dead = len(run.active) - len(keep)
        if dead and (not keep or 4 * dead >= len(run.active)):
            if keep:
                index = torch.tensor(keep, dtype=torch.long, device=self.device)
                run.cache.batch_select_indices(index)
                run.attn, run.tok = run.attn[index], run.tok[index]
                run.temps, run.top_p = run.temps[index], run.top_p[index]
                run.last_pos = run.last_pos[index]
            run.active = [run.active[b] for b in keep]

    def _merge(self, a: _Running, b: _Running) -> _Running:
        """One running batch of ``a``'s live rows then ``b``'s (dead ones dropped): each row's
        KV and mask left-padded to the longer of the two, in a cache with room for every row's
        remaining budget."""
        width = max(a.attn.shape[1], b.attn.shape[1])
        live = [torch.tensor(x.live_positions(), device=self.device) for x in (a, b)]
        offset = len(a.requests)
        for name in ("requests", "replies", "budget", "gens", "stops", "out_ids", "out_lp"):
            getattr(a, name).extend(getattr(b, name))
        a.active = [row for row in a.active if row >= 0]
        a.active += [offset + row for row in b.active if row >= 0]
        room = max(a.budget[row] - len(a.out_ids[row]) for row in a.active)
        a.cache = Cache(
            layers=[
                _PreallocatedLayer.stacked([(la, live[0]), (lb, live[1])], width, width + room)
                for la, lb in zip(a.cache.layers, b.cache.layers)
            ]
        )
        a.attn = torch.cat([_pad_left(x.attn[i], width, dim=1) for x, i in zip((a, b), live)])
        for name in ("last_pos", "temps", "top_p", "tok"):  # (the logits: sampled already)
            setattr(a, name, torch.cat([getattr(x, name)[i] for x, i in zip((a, b), live)]))
        return a

    def _prefill(
        self, prompts: list[tuple[int, ...]], room: int
    ) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Feed the prompts through the model, each after its longest kept prefix (the layout of
        the module docstring): (cache, last logits, attention mask, last positions) per prompt.
        ``room``: the tokens that decoding may add."""
        kept: list[torch.Tensor | None] = [None] * len(prompts)
        if self.prefix_cache is not None:
            kept = [self.prefix_cache.take(p) for p in prompts]
            self.reused_tokens += sum(_length(kv) for kv in kept)
            kept = self._share_prefixes(prompts, kept)
            kept = self._prefill_long_rows_apart(prompts, kept)
        self.prefilled_tokens += sum(len(p) - _length(kv) for p, kv in zip(prompts, kept))
        cache, logits, attn, positions = self._forward(prompts, kept, room)
        return cache, logits, attn, positions[:, -1]

    def _forward(
        self, seqs: Sequence[Sequence[int]], kept: list[torch.Tensor | None], room: int
    ) -> tuple[Cache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """One padded pass over ``seqs``, each after its kept KV: (cache with room for ``room``
        more tokens, last logits, attention mask, positions of the new tokens)."""
        dev = self.device
        n = len(seqs)
        reused = [_length(kv) for kv in kept]
        new = [len(p) - c for p, c in zip(seqs, reused)]
        past, width = max(reused), max(new)
        self.prefill_slots += n * width
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((n, past + width), dtype=torch.long)
        for i, p in enumerate(seqs):
            ids[i, width - new[i] :] = torch.tensor(p[reused[i] :])
            attn[i, past - reused[i] : past] = 1
            attn[i, past + width - new[i] :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)[:, past:]
        cache = self._batch_cache(kept, past, past + width + room)
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        return cache, out.logits[:, -1, :], attn, positions

    def _kv_of(
        self, seqs: Sequence[Sequence[int]], kept: list[torch.Tensor | None]
    ) -> list[torch.Tensor]:
        """Each sequence's KV over all its tokens (one pass, its kept KV reused)."""
        cache, _, attn, _ = self._forward(seqs, kept, 0)
        return [_row_kv(cache, b, attn[b]) for b in range(len(seqs))]

    def _share_prefixes(
        self, prompts: list[tuple[int, ...]], kept: list[torch.Tensor | None]
    ) -> list[torch.Tensor | None]:
        """Prompts with nothing kept that start alike get their common prefix's KV from one
        pass; each prefix is kept in the prefix cache for later prompts that start with it."""
        assert self.prefix_cache is not None
        misses = sorted((i for i, kv in enumerate(kept) if kv is None), key=prompts.__getitem__)
        groups = _shared_prefix_groups([prompts[i] for i in misses])
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
        new = [len(p) - _length(kv) for p, kv in zip(prompts, kept)]
        order = sorted(range(len(prompts)), key=new.__getitem__, reverse=True)
        buckets = _length_buckets([new[i] for i in order])
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

    def _batch_cache(self, kept: list[torch.Tensor | None], past: int, capacity: int) -> Cache:
        """The batch's KV cache, room for ``capacity`` tokens, each row's kept KV left-padded to
        ``past`` tokens (zeros) in it; a plain DynamicCache for models with other layers."""
        if not self._cache_layers:
            return DynamicCache(config=self.model.config)
        cache = Cache(layers=[_PreallocatedLayer(capacity) for _ in range(self._cache_layers)])
        if past:
            some = next(kv for kv in kept if kv is not None)
            layers, _, heads, _, dim = some.shape
            kv = some.new_zeros((layers, 2, len(kept), heads, past, dim))
            for i, row in enumerate(kept):
                if row is not None:
                    kv[:, :, i, :, past - row.shape[-2] :] = row
            for layer, (keys, values) in zip(cache.layers, kv):
                layer.update(keys, values)
        return cache

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
    batch positions; a finished row's position holds -1 until the batch drops it."""

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

    def live_positions(self) -> list[int]:
        """Batch positions of the rows still decoding (a finished row stays as -1 until the
        batch is compacted)."""
        return [b for b, row in enumerate(self.active) if row >= 0]

    @property
    def live(self) -> int:
        return len(self.live_positions())


def _pad_left(x: torch.Tensor, width: int, *, dim: int) -> torch.Tensor:
    """``x`` with zeros before it along ``dim`` up to ``width``."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    return torch.cat([x.new_zeros(shape), x], dim=dim)


class PrefixCache:
    """Finished rows' KV caches keyed by the token ids they cover, least recently kept evicted.

    An entry is a tensor ``[layers, 2 (key, value), kv heads, tokens, head dim]``. ``take``
    removes what it returns: a conversation only grows, so its next turn keeps a longer entry and
    the old one would never be used again; a shared prefix (``put(shared=True)``) stays. Only
    the engine's worker thread touches it.
    """

    def __init__(self, budget_tokens: int) -> None:
        self.budget_tokens = budget_tokens
        self.tokens = 0  # tokens held, at most budget_tokens
        self._entries: OrderedDict[tuple[int, ...], torch.Tensor] = OrderedDict()
        self._shared: set[tuple[int, ...]] = set()

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, ids: tuple[int, ...], kv: torch.Tensor, *, shared: bool = False) -> None:
        """Keep ``kv`` under ``ids``; a ``shared`` entry (a prefix that several conversations
        start with) stays when taken, until evicted."""
        if len(ids) > self.budget_tokens:
            return
        if self._entries.pop(ids, None) is not None:
            self.tokens -= len(ids)
            self._shared.discard(ids)
        self._entries[ids] = kv
        self.tokens += len(ids)
        if shared:
            self._shared.add(ids)
        while self.tokens > self.budget_tokens:
            evicted, _ = self._entries.popitem(last=False)
            self.tokens -= len(evicted)
            self._shared.discard(evicted)

    def take(self, prompt: Sequence[int]) -> torch.Tensor | None:
        """Remove and return the KV of the longest kept sequence that starts ``prompt`` (None if
        none), cut to ``len(prompt) - 1`` tokens so that at least one token is fed to the model.
        """
        best: tuple[int, ...] = ()
        for ids in self._entries:
            n = len(ids)
            # the last-token test rejects almost every other conversation before the full compare
            if (
                len(best) < n <= len(prompt)
                and ids[-1] == prompt[n - 1]
                and ids == tuple(prompt[:n])
            ):
                best = ids
        if not best:
            return None
        if best in self._shared:
            self._entries.move_to_end(best)
            kv = self._entries[best]
        else:
            kv = self._entries.pop(best)
            self.tokens -= len(best)
        return kv[..., : len(prompt) - 1, :]


def _length(kv: torch.Tensor | None) -> int:
    return 0 if kv is None else kv.shape[-2]


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def _shared_prefix_groups(prompts: list[tuple[int, ...]]) -> list[tuple[int, int, int]]:
    """Runs of sorted ``prompts`` to prefill one common prefix for: ``(start, end, length)``,
    chosen to save the most tokens (a run of k prompts sharing L tokens saves (k - 1) L; each
    prompt keeps at least one token of its own). Only prefixes of ``MIN_SHARED_PREFIX`` tokens
    or more count."""
    m = len(prompts)
    if m < 2:
        return []
    adjacent = [_common_prefix(a, b) for a, b in itertools.pairwise(prompts)]
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


def _length_buckets(new: list[int]) -> list[tuple[int, int]]:
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


# The prefix cache's default budget: this share of the memory free when the engine starts, and
# never less than this many tokens.
AUTO_PREFIX_SHARE = 0.25
AUTO_PREFIX_MIN_TOKENS = 65536


def _auto_prefix_budget(model, device: str) -> int:
    """Tokens of KV that ``AUTO_PREFIX_SHARE`` of the free memory holds (at least
    ``AUTO_PREFIX_MIN_TOKENS``, the old fixed default)."""
    free = available_memory(device)
    if free is None:
        return AUTO_PREFIX_MIN_TOKENS
    return max(AUTO_PREFIX_MIN_TOKENS, int(AUTO_PREFIX_SHARE * free) // kv_bytes_per_token(model))


def attention_shape(model) -> tuple[int, int, int, int]:
    """(layers, query heads, KV heads, head dim) of the model's attention."""
    c = model.config.get_text_config()
    heads = c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, heads, kv_heads, head_dim


def kv_bytes_per_token(model) -> int:
    """Bytes of KV cache one token takes: keys and values of every layer's KV heads."""
    layers, _, kv_heads, head_dim = attention_shape(model)
    return 2 * layers * kv_heads * head_dim * model.dtype.itemsize


def _plain_cache_layers(model) -> int:
    """How many KV layers the model caches when all are plain full attention, else 0.

    Only such layers can be cut per row, padded back together and preallocated; a sliding-window
    or recurrent layer keeps state that this scheme cannot splice, so such a model decodes with
    transformers' own DynamicCache and no prefix cache.
    """
    layers = DynamicCache(config=model.config).layers
    if all(type(layer) is DynamicLayer for layer in layers):
        return len(layers)
    log.info("prefix cache off: %s has non-full-attention cache layers", type(model).__name__)
    return 0


class _PreallocatedLayer(DynamicLayer):
    """A DynamicLayer that writes new tokens into room allocated once per batch.

    ``DynamicLayer.update`` concatenates, which copies the layer's whole cache at every decoding
    step: a step of 32 rows over 500 tokens took 1.7 ms instead of 2.0 ms on the tiny test model
    and 222 ms instead of 262 ms with SmolLM2-135M's shapes (one thread), and the copy grows with
    the context. ``capacity`` is all the batch can reach (reused + prefilled tokens + the longest
    generation budget).
    """

    def __init__(self, capacity: int) -> None:
        super().__init__()
        self.capacity = capacity
        self._keys: torch.Tensor | None = None  # the room; self.keys and self.values view it
        self._values: torch.Tensor | None = None

    def update(self, key_states, value_states, *args, **kwargs):
        if self._keys is None:
            self.lazy_initialization(key_states, value_states)
            shape = (*key_states.shape[:-2], self.capacity, key_states.shape[-1])
            self._keys, self._values = key_states.new_empty(shape), value_states.new_empty(shape)
        start = self.get_seq_length()
        end = start + key_states.shape[-2]
        self._keys[..., start:end, :] = key_states
        self._values[..., start:end, :] = value_states
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self.keys, self.values

    @classmethod
    def stacked(
        cls, parts: list[tuple[DynamicLayer, torch.Tensor]], width: int, capacity: int
    ) -> _PreallocatedLayer:
        """One layer holding the selected rows of each part ``(layer, row indices)`` in order,
        each part's tokens left-padded (zeros) to ``width``, with room for ``capacity``."""
        first = parts[0][0].keys
        rows = sum(len(index) for _, index in parts)
        shape = (rows, first.shape[1], capacity, first.shape[-1])
        layer = cls(capacity)
        layer.lazy_initialization(first, parts[0][0].values)
        layer._keys, layer._values = first.new_empty(shape), first.new_empty(shape)
        row = 0
        for p, index in parts:
            n, length = len(index), p.keys.shape[-2]
            for room, part in ((layer._keys, p.keys), (layer._values, p.values)):
                room[row : row + n, :, : width - length] = 0
                torch.index_select(
                    part, 0, index, out=room[row : row + n, :, width - length : width]
                )
            row += n
        layer.keys, layer.values = layer._keys[..., :width, :], layer._values[..., :width, :]
        return layer

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._keys is not None:
            end = self.get_seq_length()
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]


def _grouped_sdpa() -> str:
    """Register and name SDPA attention that never copies KV heads for query groups.

    transformers' SDPA repeats each KV head for its query group whenever there is a padding
    mask (torch's CUDA kernels cannot combine GQA with a mask), which on CPU copies the whole KV
    cache at every decoding step of a padded batch. torch's CPU kernels take ``enable_gqa`` with a
    mask: a decoding step of 32 rows over 500 tokens took 2.0 ms instead of 5-6 ms on the tiny
    test model and 262 ms instead of 460 ms with SmolLM2-135M's shapes (one thread).
    """

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kw):
        causal = kw.get("is_causal")
        causal = getattr(module, "is_causal", True) if causal is None else causal
        out = torch.nn.functional.scaled_dot_product_attention(
            query,
            key,
            value,
            attn_mask=attention_mask,
            dropout_p=dropout,
            scale=scaling,
            is_causal=query.shape[2] > 1 and attention_mask is None and causal,
            enable_gqa=True,
        )
        return out.transpose(1, 2).contiguous(), None

    name = "selfplay_grouped_sdpa"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, sdpa_mask)
    return name


# Up to this many rows a CPU linear layer runs as weight @ input^T (see _weight_major_linears).
WEIGHT_MAJOR_MAX_ROWS = 512


def _weight_major_linears(model) -> None:
    """Make the model's fp32 linear layers compute ``(W @ x^T)^T`` for up to
    ``WEIGHT_MAJOR_MAX_ROWS`` rows (a decoding step's rows, a prefill's last tokens).

    ``F.linear`` asks MKL for ``x @ W^T``; the product laid out as ``W @ x^T`` made a whole
    decoding step faster on the AVX2 EPYC (SmolLM2-135M, 64 rows over ~470 KV positions, 2
    threads, the layouts alternating step by step: 518 -> 459 ms, benchmarks/bench_generate.py
    part g; the 64 games of `bench_roofline.py --stages`' generate: 145 and 159 s -> 138 and 138
    s). Isolated at one shape with its weights out of cache, neither layout was clearly faster.
    Same product, other summation order: results agree to float rounding. Other dtypes, and
    more rows (a long prefill, where both layouts ran alike), keep ``F.linear``.
    """

    def forward(self, x):
        rows = x.numel() // x.shape[-1] if x.dim() else 0
        if x.dtype != torch.float32 or not 0 < rows <= WEIGHT_MAJOR_MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        y = torch.mm(self.weight, x.reshape(rows, -1).t()).t().contiguous()
        if self.bias is not None:
            y += self.bias
        return y.view(*x.shape[:-1], y.shape[-1])

    for module in model.modules():
        if type(module) is torch.nn.Linear and module.weight.dtype == torch.float32:
            module.forward = forward.__get__(module)


def _row_kv(cache, b: int, attn_row):
    """Batch row ``b``'s KV over its real tokens (mask 1), pads and holes dropped: a new tensor
    ``[layers, 2, kv heads, tokens, head dim]`` that does not hold the batch cache alive."""
    real = attn_row.nonzero()[:, 0]
    return torch.stack(
        [torch.stack((layer.keys[b][:, real], layer.values[b][:, real])) for layer in cache.layers]
    )


def _generator(seed: int | None):
    g = torch.Generator()
    g.manual_seed(int(seed) % (2**63) if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
    return g


def _sample(logits, temps, top_p, u):
    """Inverse-CDF sampling with per-row temperature and top-p; returns (tokens, logprobs).

    Temperature 0 is greedy (its log-prob is the plain log-softmax). The log-prob is taken before
    the top-p cut, the convention of SGLang and vLLM.
    """
    greedy = temps <= 0
    scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    probs = logp.exp()
    if bool((top_p < 1).any()):
        sorted_p, order = probs.sort(dim=-1, descending=True)
        cum = sorted_p.cumsum(-1)
        sorted_p = sorted_p.masked_fill(cum - sorted_p > top_p[:, None], 0.0)
        cum = sorted_p.cumsum(-1)
        pick = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True).clamp(
            max=cum.shape[1] - 1
        )
        tok = order.gather(1, pick)[:, 0]
    else:
        cum = probs.cumsum(-1)
        tok = torch.searchsorted(cum, (u * cum[:, -1])[:, None], right=True)[:, 0].clamp(
            max=cum.shape[1] - 1
        )
    tok = torch.where(greedy, scaled.argmax(-1), tok)
    return tok, logp.gather(1, tok[:, None])[:, 0]
