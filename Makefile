PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: run test bench install clean

# The environment: re-made when pyproject.toml changes. torch==2.13.0 is pinned in
# pyproject.toml so pip takes the CPU wheel these machines carry.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job. Until the training pipeline lands it runs the buffer demo with
# synthetic rollouts (it says so when it starts).
run: $(STAMP)
	$(VENV)/bin/asyncgrpo demo runs/demo --force

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/buffer.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis
