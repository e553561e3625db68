"""What benchmarks/bench.py measures: its parts' points (one measuring process each) and the entries read off them, with
their goals. The parts and their goals are described in benchmarks/bench.py's docstring."""
from __future__ import annotations

import json
import os

from model import variants
from tools.variant_configs import file_name

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PARTS = ("throughput", "peer", "memory", "data", "parallel", "layouts", "engine", "documents", "gpu-binding", "gpu",
         "gpu-accum", "gpu-variants", "gpu-memory", "convergence", "fp8")
DEMO, BIG, SHARDS = "configs/demo-cpu.yaml", "configs/synth-1.3b.yaml", "build/demo/shards"
PRESETS = {   # the sizes, and tiny ones for tests
    "default": dict(d_model=512, layers=8, heads=8, seq_len=1024, lengths="1024,2048,4096", batch=4, vocab=4096,
                    reps=3, steps=3, warmup=2, data_batches=100),
    "quick": dict(d_model=64, layers=2, heads=4, seq_len=64, lengths="64,128,256", batch=2, vocab=512,
                  reps=2, steps=2, warmup=1, data_batches=20, threads=1),
}
# Memory at 4 × the first n ÷ at the first: the goals of the memory part and of benchmarks/bench_mixer.py
GOAL_MEM = {"dot": 3, "dense": 3, "factorized_random": 3, "dense+dot": 3, "random": 5, "random+dot": 5}
QUICK_BIG = ["model.n_layers=2", "model.max_seq_len=512", "train.micro_batch_size=1"]   # gpu part under --quick
FLOP_SLACK, GOAL_PEER, GOAL_DATA, GOAL_TP = 0.9, {"dot": 1.0, "random": 1.15}, 20.0, 1.3
READER, STARTUP_SHARDS = {"shards": 600, "batches": 5}, 100_000   # the data part's reader and start-up points
GOAL_ENGINE = 1.05   # engine step ÷ plain-loop step
# MFU goals of synth-1.3b under the engine, 1 GPU, at gradient accumulation ACCUM (the per-GPU work of an 8-GPU ZeRO-1
# step without its communication: AdamW paid once per 8 micro-batches), by device; accumulation 1 is reported beside
# them, without a goal (the goals were at accumulation 1 before, the flagship's at 40%).
ACCUM = 8
GOAL_MFU = {"dot": {"H100": 0.55, "H200": 0.58}, "dense+dot": {"H100": 0.45, "H200": 0.48}}
# On a GPU (the GPU-kernels issue): every variant's whole-model throughput ÷ dot's, at d 2048, 16 heads, 8 layers,
# n 2048, batch 4, vocabulary 32000, bf16, in the plain loop and under the engine; memory at n 4096 ÷ 1024 (d 1024,
# 4 layers); the MFU of the flagship synth-1.3b (dense+dot) under the engine.
GPU_THROUGHPUT = dict(d=2048, layers=8, heads=16, n=2048, batch=4, vocab=32000, precision="bf16")
GPU_THROUGHPUT_QUICK = dict(d=256, layers=2, heads=4, n=256, batch=2, vocab=4096, precision="bf16")
GPU_GOALS = {"dense": 1.0, "random": 1.10, "random_fixed": 1.10, "factorized_random": 1.05,
             "factorized_dense": 0.95, "sgu": 1.0, "gmlp": 1.3, "random+dot": 0.90, "dense+dot": 0.80}
GPU_MEMORY = dict(d=1024, layers=4, heads=16, batch=4, vocab=32000, precision="bf16")
GPU_GOAL_MEM = {"dot": 3, "dense": 3, "factorized_random": 3, "dense+dot": 3, "factorized_dense": 3, "random": 5,
                "random+dot": 5}
LOSS_SLACK = 0.01   # a bf16-master run's loss over the bench steps within 1% of the fp32-master run's
AUTOCAST = ["parallel.zero_stage=0", "train.autocast=true"]   # fp32 weights, bf16 through torch.autocast
# Memory points measure live tensors, as CUDA's allocator counters do: on the CPU malloc returns freed blocks instead
# of keeping them resident with what the heap fragments (the trainer's faster default), and a fixed mmap threshold
# (glibc's own would rise up to 32 MB) serves every block over 64 kB from its own pages, returned when freed.
LIVE_MEMORY = ["parallel.cpu_keep_freed_memory=false"]
LIVE_MEMORY_ENV = {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"}
CPU = {"DS_ACCELERATOR": "cpu", "CUDA_VISIBLE_DEVICES": ""}   # the demo's runs and gloo TP/DP stay on the CPU
BYTES_PER_PARAM = 20   # fp32 ZeRO-1, 1 process: weight 4 + fp32 partition copy 4 + Adam 8 + gradient 4
# The documents part: model.document_mask on random tokens with an eos at each position with probability 1/95, the
# demo corpus's mean document length with its eos (tools/document_lengths.py build/demo/shards: 95.3)
DOCUMENT_LENGTH, EOS = 95, 2
DOCUMENTS = ["model.document_mask=true", f"model.eos_id={EOS}"]
# The layouts part: the demo model (configs/demo-cpu.yaml, global batch 16) at 2 gloo ranks, each layout a step time the
# time model must order (pretrain/plan/calibration.yaml keeps them; tests/unit/test_time_model.py checks the order).
LAYOUTS = {
    "dp2-zero2-micro8": ["parallel.zero_stage=2", "train.micro_batch_size=8"],   # the demo as configured
    "dp2-zero2-micro8-ckpt": ["parallel.zero_stage=2", "train.micro_batch_size=8",
                              "parallel.activation_checkpointing=1"],              # the forward again
    "dp2-zero1-micro1": ["parallel.zero_stage=1", "train.micro_batch_size=1"],   # 8 micro-batches a step
    "tp2-micro8": ["parallel.tp=2", "parallel.zero_stage=1", "train.micro_batch_size=8"],
    "pp2-micro8": ["parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch_size=8"],   # 2 micro-batches: bubble
    "pp2-micro16": ["parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch_size=16"],  # 1: the stages in turn
    "pp2-micro16-ckpt": ["parallel.pp=2", "parallel.zero_stage=1", "train.micro_batch_size=16",
                         "parallel.activation_checkpointing=1"],
}


def variant_configs() -> dict[str, str]:
    """{variant label: config path} of the study (model/variants.py; configs/variants/), `dot` first; the label is the
    mixer name (gMLP: 'gmlp')."""
    study = sorted(variants.subset("study"), key=lambda v: v != "dot")
    return {v: os.path.join("configs", "variants", file_name(v)) for v in study}


def shape(a, n: int, layers: int) -> list[str]:
    """Overrides that turn a variant config into the benchmark's model, one micro-batch per 1-process ZeRO-1 step."""
    return sized(a.d_model, layers, a.heads, n, a.batch, a.vocab, a.precision)


def sized(d: int, layers: int, heads: int, n: int, batch: int, vocab: int, precision: str) -> list[str]:
    return [f"model.vocab_size={vocab}", f"model.d_model={d}", f"model.n_layers={layers}", f"model.n_heads={heads}",
            f"model.max_seq_len={n}", f"train.micro_batch_size={batch}", f"train.global_batch_size={batch}",
            "parallel.zero_stage=1", "parallel.tp=1", f"train.precision={precision}"]


class Plan:
    """The points to measure (deduplicated: one process each) and the entries read off them."""

    def __init__(self, a):
        self.a, self.points, self.entries = a, {}, []
        self.reference = None   # the point every `paired` point alternates its repetitions with (our dot)

    def point(self, kind: str, config: str, overrides=(), world: int = 1, env=None, **extra) -> str:
        a = self.a
        spec = dict(kind=kind, config=config, overrides=list(overrides), world=world, env=env or {},
                    warmup=a.warmup, reps=a.reps, steps=a.steps, threads=a.threads, compile=False)
        spec.update(extra)
        key = json.dumps(spec, sort_keys=True)
        self.points.setdefault(key, spec)
        return key

    def entry(self, id: str, name: str, variant: str, point: str | None, field: str, unit: str, ratio_to=None,
              **extra) -> dict:
        e = dict(id=id, name=name, variant=variant, point=point, field=field, unit=unit, ratio_to=ratio_to, **extra)
        self.entries.append(e)
        return e


def fitting_layers(a, config: str) -> tuple[int, str | None]:
    """The most layers (≤ --layers) whose training state at the longest n fits in --mem-budget-gb: parameters ×
    BYTES_PER_PARAM (frozen ones × 4) plus a rough activation estimate, 4 bytes × (16·B·n·d + H·n²) a layer and
    3·B·n·V for the logits (about 2× what `dot` was measured to take at d=512, n=4096 on CPU: a safe side)."""
    from model.accounting import model_stats
    from pretrain.config import load_config

    n = max(a.lengths)

    def state_bytes(layers):
        total = model_stats(load_config(config, shape(a, n, layers)).model)["total"]
        trainable, frozen = total["trainable"], total["frozen"]
        act = 4 * (layers * (16 * a.batch * n * a.d_model + a.heads * n * n) + 3 * a.batch * n * a.vocab)
        return BYTES_PER_PARAM * trainable + 4 * frozen + act

    one, two = state_bytes(1), state_bytes(2)
    budget = a.mem_budget_gb * 2**30
    layers = min(a.layers, int((budget - one) // (two - one)) + 1) if budget >= one else 0
    if layers == a.layers:
        return layers, None
    return layers, (f"{layers} of {a.layers} layers: the {a.layers}-layer model at n={n} needs ≈ "
                    f"{(one + (a.layers - 1) * (two - one)) / 2**30:.1f} GB > --mem-budget-gb={a.mem_budget_gb:g}")


def plan(a) -> Plan:
    p, V = Plan(a), a.variant_paths

    def ours(v):   # the throughput point of variant v, shared by the throughput and peer parts
        return p.point("train", a.all_variants[v], shape(a, a.seq_len, a.layers), paired=True)

    if "throughput" in a.only or "peer" in a.only or "documents" in a.only:
        p.reference = ours("dot")

    if "throughput" in a.only:
        for v in V:
            p.entry(f"throughput:{v}", "throughput", v, ours(v), "rate", "tokens/s",
                    None if v == "dot" else "throughput:dot", n=a.seq_len, layers=a.layers)
    if "peer" in a.only:
        gpt2 = p.point("peer", a.all_variants["dot"], shape(a, a.seq_len, a.layers), paired=True)
        p.entry("peer:gpt2", "peer", "gpt2-sdpa", gpt2, "rate", "tokens/s", n=a.seq_len, layers=a.layers)
        for v, goal in GOAL_PEER.items():
            p.entry(f"peer:{v}", "peer", v, ours(v), "rate", "tokens/s", "peer:gpt2", goal_min=goal, n=a.seq_len)
    if "memory" in a.only:   # one step per repetition: its peak is the figure; GPT-2 as a reference, no goal
        first = a.lengths[0]
        for v, (kind, config) in [*((v, ("train", c)) for v, c in V.items()), ("gpt2-sdpa", ("peer", V["dot"]))]:
            layers, note = fitting_layers(a, config)
            for n in a.lengths:
                ok = layers > 0
                point = p.point(kind, config, shape(a, n, layers) + LIVE_MEMORY, env=LIVE_MEMORY_ENV,
                                steps=1) if ok else None
                p.entry(f"memory:{v}:n={n}", "memory", v, point,
                        "total_mb", "MB", None if n == first else f"memory:{v}:n={first}", n=n, layers=layers,
                        goal_max=GOAL_MEM.get(v) if n == 4 * first else None, note=note if n == first else None,
                        skipped=None if ok else note)
    if "data" in a.only:
        have = os.path.exists(os.path.join(ROOT, SHARDS, "manifest.json"))
        why = None if have else f"no shards in {SHARDS}: build them with `make {SHARDS}/manifest.json` (or make demo)"
        # 10 warm-up batches: the workers' start and the DataLoader's prefetch queue (2 per worker) are not timed
        loader = p.point("data", DEMO, shard_dir=SHARDS, batch=8, workers=2, steps=a.data_batches,
                         warmup=max(a.warmup, 10)) if have else None
        p.entry("data:loader", "data", "TokenStream (2 workers)", loader, "rate", "tokens/s", "data:demo-train",
                goal_min=GOAL_DATA, skipped=why)
        # the same shards streamed over a real socket (tools/serve_shards.py on 127.0.0.1), no local cache
        http = p.point("data", DEMO, shard_dir=SHARDS, batch=8, workers=2, steps=a.data_batches,
                       warmup=max(a.warmup, 10), http=True) if have else None
        p.entry("data:loader-http", "data", "TokenStream over HTTP (2 workers)", http, "rate", "tokens/s",
                "data:demo-train", goal_min=GOAL_DATA, skipped=why,
                note="shards served by tools/serve_shards.py on 127.0.0.1; every shard fetched, none cached")
        # three sources blended 0.5 / 0.3 / 0.2 (data.sources), each served by its own tools/serve_shards.py
        blend = p.point("data", DEMO, shard_dir=SHARDS, batch=8, workers=2, steps=a.data_batches,
                        warmup=max(a.warmup, 10), http=True, blend=True) if have else None
        p.entry("data:loader-blend", "data", "TokenStream, 3 blended HTTP sources (2 workers)", blend, "rate",
                "tokens/s", "data:demo-train", goal_min=GOAL_DATA, skipped=why,
                note="data.sources 0.5/0.3/0.2, each the demo shards behind its own tools/serve_shards.py on "
                     "127.0.0.1; none cached")
        p.entry("data:demo-train", "data", "demo-cpu train step", p.point("train", DEMO, [], env=CPU), "rate",
                "tokens/s", note="configs/demo-cpu.yaml (ZeRO-2, fp32, global batch 16) in 1 process on the CPU")
        # the content hash's cost: the loader with data.verify=size (no hashing) beside the default (hash)
        size_only = p.point("data", DEMO, shard_dir=SHARDS, batch=8, workers=2, steps=a.data_batches,
                            warmup=max(a.warmup, 10), verify="size") if have else None
        p.entry("data:loader-nohash", "data", "TokenStream, data.verify=size (2 workers)", size_only, "rate",
                "tokens/s", "data:demo-train", goal_min=GOAL_DATA, skipped=why)
        p.entry("data:hash-cost", "data", "TokenStream verify=hash ÷ verify=size", loader, "rate", "tokens/s",
                "data:loader-nohash", skipped=why, note="the loader's rate with each shard's xxh3_128 checked ÷ "
                "without (1.0: hashing costs nothing measurable)")
        # a rank's reader at cluster scale: one rank, three sources, the default order at global batch 1024 (C = 64)
        reader = p.point("reader", DEMO, global_batch=1024, shards=READER["shards"], per_shard=200, seq_len=128,
                         fetch_threads=8, batches=READER["batches"])
        p.entry("data:reader-memory", "data", "reader memory, 1 rank, 3 sources, G 1024", reader, "rss_mb", "MB",
                note="resident memory of the reading process above it at rest, peak while it reads the first "
                     f"{READER['batches']} global batches (demo-sized shards: 200 samples of 128 tokens, 52 kB); "
                     "three local sources blended 0.5/0.3/0.2, data.fetch_threads 8")
        p.entry("data:reader-shards", "data", "shards in memory at once, same reader", reader, "held_shards",
                "shards", note="the most shards being fetched at once (the only ones in memory): at most "
                               "data.fetch_threads (8)")
        # the start of a run from 100,000 shards behind HTTP: the trainer's seconds to its first step
        start = p.point("startup", DEMO, shards=STARTUP_SHARDS,
                        tokenizer=os.path.join(SHARDS, "tokenizer.model")) if have else None
        p.entry("data:first-step-100k", "data", "seconds to the first step, 100,000 shards over HTTP", start,
                "seconds", "s", skipped=why, note="configs/demo-cpu.yaml on 1 rank from a synthetic server of "
                f"{STARTUP_SHARDS:,} shards on 127.0.0.1 (the manifest ~16 MB; no request per shard before it is "
                "read); the requests it answered are in the JSON")
        # tools/make_shards.py's throughput with 1 and 2 encoding processes of one thread each (--threads 1)
        corpus_text = os.path.join(ROOT, "data", "austen.txt.gz")
        tok = os.path.join(ROOT, SHARDS, "tokenizer.model")
        writes = {w: p.point("shards", DEMO, input=corpus_text, tokenizer=tok, seq_len=128, workers=w,
                             batch_chars=1 << 18) if have else None for w in (1, 2)}
        p.entry("data:make-shards-1w", "data", "make_shards --workers 1 --threads 1", writes[1], "rate", "MB/s",
                skipped=why, note="data/austen.txt.gz (4 MB) with the demo's tokenizer, n 128")
        p.entry("data:make-shards-2w", "data", "make_shards --workers 2 --threads 1", writes[2], "rate", "MB/s",
                "data:make-shards-1w", skipped=why)
    if "parallel" in a.only:   # the throughput part's dot model and global batch, split over 2 gloo processes
        model = shape(a, a.seq_len, a.layers)
        one = p.point("train", a.all_variants["dot"], model, env=CPU)
        p.entry("parallel:1proc", "parallel", "1 process", one, "step_s", "s", n=a.seq_len, layers=a.layers)
        tp2 = p.point("train", a.all_variants["dot"], model + ["parallel.tp=2"], 2, CPU)
        p.entry("parallel:tp2", "parallel", "TP=2", tp2, "step_s", "s", "parallel:1proc", goal_max=GOAL_TP,
                n=a.seq_len, layers=a.layers)
        half = [f"train.micro_batch_size={max(1, a.batch // 2)}"]                # 2 ranks × half the batch
        dp2 = p.point("train", a.all_variants["dot"], model + half, 2, CPU)
        p.entry("parallel:dp2", "parallel", "DP=2", dp2, "step_s", "s", "parallel:1proc", n=a.seq_len, layers=a.layers)
    if "documents" in a.only:   # each variant's training step under the document mask ÷ without, both beside dot
        for v in V:
            windows = p.point("train", a.all_variants[v], shape(a, a.seq_len, a.layers), paired=True,
                              documents=DOCUMENT_LENGTH, eos=EOS)
            masked = p.point("train", a.all_variants[v], shape(a, a.seq_len, a.layers) + DOCUMENTS, paired=True,
                             documents=DOCUMENT_LENGTH, eos=EOS)
            p.entry(f"documents:{v}:windows", "documents", v, windows, "rate", "tokens/s", n=a.seq_len)
            p.entry(f"documents:{v}", "documents", f"{v}, document mask", masked, "rate", "tokens/s",
                    f"documents:{v}:windows", n=a.seq_len, layers=a.layers,
                    note=f"documents of {DOCUMENT_LENGTH} tokens on average (an eos with probability 1/"
                         f"{DOCUMENT_LENGTH}); the ratio: tokens/s masked ÷ unmasked on the same tokens")
    if "layouts" in a.only:   # each layout's step (its ranks' waits for a CPU taken out) ÷ the demo's own layout's
        first = next(iter(LAYOUTS))
        for name, over in LAYOUTS.items():
            p.entry(f"layouts:{name}", "layouts", name, p.point("train", DEMO, over, 2, CPU, foreground=True),
                    "uncontended_step_s",
                    "s", None if name == first else f"layouts:{first}", note=" ".join(over))
    if "gpu-binding" in a.only:
        plan_gpu_binding(a, p)
    if "gpu" in a.only:   # before the engine part, whose points it shares: the flagship's point is measured first
        plan_gpu(a, p)
    if "engine" in a.only:
        plan_engine(a, p)
    for part, plan_part in (("gpu-variants", plan_gpu_variants), ("gpu-memory", plan_gpu_memory)):
        if part in a.only:
            plan_part(a, p) if a.gpu else p.entry(part, part, "every variant", None, "rate", "tokens/s",
                                                  skipped="no CUDA device (torch.cuda.is_available() is False)")
    return p   # the gpu-accum, convergence and fp8 parts: benchmarks/bench_runs.py full_plan


def big_model(a, mixer: str) -> list[str]:
    """Overrides of configs/synth-1.3b.yaml for one GPU: no TP, one micro-batch a step, bf16, the given mixer."""
    from pretrain.config import load_config

    micro = 1 if a.quick else load_config(BIG).train.micro_batch_size
    return ["parallel.tp=1", f"train.global_batch_size={micro}", f"model.mixer={mixer}", "train.precision=bf16",
            *(QUICK_BIG if a.quick else [])]


def modes(a) -> list[bool]:
    """Compiled or not: eager everywhere, compiled too on CUDA (on the CPU a compile takes minutes for little)."""
    return [False, True] if a.gpu else [False]


def plan_engine(a, p: Plan) -> None:
    cuda = a.gpu is not None
    config, over = (BIG, big_model(a, "dot")) if cuda else (a.all_variants["dot"], shape(a, a.seq_len, a.layers))
    for compiled in modes(a):
        mode = "compiled" if compiled else "eager"
        loop, engine = (p.point(kind, config, over, compile=compiled) for kind in ("loop", "train"))
        p.entry(f"engine:loop:{mode}", "engine", f"plain loop ({mode})", loop, "step_s", "s")
        p.entry(f"engine:{mode}", "engine", f"DeepSpeed engine ({mode})", engine, "step_s", "s",
                f"engine:loop:{mode}", goal_max=GOAL_ENGINE)
        if cuda:   # the engine as the loop runs (fp32 weights, bf16 autocast, ZeRO-0); the CPU compares in fp32
            p.entry(f"engine:autocast:{mode}", "engine", f"DeepSpeed engine, train.autocast ({mode})",
                    p.point("train", config, over + AUTOCAST, compile=compiled), "step_s", "s",
                    f"engine:loop:{mode}", goal_max=GOAL_ENGINE)


def plan_gpu(a, p: Plan) -> None:
    from pretrain.config import load_config

    to_peak, name = peak_entry(a, p, "gpu")
    if name is None:
        return
    mixer = load_config(BIG).model.mixer
    for m in dict.fromkeys([mixer, "dot"]):   # the config's mixer and its dot twin, 1 GPU, no TP; accumulation 1
        p.entry(f"gpu:{m}", "gpu", f"synth-1.3b ({m}), fp32 master", p.point("train", BIG, big_model(a, m)), "tflops",
                "TFLOP/s", to_peak)
    for compiled in modes(a):   # the same dot model in the plain loop, and compiled under both
        mode = "compiled" if compiled else "eager"
        p.entry(f"gpu:loop:{mode}", "gpu", f"synth-1.3b (dot), plain loop (fp32 master), {mode}",
                p.point("loop", BIG, big_model(a, "dot"), compile=compiled), "tflops", "TFLOP/s", to_peak)
        if compiled:
            p.entry("gpu:dot:compiled", "gpu", "synth-1.3b (dot), fp32 master, compiled",
                    p.point("train", BIG, big_model(a, "dot"), compile=True), "tflops", "TFLOP/s", to_peak)
    for compiled in modes(a):   # the engine with ZeRO's weights and moments in bf16 (train.master_weights=bf16)
        mode = "compiled" if compiled else "eager"
        p.entry(f"gpu:dot:bf16-master:{mode}", "gpu", f"synth-1.3b (dot), bf16 master weights, {mode}",
                p.point("train", BIG, big_model(a, "dot") + ["train.master_weights=bf16"], compile=compiled),
                "tflops", "TFLOP/s", to_peak)


def peak_entry(a, p: Plan, part: str, device: str | None = None) -> tuple[str | None, str | None]:
    """The device's dense bf16 peak as the entry `<part>:peak` (what MFU entries are a ratio to): (its id or None,
    the device's name); without a device one skipped entry for the part and (None, None)."""
    from pretrain.observe.device_peaks import peak_tflops_of

    if device is None and not a.gpu:
        p.entry(part, part, "synth-1.3b", None, "tflops", "TFLOP/s",
                skipped="no CUDA device (torch.cuda.is_available() is False): MFU needs a GPU")
        return None, None
    name = device or a.gpu
    peak = peak_tflops_of(name, "bf16")
    p.entry(f"{part}:peak", part, name, None, "tflops", "TFLOP/s", reps=[peak] if peak else None,
            skipped=None if peak else f"no peak TFLOP/s known for {name!r} (pretrain/observe/device_peaks.py PEAK_TFLOPS)")
    return (f"{part}:peak" if peak else None), name


def plan_gpu_binding(a, p: Plan, device: str | None = None) -> None:
    """The binding MFU points (GPU part 1, accumulation 1: no goal, reported beside part 3's): synth-1.3b's dot twin
    and the flagship under the engine as the goals are configured (bf16 master weights, compiled blocks; fp32 master
    weights under train.autocast, compiled blocks), each beside its fp32-master eager run, whose loss over the same
    steps the bf16-master loss must stay within LOSS_SLACK of. `device`: the GPU's name (default a.gpu)."""
    from pretrain.config import load_config

    to_peak, name = peak_entry(a, p, "gpu-binding", device)
    if name is None:
        return
    for m in dict.fromkeys(["dot", load_config(BIG).model.mixer]):
        fp32 = p.point("train", BIG, big_model(a, m))
        bf16 = p.point("train", BIG, big_model(a, m) + ["train.master_weights=bf16"], compile=True)
        p.entry(f"gpu-binding:{m}:fp32-master:eager", "gpu-binding", f"synth-1.3b ({m}), fp32 master, eager", fp32,
                "tflops", "TFLOP/s", to_peak)
        p.entry(f"gpu-binding:{m}:bf16-master:compiled", "gpu-binding", f"synth-1.3b ({m}), bf16 master, compiled",
                bf16, "tflops", "TFLOP/s", to_peak)
        p.entry(f"gpu-binding:{m}:autocast:compiled", "gpu-binding",
                f"synth-1.3b ({m}), fp32 master (train.autocast, ZeRO-0), compiled",
                p.point("train", BIG, big_model(a, m) + AUTOCAST, compile=True), "tflops", "TFLOP/s", to_peak)
        p.entry(f"gpu-binding:{m}:loss:fp32-master", "gpu loss", f"{m}, fp32 master, eager", fp32, "loss", "")
        p.entry(f"gpu-binding:{m}:loss:bf16-master", "gpu loss", f"{m}, bf16 master, compiled", bf16, "loss", "",
                f"gpu-binding:{m}:loss:fp32-master", goal_min=1 - LOSS_SLACK, goal_max=1 + LOSS_SLACK)


def plan_gpu_variants(a, p: Plan) -> None:
    """Every variant ÷ dot on the GPU under the engine, eager and with compiled blocks (train.compile), goals
    GPU_GOALS (the gpu-variants part; GPU parts 3 and 4 take half the variants each)."""
    t = GPU_THROUGHPUT_QUICK if a.quick else GPU_THROUGHPUT
    for compiled, mode in ((False, "eager"), (True, "compiled")):
        for v, config in a.variant_paths.items():
            over = sized(t["d"], t["layers"], t["heads"], t["n"], t["batch"], t["vocab"], t["precision"])
            p.entry(f"gpu:{mode}:{v}", f"gpu throughput (engine, {mode})", v,
                    p.point("train", config, over, compile=compiled), "rate", "tokens/s",
                    None if v == "dot" else f"gpu:{mode}:dot", goal_min=GPU_GOALS.get(v), n=t["n"])


def plan_gpu_memory(a, p: Plan) -> None:
    """Every variant's training memory on the GPU at n 4096 ÷ 1024 (the gpu-memory part)."""
    m, lengths = GPU_MEMORY, ((128, 512) if a.quick else (1024, 4096))
    for v, config in a.variant_paths.items():
        for n in lengths:
            over = sized(m["d"], m["layers"], m["heads"], n, m["batch"], m["vocab"], m["precision"])
            p.entry(f"gpu:memory:{v}:n={n}", "gpu memory", v, p.point("train", config, over, steps=1), "total_mb",
                    "MB", None if n == lengths[0] else f"gpu:memory:{v}:n={lengths[0]}", n=n,
                    goal_max=GPU_GOAL_MEM.get(v) if n == lengths[1] else None)
