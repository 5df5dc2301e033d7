# The two commands README promises: `make demo` and `make test`. Both set up .venv first.
# Experiments are recipe files (recipes/NAME.toml, see recipes/README.md): `make run RECIPE=NAME`
# runs `selfplay iterate --config recipes/NAME.toml`, and re-running it resumes.
.PHONY: setup test lint bench demo run docs

setup:
	bash scripts/setup.sh

lint: setup
	.venv/bin/ruff check selfplay tests benchmarks
	.venv/bin/ruff format --check selfplay tests benchmarks

test: setup lint
	.venv/bin/pytest -q

bench: setup
	.venv/bin/python benchmarks/bench_scenarios.py

# The embedded SmolLM2-135M-Instruct on CPU: a warm start, one GRPO round of 8 games, both models
# evaluated on 16 held-out scenarios; the report: data/demo/REPORT.md (recipes/demo.toml says more).
demo: setup
	.venv/bin/selfplay iterate --config recipes/demo.toml

run: setup
	@test -n "$(RECIPE)" || { echo "usage: make run RECIPE=NAME (one of: $(basename $(notdir $(wildcard recipes/*.toml))))"; exit 1; }
	.venv/bin/selfplay iterate --config recipes/$(RECIPE).toml

# The user's guide as a site (mkdocs.yml, docs/): build/site/index.html; strict: a broken link fails.
docs: setup
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict --site-dir build/site
