"""Attention for packed rows without flash-attn: one causal SDPA call per row.

verl's remove-padding path (``TrainConfig.remove_padding``, on by default) concatenates the rows of
a micro-batch into one sequence of shape (1, total) whose ``position_ids`` restart at 0 at each
row. With flash-attn, its varlen kernel attends within each row. Without it (every CPU, and GPUs
without the package), transformers' ``"sdpa"`` detects the restarts and builds a block-diagonal
(total x total) mask: SDPA then computes every score of the packed square (4 rows of 1,000 tokens
cost 16 rows' worth of attention scores instead of 4) and, given a mask, cannot use its causal
kernel, which skips the upper triangle.

``"sdpa_packed"`` (``PACKED_SDPA``, what ``attn_implementation="auto"`` picks for packed rows) cuts
the packed sequence at the restarts and calls causal SDPA on each row. The result is the same
attention (``tests/test_attention.py`` compares outputs and gradients with ``"sdpa"``); what
changes is the work: sum of L_i^2 / 2 scores instead of (sum L_i)^2. Anything that is not a
packed causal forward (a mask, a KV cache, one token, 3-D position ids) goes to transformers' own
``sdpa_attention_forward`` unchanged; a sliding-window layer with a row longer than its window is
refused (use ``sdpa``). The function is registered under its name in transformers'
``AttentionInterface`` when this module is imported: verl imports it in every worker before it
builds the model (``actor_rollout_ref.model.external_lib``, set by ``workers.worker_config``),
in-process and in Ray workers alike.
"""

from __future__ import annotations

import itertools

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, flash_attention_mask

from selfplay.train.config import PACKED_SDPA


def row_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]] | None:
    """[start, end) of each packed row of a (1, total) ``position_ids``: a row starts wherever the
    position does not follow the previous one. None when the input is not one packed sequence."""
    if position_ids.dim() != 2 or position_ids.shape[0] != 1:
        return None
    pos = position_ids[0]
    if pos.numel() < 2:
        return None
    starts = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    if starts.numel() == 0:
        return None
    edges = [0, *starts.tolist(), pos.numel()]
    return list(itertools.pairwise(edges))


def packed_sdpa_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: (batch, heads, seq, dim) in,
    (batch, seq, heads, dim) out."""
    if attention_mask is not None and attention_mask.dim() == 2:
        # flash-style 2-D padding mask (see register): packed rows never carry padding
        if not bool(attention_mask.all()):
            raise ValueError(
                f"attn_implementation {PACKED_SDPA!r} takes packed rows (remove_padding); "
                "padded batches need 'sdpa'"
            )
        attention_mask = None
    position_ids = kwargs.get("position_ids")
    bounds = None
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    length = query.shape[2]
    packed = attention_mask is None and position_ids is not None and causal and length > 1
    if packed and key.shape[2] == length and position_ids.shape[-1] == length:
        bounds = row_bounds(position_ids)
    if bounds is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    window = getattr(module, "sliding_window", None)
    if window is not None and max(end - start for start, end in bounds) > window:
        raise ValueError(
            f"attn_implementation {PACKED_SDPA!r} has no sliding window and this layer attends "
            f"within {window} tokens; train this model with attn_implementation 'sdpa'"
        )
    gqa = key.shape[1] != query.shape[1]
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, start:end],
            key[:, :, start:end],
            value[:, :, start:end],
            dropout_p=dropout,
            scale=scaling,
            is_causal=True,
            enable_gqa=gqa,
        )
        for start, end in bounds
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ``attn_implementation="sdpa_packed"`` loadable by transformers in this process. Its mask
    is flash-attn's (None, or the 2-D padding mask): no (total x total) mask is ever built."""
    AttentionInterface.register(PACKED_SDPA, packed_sdpa_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(PACKED_SDPA, flash_attention_mask)


register()  # on import: verl's workers import this module (model.external_lib) to get the name
