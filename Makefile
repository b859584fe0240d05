# Two entry points for a fresh machine; each creates .venv and installs what it needs.
#   make generate   offline generation on the shipped demo model (models/demo): text prompts in, text
#                   out; installs the runtime dependencies only
#   make test       the test suite (what CI runs); installs the test extras
# One .venv serves both: .venv/.runtime stamps the runtime install, .venv/.installed the test extras.
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TINY    := artifacts/tiny
DEMO    := models/demo

.PHONY: generate test venv

$(VENV)/.runtime: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e .
	touch $@

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

$(TINY)/config.json: $(VENV)/.installed v41_jax/configs/tiny.config.json
	$(VPY) -m scripts.make_checkpoint --config v41_jax/configs/tiny.config.json --out $(TINY) --seed 0

generate: $(VENV)/.runtime
	$(VPY) -m scripts.generate --checkpoint $(DEMO) --prompts scripts/demo_prompts.jsonl --max-new-tokens 32 --one-bucket

# the suite in two worker processes (pytest-xdist), each test file on one worker so that its module
# fixtures (engines, checkpoints) are built once; most of a test's time is a single-threaded XLA
# compile, so two workers use the CI machine's two cores; tests/conftest.py starts the longest files
# first (measured on a clean clone, 2026-12-04: 19:27 in two, 37 CPU-minutes)
TEST_WORKERS ?= 2

test: $(VENV)/.installed
	$(VPY) -m pytest -n $(TEST_WORKERS) --dist loadfile tests
