# The two commands README promises: `make demo` and `make test`. Both set up .venv first.
.PHONY: setup test lint demo learn learn-replay learn-explain learn-explain-grpo learn-ranked learn-grpo shy ask ask-ranked ask-ranked-mix ask4 ask4-strict ask-gaps ask-late ask-notes ask-advice ask-advice-grpo ask-advice-guided ask-guided bench

# The embedded SmolLM2-135M-Instruct on CPU, 3x3 tables of matching-short (the rules in five
# sentences: 311 tokens a warm-start row instead of 442): a warm start (behaviour cloning of the
# scripted cooperative policy through verl's SFT loss), then one GRPO self-play round of 8 games,
# both models evaluated greedily on the same 16 held-out scenarios; the report:
# data/demo/REPORT.md.
# Re-running resumes (a finished run only rewrites the report).
# The warm start is one pass in updates of 2 rows (32 updates on 64 rows: as many as two passes
# in updates of 4, on half the tokens); GRPO takes the old log-probs from the rollout (on-policy
# rows: the generator's own log-probs), which spares a forward pass a step; the warm-started
# model's held-out games play beside the round's games on one engine. README, "The two
# commands": 8 min 10 s and 8 min 51 s on a 2-core AVX2-only CPU (fp32); the initial model's
# evaluation (0.000) is left out.
DEMO_ARGS ?= --name demo --game matching-short --table-size 3 --warm-start scripted:cooperative:32 \
	--warm-start-lr 2e-4 --warm-start-epochs 1 --warm-start-mini-batch-size 2 --iterations 1 \
	--games-per-iter 8 --games-per-scenario 4 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 10 --lr 1e-5 --eval-scenarios 16 --micro-batch-size 4 --old-log-probs rollout \
	--no-eval-initial

# Self-play learning (at most an hour): can the loop raise held-out reward above the warm-started
# model? Expert iteration: each round samples 4 games on each of 16 scenarios and clones the best
# of each (reward >= 0.5) with the SFT loss; 48 held-out scenarios. See README, "Learning".
LEARN_ARGS ?= --name learn --table-size 3 --warm-start scripted:cooperative:24 \
	--warm-start-lr 2e-4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.5 \
	--iterations 3 --games-per-iter 64 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 10 --lr 5e-5 --epochs-per-iter 2 --updates-per-round 4 \
	--eval-scenarios 48 --micro-batch-size 4

# Expert iteration that keeps what it learns (at most an hour): 128 games a round on 32 scenarios,
# only near-optimal games kept (reward >= 0.9), and every round trains on the kept games of all
# rounds so far (--ei-replay 0, ReST's growing dataset); 96 held-out scenarios. README, "Learning".
LEARN_REPLAY_ARGS ?= --name learn-replay --table-size 3 --warm-start scripted:cooperative:24 \
	--warm-start-lr 2e-4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 4 --games-per-iter 128 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 10 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 96 --micro-batch-size 4

# Can selection teach the comparison a proposal rests on (about 45 minutes)? The table shown as
# lines (--game matching-lines, which the model reads), a warm start on 96 games of the scripted
# explainer (it says its picks, highest known value first, and its partner proposes exactly them),
# then expert iteration as in learn-replay. README, "Learning".
LEARN_EXPLAIN_SFT ?= --game matching-lines --teacher scripted:explainer --num-games 96 --epochs 3 \
	--lr 1e-4 --mini-batch-size 4 --table-size 3
LEARN_EXPLAIN_ARGS ?= --name learn-explain --game matching-lines --table-size 3 \
	--model checkpoints/explainer-warm --algorithm expert-iteration --ei-top-k 1 \
	--ei-min-reward 0.9 --ei-replay 0 --iterations 4 --games-per-iter 128 --games-per-scenario 4 \
	--temperature 1.0 --max-new-tokens 64 --max-actions 10 --lr 1e-4 --epochs-per-iter 1 \
	--mini-batch-size 8 --eval-scenarios 96 --micro-batch-size 4

# Is the comparison what holds learn-explain back (about 45 minutes)? The same warm start and
# expert iteration with each seat's known values listed highest first, in its table and in the
# scripted messages (--game matching-ranked): the explainer's picks become a merge of two sorted
# lists. README, "Learning".
LEARN_RANKED_SFT ?= --game matching-ranked --teacher scripted:explainer --num-games 96 --epochs 3 \
	--lr 1e-4 --mini-batch-size 4 --table-size 3
LEARN_RANKED_ARGS ?= --name learn-ranked --game matching-ranked --table-size 3 \
	--model checkpoints/explainer-ranked-warm --algorithm expert-iteration --ei-top-k 1 \
	--ei-min-reward 0.9 --ei-replay 0 --iterations 4 --games-per-iter 128 --games-per-scenario 4 \
	--temperature 1.0 --max-new-tokens 64 --max-actions 10 --lr 1e-4 --epochs-per-iter 1 \
	--mini-batch-size 8 --eval-scenarios 96 --micro-batch-size 4

# The GRPO arm of learn-explain at about the same wall time: the same warm start, GRPO rounds of
# 64 games (16 scenarios x 4), lr 1e-5, the rollout's log-probs as the old ones.
LEARN_EXPLAIN_GRPO_ARGS ?= --name learn-explain-grpo --game matching-lines --table-size 3 \
	--model checkpoints/explainer-warm --iterations 4 --games-per-iter 64 --games-per-scenario 4 \
	--temperature 1.0 --max-new-tokens 64 --max-actions 10 --lr 1e-5 \
	--loss-agg seq-mean-token-mean --updates-per-round 4 --old-log-probs rollout \
	--eval-scenarios 96 --micro-batch-size 4

# The same with GRPO (the earlier `make learn`, now on 48 held-out scenarios): every game of a
# round, lr 5e-6, 4 updates a round.
LEARN_GRPO_ARGS ?= --name learn-grpo --table-size 3 --warm-start scripted:cooperative:24 \
	--warm-start-lr 2e-4 --iterations 3 --games-per-iter 32 \
	--games-per-scenario 4 --temperature 1.0 --max-new-tokens 64 --max-actions 10 --lr 5e-6 \
	--loss-agg seq-mean-token-mean --updates-per-round 4 --eval-scenarios 48 --micro-batch-size 4

# The shy-partner experiment (about an hour): warm start on cooperative self-play (which never
# asks), then GRPO with the model in seat 1 and the scripted shy partner (answers only direct
# questions) in seat 2, each round's model evaluated against the same partner. Does the model
# learn to ask? See README, "The shy partner". 20 actions a game leave room to ask (at 10 even the
# inquisitive reference runs out of actions before it proposes).
SHY_ARGS ?= --name shy --table-size 3 --partner scripted:shy --warm-start scripted:cooperative:24 \
	--warm-start-lr 2e-4 --iterations 4 --games-per-iter 32 \
	--games-per-scenario 8 --temperature 1.0 --max-new-tokens 64 --max-actions 20 --lr 1e-5 \
	--loss-agg seq-mean-token-mean --updates-per-round 4 --eval-scenarios 24 --micro-batch-size 4

# Does the model learn to ask (at most an hour)? A warm start that clones, in seat 1 against
# scripted:shy, a few inquisitive games (it asks) beside cooperative ones (it never does), then
# expert iteration against scripted:shy in seat 2: each round samples 8 games on each of 6 scenarios and clones the best 2 of each (reward
# >= 0.5) with the SFT loss; 48 held-out scenarios against the same partner. See README, "Asking".
ASK_ARGS ?= --name ask --table-size 3 --partner scripted:shy \
	--warm-start scripted:cooperative:24,scripted:inquisitive:4 --warm-start-partner run \
	--warm-start-lr 2e-4 --warm-start-epochs 3 \
	--algorithm expert-iteration --ei-top-k 2 --ei-min-reward 0.5 --iterations 4 \
	--games-per-iter 48 --games-per-scenario 8 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 20 --lr 1e-4 --epochs-per-iter 2 --updates-per-round 3 --eval-scenarios 48 \
	--micro-batch-size 4

# The asking question with a teacher whose use of the answers is a copy (about 45 minutes): the
# ranked table (--game matching-ranked), a warm start on 48 games of scripted:picker (says its
# picks from its own values, proposes them) and 12 of scripted:asker (first asks shy about the
# cells it does not know, then picks from its values and the answers), seat 1 cloned, then
# expert iteration against scripted:shy. Asking is worth 0.836 against 0.760 scripted.
ASK_RANKED_ARGS ?= --name ask-ranked --game matching-ranked --table-size 3 --partner scripted:shy \
	--warm-start scripted:picker:48,scripted:asker:12 --warm-start-partner run \
	--warm-start-lr 2e-4 --warm-start-epochs 3 --warm-start-mini-batch-size 4 \
	--algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 --ei-replay 0 --iterations 4 \
	--games-per-iter 128 --games-per-scenario 4 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 20 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 --eval-scenarios 48 \
	--micro-batch-size 4

# The same with asking in the warm start's support at 40% (36 picker, 24 asker games; greedy, the
# warm-started model then asks 3 questions a game) and 2 rounds (43 minutes on an AVX2-only CPU in
# fp32): does selection keep the asking that pays? See README, "Asking".
ASK_RANKED_MIX_ARGS ?= --name ask-ranked-mix --game matching-ranked --table-size 3 \
	--partner scripted:shy --warm-start scripted:picker:36,scripted:asker:24 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 3 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 2 --games-per-iter 128 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 20 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 48 --micro-batch-size 4 --no-eval-initial

# The same expert iteration on 4x4 tables with 30 actions, where asking pays more than proposing
# until accepted (scripted, against shy on held-out scenarios: inquisitive 0.94, random 0.72;
# on 3x3 0.88 against 0.84), and a warm start with 6 of 30 games asking.
ASK4_ARGS ?= --name ask4 --table-size 4 --partner scripted:shy \
	--warm-start scripted:cooperative:24,scripted:inquisitive:6 --warm-start-partner run \
	--warm-start-lr 2e-4 --warm-start-epochs 3 \
	--algorithm expert-iteration --ei-top-k 2 --ei-min-reward 0.5 --iterations 3 \
	--games-per-iter 48 --games-per-scenario 8 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 30 --lr 1e-4 --epochs-per-iter 2 --updates-per-round 3 --eval-scenarios 48 \
	--micro-batch-size 4

# Expert iteration where asking pays most (scripted, README "Where asking pays": on 4x4 tables with
# 30 actions beside scripted:shy-strict, asker 0.765 against picker 0.621 and random proposing
# 0.682): the ranked table, a warm start on 30 picker and 10 asker games (a quarter asking), then
# 2 rounds of 96 games (24 scenarios x 4), the best of each scenario kept at reward >= 0.9.
# 64 minutes on an AVX2-only CPU in fp32; held-out 0.258 -> 0.116 -> 0.130, questions 0 -> 6 -> 0.
ASK4_STRICT_ARGS ?= --name ask4-strict --game matching-ranked --table-size 4 \
	--partner scripted:shy-strict --warm-start scripted:picker:30,scripted:asker:10 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 2 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 2 --games-per-iter 96 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 30 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 48 --micro-batch-size 4 --no-eval-initial

# The same question on a table that lists what a seat does not know (--game matching-gaps: after
# the ranked known cells, "Not known to you:" and one "Ava Li on GloVe" line per unknown cell, in
# the order scripted:asker asks them), so that a good question is a copy of a line; 3x3 tables
# with 20 actions beside scripted:shy-strict (asker 0.740, picker 0.671, random 0.700), a warm
# start on 36 picker and 12 asker games (a quarter asking), then 2 rounds of expert iteration.
ASK_GAPS_ARGS ?= --name ask-gaps --game matching-gaps --table-size 3 \
	--partner scripted:shy-strict --warm-start scripted:picker:36,scripted:asker:12 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 3 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 2 --games-per-iter 128 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 20 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 48 --micro-batch-size 4 --no-eval-initial

# The same game with asking as the answer to a rejection: scripted:late-asker proposes its own
# picks first and asks about its unknown cells only once that proposal is rejected, then says its
# picks over the answers and proposes them. A warm start on 40 picker and 8 late-asker games puts
# the choice, ask or propose again, after every rejection the model meets (a greedy picker clone
# proposes the rejected assignment again); expert iteration keeps the branch that scores.
ASK_LATE_ARGS ?= --name ask-late --game matching-gaps --table-size 3 \
	--partner scripted:shy-strict --warm-start scripted:picker:40,scripted:late-asker:8 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 3 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 2 --games-per-iter 128 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 20 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 48 --micro-batch-size 4 --no-eval-initial

# ask-late on matching-notes: after each answer the game shows the seat its values merged with
# the answers so far, highest first, so that the picks after asking are read off a list (in
# ask-late the model asked the right cells but merged the answers wrongly: askers scored 0.240).
ASK_NOTES_ARGS ?= --name ask-notes --game matching-notes --table-size 3 \
	--partner scripted:shy-strict --warm-start scripted:picker:40,scripted:late-asker:8 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 3 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 1 --ei-min-reward 0.9 \
	--ei-replay 0 --iterations 2 --games-per-iter 128 --games-per-scenario 4 --temperature 1.0 \
	--max-new-tokens 64 --max-actions 20 --lr 1e-4 --epochs-per-iter 1 --mini-batch-size 8 \
	--eval-scenarios 48 --micro-batch-size 4 --no-eval-initial

# Asking where the proposal is a copy: matching-advice shows each seat the best proposal by what
# it knows (updated after each answer and rejection) and, once it has asked, the cells left to
# ask, so the one choice left to the model is ask or propose (scripted beside shy-strict:
# advised 0.651 never asks, advised-asker 0.741). The warm start clones 34 advised and 14 advised-asker games; expert iteration samples 8 games a
# scenario and keeps those above their scenario's mean reward (>= 0.5): what set a game apart.
ASK_ADVICE_ARGS ?= --name ask-advice --game matching-advice --table-size 3 \
	--partner scripted:shy-strict --warm-start scripted:advised:34,scripted:advised-asker:14 \
	--warm-start-partner run --warm-start-lr 2e-4 --warm-start-epochs 3 \
	--warm-start-mini-batch-size 4 --algorithm expert-iteration --ei-top-k 8 --ei-min-reward 0.5 \
	--ei-above-mean --ei-replay 0 --iterations 2 --games-per-iter 128 --games-per-scenario 8 \
	--temperature 1.0 --max-new-tokens 64 --max-actions 20 --lr 1e-4 --epochs-per-iter 2 \
	--mini-batch-size 8 --eval-scenarios 96 --micro-batch-size 4 --no-eval-initial

# The other two arms of ask-advice at about its wall time, from its warm start (run make
# ask-advice first): GRPO on the model's own games (8 a scenario, the rollout's log-probs as the
# old ones), and guided GRPO, each group of 6 own games joined by 2 of scripted:advised-asker
# (LUFFY's shaped loss; guide rows need the recomputed old log-probs). 64 rows a round both.
ASK_ADVICE_GRPO_ARGS ?= --name ask-advice-grpo --model checkpoints/ask-advice/warm_start \
	--game matching-advice --table-size 3 --partner scripted:shy-strict --iterations 3 \
	--games-per-iter 64 --games-per-scenario 8 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 20 --lr 1e-5 --loss-agg seq-mean-token-mean --updates-per-round 4 \
	--old-log-probs rollout --eval-scenarios 96 --micro-batch-size 4
ASK_ADVICE_GUIDED_ARGS ?= --name ask-advice-guided --model checkpoints/ask-advice/warm_start \
	--game matching-advice --table-size 3 --partner scripted:shy-strict --iterations 4 \
	--games-per-iter 48 --games-per-scenario 6 --guide scripted:advised-asker --guide-games 2 \
	--temperature 1.0 --max-new-tokens 64 --max-actions 20 --lr 1e-5 \
	--loss-agg seq-mean-token-mean --updates-per-round 4 --eval-scenarios 96 --micro-batch-size 4

# The guided-GRPO arm of the same question: a warm start that never asks (24 cooperative games
# against shy), then GRPO rounds whose groups each get 2 games of scripted:inquisitive (it asks)
# on the same scenario, trained off-policy with LUFFY's shaped loss.
ASK_GUIDED_ARGS ?= --name ask-guided --table-size 3 --partner scripted:shy \
	--warm-start scripted:cooperative:24 --warm-start-partner run \
	--warm-start-lr 2e-4 --warm-start-epochs 3 \
	--guide scripted:inquisitive --guide-games 2 --iterations 4 \
	--games-per-iter 48 --games-per-scenario 8 --temperature 1.0 --max-new-tokens 64 \
	--max-actions 20 --lr 1e-5 --loss-agg seq-mean-token-mean --updates-per-round 4 \
	--eval-scenarios 48 --micro-batch-size 4

setup:
	bash scripts/setup.sh

lint: setup
	.venv/bin/ruff check selfplay tests benchmarks
	.venv/bin/ruff format --check selfplay tests benchmarks

test: setup lint
	.venv/bin/pytest -q

demo: setup
	.venv/bin/selfplay iterate $(DEMO_ARGS)

learn: setup
	.venv/bin/selfplay iterate $(LEARN_ARGS)

learn-replay: setup
	.venv/bin/selfplay iterate $(LEARN_REPLAY_ARGS)

learn-explain: setup
	test -f checkpoints/explainer-warm/config.json || \
		.venv/bin/selfplay sft $(LEARN_EXPLAIN_SFT) --out checkpoints/explainer-warm
	.venv/bin/selfplay iterate $(LEARN_EXPLAIN_ARGS)

learn-explain-grpo: setup
	test -f checkpoints/explainer-warm/config.json || \
		.venv/bin/selfplay sft $(LEARN_EXPLAIN_SFT) --out checkpoints/explainer-warm
	.venv/bin/selfplay iterate $(LEARN_EXPLAIN_GRPO_ARGS)

learn-ranked: setup
	test -f checkpoints/explainer-ranked-warm/config.json || \
		.venv/bin/selfplay sft $(LEARN_RANKED_SFT) --out checkpoints/explainer-ranked-warm
	.venv/bin/selfplay iterate $(LEARN_RANKED_ARGS)

learn-grpo: setup
	.venv/bin/selfplay iterate $(LEARN_GRPO_ARGS)

shy: setup
	.venv/bin/selfplay iterate $(SHY_ARGS)

ask: setup
	.venv/bin/selfplay iterate $(ASK_ARGS)

ask-ranked: setup
	.venv/bin/selfplay iterate $(ASK_RANKED_ARGS)

ask-ranked-mix: setup
	.venv/bin/selfplay iterate $(ASK_RANKED_MIX_ARGS)

ask4: setup
	.venv/bin/selfplay iterate $(ASK4_ARGS)

ask4-strict: setup
	.venv/bin/selfplay iterate $(ASK4_STRICT_ARGS)

ask-gaps: setup
	.venv/bin/selfplay iterate $(ASK_GAPS_ARGS)

ask-late: setup
	.venv/bin/selfplay iterate $(ASK_LATE_ARGS)

ask-notes: setup
	.venv/bin/selfplay iterate $(ASK_NOTES_ARGS)

ask-advice: setup
	.venv/bin/selfplay iterate $(ASK_ADVICE_ARGS)

ask-guided: setup
	.venv/bin/selfplay iterate $(ASK_GUIDED_ARGS)

ASK_ADVICE_WARM = checkpoints/ask-advice/warm_start/config.json

ask-advice-grpo: setup
	@test -f $(ASK_ADVICE_WARM) || { echo "run make ask-advice first: $@ starts from its warm start"; exit 1; }
	.venv/bin/selfplay iterate $(ASK_ADVICE_GRPO_ARGS)

ask-advice-guided: setup
	@test -f $(ASK_ADVICE_WARM) || { echo "run make ask-advice first: $@ starts from its warm start"; exit 1; }
	.venv/bin/selfplay iterate $(ASK_ADVICE_GUIDED_ARGS)

bench: setup
	.venv/bin/python benchmarks/bench_scenarios.py
