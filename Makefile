# The two commands README promises: `make demo` and `make test`. Both set up .venv first.
.PHONY: setup test lint demo bench

setup:
	bash scripts/setup.sh

lint: setup
	.venv/bin/ruff check selfplay tests benchmarks
	.venv/bin/ruff format --check selfplay tests benchmarks

test: setup lint
	.venv/bin/pytest -q

bench: setup
	.venv/bin/python benchmarks/bench_scenarios.py
