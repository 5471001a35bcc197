# The two commands. Each does its own set-up first (scripts/setup_env.sh): installs what is missing,
# builds the extension in place when its sources changed, and uses the torch that is already there.
PYTHON ?= python3
BENCH_ARGS ?=
TEST_ARGS ?=

.PHONY: bench test setup
setup:
	PYTHON=$(PYTHON) EXTRA_MODULES="matplotlib:matplotlib tqdm:tqdm" bash scripts/setup_env.sh

bench: setup
	$(PYTHON) -m benchmarks $(BENCH_ARGS)

test:
	PYTHON=$(PYTHON) bash scripts/setup_env.sh
	$(PYTHON) -m pytest $(TEST_ARGS)
