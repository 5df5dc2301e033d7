"""Turn verl's checkpoint into a clean Hugging Face model directory.

verl's ``huggingface/`` folder holds loadable safetensors, but its config.json says
``dtype: bfloat16`` whatever the weights are, and it keeps the attention-implementation override
the trainer used. ``export_hf_dir`` copies the weights, writes a config.json whose dtype is the
weights' own and that has no attention override, and saves the tokenizer (with its chat template)
of the model that was trained, so transformers and SGLang load the directory directly.

With LoRA (``lora=(rank, alpha)``) verl writes the peft-wrapped state dict as it is: the base
weights under ``...base_layer.weight`` beside ``lora_A``/``lora_B``, every name under
``base_model.model.``. ``merge_lora`` folds each adapter into its base weight,
W + alpha / rank * B A (computed in fp32), and restores the model's own names, so the directory is
a plain model of the base architecture that every engine loads like any other.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
from pathlib import Path

from selfplay.fileio import atomic_write

log = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"F32": "float32", "BF16": "bfloat16", "F16": "float16", "F64": "float64"}
_ATTN_KEYS = ("attn_implementation", "_attn_implementation", "_attn_implementation_autoset")


def safetensors_dtype(path: Path) -> str:
    """The floating dtype of the tensors in a .safetensors file (read from its header only)."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    dtypes = {v["dtype"] for k, v in header.items() if k != "__metadata__"}
    floating = {_SAFETENSORS_DTYPES[d] for d in dtypes if d in _SAFETENSORS_DTYPES}
    if len(floating) != 1:
        raise ValueError(
            f"{path} holds tensors of dtypes {sorted(dtypes)}; expected one float dtype"
        )
    return floating.pop()


_PEFT_PREFIX = "base_model.model."


def merge_lora(state: dict, rank: int, alpha: int) -> dict:
    """A peft LoRA state dict (names as verl saves them) -> the base model's, adapters merged."""
    import torch

    state = {k.removeprefix(_PEFT_PREFIX): v for k, v in state.items()}
    out, scale = {}, alpha / rank
    for name, tensor in state.items():
        if ".lora_" in name:
            continue
        if ".base_layer." not in name:
            out[name] = tensor
            continue
        module, _, leaf = name.partition(".base_layer.")
        if leaf == "weight":
            a, b = (
                state[f"{module}.lora_A.default.weight"],
                state[f"{module}.lora_B.default.weight"],
            )
            delta = scale * (b.to(torch.float32) @ a.to(torch.float32))
            tensor = (tensor.to(torch.float32) + delta).to(tensor.dtype)
        out[f"{module}.{leaf}"] = tensor
    left = [k for k in state if ".lora_" in k and k.partition(".lora_")[0] + ".base_layer.weight"
            not in state]  # fmt: skip
    if left:
        raise ValueError(f"LoRA weights without a base layer: {left[:3]}")
    return out


def _write_merged(weights: list[Path], dst: Path, lora: tuple[int, int]) -> None:
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import load_file

    state = {}
    for path in weights:
        state.update(load_file(path))
    merged = merge_lora(state, *lora)
    save_torch_state_dict(merged, dst, max_shard_size="5GB", metadata={"format": "pt"})
    log.info("merged LoRA adapters (rank %d, alpha %d) into %d tensors", *lora, len(merged))


def export_hf_dir(
    src: Path, dst: Path, tokenizer_source: str, *, lora: tuple[int, int] | None = None
) -> Path:
    """Write a loadable HF directory at ``dst`` from verl's ``<checkpoint>/huggingface``;
    ``lora`` (rank, alpha): the weights hold LoRA adapters, merged into the base weights here."""
    src, dst = Path(src), Path(dst)
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(
            f"{src} has no .safetensors weights; the verl checkpoint must be saved with "
            "save_contents including 'hf_model'"
        )
    dst.mkdir(parents=True, exist_ok=True)
    if lora is not None:
        _write_merged(weights, dst, lora)
        weights = sorted(dst.glob("*.safetensors"))
    copied = [] if lora is not None else [*weights, *src.glob("*.safetensors.index.json")]
    for path in [*copied, src / "generation_config.json"]:
        if path.exists():
            shutil.copy2(path, dst / path.name)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(dst)
    config = json.loads((src / "config.json").read_text())
    for key in _ATTN_KEYS:
        config.pop(key, None)
    dtype = safetensors_dtype(weights[0])
    config["dtype"] = dtype
    if "torch_dtype" in config:
        config["torch_dtype"] = dtype
    # config.json last: its presence marks a complete directory
    atomic_write(dst / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
    log.info("wrote the Hugging Face model to %s (dtype %s)", dst, dtype)
    return dst
