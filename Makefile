# Two entry points on a fresh machine: `make demo` and `make test` (both set themselves up).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   := torch==2.13.0

.PHONY: setup test test-quick demo clean bench

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

clean:  ## remove build outputs and runs (not the venv)
	rm -rf runs build

# ---- the demo: tokenizer + shards from the embedded corpus, then pretraining on 2 CPU processes (ZeRO-2) ----
DEMO       := build/demo
CORPUS     := data/austen.txt.gz
DEMO_VOCAB := 4096
DEMO_SEQ   := 128

$(DEMO)/tokenizer.model: $(CORPUS) | setup
	$(VPY) tools/train_tokenizer.py --input $(CORPUS) --vocab-size $(DEMO_VOCAB) --out $@

$(DEMO)/shards/manifest.json: $(DEMO)/tokenizer.model
	$(VPY) tools/make_shards.py --input $(CORPUS) --tokenizer $< --out $(DEMO)/shards --seq-len $(DEMO_SEQ) \
	    --samples-per-shard 200 --val-fraction 0.02 --force

demo: setup $(DEMO)/shards/manifest.json
	NPROC=2 launch/pretrain.sh configs/demo-cpu.yaml
	@echo "TensorBoard: $(VPY) -m tensorboard.main --logdir runs/demo/tensorboard"

# ---- benchmarks (tools/bench.py): ratios to `dot`, to GPT-2, across n, loader ÷ training, TP/DP ÷ 1 process, GPU MFU.
# The issue's sizes take ~2 h on 2 CPU cores; `make bench BENCH_ARGS=--quick` is a tiny run. Writes bench/results.*
bench: setup $(DEMO)/shards/manifest.json
	$(VPY) tools/bench.py $(BENCH_ARGS)
