# make run  - the main job: the Gemma-4 engine on the embedded trained Gemma-4 checkpoint (CPU; the
#             CI size of scripts/train_checkpoints.py, committed), or on the real unsloth/gemma-4-E2B-it
#             where a GPU and the hub are there
# make test - the whole test suite (CPU, float32; GPU-only tests skip without CUDA), on two workers
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: install run test checkpoints clean

$(VENV)/.installed: requirements.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements.txt
	touch $@

install: $(VENV)/.installed

checkpoints: install
	$(PY) scripts/make_tiny_checkpoints.py

run: install
	$(PY) -m scripts.run_main

test: install
	$(PY) -m pytest -q -n 2 --dist loadfile tests

clean:
	rm -rf $(VENV) checkpoints out
