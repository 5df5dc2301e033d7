"""transformers in-process engine (CPU or GPU): concurrent requests decoded in padded batches.

Prompts are left-padded into one batch; each decoding step samples every row with its own
temperature, top-p and seeded generator, records log-softmax(logits / temperature) of the
sampled token (before top-p renormalisation, as SGLang reports it), and drops finished rows
from the batch and the KV cache. A row is answered as soon as it finishes.
"""

from __future__ import annotations

import logging
import os

from selfplay.engines import (
    EngineRequestError,
    Generation,
    GenerationRequest,
    HFEngineConfig,
)
from selfplay.engines.batching import Batcher, Reply

log = logging.getLogger(__name__)


class HFEngine:
    """A Hugging Face causal LM behind the ``Engine`` protocol."""

    def __init__(self, config: HFEngineConfig, *, model=None, tokenizer=None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.config = config
        self.name = config.model
        device = config.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.device = torch.device(device)
        if self.device.type == "cpu":
            threads = config.cpu_threads or max(1, (os.cpu_count() or 2) - 1)
            if torch.get_num_threads() != threads:
                torch.set_num_threads(threads)
        if config.dtype == "auto":
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        else:
            dtype = getattr(torch, config.dtype)
        self.tokenizer = tokenizer or AutoTokenizer.from_pretrained(config.model)
        if model is None:
            try:
                model = AutoModelForCausalLM.from_pretrained(config.model, dtype=dtype)
            except OSError as e:
                raise RuntimeError(
                    f"cannot load model {config.model!r}: {e}. Pass a local directory or an "
                    "HF model id this machine can download."
                ) from e
        self.model = model.to(self.device).eval()
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

    async def start(self) -> None:
        return None

    async def generate(self, request: GenerationRequest) -> Generation:
        return await self._batcher.submit(request)

    async def aclose(self) -> None:
        await self._batcher.aclose()

    # -----------------------------------------------------------------------------------------
    # the decoding loop (runs in a worker thread)

    def _run_batch(self, requests: list[GenerationRequest], replies: list[Reply]) -> None:
        import torch

        # Requests that cannot fit are answered with an error; the rest are decoded together.
        rows: list[int] = []
        budget: list[int] = []
        for i, r in enumerate(requests):
            room = r.max_new_tokens
            if self.max_context is not None:
                room = min(room, self.max_context - len(r.prompt_ids))
            if not r.prompt_ids or room < 1:
                replies[i](
                    EngineRequestError(
                        f"prompt of {len(r.prompt_ids)} tokens leaves no room to generate "
                        f"(model context {self.max_context})"
                    )
                )
                continue
            rows.append(i)
            budget.append(room)
        if not rows:
            return
        with torch.inference_mode():
            self._decode([requests[i] for i in rows], [replies[i] for i in rows], budget)

    def _decode(
        self, requests: list[GenerationRequest], replies: list[Reply], budget: list[int]
    ) -> None:
        import torch
        from transformers import DynamicCache

        dev = self.device
        n = len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        ids = torch.full((n, width), self._pad_id, dtype=torch.long)
        attn = torch.zeros((n, width), dtype=torch.long)
        for i, r in enumerate(requests):
            ids[i, width - lengths[i] :] = torch.tensor(list(r.prompt_ids), dtype=torch.long)
            attn[i, width - lengths[i] :] = 1
        ids, attn = ids.to(dev), attn.to(dev)
        positions = (attn.cumsum(-1) - 1).clamp(min=0)
        temps = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=dev)
        top_p = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=dev)
        gens = [_generator(r.seed) for r in requests]
        stops = [frozenset(r.stop_token_ids) for r in requests]
        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        active = list(range(n))  # original row of each current batch row
        cache = DynamicCache(config=self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=attn,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        logits = out.logits[:, -1, :]
        last_pos = positions[:, -1]
        while active:
            if self._batcher.stopping.is_set():
                return
            u = torch.stack([torch.rand((), generator=gens[row]) for row in active]).to(dev)
            tok, lp = _sample(logits.float(), temps, top_p, u)
            tok_l, lp_l = tok.tolist(), lp.tolist()
            keep: list[int] = []
            for b, row in enumerate(active):
                out_ids[row].append(tok_l[b])
                out_lp[row].append(lp_l[b])
                if tok_l[b] in stops[row]:
                    self._finish(row, requests, replies, out_ids, out_lp, "stop")
                elif len(out_ids[row]) >= budget[row]:
                    self._finish(row, requests, replies, out_ids, out_lp, "length")
                else:
                    keep.append(b)
            if not keep:
                break
            if len(keep) < len(active):
                index = torch.tensor(keep, dtype=torch.long, device=dev)
                cache.batch_select_indices(index)
                attn, tok = attn[index], tok[index]
                temps, top_p, last_pos = temps[index], top_p[index], last_pos[index]
                active = [active[b] for b in keep]
            attn = torch.cat([attn, attn.new_ones((len(active), 1))], dim=1)
            last_pos = last_pos + 1
            out = self.model(
                input_ids=tok[:, None],
                attention_mask=attn,
                position_ids=last_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            logits = out.logits[:, -1, :]

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


def _generator(seed: int | None):
    import torch

    g = torch.Generator()
    g.manual_seed(int(seed) % (2**63) if seed is not None else int.from_bytes(os.urandom(8)) >> 1)
    return g


def _sample(logits, temps, top_p, u):
    """Inverse-CDF sampling with per-row temperature and top-p; returns (tokens, logprobs).

    Temperature 0 is greedy (its log-prob is the plain log-softmax). The log-prob is taken before
    the top-p cut, the convention of SGLang and vLLM.
    """
    import torch

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
