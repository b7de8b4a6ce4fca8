PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
BENCH_STAMP := $(VENV)/.installed-bench
BENCH_ARGS ?=

.PHONY: demo test lint typecheck clean bench

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	@touch $(STAMP)

$(BENCH_STAMP): $(STAMP) pyproject.toml
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	@touch $(BENCH_STAMP)

# Full benchmark: umt vs a raw psycopg ceiling, DBOS, pgqueuer and procrastinate (installed by
# the harness into .venv-bench-peers). Results: bench/results/. Quick check: BENCH_ARGS=--quick
bench: $(BENCH_STAMP)
	$(BIN)/python -m bench $(BENCH_ARGS)

demo: $(STAMP)
	$(BIN)/python examples/demo/demo.py

lint: $(STAMP)
	$(BIN)/ruff check umt_sdk umt_backend_memory umt_backend_pg tests examples bench
	$(BIN)/ruff format --check umt_sdk umt_backend_memory umt_backend_pg tests examples bench

typecheck: $(STAMP)
	$(BIN)/mypy

# The suite runs in TEST_WORKERS worker processes (pytest-xdist); the tests that kill, freeze or
# crash processes run one after another in one of them (tests/conftest.py). TEST_WORKERS=0: one
# process.
TEST_WORKERS ?= 4
test: $(STAMP) lint typecheck
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup --durations=20

clean:
	rm -rf $(VENV) .venv-bench-peers .pytest_cache .mypy_cache .ruff_cache
