# Two entry points for a fresh machine; each creates .venv and installs what it needs.
#   make generate   offline generation on the repo's tiny model (built on first use)
#   make test       the test suite (what CI runs)
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TINY    := artifacts/tiny

.PHONY: generate test venv

$(VENV)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q -e '.[test]'
	touch $@

venv: $(VENV)/.installed

$(TINY)/config.json: $(VENV)/.installed v41_jax/configs/tiny.config.json
	$(VPY) -m scripts.make_checkpoint --config v41_jax/configs/tiny.config.json --out $(TINY) --seed 0

generate: $(TINY)/config.json
	$(VPY) -m scripts.generate --checkpoint $(TINY) --prompts scripts/example_prompts.jsonl --max-new-tokens 32

test: $(VENV)/.installed
	$(VPY) -m pytest tests
