"""The CPU engine's decoding attention (``hf_cpu.grouped_decode_attention``: one product per KV
head over its group of query heads) is SDPA's attention to float rounding, with the masks and
the cache views the engine passes it, alone and inside a model's decoding step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

from selfplay.engines import hf_cpu
from selfplay.engines.hf_cpu import grouped_decode_attention


def _cache_view(rows: int, kv_heads: int, length: int, dim: int, g) -> torch.Tensor:
    """Keys or values as the engine's PreallocatedLayer hands them over: a view of the first
    ``length`` positions of room for more (not contiguous over rows)."""
    return torch.randn(rows, kv_heads, length + 7, dim, generator=g)[..., :length, :]


def _padding_mask(rows: int, length: int) -> torch.Tensor:
    """Left padding of a different width a row, and a hole (a joined batch's padding) in one."""
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
    for b in range(rows):
        mask[b, ..., : (3 * b) % (length // 2)] = False
    mask[-1, ..., length // 2 : length // 2 + 3] = False
    return mask


@pytest.mark.parametrize(
    "heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (14, 2, 64), (6, 6, 32), (8, 1, 16)]
)
@pytest.mark.parametrize("masking", ["none", "bool", "additive", "per-head"])
def test_grouped_decode_attention_is_sdpa_to_1e5(heads, kv_heads, dim, masking):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    rows, length = 6, 41
    query = torch.randn(rows, heads, 1, dim, generator=g)
    key = _cache_view(rows, kv_heads, length, dim, g)
    value = _cache_view(rows, kv_heads, length, dim, g)
    mask = {
        "none": None,
        "bool": _padding_mask(rows, length),
        "additive": torch.zeros(rows, 1, 1, length).masked_fill(
            ~_padding_mask(rows, length), float("-inf")
        ),
        "per-head": _padding_mask(rows, length).expand(rows, heads, 1, length).clone(),
    }[masking]
    if masking == "per-head":
        mask[:, 0, :, 5] = False  # one query head masked apart from its group
    for scale in (None, 0.3):
        want = sdpa(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        got = grouped_decode_attention(query, key, value, mask, scale)
        assert got.shape == want.shape == (rows, heads, 1, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_grouped_decode_attention_in_bf16_is_sdpa_to_bf16_rounding():
    g = torch.Generator().manual_seed(1)
    query = torch.randn(4, 9, 1, 64, generator=g).bfloat16()
    key, value = (_cache_view(4, 3, 50, 64, g).bfloat16() for _ in range(2))
    mask = _padding_mask(4, 50)
    want = sdpa(query.float(), key.float(), value.float(), attn_mask=mask, enable_gqa=True)
    got = grouped_decode_attention(query, key, value, mask)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def _decode_logits(model, grouped: bool) -> list[torch.Tensor]:
    """A left-padded batch prefilled into the engine's preallocated cache, then decoding steps:
    each step's logits, with the decoding attention grouped or torch's SDPA."""
    from transformers import Cache

    from selfplay.engines.hf_kv import PreallocatedLayer, plain_cache_layers

    g = torch.Generator().manual_seed(0)
    rows, width, steps = 5, 23, 4
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=g)
    attn = torch.ones(rows, width, dtype=torch.long)
    for b in range(rows):
        attn[b, : 2 * b] = 0  # left padding
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    cache = Cache(
        layers=[PreallocatedLayer(width + steps) for _ in range(plain_cache_layers(model))]
    )
    old = hf_cpu.GROUPED_DECODE
    hf_cpu.GROUPED_DECODE = grouped
    try:
        with torch.inference_mode():
            out = model(
                input_ids=ids,
                attention_mask=attn,
                position_ids=pos,
                past_key_values=cache,
                use_cache=True,
            )
            logits, last = [out.logits[:, -1]], pos[:, -1]
            for _ in range(steps):
                tok = logits[-1].argmax(-1)
                attn = torch.cat([attn, attn.new_ones((rows, 1))], dim=1)
                last = last + 1
                out = model(
                    input_ids=tok[:, None],
                    attention_mask=attn,
                    position_ids=last[:, None],
                    past_key_values=cache,
                    use_cache=True,
                )
                logits.append(out.logits[:, -1])
    finally:
        hf_cpu.GROUPED_DECODE = old
    return logits


def test_a_models_decoding_steps_are_the_same_with_grouped_attention(tiny_model):
    from selfplay.engines import HFEngineConfig
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32"))
    assert engine.model.config._attn_implementation == "selfplay_grouped_sdpa"
    grouped, plain = (_decode_logits(engine.model, flag) for flag in (True, False))
    for a, b in zip(grouped, plain):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 16), (6, 6, 32), (8, 1, 16)])
@pytest.mark.parametrize("masking", ["none", "bool"])
def test_cascade_decode_attention_is_sdpa_over_every_rows_copy_to_1e5(
    heads, kv_heads, dim, masking
):
    """Rows whose first columns hold the same KV (the engine's shared prefix), then padding
    after them and their own tokens: attending to row 0's prefix once for all rows and to each
    row's own columns apart, merged by log-sum-exp, is SDPA over every row's whole cache."""
    from selfplay.engines.hf_cpu import SharedPrefix, cascade_decode_attention

    g = torch.Generator().manual_seed(heads * 10 + dim)
    rows, length, shared = 6, 90, 70
    query = torch.randn(rows, heads, 1, dim, generator=g)
    key = _cache_view(rows, kv_heads, length, dim, g)
    value = _cache_view(rows, kv_heads, length, dim, g)
    key[:, :, :shared] = key[:1, :, :shared]  # every row's copy of the prefix
    value[:, :, :shared] = value[:1, :, :shared]
    mask = None
    if masking == "bool":
        mask = torch.ones(rows, 1, 1, length, dtype=torch.bool)
        for b in range(rows):
            mask[b, ..., shared : shared + (3 * b) % 15] = False  # padding after the prefix
    for scale in (None, 0.3):
        prefix = SharedPrefix(shared)
        want = sdpa(query, key, value, attn_mask=mask, scale=scale, enable_gqa=True)
        got = cascade_decode_attention(query, key, value, mask, scale, prefix)
        assert got.shape == want.shape == (rows, heads, 1, dim)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # a query whose head dims are not contiguous (feature-major activations) reads the same
    strided = query.permute(3, 1, 2, 0).contiguous().permute(3, 1, 2, 0)
    assert strided.stride(-1) != 1
    got = cascade_decode_attention(strided, key, value, mask, None, SharedPrefix(shared))
    torch.testing.assert_close(got, sdpa(query, key, value, attn_mask=mask, enable_gqa=True))
    # a different prefix in one row would be ignored: the cascade reads row 0's only
    key[3, :, :shared] += 1.0
    got = cascade_decode_attention(query, key, value, mask, None, SharedPrefix(shared))
    want = sdpa(query, key, value, attn_mask=mask, enable_gqa=True)
    assert not torch.allclose(got[3], want[3], atol=1e-3)
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-5, atol=1e-5)


def test_a_model_hands_the_shared_prefix_to_every_layers_attention(tiny_model):
    """The engine lays batches out for the cascade only where the model passes its keyword
    arguments down to attention: the tiny Qwen2 does, every layer; a model whose forward takes
    no such keyword does not."""
    from selfplay.engines import HFEngineConfig
    from selfplay.engines.hf import HFEngine
    from selfplay.engines.hf_cpu import passes_shared_prefix

    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32"))
    assert passes_shared_prefix(engine.model) and engine._shared_layout

    class Strict(torch.nn.Module):
        config = engine.model.config

        def forward(self, input_ids):
            return engine.model(input_ids=input_ids)

    assert not passes_shared_prefix(Strict())


def _steps_both_ways(
    model, lean, shared: int, rows: int = 5, reference=None
) -> list[tuple[torch.Tensor, ...]]:
    """A batch prefilled through the model into two copies of the engine's cache (left-padded,
    or with its first ``shared`` columns the same tokens in every row and the padding after
    them), then decoding steps on one through the model and on the other through ``lean``:
    each step's logits both ways. With ``reference`` (another model of the same architecture),
    a third copy of the cache goes through it too, each step's logits a third item, and its
    argmax picks the next tokens."""
    from transformers import Cache

    from selfplay.engines.hf_cpu import SHARED_PREFIX, SharedPrefix
    from selfplay.engines.hf_kv import PreallocatedLayer, plain_cache_layers

    g = torch.Generator().manual_seed(shared)
    width, steps = shared + 20, 4
    ids = torch.randint(3, model.config.vocab_size, (rows, width), generator=g)
    ids[:, :shared] = ids[0, :shared]
    attn = torch.ones(rows, width, dtype=torch.long)
    for b in range(rows):
        attn[b, shared : shared + (2 * b) % 10] = 0  # padding (after the shared columns)
    pos = (attn.cumsum(-1) - 1).clamp(min=0)
    models = [model, model] + ([reference] if reference is not None else [])
    caches = [
        Cache(layers=[PreallocatedLayer(width + steps) for _ in range(plain_cache_layers(model))])
        for _ in models
    ]
    out = []
    with torch.inference_mode():
        for cache, m in zip(caches, models):
            first = m(input_ids=ids, attention_mask=attn, position_ids=pos,
                      past_key_values=cache, use_cache=True).logits[:, -1]  # fmt: skip
        tok, last = first.argmax(-1), pos[:, -1]
        for _ in range(steps):
            attn = torch.cat([attn, attn.new_ones((rows, 1))], dim=1)
            last = last + 1
            logits = []
            for i, (m, cache) in enumerate(zip(models, caches)):
                if i == 1:
                    logits.append(lean.step(tok, last, cache, attn, shared))
                    continue
                extra = {SHARED_PREFIX: SharedPrefix(shared)} if shared else {}
                extra.update(attention_mask=attn, position_ids=last[:, None], use_cache=True)
                step = m(input_ids=tok[:, None], past_key_values=cache, **extra)
                logits.append(step.logits[:, -1])
            want, got, *ref = logits
            out.append((got, want, *ref))
            tok = (ref or [want])[0].argmax(-1)
    return out


@pytest.mark.parametrize("packed", [True, False])
@pytest.mark.parametrize("shared,rows", [(0, 5), (70, 5), (0, 1), (70, 2), (70, 17)])
def test_lean_decoding_steps_are_the_models_own_to_1e5(
    tiny_model, shared, rows, packed, monkeypatch
):
    """The engine's lean decoding step (hf_step), both ways it runs: in rows on the weights
    oneDNN packed at start-up, and feature-major through MKL (rows padded with zero columns to
    MIN_COLUMNS or the next multiple of COLUMN_MULTIPLE, one row not); the fused products and
    attention called directly either way. Each gives the model's own logits, step after step,
    over a left-padded batch and over a batch whose first columns are shared (the cascade)."""
    from selfplay.engines import HFEngineConfig, hf_step
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32"))
    assert engine._lean is not None  # the tiny Qwen2 (q/k/v biases) passed the start-up check
    assert engine._lean.packed  # this torch has oneDNN and the packed step passed it too
    monkeypatch.setattr(hf_step, "PACKED_DECODE", packed)
    for got, want in _steps_both_ways(engine.model, engine._lean, shared, rows):
        assert got.shape == want.shape == (rows, engine.model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_lean_decoding_is_off_where_it_does_not_cover_the_model(tiny_model, monkeypatch):
    """Another model type, another dtype, or a model whose logits the check finds different:
    the engine keeps transformers' forward."""
    from transformers import AutoModelForCausalLM

    from selfplay.engines import hf_step
    from selfplay.engines.hf_kv import plain_cache_layers

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    layers = plain_cache_layers(model)
    assert hf_step.lean_decode(model, layers) is not None
    assert hf_step.lean_decode(model, 0) is None
    assert hf_step.lean_decode(model.to(torch.float16), layers) is None
    with monkeypatch.context() as m:  # bf16 runs on packed weights only
        m.setattr(hf_step, "available_memory", lambda device: 1024)
        assert hf_step.lean_decode(model.to(torch.bfloat16), layers) is None
    model.float()
    monkeypatch.setattr(hf_step, "LEAN_MODEL_TYPES", ("llama",))
    assert hf_step.lean_decode(model, layers) is None
    monkeypatch.setattr(hf_step, "LEAN_MODEL_TYPES", ("qwen2",))
    step = hf_step.LeanDecode.step
    monkeypatch.setattr(hf_step.LeanDecode, "step", lambda *a, **k: step(*a, **k) * 1.01)
    assert hf_step.lean_decode(model, layers) is None


def test_packed_decoding_steps_are_off_where_they_cannot_run_or_differ(tiny_model, monkeypatch):
    """The lean step keeps its feature-major products (MKL, the model's own weights) where the
    weights cannot be packed (no oneDNN linear in this torch, no memory for a second copy) or the
    packed step's logits differ from the model's."""
    from transformers import AutoModelForCausalLM

    from selfplay.engines import hf_step
    from selfplay.engines.hf_kv import plain_cache_layers

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    layers = plain_cache_layers(model)
    lean = hf_step.lean_decode(model, layers)
    assert lean is not None and lean.packed
    assert all(layer.packed is not None for layer in lean.layers)
    with monkeypatch.context() as m:
        m.setattr(hf_step, "available_memory", lambda device: 1024)  # 1 KiB free
        lean = hf_step.lean_decode(model, layers)
        assert lean is not None and not lean.packed
    with monkeypatch.context() as m:
        m.setattr(hf_step, "available_memory", lambda device: None)  # the machine does not say
        assert not hf_step.lean_decode(model, layers).packed

    def no_onednn(weight):
        raise RuntimeError("mkldnn::_reorder_linear_weight: not built with oneDNN")

    with monkeypatch.context() as m:
        m.setattr(hf_step, "_pack", no_onednn)
        assert not hf_step.lean_decode(model, layers).packed
    product = hf_step._packed_product
    monkeypatch.setattr(hf_step, "_packed_product", lambda *a: product(*a) * 1.01)
    lean = hf_step.lean_decode(model, layers)
    assert lean is not None and not lean.packed
    assert all(layer.packed is None for layer in lean.layers)  # the copies are let go


def test_lean_decoding_of_the_embedded_smollm2_is_its_own_to_1e4(monkeypatch):
    """The architecture users start from (Llama: SmolLM2-135M-Instruct, the embedded default)
    passes the start-up check, packed and not, and its lean steps give its own logits over a
    shared prefix each way, with the compiled attention (where this machine builds it) and
    torch's flash kernel."""
    from selfplay.engines import HFEngineConfig, hf_native, hf_step
    from selfplay.engines.hf import HFEngine
    from selfplay.models import embedded_model_dir

    engine = HFEngine(HFEngineConfig(model=str(embedded_model_dir()), device="cpu", dtype="fp32"))
    assert engine._lean is not None and engine._shared_layout and engine._lean.packed
    assert engine._lean.native is hf_native.kernel()
    for packed, native in ((True, True), (True, False), (False, True)):
        monkeypatch.setattr(hf_step, "PACKED_DECODE", packed)
        monkeypatch.setattr(hf_native, "NATIVE_ATTENTION", native)
        for got, want in _steps_both_ways(engine.model, engine._lean, 70):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_a_padded_prefill_computes_its_real_tokens_alone_and_the_same_logits(
    tiny_model, monkeypatch
):
    """A prefill pass over prompts of different lengths (left-padded) runs its linear layers on
    the real tokens alone (hf_cpu.real_tokens: gathered, then scattered back into zeros), and its
    last logits and every real position's KV are the ones the padded products give."""
    from selfplay.engines import HFEngineConfig, hf_cpu
    from selfplay.engines.hf import HFEngine

    engine = HFEngine(
        HFEngineConfig(model=str(tiny_model), device="cpu", dtype="fp32", prefix_cache_tokens=0)
    )
    g = torch.Generator().manual_seed(3)
    vocab = engine.model.config.vocab_size
    prompts = [tuple(torch.randint(3, vocab, (n,), generator=g).tolist()) for n in (23, 9, 17, 4)]
    rows_seen = []
    scattered = hf_cpu._scattered
    monkeypatch.setattr(
        hf_cpu, "_scattered", lambda y, i, x: rows_seen.append(y.shape[0]) or scattered(y, i, x)
    )
    out = {}
    with torch.inference_mode():
        for packed in (False, True):
            monkeypatch.setattr(hf_cpu, "PACKED_PREFILL", packed)
            out[packed] = engine._forward(prompts, [None] * len(prompts), 4)
    assert rows_seen and set(rows_seen) == {sum(map(len, prompts))}  # 53 of 4 x 23 slots
    (cache0, logits0, attn, _, _), (cache1, logits1, attn1, _, _) = out[False], out[True]
    assert torch.equal(attn, attn1)
    torch.testing.assert_close(logits1, logits0, rtol=1e-5, atol=1e-5)
    real = attn.bool()
    for a, b in zip(cache0.layers, cache1.layers):
        width = attn.shape[1]
        for x, y in ((a.keys, b.keys), (a.values, b.values)):
            x, y = x[:, :, :width].transpose(1, 2)[real], y[:, :, :width].transpose(1, 2)[real]
            torch.testing.assert_close(y, x, rtol=1e-5, atol=1e-5)


def _native_kernel():
    """The compiled decode attention; it must build wherever a C compiler is found."""
    import os
    import shutil

    from selfplay.engines import hf_native

    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here: the engine runs torch's flash kernel instead")
    lib = hf_native.kernel()
    assert lib is not None, "a C compiler is here, yet the native decode attention is off"
    return lib


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (14, 2), (4, 4), (16, 1)])
def test_native_decode_attention_is_the_flash_kernels_within_its_rounding(
    dim, heads, kv_heads, cache
):
    """The compiled kernel (hf_native) over rows of a cache with room to spare, read at the runs
    of each row's mask (left padding, holes, none at all): the output and log-sum-exp of torch's
    flash kernel over the same rows with the same mask; a row that attends to nothing gives
    zeros and a log-sum-exp of -inf (the cascade's merge then takes the shared prefix alone). A
    bf16 cache (a bf16 model's) is read widened to fp32: the flash kernel's over the widened
    cache, to the same 1e-5; or, on a CPU with AVX-512 BF16, by pair products, to the bound
    ``attention_slack`` gives (the query split in two bf16 parts, the probabilities in bf16)."""
    from selfplay.engines import hf_native
    from selfplay.engines.hf_cpu import additive_mask, grouped_flash

    lib = _native_kernel()
    g = torch.Generator().manual_seed(dim + heads)
    rows, length = 7, 301
    query = torch.randn(rows, heads, 1, dim, generator=g)
    room = torch.randn(2, rows, kv_heads, length + 40, dim, generator=g).to(cache)
    key, value = room[0, :, :, :length], room[1, :, :, :length]
    mask = torch.ones(rows, length, dtype=torch.bool)
    for b in range(1, rows - 1):
        mask[b, : 11 * b] = False  # left padding
        mask[b, 150 + b : 160 + 3 * b] = False  # a hole
    mask[rows - 1] = False
    mask[rows - 1, 200:203] = True  # three positions, one run, mid-cache
    runs = hf_native.mask_runs(mask)
    assert runs.shape == (rows, 2, 2) and runs[0].tolist() == [[0, length], [0, 0]]
    assert runs[1].tolist() == [[11, 151], [163, length]]
    cut = additive_mask(mask[:, None, None], query.dtype)
    pairs = cache == torch.bfloat16 and lib.pair_products()
    for scale in (dim**-0.5, 0.3):
        out, lse = hf_native.decode_attention(lib, query, key, value, runs, scale)
        want, want_lse = grouped_flash(query, key.float(), value.float(), cut, scale)
        assert out.shape == want.shape == (rows, heads, dim) and lse.shape == (rows, heads)
        slack, lse_slack = hf_native.attention_slack(lib, query, key, value, mask, scale)
        assert (slack.numel() > 1) == pairs  # pair products: a bound per element, else 1e-5
        assert ((out - want).abs() <= slack + 1e-5 * want.abs()).all()
        finite = want_lse.isfinite()
        assert (lse.isfinite() == finite).all()
        off = (lse - want_lse)[finite].abs()
        assert (off <= (lse_slack + 1e-5 * want_lse.abs())[finite]).all()
        if pairs:  # the bound is not loose: the probabilities' rounding shows in the output
            assert (out - want).abs().max() > 1e-5
    # every row's first 40 columns the same (the cascade's shared prefix): read from row 0 for
    # every row, as the cascade's flash kernel over the prefix joined with each row's own columns
    from selfplay.engines.hf_cpu import SharedPrefix, cascade_decode_attention

    room[:, :, :, :40] = room[:, :1, :, :40]
    own = hf_native.mask_runs(mask[:, 40:])
    attends = mask.clone()
    attends[:, :40] = True
    for scale in (dim**-0.5, 0.3):
        got = hf_native.attention(lib, query, key, value, own, scale, 40)
        wide, prefix = mask[:, None, None], SharedPrefix(40)
        want = cascade_decode_attention(query, key.float(), value.float(), wide, scale, prefix)
        slack = hf_native.attention_slack(lib, query, key, value, attends, scale)[0]
        assert ((got - want[:, :, 0]).abs() <= slack + 1e-5 * want.abs()[:, :, 0]).all()
    nothing = hf_native.mask_runs(torch.zeros(1, length, dtype=torch.bool))
    out, lse = hf_native.decode_attention(lib, query[:1], key[:1], value[:1], nothing, 0.3)
    assert (out == 0).all() and (lse == float("-inf")).all()
    # tensors it does not cover: the caller runs the flash kernel
    half = [x[..., :32] for x in (query, key, value)]
    assert hf_native.decode_attention(lib, *half, runs, 0.3) is None
    assert hf_native.decode_attention(lib, query, key.double(), value, runs, 0.3) is None
    assert hf_native.decode_attention(lib, query, key.contiguous(), value, runs, 0.3) is None
    assert hf_native.decode_attention(lib, query.to(cache).double(), key, value, runs, 0.3) is None


def test_native_decode_attention_is_off_where_it_cannot_build_or_differs(tiny_model, monkeypatch):
    """No compiler, or a compiler that fails: no kernel, and a kernel whose output differs from
    the flash kernel's is not used; either way the lean step runs the flash kernel."""
    from transformers import AutoModelForCausalLM

    from selfplay.engines import hf_native, hf_step
    from selfplay.engines.hf_kv import plain_cache_layers

    lib = _native_kernel()
    assert hf_native.build("selfplay-no-such-compiler") is None
    assert hf_native.build("false") is None  # a compiler that exits 1

    def no_load(path):
        raise OSError(f"{path}: failed to map segment from shared object")  # a noexec /tmp

    with monkeypatch.context() as m:
        m.setattr(hf_native.ctypes, "CDLL", no_load)
        assert hf_native.build() is None
    assert hf_native.agrees(lib)
    attention = hf_native.decode_attention
    with monkeypatch.context() as m:
        m.setattr(hf_native, "decode_attention", lambda *a: tuple(x + 1e-3 for x in attention(*a)))
        assert not hf_native.agrees(lib)
    model = AutoModelForCausalLM.from_pretrained(str(tiny_model), dtype=torch.float32).eval()
    monkeypatch.setattr(hf_native, "kernel", lambda: None)
    lean = hf_step.lean_decode(model, plain_cache_layers(model))
    assert lean is not None and lean.native is None


@pytest.fixture(scope="module")
def tiny_model_d64(tmp_path_factory) -> Path:
    """The tiny Qwen2 with 64-dim heads: a head dim the native kernel covers."""
    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    out = tmp_path_factory.mktemp("models") / "tiny_qwen2_d64"
    return build_tiny_model(out, corpus=tokenizer_corpus(), head_dim=64)


@pytest.mark.parametrize("shared,rows", [(0, 5), (70, 5), (0, 1), (70, 17)])
def test_lean_steps_on_the_native_kernel_are_the_models_own_to_1e5(tiny_model_d64, shared, rows):
    """The lean step with the compiled kernel attending to each row's own columns (alone, or
    beside the cascade's shared prefix) gives the model's own logits, step after step."""
    from selfplay.engines import HFEngineConfig
    from selfplay.engines.hf import HFEngine

    lib = _native_kernel()
    engine = HFEngine(HFEngineConfig(model=str(tiny_model_d64), device="cpu", dtype="fp32"))
    assert engine._lean is not None and engine._lean.native is lib
    for got, want in _steps_both_ways(engine.model, engine._lean, shared, rows):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "which,native,shared,rows",
    [("tiny", True, 0, 5), ("tiny", True, 70, 5), ("tiny", True, 70, 17), ("tiny", False, 0, 5),
     ("tiny", False, 70, 5), ("smollm2", True, 70, 5), ("smollm2", False, 70, 5)],
)  # fmt: skip
def test_bf16_lean_steps_are_as_close_to_exact_as_the_models_own_bf16_forward(
    tiny_model_d64, which, shared, rows, native, monkeypatch
):
    """A bf16 model's lean step (its products oneDNN's bf16 kernels on the packed weights; its
    residual stream, norms, rotary embedding and attention over the bf16 cache in fp32,
    by the compiled kernels or torch's ops) against the exact result, the same bf16 weights
    computed in fp32: within 1.5x of the model's own bf16 forward's distance from it, step after
    step, and picking the same next tokens where that forward does. On the tiny random model
    both are near the logits' own bf16 rounding; on SmolLM2-135M (the embedded default, real
    weights) a slip in the arithmetic shows (without its rotary embedding the step is 0.4 of the
    logits' scale off, against 0.01)."""
    from transformers import AutoModelForCausalLM

    from selfplay.engines import HFEngineConfig, hf_native
    from selfplay.engines.hf import HFEngine
    from selfplay.engines.hf_cpu import fuse_projections, grouped_sdpa, weight_major_linears
    from selfplay.models import embedded_model_dir

    lib = _native_kernel()
    monkeypatch.setattr(hf_native, "NATIVE_ATTENTION", native)
    monkeypatch.setattr(hf_native, "NATIVE_ELEMENTWISE", native)
    path = str(tiny_model_d64 if which == "tiny" else embedded_model_dir())
    engine = HFEngine(HFEngineConfig(model=path, device="cpu", dtype="bf16"))
    assert engine.model.dtype == torch.bfloat16
    assert engine._lean is not None and engine._lean.packed and engine._lean.native is lib
    exact = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    exact = exact.float().eval()  # the bf16 weights, every sum in fp32
    exact.set_attn_implementation(grouped_sdpa())
    weight_major_linears(exact)
    fuse_projections(exact)
    steps = _steps_both_ways(engine.model, engine._lean, shared, rows, reference=exact)
    ours, theirs = [], []
    for got, want, ref in steps:
        assert got.dtype == ref.dtype == torch.float32 and got.shape == want.shape
        ours.append((got - ref).abs().max().item())
        theirs.append((want.float() - ref).abs().max().item())
        agree = want.argmax(-1) == ref.argmax(-1)
        assert (got.argmax(-1)[agree] == ref.argmax(-1)[agree]).all()
    assert max(ours) <= 1.5 * max(theirs), (ours, theirs)
    assert max(ours) > 0  # bf16 products: not fp32's arithmetic


def test_the_lean_step_of_a_bf16_model_is_off_where_it_differs(tiny_model_d64, monkeypatch):
    """The start-up check of a bf16 model's lean step: a step whose logits are off the model's
    own bf16 forward by more than bf16's rounding (a rotary embedding left out, here) is not
    used, and the engine keeps transformers' forward."""
    from transformers import AutoModelForCausalLM

    from selfplay.engines import hf_step
    from selfplay.engines.hf_kv import plain_cache_layers

    model = AutoModelForCausalLM.from_pretrained(str(tiny_model_d64), dtype=torch.bfloat16)
    layers = plain_cache_layers(model.eval())
    assert hf_step.lean_decode(model, layers) is not None
    step = hf_step.LeanDecode.step
    monkeypatch.setattr(hf_step.LeanDecode, "step", lambda *a, **k: step(*a, **k) * 1.2)
    assert hf_step.lean_decode(model, layers) is None


@pytest.mark.parametrize(
    "march", [("-march=x86-64-v4", "-mavx512bf16"), ("-march=x86-64-v3",), ("-march=x86-64",)]
)
def test_the_kernels_agree_when_built_for_other_instruction_sets(march, monkeypatch):
    """The kernels are built for the machine they run on; their code differs by instruction set
    (AVX-512 BF16: a bf16 cache read by pair products; AVX-512: three query heads' sums a
    register block, AVX2: two; without AVX2, the generic vector code and no widening load).
    Built for each, here, each passes the start-up check against torch (fp32 and bf16); the
    AVX-512 BF16 build is only built (and says it reads by pair products) where this CPU lacks
    those instructions."""
    import platform

    from selfplay.engines import hf_native
    from selfplay.hardware import cpu_flags

    _native_kernel()
    if platform.machine() != "x86_64":
        pytest.skip("x86-64 instruction sets")
    flags = tuple(
        f for flag in hf_native.FLAGS for f in (march if flag == "-march=native" else (flag,))
    )
    monkeypatch.setattr(hf_native, "FLAGS", flags)
    lib = hf_native.build()
    assert lib is not None
    assert lib.pair_products() == ("-mavx512bf16" in march)
    v4 = {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl", "avx512_bf16"}
    if "-mavx512bf16" in march and not v4 <= cpu_flags():
        return  # it would stop at its first AVX-512 instruction here
    assert hf_native.agrees(lib)


def _prefill_mask(rows: int, new: int, length: int, g: torch.Generator) -> torch.Tensor:
    """SDPA's mask ``[rows, 1, new, length]`` of a prefill pass as the engine lays it out: each
    row's kept KV left-padded up to the new tokens, its new tokens left-padded and causal (a
    padding token's row empty), one row with a hole in its kept KV."""
    past = length - new
    mask = torch.zeros(rows, 1, new, length, dtype=torch.bool)
    for b in range(rows):
        kept = int(torch.randint(0, past + 1, (), generator=g))
        real = int(torch.randint(1, new + 1, (), generator=g))
        mask[b, 0, new - real :, past - kept : past] = True
        for t in range(new - real, new):
            mask[b, 0, t, past + new - real : past + t + 1] = True
    mask[0, 0, :, past - 5 : past - 2] = False  # a hole
    return mask


@pytest.mark.parametrize("cache", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128)])
def test_a_prefill_pass_attends_by_the_kernel_a_row_a_token(cache, heads, kv_heads, dim):
    """A prefill pass's attention by the kernel (``hf_native.PrefillAttention``: each new token a
    query row reading its row of the cache, at its row of the causal mask) is exact attention
    over the widened cache within the kernel's bound (``attention_slack`` of each token as a row
    of its own) and the output's rounding to the queries' dtype; a padding token's output is
    zeros; every layer's call of a pass finds the mask's runs once."""
    from selfplay.engines import hf_native

    lib = _native_kernel()
    g = torch.Generator().manual_seed(heads + dim)
    rows, new, length = 5, 9, 70
    query = torch.randn(rows, heads, new, dim, generator=g).to(cache)
    room = torch.randn(2, rows, kv_heads, length + 6, dim, generator=g).to(cache)
    key, value = room[0, :, :, :length], room[1, :, :, :length]
    mask = _prefill_mask(rows, new, length, g)
    attention = hf_native.PrefillAttention(lib)
    got = attention(query, key, value, mask, 0.3)
    assert got.shape == (rows, new, heads, dim) and got.dtype == cache
    runs = attention._runs[1]
    assert attention(query, key, value, mask, 0.3) is not None and attention._runs[1] is runs
    exact = torch.nn.functional.scaled_dot_product_attention(
        query.float(), key.float(), value.float(), attn_mask=mask, scale=0.3, enable_gqa=True
    ).transpose(1, 2)
    real = mask[:, 0].any(-1)  # [rows, new]: the tokens that are not padding
    assert (got[~real] == 0).all() and (~real).any()
    each = [x.repeat_interleave(new, dim=0) for x in (key, value)]  # a token's own rows
    q = query.float().transpose(1, 2).reshape(rows * new, heads, 1, dim)
    slack = hf_native.attention_slack(lib, q, *each, mask.reshape(rows * new, length), 0.3)[0]
    slack = slack.reshape(rows, new, heads, dim) if slack.numel() > 1 else slack
    rounding = exact.abs() * (2**-8 if cache == torch.bfloat16 else 0)
    assert ((got.float() - exact).abs() <= slack + rounding + 1e-5)[real].all()
    # masks the kernel does not take: SDPA runs (the caller's None)
    assert attention(query, key, value, None, 0.3) is None
    assert attention(query, key, value, mask.float(), 0.3) is None


def test_a_bf16_engine_prefills_by_the_kernel_where_it_reads_pairs(tiny_model_d64, monkeypatch):
    """A bf16 model's prefill passes attend by the kernel where it reads the cache by pair
    products (else SDPA: a fp32 model, the switch off, or a CPU without AVX-512 BF16), and the
    logits after a batch's prefill are SDPA's within bf16's rounding."""
    from selfplay.engines import HFEngineConfig, hf_native
    from selfplay.engines.hf import HFEngine

    lib = _native_kernel()
    assert hf_native.prefill_attention(torch.float32) is None
    if not lib.pair_products():
        assert hf_native.prefill_attention(torch.bfloat16) is None
        pytest.skip("this CPU has no AVX-512 BF16: prefill attends by SDPA")
    assert isinstance(hf_native.prefill_attention(torch.bfloat16), hf_native.PrefillAttention)
    engine = HFEngine(HFEngineConfig(model=str(tiny_model_d64), device="cpu", dtype="bf16"))
    calls = []
    call = hf_native.PrefillAttention.__call__
    monkeypatch.setattr(
        hf_native.PrefillAttention,
        "__call__",
        lambda self, *a: calls.append(a[0].shape) or call(self, *a),
    )
    g = torch.Generator().manual_seed(3)
    prompts = [tuple(torch.randint(5, 200, (n,), generator=g).tolist()) for n in (40, 23, 31)]
    logits = {}
    for native in (True, False):
        monkeypatch.setattr(hf_native, "NATIVE_PREFILL", native)
        with torch.inference_mode():
            logits[native] = engine._prefill(prompts, 4)[1].float()
    layers = engine.model.config.num_hidden_layers
    assert len(calls) == layers and calls[0][0] == len(prompts)  # the switch on: each layer
    scale = logits[False].abs().max()
    assert (logits[True] - logits[False]).abs().max() <= 0.05 * scale
