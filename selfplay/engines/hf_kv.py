"""The HF engine's KV cache: the prefix cache of finished rows, preallocated cache layers, and
the sizes they are planned with.

A finished row's KV is kept under the token ids it covers (``PrefixCache``) for the next turn of
the same conversation; a batch's cache is built of ``PreallocatedLayer``s that write each new
token into room allocated once per batch instead of concatenating at every step. Only models whose
cache layers are all plain full attention (``plain_cache_layers``) can be cut and spliced this way.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Sequence

import numpy as np
import torch
from transformers import DynamicCache, DynamicLayer

from selfplay.hardware import available_memory

log = logging.getLogger(__name__)

# copy(src, dst, bytes): int64 arrays of addresses and sizes, each span copied (src 0: zeroed)
SpanCopy = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


def pad_left(x: torch.Tensor, width: int, *, dim: int, keep: int = 0) -> torch.Tensor:
    """``x`` with zeros inserted along ``dim`` after its first ``keep`` entries (before it
    where ``keep`` is 0), up to ``width``."""
    missing = width - x.shape[dim]
    if missing == 0:
        return x
    shape = list(x.shape)
    shape[dim] = missing
    head, tail = x.narrow(dim, 0, keep), x.narrow(dim, keep, x.shape[dim] - keep)
    return torch.cat([head, x.new_zeros(shape), tail], dim=dim)


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


def kv_length(kv: torch.Tensor | None) -> int:
    return 0 if kv is None else kv.shape[-2]


AUTO_PREFIX_SHARE = 0.25
AUTO_PREFIX_MIN_TOKENS = 65536


def auto_prefix_budget(model, device: str) -> int:
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


def plain_cache_layers(model) -> int:
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


class PreallocatedLayer(DynamicLayer):
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

    def grow(self, n: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Room for ``n`` more tokens that the caller writes itself: the key and value rooms and
        the column where the new tokens go; the layer's keys and values now reach past them."""
        start = self.get_seq_length()
        end = start + n
        if self._keys is None or end > self.capacity:
            raise RuntimeError(f"no room for {n} more tokens ({start} of {self.capacity} held)")
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]
        return self._keys, self._values, start

    @classmethod
    def empty(cls, rows: int, like: torch.Tensor, capacity: int, length: int) -> PreallocatedLayer:
        """A layer of ``rows`` rows with room for ``capacity`` tokens, its heads, head dim, dtype
        and device those of ``like`` (``[..., kv heads, tokens, head dim]``), its keys and values
        the first ``length`` columns of the room, for the caller to fill."""
        layer = cls(capacity)
        layer.lazy_initialization(like, like)
        shape = (rows, like.shape[-3], capacity, like.shape[-1])
        layer._keys, layer._values = like.new_empty(shape), like.new_empty(shape)
        layer.keys, layer.values = layer._keys[..., :length, :], layer._values[..., :length, :]
        return layer

    @classmethod
    def stacked(
        cls,
        parts: list[tuple[DynamicLayer, torch.Tensor]],
        width: int,
        capacity: int,
        keep: int = 0,
    ) -> PreallocatedLayer:
        """One layer holding the selected rows of each part ``(layer, row indices)`` in order,
        each part's tokens padded (zeros) to ``width`` after their first ``keep`` columns (the
        shared prefix stays where it is; 0: left-padded), with room for ``capacity``."""
        rows = sum(len(index) for _, index in parts)
        layer = cls.empty(rows, parts[0][0].keys, capacity, width)
        row = 0
        for p, index in parts:
            n, length = len(index), p.keys.shape[-2]
            start = width - (length - keep)  # where the part's columns after ``keep`` go
            for room, part in ((layer._keys, p.keys), (layer._values, p.values)):
                room[row : row + n, :, keep:start] = 0
                for a, b, to in ((0, keep, 0), (keep, length, start)):
                    torch.index_select(
                        part[..., a:b, :], 0, index, out=room[row : row + n, :, to : to + b - a]
                    )
            row += n
        return layer

    @classmethod
    def padded(
        cls,
        rows: list[torch.Tensor | None],
        like: torch.Tensor,
        past: int,
        capacity: int,
        keep: int,
    ) -> PreallocatedLayer:
        """One layer holding each row's kept ``(keys, values)`` (``[2, kv heads, tokens, head
        dim]``; None: nothing kept), padded (zeros) to ``past`` tokens after their first ``keep``
        (the shared prefix; 0: left-padded), written straight into room for ``capacity``:
        only the padding is zeroed, and nothing is staged in between (a 64-row prefill after
        388 kept tokens spent 0.9 of its 7.3 s filling and copying a staged batch of them)."""
        layer = cls.empty(len(rows), like, capacity, past)
        for i, kv in enumerate(rows):
            for room, part in ((layer._keys[i], None if kv is None else kv[0]),
                               (layer._values[i], None if kv is None else kv[1])):  # fmt: skip
                if part is None:
                    room[:, :past] = 0
                    continue
                start = past - (part.shape[-2] - keep)  # where its columns after ``keep`` go
                room[:, :keep] = part[:, :keep]
                room[:, keep:start] = 0
                room[:, start:past] = part[:, keep:]
        return layer

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor, rows: int) -> None:
        """Copy rows ``src``'s KV over rows ``dst`` and keep the first ``rows`` rows (views of
        the same room: nothing else is copied)."""
        if self._keys is None:
            return
        end = self.get_seq_length()
        if len(src):
            self._keys[dst, :, :end] = self._keys[src, :, :end]
            self._values[dst, :, :end] = self._values[src, :, :end]
        self._keys, self._values = self._keys[:rows], self._values[:rows]
        self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        if self._keys is not None:
            end = self.get_seq_length()
            self._keys, self._values = self._keys[indices], self._values[indices]
            self.keys, self.values = self._keys[..., :end, :], self._values[..., :end, :]


def row_kv(cache, b: int, attn_row, copy: SpanCopy | None = None):
    """Batch row ``b``'s KV over its real tokens (mask 1), pads and holes dropped: a new tensor
    ``[layers, 2, kv heads, tokens, head dim]`` that does not hold the batch cache alive.
    ``copy``: a span copy (``hf_native.span_copy``) that does it in one call, where the cache's
    layers are the engine's own."""
    runs = real_runs(attn_row)
    first = cache.layers[0].keys
    tokens = sum(end - start for start, end in runs)
    heads, dim = first.shape[1], first.shape[-1]
    out = first.new_empty((len(cache.layers), 2, heads, tokens, dim))
    rooms = _rooms(cache.layers) if copy is not None and tokens else None
    if rooms is not None:
        size, (row, head) = first.element_size(), rooms[1]
        starts, ends = np.array(runs, dtype=np.int64).T
        at = np.concatenate([[0], np.cumsum(ends - starts)[:-1]])
        # spans over (layer, key / value, head, run), in out's order
        base = rooms[0][:, :, None, None] + b * row + np.arange(heads)[:, None] * head
        src = base + starts * dim * size
        layer_kv_head = np.arange(src.shape[0] * 2 * heads).reshape(src.shape[:3])[..., None]
        dst = out.data_ptr() + (layer_kv_head * tokens + at) * dim * size
        nbytes = np.broadcast_to((ends - starts) * dim * size, src.shape)
        copy(src.ravel(), dst.ravel(), nbytes.ravel())
        return out
    for layer, room in zip(cache.layers, out):
        at = 0
        for start, end in runs:  # a row's real tokens are a few runs: slices, not a gather
            room[0, :, at : at + end - start] = layer.keys[b, :, start:end]
            room[1, :, at : at + end - start] = layer.values[b, :, start:end]
            at += end - start
    return out


def move_rows(layers, src: list[int], dst: list[int], rows: int, copy: SpanCopy | None = None):
    """Each layer's ``PreallocatedLayer.move_rows``: rows ``src``'s KV over rows ``dst`` (apart
    from them), the first ``rows`` rows kept. With ``copy`` (``hf_native.span_copy``) every
    layer's rows in one call, a span a (row, head), where the layers are the engine's own rooms
    in host memory (torch's indexed copy of a few rows took about 17 ms for 30 layers at 64 rows
    over 450 columns)."""
    rooms = _rooms(layers) if copy is not None and src else None
    if rooms is None:
        device = layers[0].keys.device if layers and layers[0].keys is not None else "cpu"
        at, to = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
        for layer in layers:
            layer.move_rows(at, to, rows)
        return
    bases, (row, head) = rooms
    first = layers[0]._keys
    heads = np.arange(first.shape[1]) * head
    nbytes = layers[0].get_seq_length() * first.shape[-1] * first.element_size()
    at, to = (
        bases[:, :, None, None] + np.array(x, dtype=np.int64)[:, None] * row + heads
        for x in (src, dst)
    )  # [layers, 2, rows, heads]
    copy(at.ravel(), to.ravel(), np.full(at.size, nbytes, dtype=np.int64))
    empty = torch.zeros(0, dtype=torch.long)
    for layer in layers:
        layer.move_rows(empty, empty, rows)


def padded_layers(
    kept: list[torch.Tensor | None],
    past: int,
    capacity: int,
    keep: int,
    copy: SpanCopy | None = None,
) -> list[PreallocatedLayer]:
    """The layers of a batch cache holding each row's kept KV (an entry ``[layers, 2, kv
    heads, tokens, head dim]``; None: nothing kept) as ``PreallocatedLayer.padded`` lays it
    out, room for ``capacity`` tokens; with ``copy`` (``hf_native.span_copy``) every layer's
    copies and zeros in one call."""
    some = next(kv for kv in kept if kv is not None)
    layers_n, _, heads, _, dim = some.shape
    size = some.element_size()
    # the span copy takes host memory, each token's head dims contiguous, one dtype
    plain = some.device.type == "cpu" and all(
        kv is None or (kv.stride(-1) == 1 and kv.stride(-2) == dim and kv.dtype == some.dtype)
        for kv in kept
    )
    if copy is None or not plain:
        return [
            PreallocatedLayer.padded(
                [None if kv is None else kv[i] for kv in kept], some[i], past, capacity, keep
            )
            for i in range(layers_n)
        ]
    layers = [PreallocatedLayer.empty(len(kept), some[i], capacity, past) for i in range(layers_n)]
    (bases, (row, head)) = _rooms(layers)
    spans: list[np.ndarray] = []  # (src, dst, bytes) columns; src 0: zeros
    width = dim * size
    for i, kv in enumerate(kept):
        dst = bases[:, :, None] + i * row + np.arange(heads) * head  # [layers, 2, heads]
        if kv is None:
            if past:
                spans.append(np.stack(np.broadcast_arrays(0, dst, past * width), -1).reshape(-1, 3))
            continue
        start = past - (kv.shape[-2] - keep)  # where its columns after ``keep`` go
        along = [np.arange(n).reshape([-1] + [1] * (2 - k)) for k, n in enumerate(dst.shape)]
        src = kv.data_ptr() + sum(a * st * size for a, st in zip(along, kv.stride()[:3]))
        for s, d, n in ((src, dst, keep), (0, dst + keep * width, start - keep),
                        (src + keep * width, dst + start * width, past - start)):  # fmt: skip
            if n > 0:
                spans.append(np.stack(np.broadcast_arrays(s, d, n * width), -1).reshape(-1, 3))
    if spans:
        table = np.concatenate(spans)
        copy(*(np.ascontiguousarray(table[:, k]) for k in range(3)))
    return layers


def _rooms(layers) -> tuple[np.ndarray, tuple[int, int]] | None:
    """The addresses of ``layers``' key and value rooms (``[layers, 2]``) and their row and head
    strides in bytes, where every layer is a ``PreallocatedLayer`` with contiguous rooms of one
    shape and dtype in host memory (the span copy's); None otherwise (a GPU's cache)."""
    first = layers[0]._keys if isinstance(layers[0], PreallocatedLayer) else None
    if first is None or first.device.type != "cpu":
        return None
    for layer in layers:
        if not (
            isinstance(layer, PreallocatedLayer)
            and layer._keys is not None
            and all(
                room.is_contiguous()
                and room.shape == first.shape
                and room.dtype == first.dtype
                and room.device == first.device
                for room in (layer._keys, layer._values)
            )
        ):
            return None
    bases = np.array([[x._keys.data_ptr(), x._values.data_ptr()] for x in layers], dtype=np.int64)
    size = first.element_size()
    return bases, (first.stride(0) * size, first.stride(1) * size)


def real_runs(attn_row: torch.Tensor) -> list[tuple[int, int]]:
    """The ``[start, end)`` runs of a mask row's 1s, in order (a batch row: its shared prefix,
    its kept KV, its new tokens, with padding between)."""
    edges = torch.diff(
        attn_row.bool().long(), prepend=attn_row.new_zeros(1), append=attn_row.new_zeros(1)
    )
    starts, ends = (edges == 1).nonzero()[:, 0].tolist(), (edges == -1).nonzero()[:, 0].tolist()
    return list(zip(starts, ends))
