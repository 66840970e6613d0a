# Two commands: `make demo` runs the main job, `make test` runs the whole suite (on every core, printing the
# 15 slowest tests so that growth shows).
# Each creates .venv first when it is missing.
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: demo test setup bench

$(VENV)/.ready: pyproject.toml scripts/setup.sh scripts/gen_protos.sh $(wildcard protos/deltaspec/v1/*.proto)
	bash scripts/setup.sh
	touch $@

setup: $(VENV)/.ready

demo: $(VENV)/.ready
	$(VENV)/bin/deltaspec demo

# Compiled graphs are cached inside the checkout: a fresh clone compiles from cold, and no graph another checkout's
# code compiled is ever handed to this one.
test: export TORCHINDUCTOR_CACHE_DIR ?= $(CURDIR)/.cache/inductor
test: $(VENV)/.ready
	$(PY) -m pytest -n auto --dist loadgroup --durations=15

bench: $(VENV)/.ready
	$(VENV)/bin/deltaspec bench
