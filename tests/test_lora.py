"""LoRA (``--lora-rank``): verl trains peft adapters and the exported model has them merged in,
a plain model of the base architecture that the hf engine loads like any other."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
from typer.testing import CliRunner

from selfplay.train.export import merge_lora
from tests.fakes import make_rows, write_rows


def test_merge_folds_each_adapter_into_its_base_weight_and_restores_names():
    g = torch.Generator().manual_seed(0)
    w, bias = torch.randn(6, 4, generator=g), torch.randn(6, generator=g)
    a, b = torch.randn(2, 4, generator=g), torch.randn(6, 2, generator=g)
    emb = torch.randn(10, 4, generator=g)
    peft = {
        "base_model.model.model.embed_tokens.weight": emb,
        "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": w,
        "base_model.model.model.layers.0.mlp.up_proj.base_layer.bias": bias,
        "base_model.model.model.layers.0.mlp.up_proj.lora_A.default.weight": a,
        "base_model.model.model.layers.0.mlp.up_proj.lora_B.default.weight": b,
    }
    out = merge_lora(peft, rank=2, alpha=8)
    assert set(out) == {
        "model.embed_tokens.weight",
        "model.layers.0.mlp.up_proj.weight",
        "model.layers.0.mlp.up_proj.bias",
    }
    torch.testing.assert_close(out["model.layers.0.mlp.up_proj.weight"], w + 4.0 * (b @ a))
    assert torch.equal(out["model.layers.0.mlp.up_proj.bias"], bias)
    assert torch.equal(out["model.embed_tokens.weight"], emb)
    # a plain (non-peft) state dict passes through unchanged
    assert merge_lora({"x.weight": w}, rank=2, alpha=8) == {"x.weight": w}
    with pytest.raises(ValueError, match="without a base layer"):
        merge_lora({"m.lora_A.default.weight": a, "m.lora_B.default.weight": b}, 2, 8)


@pytest.mark.slow
def test_a_lora_trained_checkpoint_loads_in_the_hf_engine_and_differs_from_the_base(
    tmp_path, tiny_model
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from selfplay import cli
    from selfplay.engines import GenerationRequest, HFEngineConfig
    from selfplay.engines.hf import HFEngine
    from selfplay.models import tokenizer_fingerprint

    fp = tokenizer_fingerprint(AutoTokenizer.from_pretrained(tiny_model))
    specs = [
        (g, [5 + g, 6, 7], [20 + k, 21, 22, 23], [1, 0, 1, 1], float(k % 2))
        for g in range(2)
        for k in range(4)
    ]
    data = write_rows(tmp_path / "train.parquet", make_rows(specs, fingerprint=fp))
    out = tmp_path / "lora"
    res = CliRunner().invoke(cli.app, [
        "train", "--data", str(data), "--model", str(tiny_model), "--out", str(out),
        "--lr", "1e-2", "--lora-rank", "4", "--lora-alpha", "8", "--mini-batch-size", "4",
    ], env={"MICRO_BATCH_SIZE": "2"})  # fmt: skip
    assert res.exit_code == 0, res.output
    assert json.loads((out / "metrics.json").read_text())["config"]["lora_rank"] == 4
    base = AutoModelForCausalLM.from_pretrained(tiny_model).state_dict()
    trained = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert set(trained) == set(base)  # the base architecture's names: no peft wrapper left
    changed = {k for k in base if not torch.equal(base[k], trained[k])}
    assert any(".q_proj." in k for k in changed) and any(".down_proj." in k for k in changed)
    assert "model.embed_tokens.weight" not in changed  # LoRA adapts linear layers only
    assert not any("norm" in k for k in changed)

    async def generate() -> list[int]:
        engine = HFEngine(HFEngineConfig(model=str(out), device="cpu", dtype="fp32"))
        await engine.start()
        try:
            got = await engine.generate(
                GenerationRequest(prompt_ids=[5, 6, 7], max_new_tokens=4, temperature=0.0)
            )
        finally:
            await engine.aclose()
        return got.token_ids

    assert len(asyncio.run(generate())) >= 1
