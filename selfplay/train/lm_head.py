"""The LM head only at the positions the loss reads (``TrainConfig.lm_head_positions``).

verl's FSDP engine computes the logits of every token of a packed micro-batch, prompt and partner
turns included, and the loss then reads the log-probs of the trained tokens alone: the seat's own
generated tokens, about an eighth of a row of our games. On SmolLM2-135M the LM head (576 x 49,152)
is a fifth of a forward pass's FLOPs and runs slower than the layers' matmuls on a CPU, so most of
that work is thrown away.

With ``lm_head_positions="trained"`` a training forward (an update, or ``Workers.loss``: verl's
``compute_loss``) passes transformers' own ``logits_to_keep`` (a tensor of positions) to the model:
the head runs on the positions whose next token is trained (``loss_mask`` rolled by one, as verl's
losses read it), the log-softmax and the gather run on those positions too (``kept_scores``, as
verl's own path: temperature, log-softmax, the next token's log-prob, the entropy when asked),
and the per-position results are spread into tensors of the full packed length, 0 elsewhere, which
verl's fused-kernel branch unpads and splits per sequence like its own. Every loss multiplies the
other positions by a mask of 0, so the loss and its gradients are the ones of the full head
(``tests/test_train.py`` compares an update under both). An earlier version scattered the logits
into a zero tensor of every position ([tokens, vocabulary]): the log-softmax over it, the scatter
and their backward cost about a tenth of a GRPO update on an AVX2 CPU.
Forward-only scoring (old and reference log-probs) keeps every position; its entropy, a report
(the trainer's mean over the trained tokens; a bonus is computed in the update), is computed at
the trained positions alone, 0 elsewhere: over every position and the whole vocabulary it was
half of a warm GRPO update on an AVX2 CPU at a vocabulary of 152k.

Both kinds of forward take the next tokens' log-probs from ``label_log_probs``: verl's
``logprobs_from_logits`` without flash-attn's fused cross-entropy (every CPU, and GPUs without the
package) is ``logprobs_from_logits_v2``, a Python loop over the packed positions, one token at a
time (a log-softmax or logsumexp, a gather, and their backward, per token): 27 (bf16) to 42 (fp32)
operator calls per token of an update. On a GPU each is a dispatch or a small kernel launch, so
the old-log-prob pass and the update cost host time in proportion to the tokens, whatever the
model's size: Qwen2.5 updates on an H200 ran at 3,100-3,800 tokens/s at 0.5B and 1.5B alike
(2-6% of the chip's FLOPs). ``label_log_probs`` computes the same quantity per
position (verl's formula for the logits' dtype) over blocks of positions.

Pinned to verl 0.9.1's ``FSDPEngineWithLMHead`` (``selfplay.train.compat`` checks the version);
the in-process launcher (CPU, one GPU) applies it; Ray workers run verl's full head.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator

import torch

from selfplay.train.batch import full_sequence_mask

_KEPT = "selfplay_logits_kept"
_state = {"trained": False}


@contextlib.contextmanager
def positions(trained: bool) -> Iterator[None]:
    """Within the block, training forwards in this process run the LM head at the trained
    positions only (``trained``) or at every position, and (``trained``) every forward takes its
    log-probs from ``label_log_probs``; otherwise verl's own path runs unchanged."""
    if trained:
        install()
    before = _state["trained"]
    _state["trained"] = trained
    try:
        yield
    finally:
        _state["trained"] = before


def kept_positions(micro_batch, total: int) -> torch.Tensor | None:
    """Indices into the packed sequence (length ``total``) of the positions whose next token the
    loss trains on; None when the micro-batch does not say (then every position is kept)."""
    mask = micro_batch.get("loss_mask", None)
    if mask is not None and mask.is_nested:  # SFT: a full-sequence mask, packed like input_ids
        flat = mask.values()
    else:  # PPO: the response mask, padded, beside the padded attention mask
        response = micro_batch.get("response_mask", None)
        attention = micro_batch.get("attention_mask", None)
        prompts = micro_batch.get("prompts", None)
        if response is None or attention is None or prompts is None:
            return None
        if response.is_nested or attention.is_nested or prompts.is_nested:
            return None
        flat = full_sequence_mask(prompts, response)[attention.bool()]
    if flat.numel() != total:  # padded to a bucket or split for sequence parallelism
        return None
    needed = torch.roll(flat.bool(), shifts=-1, dims=0)  # position t predicts token t + 1
    if not needed.any():
        return None
    return needed.nonzero().squeeze(-1)


def _applies(engine, micro_batch, *, training: bool = True) -> bool:
    """Whether this forward's log-probs are ours: a packed forward verl would score through its
    plain path (no fused kernels, no sequence parallelism, no extra outputs); ``training``: and
    one that computes a loss (the LM head at the trained positions then)."""
    from verl.utils import tensordict_utils as tu

    def flag(key: str, default: bool) -> bool:
        return bool(tu.get_non_tensor_data(data=micro_batch, key=key, default=default))

    return (
        _state["trained"]
        and (flag("compute_loss", False) or not training)
        and flag("use_remove_padding", True)
        and not flag("use_fused_kernels", False)
        and not flag("calculate_sum_pi_squared", False)
        and not flag("distillation_use_topk", False)
        and not flag("distillation_only", False)
        and not getattr(engine, "use_ulysses_sp", False)
    )


@functools.cache
def install() -> None:
    """Wrap verl's engine once per process; it stays inert until ``positions(True)``."""
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    inputs = FSDPEngineWithLMHead.prepare_model_inputs
    outputs = FSDPEngineWithLMHead.prepare_model_outputs

    def prepare_model_inputs(self, micro_batch):
        model_inputs, output_args = inputs(self, micro_batch)
        if _applies(self, micro_batch):
            total = model_inputs["input_ids"].shape[-1]
            kept = kept_positions(micro_batch, total)
            if kept is not None:
                kept = kept.to(model_inputs["input_ids"].device)
                model_inputs["logits_to_keep"] = kept
                output_args[_KEPT] = (kept, total)
        return model_inputs, output_args

    def prepare_model_outputs(self, output, output_args, micro_batch, logits_processor_func):
        kept = output_args.pop(_KEPT, None)
        if kept is None and _every_position(self, output, output_args, micro_batch):
            kept = (None, output.logits.shape[1])
        if kept is None:
            return outputs(self, output, output_args, micro_batch, logits_processor_func)
        from verl.utils import tensordict_utils as tu

        entropy = bool(tu.get_non_tensor_data(micro_batch, "calculate_entropy", False))
        # every position scored: the entropy (a report; a bonus needs a loss) where it is read
        at = kept_positions(micro_batch, kept[1]) if entropy and kept[0] is None else None
        scores = kept_scores(
            self, output.logits, output_args, *kept, entropy=entropy, entropy_at=at
        )
        # verl's fused-kernel branch takes per-position log-probs (and entropies) from the model's
        # output and does the rest (unpadding, one nested row per sequence): hand it ours
        before = micro_batch.get("use_fused_kernels", None)
        tu.assign_non_tensor_data(micro_batch, "use_fused_kernels", True)
        try:
            return outputs(self, scores, output_args, micro_batch, logits_processor_func)
        finally:
            if before is None:
                del micro_batch["use_fused_kernels"]
            else:
                micro_batch["use_fused_kernels"] = before

    FSDPEngineWithLMHead.prepare_model_inputs = prepare_model_inputs
    FSDPEngineWithLMHead.prepare_model_outputs = prepare_model_outputs


def _every_position(engine, output, output_args, micro_batch) -> bool:
    """A forward that keeps every position (forward-only scoring, or a training forward whose
    positions could not be picked) whose log-probs ``label_log_probs`` can still compute: plain
    logits of one packed sequence."""
    from torch.distributed.tensor import DTensor

    logits = getattr(output, "logits", None)
    return (
        _applies(engine, micro_batch, training=False)
        and isinstance(logits, torch.Tensor)
        and not isinstance(logits, DTensor)
        and logits.dim() == 3
        and logits.shape[0] == 1
        and "input_ids_rmpad_rolled" in output_args
        and "temperature_rmpad" in output_args
    )


# elements of a block of logits [positions, vocabulary] that label_log_probs scores at once: on a
# GPU a block is a few kernels whatever its size; on a CPU a smaller one stays in the cache
_BLOCK_ELEMENTS = {"cpu": 1 << 20}
_BLOCK_ELEMENTS_DEFAULT = 1 << 24


def label_log_probs(
    logits: torch.Tensor, labels: torch.Tensor, *, inplace_backward: bool = True
) -> torch.Tensor:
    """verl's ``logprobs_from_logits(logits [N, vocab], labels [N]) -> [N]``, the same quantity per
    position (verl's formula for the dtype: logit - logsumexp in fp32/fp64, else log-softmax and
    gather) over blocks of positions instead of verl's loop over single positions (module
    docstring). Where verl would use a fused cross-entropy kernel (flash-attn, NPU), verl's own."""
    import os

    from verl.utils import torch_functional as verl_F

    # verl's own condition for its fused kernels (VERL_DISABLE_FLASH_ATTN_CE=1 turns flash-attn's
    # off, and then verl would loop: the blocks below serve it instead)
    flash = verl_F.FLAH_ATTN_CROSS_ENTROPY_LOSS_AVAILABLE and (
        os.environ.get("VERL_DISABLE_FLASH_ATTN_CE", "0") != "1"
    )
    if flash or verl_F.NPU_CROSS_ENTROPY_LOSS_AVAILABLE:
        return verl_F.logprobs_from_logits(logits, labels, inplace_backward=inplace_backward)
    budget = _BLOCK_ELEMENTS.get(logits.device.type, _BLOCK_ELEMENTS_DEFAULT)
    rows = max(1, budget // max(1, logits.shape[-1]))
    parts = []
    # split, not slicing: one backward node concatenates the blocks' gradients
    for block, ids in zip(logits.split(rows), labels.split(rows), strict=True):
        picked = ids.unsqueeze(-1)
        if block.dtype in (torch.float32, torch.float64):
            value = block.gather(-1, picked).squeeze(-1) - torch.logsumexp(block, dim=-1)
        else:  # verl: logsumexp is unstable in bfloat16
            value = torch.log_softmax(block, dim=-1).gather(-1, picked).squeeze(-1)
        parts.append(value)
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def kept_scores(engine, logits, output_args, index, total: int, *, entropy: bool, entropy_at=None):
    """The log-probs of the next tokens (and the entropies) at the kept positions, from their
    logits ``[1, kept, vocab]``, in tensors of the full packed length ``[1, total]`` that hold
    0 elsewhere; as verl's own path computes them (temperature, log-softmax, gather).
    ``index`` None: every position is kept (logits ``[1, total, vocab]``); the entropies then
    only at the positions ``entropy_at`` when given (0 elsewhere)."""
    from types import SimpleNamespace

    logits = logits.squeeze(0)
    every = slice(None) if index is None else index
    # verl's _scale_logits_by_temperature, written out: importing verl's FSDP engine module here
    # (the CPU tests call this first) would cache its device before the CPU platform is installed
    if not output_args.get("temperature_is_one", False):
        temperature = output_args["temperature_rmpad"][every].clamp(min=1e-8)
        logits = logits / temperature.unsqueeze(-1).to(logits.dtype)
    labels = output_args["input_ids_rmpad_rolled"][every]
    log_probs = label_log_probs(logits, labels, inplace_backward=not entropy)

    def spread(values, where=index):
        if where is None:
            return values.unsqueeze(0)
        return values.new_zeros(total).index_copy(0, where, values).unsqueeze(0)

    ent = None
    if entropy and index is None and entropy_at is not None:
        ent = spread(engine.compute_entropy_from_logits(logits[entropy_at]), entropy_at)
    elif entropy:
        ent = spread(engine.compute_entropy_from_logits(logits))
    return SimpleNamespace(log_probs=spread(log_probs), entropy=ent)
