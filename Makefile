# The two commands README promises: `make demo` and `make test`. Both set up .venv first.
.PHONY: setup test lint demo bench

# Two self-play rounds with the embedded SmolLM2-135M-Instruct on CPU (small 3x3 tables), then the
# report: data/demo/REPORT.md. Re-running resumes (a finished run only rewrites the report).
DEMO_ARGS ?= --name demo --iterations 2 --games-per-iter 8 --games-per-scenario 4 \
	--table-size 3 --max-new-tokens 64 --max-actions 10 --temperature 1.0 --lr 1e-5 \
	--micro-batch-size 2

setup:
	bash scripts/setup.sh

lint: setup
	.venv/bin/ruff check selfplay tests benchmarks
	.venv/bin/ruff format --check selfplay tests benchmarks

test: setup lint
	.venv/bin/pytest -q

demo: setup
	.venv/bin/selfplay iterate $(DEMO_ARGS)

bench: setup
	.venv/bin/python benchmarks/bench_scenarios.py
