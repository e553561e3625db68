# Two entry points on a fresh machine: `make demo` and `make test` (both set themselves up).
PY      ?= python3
VENV    := .venv
VPY     := $(VENV)/bin/python
TORCH   := torch==2.13.0

.PHONY: setup test test-quick demo clean bench gpu-check gpu-bench gpu-window gpu-shards gpu-queue wheelhouse rehearsal

setup: $(VENV)/.installed

# torch first: a plain `pip install torch` (or a package that needs it) would pull a multi-GB CUDA build.
# WHEELS=DIR: from a folder of wheels only (`make wheelhouse`), for a node without package access; the venv sees the
# system's packages, so a node's own torch serves where the folder holds none.
WHEELS ?=
$(VENV)/.installed: requirements.txt pyproject.toml
ifeq ($(WHEELS),)
	$(PY) -m venv $(VENV)
	$(VPY) -m pip install -q $(TORCH)
	$(VPY) -m pip install -q -r requirements.txt
else
	$(PY) -m venv --system-site-packages $(VENV)
	$(VPY) -m pip install -q --no-index --find-links $(WHEELS) setuptools wheel -r requirements.txt
endif
	$(VPY) -m pip install -q --no-index --no-build-isolation --no-deps -e .   # the project itself: tools/ import it
	# DeepSpeed JIT-builds its CPU shared-memory op in the first run of each venv (~40 s): build it now, once
	$(VPY) -c "from deepspeed.accelerator import get_accelerator as a; b = a().create_op_builder('ShareMemCommBuilder'); b and b.load()"
	touch $@

# A folder of wheels to carry to a node without package access (tools/wheelhouse.py): requirements.txt, all it pulls
# in, and the project; torch and its CUDA wheels left out unless WITH_TORCH=1 (GPU nodes have their own).
WHEELHOUSE ?= wheels
wheelhouse: setup
	$(VPY) tools/wheelhouse.py --out $(WHEELHOUSE) $(if $(WITH_TORCH),--with-torch)

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

DEMO_TOKENIZER := tools/train_tokenizer.py --input $(CORPUS) --vocab-size $(DEMO_VOCAB) --out $(DEMO)/tokenizer.model
DEMO_SHARDS    := tools/make_shards.py --input $(CORPUS) --tokenizer $(DEMO)/tokenizer.model --out $(DEMO)/shards \
                  --seq-len $(DEMO_SEQ) --samples-per-shard 200 --val-fraction 0.02 --force

$(DEMO)/tokenizer.model: $(CORPUS) | setup
	$(VPY) $(DEMO_TOKENIZER)

$(DEMO)/shards/manifest.json: $(DEMO)/tokenizer.model
	$(VPY) $(DEMO_SHARDS)

demo: setup $(DEMO)/shards/manifest.json
	NPROC=2 launch/pretrain.sh configs/demo-cpu.yaml
	@echo "TensorBoard: $(VPY) -m tensorboard.main --logdir runs/demo/tensorboard"

# ---- a cluster in miniature on this machine (not in CI): 8 gloo ranks as 2 nodes of 4, a kill -9, a hang, the same
# hang twice, a preemption, an error on one rank, an outage of the shard server, a data error, a slow node moved off
# (fleet.exclude: a relayout from 4 ranks to 2); each claim PASS or FAIL, the time and the peak memory (tools/rehearsal.py)
rehearsal: setup
	$(VPY) tools/rehearsal.py

# ---- benchmarks (benchmarks/bench.py): ratios to `dot`, to GPT-2, across n, loader ÷ training, TP/DP ÷ 1 process, GPU MFU.
# The issue's sizes take ~2 h on 2 CPU cores; `make bench BENCH_ARGS=--quick` is a tiny run. Writes bench/results.*
bench: setup $(DEMO)/shards/manifest.json
	$(VPY) benchmarks/bench.py $(BENCH_ARGS)

# ---- on a GPU node: the demo in bf16 on the GPU(s), resumed and converted, the GPU tests, and the engine and MFU points
# of the benchmark. The Python: the venv of `make setup` if there is one, else $(PY) with the packages installed
# (a node without package access: docs/gpu/README.md). Everything it writes goes under runs/gpu-check.
GPY   ?= $(if $(wildcard $(VPY)),$(VPY),$(PY))
CHECK := runs/gpu-check
gpu-check: export PYTHONPATH := $(CURDIR)
gpu-check:
	@$(GPY) -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu-check: no CUDA device')"
	rm -rf $(CHECK)
	test -f $(DEMO)/shards/manifest.json || { $(GPY) $(DEMO_TOKENIZER) && $(GPY) $(DEMO_SHARDS); }
	PYTHON=$(GPY) launch/pretrain.sh configs/demo-cpu.yaml train.precision=bf16 train.run_dir=$(CHECK)/demo \
	    train.stop_after_steps=200
	PYTHON=$(GPY) launch/pretrain.sh configs/demo-cpu.yaml train.precision=bf16 train.run_dir=$(CHECK)/demo
	$(GPY) tools/convert.py to-release $(CHECK)/demo $(CHECK)/release
	# the flight recorder where the hang watchdog lands it: the rank made to stall at step 3 exits 3 (hence the -)
	-PYTHON=$(GPY) SYNTHFORMER_FAULTS=stall@3@0 launch/pretrain.sh configs/demo-cpu.yaml train.precision=bf16 \
	    train.run_dir=$(CHECK)/stall train.hang_timeout=20 train.max_steps=10
	$(GPY) -c "import pickle; d = pickle.load(open('$(CHECK)/stall/hang/flight_recorder/rank_0', 'rb')); \
	    print('flight recorder:', len(d['entries']), 'entries;', d['pg_status'])"
	$(GPY) -m pytest -q -o addopts=-ra tests/distributed/test_gpu.py tests/distributed/test_gpu_kernels.py
	$(GPY) benchmarks/bench.py --only engine,gpu --out $(CHECK)/bench

# ---- the GPU measurement queue (benchmarks/gpu_queue.py): 0 compiled = eager (benchmarks/compile_check.py), 1 the
# binding MFU points, 2 engine ÷ plain loop, 3 accumulation 8 (the MFU goals), 4 the variants ÷ dot, 5 memory at n 4096
# ÷ 1024, 6 `make gpu-check`, 7 the convergence check of master weights (demo shards), 8 FP8 (torchao). A part
# measures only its points that do not stand, each appended with its census entry as it finishes (a part cut short
# keeps them). `make gpu-window`: one command a window, the next parts that fit before DEADLINE_S (seconds); with
# DRY_RUN=1, on a CPU before the window, the plan with each point's estimated seconds and the stamp the GPU machine
# reads. `make gpu-queue`: which parts' figures stand. Outputs under docs/gpu/<date>-<commit>-<device>/ (GPU_DIR
# elsewhere).
PART       ?= 1
DEADLINE_S ?= 480
GPU_DIR    ?=
gpu-bench: export PYTHONPATH := $(CURDIR)
gpu-bench:
	$(GPY) benchmarks/bench.py --gpu-part $(PART) --timeout 300$(if $(GPU_DIR), --out $(GPU_DIR)/part$(PART))

gpu-window: export PYTHONPATH := $(CURDIR)
gpu-window:
	$(GPY) benchmarks/gpu_window.py --deadline-s $(DEADLINE_S)$(if $(DRY_RUN), --dry-run)$(if $(GPU_DIR), --out $(GPU_DIR))

gpu-shards:   # the demo shards on a GPU node (parts 7 and 8): no venv needed
	test -f $(DEMO)/shards/manifest.json || { $(GPY) $(DEMO_TOKENIZER) && $(GPY) $(DEMO_SHARDS); }

gpu-queue: export PYTHONPATH := $(CURDIR)
gpu-queue:
	$(GPY) benchmarks/bench.py --gpu-queue
