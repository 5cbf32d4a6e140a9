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
	$(BIN)/mypy pdserve/engine/scheduler.py pdserve/engine/block_manager.py \
		pdserve/engine/reservation.py pdserve/engine/kv_view.py pdserve/engine/engine_stats.py \
		pdserve/engine/request_checks.py pdserve/engine/tp_rank.py pdserve/instance/ \
		pdserve/kv_transfer/ pdserve/router/ pdserve/prefill_worker/ pdserve/decode_worker/

test: lint
	$(BIN)/pytest -q

# the inner loop: no clusters, routers, peer processes nor HF oracles (tests/conftest.py)
test-fast: lint
	$(BIN)/pytest -q -m "not heavy" -n 2 --dist load

bench: setup
	$(BIN)/python -m pdserve.bench.engine
