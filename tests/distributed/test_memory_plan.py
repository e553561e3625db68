"""The memory plan (model/memory.py, pretrain/plan/memory.py) against what the real modules and engines hold.

- Activations: for every variant (and activation checkpointing), the bytes the plan says a layer keeps for backward
  equal the bytes autograd saves, counted by torch's saved-tensors hooks during a real forward pass (each storage
  once, parameters left out).
- Whole steps, one launch per layout as benchmarks/bench.py's memory points measure them (a fresh process per
  layout, malloc returning freed memory, live peaks, not the mapped files' pages, whose count is the page cache's
  state: the peaks are the same whatever ran before): a model with dot, random and dense+dot layers whose states
  pass 100 MB, at (tp, pp, dp, ZeRO) ∈ {(1,1,1,0), (2,1,1,1), (1,2,1,1), (1,1,2,2), (1,1,2,3)}; per rank, the
  predicted model-state bytes within 2% of those held in the engine's tensors at rest, and the predicted peak within
  15% of the measured one.
"""
import os

import pytest
import torch

from model import ModelConfig, build_model, variants
from model.memory import activations
from tests.support.runs import PY, ROOT, run_py

SIZES = [(2, 64, 64, 4, 512), (3, 96, 96, 4, 1024)]   # (B, n, d, H, V)


def saved_bytes(model, tokens, targets) -> int:
    """Bytes autograd keeps for backward in one forward pass: every saved tensor's storage once, no parameter."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(tokens, targets)
    return sum(seen.values())


@pytest.mark.parametrize("documents", [False, True], ids=["windows", "documents"])
@pytest.mark.parametrize("label", variants.subset("all"))
def test_activation_terms_equal_the_tensors_autograd_saves(label, documents):
    """Also under model.document_mask (model/memory.py document_attention_terms), with three documents a window."""
    for B, n, d, H, V in SIZES:
        cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=1, n_heads=H, max_seq_len=n, document_mask=documents,
                          eos_id=3, **variants.model_fields(label))
        torch.manual_seed(0)
        tokens, targets = torch.randint(V, (2, B, n))
        tokens[:, [10, 40]] = 3
        measured = saved_bytes(build_model(cfg), tokens, targets)
        predicted = activations(cfg, B, n).total
        assert predicted == pytest.approx(measured, rel=0.01), (label, B, n)


@pytest.mark.parametrize("kernel", ["sdpa", "triton"])
def test_the_flagship_s_attention_on_the_gpu_path_keeps_what_the_plan_says(kernel, monkeypatch):
    """dense+dot at d_h 128, where its q·k features (128 + 128) fill SDPA's 256 beside dense's key bias, on the GPU
    path (CPU tensors; the Triton kernel under TRITON_INTERPRET=1): the plan's bytes equal those autograd saves for
    the SDPA form (q, k, [e ⊙ v, e] and the output at 256, v, the quotient's output) and for the key-bias kernel
    (q at 256; dot's keys, v and the output at 128; W_2's keys a view), which keeps 5 × B·Hl·n·128 fewer."""
    monkeypatch.setenv("SYNTHFORMER_KERNELS", "gpu")
    monkeypatch.setenv("SYNTHFORMER_KEY_BIAS_KERNEL", kernel)
    B, n, d, H, V = 2, 32, 256, 2, 64
    cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=1, n_heads=H, max_seq_len=n, mixer="dense+dot")
    torch.manual_seed(0)
    tokens, targets = torch.randint(V, (2, B, n))
    measured, plan = saved_bytes(build_model(cfg), tokens, targets), activations(cfg, B, n, gpu=True)
    assert plan.total == pytest.approx(measured, rel=0.001), (measured, plan)
    if kernel == "triton":
        monkeypatch.setenv("SYNTHFORMER_KEY_BIAS_KERNEL", "sdpa")
        assert activations(cfg, B, n, gpu=True).total - plan.total == 5 * 4 * B * H * n * 128   # fp32


def test_checkpointed_layers_keep_their_input_only():
    from pretrain.engine import checkpoint_activations

    B, n, d, H, V = SIZES[1]
    cfg = ModelConfig(vocab_size=V, d_model=d, n_layers=4, n_heads=H, max_seq_len=n, mixer="dense+dot")
    tokens, targets = torch.randint(V, (2, B, n))
    plain, every2 = build_model(cfg), build_model(cfg)
    checkpoint_activations(every2, 2)
    full, ck = activations(cfg, B, n), activations(cfg, B, n, checkpoint_every=2)
    assert full.total == pytest.approx(saved_bytes(plain, tokens, targets), rel=0.01)
    assert ck.total == pytest.approx(saved_bytes(every2, tokens, targets), rel=0.01)
    assert ck.total < full.total


# ---- whole steps, one launch per layout ------------------------------------------------------------------------
MODEL = ["model.vocab_size=65536", "model.d_model=128", "model.n_heads=4", "model.max_seq_len=128",
         "model.n_layers=6", "model.mixer=[dot,random,dense+dot,dot,random,dense+dot]", "train.micro_batch_size=2"]
LAYOUTS = [(1, 1, 1, 0), (2, 1, 1, 1), (1, 2, 1, 1), (1, 1, 2, 2), (1, 1, 2, 3)]
STATE_TOLERANCE, PEAK_TOLERANCE = 0.02, 0.15


def layout_overrides(tp, pp, dp, zero):
    micro_batches = 2 if pp > 1 else 1   # a pipeline step of 2 micro-batches: 1F1B with a batch in flight
    return MODEL + [f"parallel.tp={tp}", f"parallel.pp={pp}", f"parallel.zero_stage={zero}",
                    f"train.global_batch_size={2 * dp * micro_batches}"]


@pytest.mark.slow
def test_plan_against_launches_of_five_layouts():
    from benchmarks.bench import run_point
    from benchmarks.bench_points import CPU, LIVE_MEMORY, LIVE_MEMORY_ENV
    from pretrain.config import load_config
    from pretrain.config.deepspeed_dict import deepspeed_config
    from pretrain.plan.memory import Layout, plan

    config, rows, failures = os.path.join(ROOT, "configs", "demo-cpu.yaml"), [], []
    for tp, pp, dp, zero in LAYOUTS:
        overrides = layout_overrides(tp, pp, dp, zero)
        spec = dict(kind="train", config=config, overrides=overrides + LIVE_MEMORY, world=tp * pp * dp,
                    env={**LIVE_MEMORY_ENV, **CPU, "OMP_NUM_THREADS": "1"}, warmup=1, reps=1, steps=1, threads=1,
                    compile=False)
        result = run_point(spec, 600)
        assert "error" not in result, result
        cfg, lay = load_config(config, overrides), Layout(tp, pp, dp, zero)
        ds = deepspeed_config(cfg, dp)
        on_cpu, on_gpu = plan(cfg, lay, device="cpu", ds=ds), plan(cfg, lay, device="cuda", ds=ds)
        for measured in result.get("by_rank", [result]):
            stage = measured["rank"] // (tp * dp)   # megatron's rank order: tp fastest, then dp, then pp
            engine = on_gpu.stages[stage].engine_bytes / 2**20   # the buffers DeepSpeed allocates whole, as on a GPU
            peak, got_peak = on_cpu.stages[stage].peak / 2**20, max(measured["total_mb"])
            rows.append(f"{(tp, pp, dp, zero)} rank {measured['rank']}: engine tensors {measured['tensors_at_rest_mb']:.1f}"
                        f" MiB, predicted {engine:.1f} ({engine / measured['tensors_at_rest_mb'] - 1:+.1%}); peak "
                        f"{got_peak:.1f} MiB, predicted {peak:.1f} ({peak / got_peak - 1:+.1%})")
            if abs(engine / measured["tensors_at_rest_mb"] - 1) > STATE_TOLERANCE or \
                    abs(peak / got_peak - 1) > PEAK_TOLERANCE:
                failures.append(rows[-1])
    print("\n".join(rows))
    assert not failures, "\n".join(failures)


def test_a_point_s_cpu_memory_leaves_out_the_pages_of_mapped_files(tmp_path):
    """The launches' CPU peaks (benchmarks/bench_lib.py Memory) count anonymous and shared memory, not the pages of
    mapped files: the libraries' code, of which a process maps more or fewer for the same step as the page cache holds
    the files, i.e. as other processes read them before (bench_memory.cpu_memory_mb; a full run's earlier tests). 64 MiB
    of a file's pages mapped after the baseline count nothing; 64 MiB of tensors count whole."""
    import mmap

    from benchmarks.bench_memory import Memory

    def rss_file_mb():
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("RssFile:")) / 1024

    size = 64 * 2**20
    path = tmp_path / "pages"
    path.write_bytes(b"\1" * size)   # now in the page cache
    mem = Memory(torch.device("cpu"))
    mem.reset_peak()
    before = rss_file_mb()
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as pages:
        assert sum(pages[i] for i in range(0, size, 4096)) == size // 4096   # every page mapped into this process
        assert rss_file_mb() - before > 48
        mem.phase("file pages")
        assert mem.peak() - mem.after_init < 16 and mem.now() - mem.after_init < 16, (mem.peak(), mem.after_init)
    tensor = torch.ones(size // 4)
    mem.phase("a tensor")
    assert mem.phases["a tensor"] - mem.after_init > 56 and mem.now() - mem.after_init > 56
    del tensor


def test_model_states_pass_100_mb():
    from pretrain.config import load_config
    from pretrain.plan.memory import Layout, plan

    cfg = load_config(os.path.join(ROOT, "configs", "demo-cpu.yaml"), layout_overrides(1, 1, 1, 0))
    assert plan(cfg, Layout(1, 1, 1, 0)).stages[0].states_bytes > 100e6


def memory_cli(*args):
    return run_py([PY, "-m", "pretrain.config", *args], env={**os.environ, "PYTHONPATH": ROOT})


def test_memory_cli_says_what_fits_and_errors_are_one_line():
    big = os.path.join(ROOT, "configs", "synth-1.3b.yaml")
    r = memory_cli(big, "--world-size", "64", "--memory", "--gpu-memory", "80GiB")
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert out.startswith("memory plan per rank: tp 2 × pp 1 × dp 32, ZeRO-1, micro-batch 4 × n 2048, bf16")
    for words in ("model states", "AdamW moments", "DeepSpeed buffers", "activations", "one dense+dot layer",
                  "concatenated q·k features", "dense: hidden features", "fused loss", "peak", "fits with ",
                  "GiB to spare: the peak ", "; largest micro-batch that fits:", "layouts of 64 ranks that fit", "tp 8  pp 1  dp 8  ZeRO-3",
                  "with parallel.activation_checkpointing=1"):
        assert words in out, words
    tight = memory_cli(big, "parallel.tp=1", "parallel.zero_stage=0", "--world-size", "64", "--memory",
                       "--gpu-memory", "20GiB")
    assert "per GPU: does not fit: " in tight.stdout and tight.returncode == 0
    random = memory_cli(big, "model.mixer=random", "--world-size", "64", "--memory")
    assert "softmax of the map, Hl·n² = 8·2048²" in random.stdout      # random's H·n² maps, per TP rank
    bad = memory_cli(big, "--world-size", "64", "--memory", "--gpu-memory", "lots")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "--gpu-memory='lots' is not a size" in bad.stderr
