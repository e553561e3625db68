# Two entry points on a fresh machine: `make demo` and `make test` (both set themselves up).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   := torch==2.13.0

.PHONY: setup test test-quick demo clean

setup: $(VENV)/.installed

# torch first: a plain `pip install torch` (or a package that needs it) would pull a multi-GB CUDA build.
$(VENV)/.installed: requirements.txt
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -r requirements.txt
	touch $@

test: setup
	$(VPY) -m pytest -q

test-quick: setup
	$(VPY) -m pytest -q -m "not slow"

clean:
	rm -rf runs build
