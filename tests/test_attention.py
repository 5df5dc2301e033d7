"""`sdpa_packed`: per-row causal SDPA on packed rows gives transformers' own attention."""

from __future__ import annotations

import pytest
import torch

from selfplay.train.attention import register, row_bounds
from selfplay.train.config import PACKED_SDPA


def test_row_bounds_cut_where_positions_restart():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert row_bounds(pos) == [(0, 3), (3, 5), (5, 9)]
    assert row_bounds(torch.tensor([[0, 1, 2, 3]])) is None  # one row: nothing to cut
    assert row_bounds(torch.tensor([[0, 1], [0, 1]])) is None  # a padded batch, not packed


def _packed(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (1, sum(lengths)), generator=g)
    pos = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
    return ids, pos


@pytest.mark.parametrize("lengths", [[7, 12, 3, 20], [30]])
def test_packed_rows_attend_as_sdpa_does_and_only_within_their_row(tiny_model, lengths):
    from transformers import AutoModelForCausalLM

    register()
    torch.manual_seed(0)
    models = {
        impl: AutoModelForCausalLM.from_pretrained(
            tiny_model, dtype=torch.float32, attn_implementation=impl
        )
        for impl in ("sdpa", PACKED_SDPA)
    }
    ids, pos = _packed(models["sdpa"], lengths)
    logits, grads = {}, {}
    for impl, model in models.items():
        model.train()  # as verl calls it: training mode, no KV cache
        out = model(input_ids=ids, position_ids=pos, attention_mask=None, use_cache=False).logits
        out.float().pow(2).mean().backward()
        logits[impl] = out.detach()
        grads[impl] = model.model.layers[0].self_attn.q_proj.weight.grad.clone()
    assert torch.allclose(logits["sdpa"], logits[PACKED_SDPA], atol=2e-5, rtol=1e-4)
    assert torch.allclose(grads["sdpa"], grads[PACKED_SDPA], atol=2e-6, rtol=1e-3)
    # each row alone gives the same logits: nothing leaks across rows
    start = 0
    model = models[PACKED_SDPA]
    with torch.no_grad():
        for n in lengths:
            alone = model(input_ids=ids[:, start : start + n]).logits
            assert torch.allclose(alone, logits[PACKED_SDPA][:, start : start + n], atol=2e-5)
            start += n


def test_a_padding_mask_is_refused_not_ignored(tiny_model):
    from transformers import AutoModelForCausalLM

    register()
    model = AutoModelForCausalLM.from_pretrained(
        tiny_model, dtype=torch.float32, attn_implementation=PACKED_SDPA
    )
    ids = torch.randint(0, model.config.vocab_size, (2, 6))
    mask = torch.ones(2, 6, dtype=torch.long)
    mask[1, :2] = 0
    with pytest.raises(ValueError, match="padded batches need 'sdpa'"):
        model(input_ids=ids, attention_mask=mask)
    model(input_ids=ids, attention_mask=torch.ones(2, 6, dtype=torch.long))  # no padding: fine


def test_packed_rows_train_with_sdpa_packed_by_default_and_verl_imports_it(tmp_path):
    from selfplay.train.config import TrainConfig
    from selfplay.train.workers import worker_config

    def cfg(**kw):
        return TrainConfig(data=tmp_path / "t.parquet", model="m", out=tmp_path / "o", **kw)

    a = worker_config(cfg(), total_steps=1)
    assert a.model.override_config["attn_implementation"] == PACKED_SDPA
    assert a.model.external_lib == "selfplay.train.attention"
    padded = worker_config(cfg(remove_padding=False), total_steps=1)
    assert padded.model.override_config["attn_implementation"] == "sdpa"
    assert padded.model.external_lib is None
    flash = worker_config(cfg(attn_implementation="flash_attention_2"), 1)
    assert flash.model.override_config["attn_implementation"] == "flash_attention_2"
    with pytest.raises(ValueError, match="sdpa_packed needs packed rows"):
        cfg(attn_implementation=PACKED_SDPA, remove_padding=False)


def test_a_sliding_window_layer_is_refused_when_a_row_is_longer_than_it():
    from types import SimpleNamespace

    from selfplay.train.attention import packed_sdpa_forward

    q = k = v = torch.zeros(1, 2, 10, 4)
    pos = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 2, 3]])
    layer = SimpleNamespace(is_causal=True, sliding_window=4)
    with pytest.raises(ValueError, match="sliding window"):
        packed_sdpa_forward(layer, q, k, v, None, position_ids=pos)
    wide = SimpleNamespace(is_causal=True, sliding_window=8)
    out, _ = packed_sdpa_forward(wide, q, k, v, None, position_ids=pos)
    assert out.shape == (1, 10, 2, 4)
