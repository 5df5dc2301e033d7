"""Turn verl's checkpoint into a clean Hugging Face model directory.

verl's ``huggingface/`` folder holds loadable safetensors, but its config.json says
``dtype: bfloat16`` whatever the weights are, and it keeps the attention-implementation override
the trainer used. ``export_hf_dir`` copies the weights, writes a config.json whose dtype is the
weights' own and that has no attention override, and saves the tokenizer (with its chat template)
of the model that was trained, so transformers and SGLang load the directory directly.
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


def export_hf_dir(src: Path, dst: Path, tokenizer_source: str) -> Path:
    """Write a loadable HF directory at ``dst`` from verl's ``<checkpoint>/huggingface``."""
    src, dst = Path(src), Path(dst)
    weights = sorted(src.glob("*.safetensors"))
    if not weights:
        raise FileNotFoundError(
            f"{src} has no .safetensors weights; the verl checkpoint must be saved with "
            "save_contents including 'hf_model'"
        )
    dst.mkdir(parents=True, exist_ok=True)
    for path in [*weights, *src.glob("*.safetensors.index.json"), src / "generation_config.json"]:
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
