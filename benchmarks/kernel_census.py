"""The kernel census: the kernels a training step launches on the GPU path, by phase and by op name, counted on the
CPU. Kernels (below) counts them under a TorchDispatchMode: every aten op that is not a view (each is a kernel launch
on a GPU); tests/distributed/test_kernel_count.py counts a block with it, tests/support/loop_compare.py a whole step.

    python benchmarks/kernel_census.py SPECS.json OUT.json     (census_of: one fresh process, any checkout's code)

Invariant (the GPU measurement queue, benchmarks/gpu_queue.py): a GPU figure measured on a configuration stands while
the census of that configuration is unchanged. The census of a configuration (a bench point's spec: kind `train`, our
DeepSpeed engine, or `loop`, the plain loop; config; overrides; compiled or not) is one optimizer step's ops, after a
first step has made AdamW's states, counted per phase (forward, backward, optimizer step) with SYNTHFORMER_KERNELS=gpu,
so that CPU tensors take the GPU path (model/kernels.py on_gpu_path; Triton kernels under TRITON_INTERPRET=1, where
each launch shows as the interpreter's copies of its arguments: the census is a fingerprint of the step, not a launch
count).

It is counted at tiny widths of the same structure (`tiny`): what decides which kernels run is kept (the mixer of each
layer, the layers, the head width d_h, TP/PP/ZeRO, precision, autocast, master weights, gradient accumulation, the
fused loss's chunk count, biases, positions, block, tying), what only sizes them is shrunk (2 heads per TP rank, so
d = 2·d_h, n, the vocabulary, a micro-batch of 1). Compiled configurations are counted eager: the census fingerprints
the code torch.compile traces, not inductor's fusion of it; an FP8 configuration (train.fp8) is counted without
FP8, whose kernels are torchao's. That the counts do not depend on what is shrunk is checked by
tests/unit/test_gpu_queue.py (two shapes, one census).

Beside the op counts, each census holds `beside` (Beside): what moves a figure without changing which ops run, and
is compared with them: what is compiled (each torch.compile target, e.g. the blocks, the embedding, the head + loss,
with its options), the compiler's settings that differ from torch's defaults (torch._inductor.config and
torch._dynamo.config, set by code or environment), every SDPA call's signature (widths, dtypes, mask, causal, which
backends are enabled: what CUDA picks its kernel by), the Triton source files launched (a hash of each), and a
digest of the ops by output dtype per phase (a dtype-only change). The measuring machine's side (device, torch,
triton, CUDA, the environment) is recorded with each point (benchmarks/gpu_records.py). CENSUS_VERSION: a stored
census of another version is counted again at its commit.
"""
from __future__ import annotations

import collections
import hashlib
import inspect
import json
import math
import os
import subprocess
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

NOT_KERNELS = ("detach", "alias", "lift_fresh")   # and the profiler's record_function ops: labels, not kernels
PHASES = ("forward", "backward", "optimizer step")
TINY = dict(heads_per_rank=2, n=32, vocab_per_rank=64)   # the census's shape (check_shape: another one)
PROJECT = ("model.", "pretrain.", "tokendata.", "benchmarks.", "evaluation.", "cli.", "tools.")   # its functions
CENSUS_VERSION = 2   # 2: `beside` and the dtypes; compiled specs keyed apart
ENV = {"SYNTHFORMER_KERNELS": "gpu", "TRITON_INTERPRET": "1", "CUDA_VISIBLE_DEVICES": "", "DS_ACCELERATOR": "cpu",
       "OMP_NUM_THREADS": "1"}


class Kernels(TorchDispatchMode):
    """Per phase: the non-view aten ops by name, bias adds apart from a GEMM, and 4-D copies (head layouts) of the
    attention's inputs (made before the attention kernel runs); the output shape of each where `shapes` is a list.
    `phase(name)` closes a phase: its ops go to `phases[name]` and counting starts again."""

    def __init__(self, in_triton):
        super().__init__()
        self.ops, self.bias_adds, self.head_copies, self.in_triton = collections.Counter(), 0, 0, in_triton
        self.phases: dict[str, collections.Counter] = {}
        self.dtyped, self.dtype_phases = collections.Counter(), {}   # the same ops as "name:output dtype"
        self.shapes = None   # a list to collect every counted op's output shape in

    def phase(self, name: str) -> None:
        self.phases.setdefault(name, collections.Counter()).update(self.ops)
        self.dtype_phases.setdefault(name, collections.Counter()).update(self.dtyped)
        self.ops, self.dtyped = collections.Counter(), collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self.in_triton() or func.is_view or name in NOT_KERNELS or func.namespace in ("profiler", "synthformer"):
            return out   # profiler labels; the project's custom ops only launch Triton kernels (counted apart) and allocate
        self.ops[name] += 1
        self.dtyped[f"{name}:{out.dtype if isinstance(out, torch.Tensor) else '-'}"] += 1
        if self.shapes is not None and isinstance(out, torch.Tensor):
            self.shapes.append(tuple(out.shape))
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        if name == "add" and len(tensors) == 2 and min(t.dim() for t in tensors) == 1 and \
                max(t.dim() for t in tensors) >= 2:   # y + b with b (d_out,): a bias added after its matmul
            self.bias_adds += 1
        attended = self.ops["triton"] or any("scaled_dot_product" in op for op in self.ops)
        if name in ("clone", "contiguous", "_to_copy", "copy_") and isinstance(out, torch.Tensor) and out.dim() == 4 \
                and not attended:
            self.head_copies += 1
        return out


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True, default=str).encode()).hexdigest()[:16]


def compiled_name(target) -> str:
    """A torch.compile target by what it is: Class.method for a bound method (nn.Module.compile compiles the
    module's `_call_impl`), the class of a module, else module.qualname."""
    owner = getattr(target, "__self__", None)
    if owner is not None and not inspect.ismodule(owner):
        return f"{type(owner).__name__}.{getattr(target, '__name__', '?')}"
    if isinstance(target, torch.nn.Module):
        return type(target).__name__
    return f"{getattr(target, '__module__', '?')}.{getattr(target, '__qualname__', repr(target))}"


def compiler_settings() -> dict:
    """The values of torch._inductor.config and torch._dynamo.config that differ from torch's defaults (set by code
    or by the environment: TORCHINDUCTOR_*)."""
    import importlib

    out = {}
    for name in ("torch._inductor.config", "torch._dynamo.config"):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        is_default = getattr(module, "_is_default", None)
        entries = getattr(module, "_config", None)
        if is_default is None or entries is None:
            out[name] = "unreadable under this torch"
            continue
        out[name] = {k: repr(getattr(module, k)) for k in sorted(entries) if not is_default(k)}
    return out


def sdpa_signature(args, kwargs) -> str:
    """What CUDA chooses an SDPA kernel by: widths and dtypes of q, k, v (and whether their last dim is dense),
    the mask's dtype, causal, dropout, a given scale, GQA, autocast, and the backends enabled at the call."""
    q, k, v = args[:3]
    given = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa"), args[3:]), **kwargs)
    mask, device = given.get("attn_mask"), q.device.type
    backends = [b for b in ("flash", "mem_efficient", "cudnn", "math")
                if getattr(torch.backends.cuda, f"{b}_sdp_enabled", lambda: None)()]
    return json.dumps({
        "q": [q.dim(), q.shape[-1], str(q.dtype)], "k": [k.shape[-1], str(k.dtype)], "v": [v.shape[-1], str(v.dtype)],
        "dense_last": [t.stride(-1) == 1 for t in (q, k, v)], "mask": None if mask is None else [str(mask.dtype),
                                                                                             mask.dim()],
        "causal": bool(given.get("is_causal")), "dropout": float(given.get("dropout_p") or 0) > 0,
        "scale": given.get("scale") is not None, "gqa": bool(given.get("enable_gqa")),
        "autocast": str(torch.get_autocast_dtype(device)) if torch.is_autocast_enabled(device) else None,
        "backends": backends}, sort_keys=True)


class Beside(TorchFunctionMode):
    """Records what moves a figure beside the op counts (module docstring) while a configuration is built and
    stepped: torch.compile is replaced by a recorder that returns its target as it is (so the census counts the
    eager code that would be traced), SDPA calls are recorded as a function mode, and each Triton function the
    interpreter runs is recorded by its source file. `record(kernels)`: the `beside` entry."""

    def __init__(self):
        super().__init__()
        self.compiled, self.sdpa, self.triton_files = collections.Counter(), collections.Counter(), set()
        self.counting = False   # SDPA calls are counted in the counted step only
        self._undo = []

    def compile(self, model=None, **options):
        if model is None:   # @torch.compile(...) as a decorator
            return lambda fn: self.compile(fn, **options)
        name = compiled_name(model)
        if inspect.isfunction(model) and not name.startswith(PROJECT):   # a library's, at its import (DeepSpeed's)
            return model
        shown = ", ".join(f"{k}={v!r}" for k, v in sorted(options.items()))
        self.compiled[f"{name}({shown})"] += 1
        return model

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.counting and getattr(func, "__name__", "") == "scaled_dot_product_attention":
            self.sdpa[sdpa_signature(args, kwargs)] += 1
        return func(*args, **kwargs)

    def patch(self):
        """torch.compile, and the Triton interpreter's launch and device call (where triton is there)."""
        kept = torch.compile
        torch.compile = self.compile
        self._undo.append(lambda: setattr(torch, "compile", kept))
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:
            return self
        for name in ("run", "__call__"):
            original = getattr(InterpretedFunction, name)

            def wrapped(fn, *args, _original=original, **kwargs):
                self.triton_files.add(inspect.getsourcefile(fn.fn))
                return _original(fn, *args, **kwargs)
            setattr(InterpretedFunction, name, wrapped)
            self._undo.append(lambda n=name, o=original: setattr(InterpretedFunction, n, o))
        return self

    def unpatch(self):
        while self._undo:
            self._undo.pop()()

    def record(self, kernels: Kernels, tree: str = ".") -> dict:
        def file_hash(path):
            with open(path, "rb") as f:
                return hashlib.sha256(f.read()).hexdigest()[:16]
        files = {os.path.relpath(p, tree): p for p in self.triton_files if p}   # the tree's (triton's own: its version)
        return {"compiled": dict(sorted(self.compiled.items())), "compiler": compiler_settings(),
                "sdpa": dict(sorted(self.sdpa.items())),
                "triton": {rel: file_hash(p) for rel, p in sorted(files.items()) if not rel.startswith("..")},
                "dtypes": {phase: digest(dict(kernels.dtype_phases.get(phase, {}))) for phase in PHASES}}


# ---- the census of a configuration (in the census process) --------------------------------------------------------
def key(spec: dict) -> str:
    """What identifies a configuration to the census: kind, config, overrides, and `compile` where the point is
    compiled (an eager point's key has no such field: the keys of earlier records stand)."""
    fields = {k: spec.get(k) for k in ("kind", "config", "overrides")}
    if spec.get("compile"):
        fields["compile"] = True
    return json.dumps(fields, sort_keys=True)


def loss_chunks(cfg) -> int:
    """How many row chunks the fused loss (model/linear_cross_entropy.py) runs a micro-batch in; 1 where the tree
    has none."""
    try:
        from model import linear_cross_entropy as lce
    except ImportError:
        return 1
    rows, tp = cfg.train.micro_batch_size * cfg.model.max_seq_len, cfg.parallel.tp
    return math.ceil(rows / lce.chunk_rows(cfg.model.vocab_size // tp, rows))


def tiny(cfg, shape: dict = TINY) -> tuple[list[str], int]:
    """(overrides, CHUNK_ELEMENTS) that shrink cfg's widths to `shape` and keep its structure (module docstring):
    heads per TP rank, d = heads · d_h, n a multiple of the loss's chunk count near shape's n, the vocabulary per
    rank, a micro-batch of 1 at the same accumulation; and the chunk size that gives the loss its chunk count."""
    m, tp = cfg.model, cfg.parallel.tp
    heads = shape["heads_per_rank"] * tp
    d, chunks = heads * m.head_dim, loss_chunks(cfg)
    n = chunks * max(1, -(-shape["n"] // chunks))
    vocab = shape["vocab_per_rank"] * tp
    accum = cfg.train.global_batch_size // cfg.train.micro_batch_size   # one process: one data-parallel rank
    overrides = [f"model.n_heads={heads}", f"model.d_model={d}", f"model.max_seq_len={n}", f"model.vocab_size={vocab}",
                 f"model.d_ffn={max(2 * heads, m.d_ffn * d // m.d_model)}", "model.factorized_a=null",
                 "model.factorized_b=null", "train.micro_batch_size=1", f"train.global_batch_size={accum}",
                 "data.canonical_streams=null", "train.compile=false"]
    return overrides, (vocab // tp) * (n // chunks)


def count(spec: dict, shape: dict = TINY) -> dict:
    """The census of one configuration in this process (CPU, SYNTHFORMER_KERNELS=gpu): {phase: {op: count}, "beside":
    Beside's record}; a compiled configuration is built compiled, with torch.compile recording instead."""
    from pretrain.config import load_config

    overrides = list(spec["overrides"])
    if any(o.startswith("train.fp8=") for o in overrides):
        overrides.append("train.fp8=null")   # torchao's kernels are not the project's (module docstring)
    cfg = load_config(spec["config"], overrides)
    extra, chunk_elements = tiny(cfg, shape)
    compiling = cfg.train.compile or (bool(spec.get("compile")) and spec["kind"] == "train")   # as the bench does
    cfg = load_config(spec["config"], overrides + extra + [f"train.compile={str(compiling).lower()}"])
    try:
        from model import linear_cross_entropy as lce
    except ImportError:
        lce = None
    kept = getattr(lce, "CHUNK_ELEMENTS", None)
    try:
        if lce:
            lce.CHUNK_ELEMENTS = chunk_elements
        return counted(spec, cfg)
    finally:
        if lce:
            lce.CHUNK_ELEMENTS = kept


def counted(spec: dict, cfg) -> dict:
    """One optimizer step's ops after a first step, per phase, and beside them what else moves a figure."""
    beside = Beside().patch()
    try:
        return counted_beside(spec, cfg, beside)
    finally:
        beside.unpatch()


def counted_beside(spec: dict, cfg, beside: Beside) -> dict:
    from pretrain import distributed
    from pretrain.engine import build_engine

    lay = distributed.init(cfg)
    torch.manual_seed(cfg.train.seed)
    if spec["kind"] == "loop":
        from benchmarks.bench_lib import PlainLoop
        engine = PlainLoop(cfg, lay)
        if spec.get("compile"):   # torch.compile of the whole model, as the bench's loop
            engine.compile()
    else:
        engine = build_engine(cfg, lay)
    tokens = torch.randint(cfg.model.vocab_size, (cfg.train.micro_batch_size, cfg.model.max_seq_len + 1),
                           generator=torch.Generator().manual_seed(0))
    inputs, targets = tokens[:, :-1], tokens[:, 1:]

    def step(mark=lambda name: None):
        for _ in range(lay.grad_accum):
            loss = engine(inputs, targets)
            mark("forward")
            engine.backward(loss)
            mark("backward")
            engine.step()
            mark("optimizer step")

    step()   # the first step makes AdamW's states
    beside.counting = True
    with Kernels(in_triton=lambda: False) as kernels, beside:
        step(kernels.phase)
    distributed.shutdown()
    return {**{phase: dict(sorted(kernels.phases.get(phase, {}).items())) for phase in PHASES},
            "beside": beside.record(kernels)}


def main(argv=None) -> int:
    """SPECS.json ([spec, ...]) → OUT.json ({key: census}), each configuration in turn in this process."""
    import argparse

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("specs", help="JSON list of bench point specs ({kind, config, overrides}; census_shape optional)")
    ap.add_argument("out", help="JSON file the census of each is written to, keyed by `key`")
    a = ap.parse_args(argv)
    with open(a.specs) as f:
        specs = json.load(f)
    out = {}
    for i, spec in enumerate(specs, 1):
        out[key(spec)] = count(spec, spec.get("census_shape", TINY))
        print(f"census {i}/{len(specs)}: {spec['kind']} {spec['config']} {' '.join(spec['overrides'])}", flush=True)
        with open(a.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


# ---- in the parent ------------------------------------------------------------------------------------------------
def census_of(specs: list[dict], tree: str, timeout: float = 900.0) -> dict:
    """{key: census} of `specs` at the code of `tree` (a checkout: this one, or a worktree of a record's commit), in
    one fresh CPU process of this file run against that tree's packages. RuntimeError (one line) if it fails."""
    import tempfile

    specs = list({key(s): s for s in specs if s.get("world", 1) == 1}.values())   # the GPU queue's: one process
    if not specs:
        return {}
    with tempfile.TemporaryDirectory() as tmp:
        spec_path, out_path = os.path.join(tmp, "specs.json"), os.path.join(tmp, "census.json")
        with open(spec_path, "w") as f:
            json.dump(specs, f)
        env = {**os.environ, **ENV, "PYTHONPATH": os.path.abspath(tree)}
        for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(k, None)   # a world of one of its own
        r = subprocess.run([sys.executable, os.path.abspath(__file__), spec_path, out_path], cwd=tree, env=env,
                           capture_output=True, text=True, timeout=timeout)
        if r.returncode:
            last = (r.stderr.strip() or r.stdout.strip() or "no output").splitlines()[-1]
            raise RuntimeError(f"kernel census at {tree} failed: {last[-300:]}")
        with open(out_path) as f:
            return json.load(f)


if __name__ == "__main__":
    sys.exit(main())
