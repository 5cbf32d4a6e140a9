VENV := .venv
BIN := $(VENV)/bin

.PHONY: setup run test test-fast lint bench

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml setup.py scripts/setup.sh router/pdserve.proto kv_transfer/kv_transfer.proto
	bash scripts/setup.sh
	touch $@

run: setup
	$(BIN)/pdserve up configs/local-disagg.yaml --demo "What is the capital of France?"

lint: setup
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy engine/scheduler.py engine/block_manager.py engine/reservation.py \
		engine/kv_view.py engine/engine_stats.py engine/request_checks.py engine/tp_rank.py \
		instance/ kv_transfer/ router/ prefill_worker/ decode_worker/

test: lint
	$(BIN)/pytest -q

# the inner loop: no clusters, routers, peer processes nor HF oracles (tests/conftest.py)
test-fast: lint
	$(BIN)/pytest -q -m "not heavy" -n 2 --dist load

bench: setup
	$(BIN)/python -m bench.engine
