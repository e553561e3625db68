"""Tensor-parallel building blocks: megatron-core layers under TP > 1, plain torch layers at TP = 1.

The model code asks this module for "a column-parallel linear", "a vocab-parallel embedding", … and never
looks at ranks. With more than one tensor-parallel rank the layers are megatron's (`ColumnParallelLinear`,
`RowParallelLinear`, `VocabParallelEmbedding`, `vocab_parallel_cross_entropy`); with one (no process group, or a pure
data- or pipeline-parallel run) they are `nn.Linear` / `nn.Embedding` / `F.cross_entropy` with the same parameter
names, so one state dict fits both. At TP = 1 the plain linear adds its bias inside the GEMM (megatron's adds it
apart, in fp32 under autocast, which also promotes the output to fp32) and torch.compile sees plain aten ops.

Every parameter carries how it is split (`tensor_model_parallel`, `partition_dim`, megatron's attribute names) and
how it is initialised (`init`), so `init_from_seed` can draw the *full* tensor from one seed and keep this rank's
slice: TP=k starts from exactly the TP=1 model.
"""
from __future__ import annotations

import contextlib
import functools
import zlib
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .fields import ConfigError
from .ranks import mcore, tp_group, tp_rank, tp_world, under_process_group
from .sequence_parallel import (gather_sequence, reduce_scatter_sequence, scatter_sequence, sequence_parallel,
                                set_sequence_parallel, summed_over_tp, whole_sequences)


# ---- where am I: model/ranks.py ---------------------------------------------------------------------
def split_size(total: int, what: str) -> int:
    """total / TP, with a one-line error when it does not divide."""
    tp = tp_world()
    if total % tp:
        raise ConfigError(f"{what}={total} is not divisible by the tensor-parallel size parallel.tp={tp}; "
                          f"choose {what} as a multiple of {tp}")
    return total // tp


# ---- parameter annotations: how a tensor is split and initialised ------------------------------------
def annotate(param: nn.Parameter, init: Callable, partition_dim: int | None = None) -> nn.Parameter:
    """Record this parameter's init rule and, if sharded over TP, the dimension it is split along."""
    param.init = init
    if partition_dim is not None:
        param.tensor_model_parallel = True
        param.partition_dim = partition_dim
        param.partition_stride = 1
    return param


def normal(std: float) -> Callable:
    return lambda t, g: t.normal_(0.0, std, generator=g)


def uniform(bound: float) -> Callable:
    return lambda t, g: t.uniform_(-bound, bound, generator=g)


def constant(value: float) -> Callable:
    return lambda t, g: t.fill_(value)


def is_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def full_shape(param: torch.Tensor) -> list[int]:
    """The TP=1 shape of a (possibly sharded) parameter."""
    shape = list(param.shape)
    if is_sharded(param):
        shape[param.partition_dim] *= tp_world()
    return shape


def local_slice(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """This TP rank's part of the full tensor of `param`: its chunk along the split dim, or all of it."""
    return full.chunk(tp_world(), dim=param.partition_dim)[tp_rank()] if is_sharded(param) else full


@torch.no_grad()
def init_from_seed(model: nn.Module, seed: int, rename: Callable[[str], str] = lambda name: name) -> None:
    """Draw every parameter's full tensor from (seed, its name) and keep this rank's slice.

    The generator depends on the name only, so the result is the same whatever the TP layout or the order
    in which modules were built; `rename` maps a wrapper's names (pipeline stages) to the canonical ones.
    """
    for local_name, p in model.named_parameters():
        name = rename(local_name)
        init = getattr(p, "init", None)
        if init is None:
            raise RuntimeError(f"parameter {name} has no init rule (annotate it in its module)")
        g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        p.copy_(local_slice(init(torch.empty(full_shape(p), dtype=torch.float32), g), p))


# ---- layers ------------------------------------------------------------------------------------------
def _megatron_config():
    # Weights are filled by init_from_seed; megatron's own init would draw per-rank random numbers.
    return mcore().ModelParallelConfig(tensor_model_parallel_size=tp_world(), use_cpu_initialization=True,
                                        perform_initialization=False, params_dtype=torch.float32)


def _no_init(_):
    return None


class EngineLinear(nn.Linear):
    """nn.Linear with the state-dict keys of megatron's parallel linears: an `_extra_state` entry (None, ignored on
    load), as every DeepSpeed checkpoint written at TP=1 before this layer replaced megatron's there holds, so
    those load, and checkpoints stay loadable by earlier code. Without a process group (a release, an HF export)
    the layer is a plain nn.Linear, as it always was."""

    def get_extra_state(self) -> None:
        return None

    def set_extra_state(self, state) -> None:
        pass


def plain_linear(d_in: int, d_out: int, bias: bool) -> nn.Linear:
    return (EngineLinear if under_process_group() else nn.Linear)(d_in, d_out, bias=bias)


def column_linear(d_in: int, d_out: int, bias: bool, std: float) -> nn.Module:
    """y = x Wᵀ + b with W (d_out, d_in) split along d_out: each rank computes its own d_out/TP outputs."""
    if tp_world() == 1:
        layer = plain_linear(d_in, d_out, bias)
    else:
        # under sequence parallelism the input is gather_sequence's output, whose backward sums ∂x over TP already
        layer = _megatron_linear("column")(d_in, d_out, config=_megatron_config(), init_method=_no_init, bias=bias,
                              gather_output=False, disable_grad_reduce=sequence_parallel())
    annotate(layer.weight, normal(std), partition_dim=0)
    if bias:
        annotate(layer.bias, constant(0.0), partition_dim=0)
    return layer


def joint_column(x: torch.Tensor, layers: list[nn.Module]) -> list[torch.Tensor]:
    """[layer(x) for layer in layers] for column-parallel linears that read the same x, as one GEMM over their
    (local) weights and biases concatenated: one launch for all, one ∂x GEMM in backward instead of one per layer
    plus their sum, one bias-gradient reduction. The outputs are views of the joint one (B, n, Σ d_out/TP). Layers
    that are not the linears this module built (swapped in from outside: FP8's, whose GEMMs are their own) are
    called one by one."""
    if len(layers) == 1 or any(own_forward(layer) for layer in layers):
        return [layer(x) for layer in layers]
    biases = [layer.bias for layer in layers if layer.bias is not None]
    y = JointLinear.apply(copy_to_tp(x), torch.cat(biases) if biases else None, *(l.weight for l in layers))
    return list(y.split([layer.weight.shape[0] for layer in layers], dim=-1))


def own_forward(layer: nn.Module) -> bool:
    """A layer of a class other than the linears built here (BUILT): its GEMM, which the joint one would skip."""
    return type(layer) not in BUILT


BUILT: set[type] = {nn.Linear, EngineLinear}   # the linears built here; `_megatron_linear` adds megatron's


class JointLinear(torch.autograd.Function):
    """y = x [W_1; W_2; …]ᵀ + b, saving x and the weights themselves, not their concatenation: backward concatenates
    them again (one copy of Σ d_out·d_in, no activation memory) rather than keeping a copy of every weight alive from
    forward to backward. Under autocast the GEMMs run in its dtype, as F.linear's would (x saved cast, as F.linear
    saves it); 2·d_in·Σ d_out FLOPs a token forward, twice that backward."""

    @staticmethod
    def forward(ctx, x, bias, *weights):
        kind = x.device.type
        autocast = torch.amp.is_autocast_available(kind)
        dtype = torch.get_autocast_dtype(kind) if autocast and torch.is_autocast_enabled(kind) else x.dtype
        with torch.autocast(kind, enabled=False) if autocast else contextlib.nullcontext():
            xc = x.to(dtype)                                                       # (B, n, d_in)
            w = torch.cat([t.to(dtype) for t in weights])                          # (Σ d_out, d_in)
            y = F.linear(xc, w, None if bias is None else bias.to(dtype))          # (B, n, Σ d_out)
        ctx.save_for_backward(xc, *weights)
        ctx.dtypes = (x.dtype, None if bias is None else bias.dtype, dtype)
        return y

    @staticmethod
    def backward(ctx, dy):
        xc, *weights = ctx.saved_tensors
        x_dtype, bias_dtype, dtype = ctx.dtypes
        kind = dy.device.type
        with torch.autocast(kind, enabled=False) if torch.amp.is_autocast_available(kind) else contextlib.nullcontext():
            dy = dy.to(dtype)
            w = torch.cat([t.to(dtype) for t in weights])                          # again, as in forward
            dx = (dy @ w).to(x_dtype)                                              # (B, n, d_in)
            dw = dy.flatten(0, -2).T @ xc.flatten(0, -2)                           # (Σ d_out, d_in)
            db = None if bias_dtype is None else dy.flatten(0, -2).sum(0).to(bias_dtype)
        parts = dw.split([t.shape[0] for t in weights])
        return (dx, db, *(p.to(t.dtype) for p, t in zip(parts, weights)))


def row_linear(d_in: int, d_out: int, bias: bool, std: float) -> nn.Module:
    """y = x Wᵀ + b with W (d_out, d_in) split along d_in: partial sums are all-reduced over TP, b added once —
    under sequence parallelism reduce-scattered along the sequence instead (each rank keeps n/TP positions)."""
    if tp_world() == 1:
        layer = plain_linear(d_in, d_out, bias)
    else:
        kind = "sequence row" if sequence_parallel() else "row"
        layer = _megatron_linear(kind)(d_in, d_out, config=_megatron_config(), init_method=_no_init, bias=bias,
                                       input_is_parallel=True, skip_bias_add=False)
    annotate(layer.weight, normal(std), partition_dim=1)
    if bias:
        annotate(layer.bias, constant(0.0))
    return layer


def vocab_embedding(vocab: int, d: int, std: float) -> nn.Module:
    """Token embedding (V, d) split along V: each rank looks up its vocabulary range, results all-reduced."""
    if tp_world() == 1:
        layer = nn.Embedding(vocab, d)
    else:
        layer = mcore().tensor_parallel.VocabParallelEmbedding(vocab, d, init_method=_no_init,
                                                                config=_megatron_config())
    annotate(layer.weight, normal(std), partition_dim=0)
    return layer


class SequenceParallelNorm(nn.LayerNorm):
    """LayerNorm on this rank's n/TP positions; its weight and bias (replicated over TP) get gradients summed over
    TP."""

    def forward(self, x):
        weight, bias = summed_over_tp(self.weight), summed_over_tp(self.bias)
        return F.layer_norm(x, self.normalized_shape, weight, bias, self.eps)


def layer_norm(d: int, eps: float) -> nn.LayerNorm:
    """A norm of the residual stream: in the sequence-parallel region where that is on."""
    norm = (SequenceParallelNorm if sequence_parallel() else nn.LayerNorm)(d, eps=eps)
    annotate(norm.weight, constant(1.0))
    annotate(norm.bias, constant(0.0))
    return norm


@functools.cache
def _megatron_linear(kind: str):
    """megatron's parallel linears return (output, bias); ours return the output with the bias added. And their
    matmul gets the layer's own TP group: megatron-core 0.16.1's RowParallelLinear.forward passes tp_group=None,
    whose deprecation warning (rank 0, every call) is a torch.compile graph break in every row-parallel linear
    (the column one passes self.tp_group already; the group changes no number here)."""
    tensor_parallel = mcore().tensor_parallel
    base = {"column": tensor_parallel.ColumnParallelLinear, "row": tensor_parallel.RowParallelLinear,
            "sequence row": tensor_parallel.RowParallelLinear}[kind]
    def forward_impl(self, input, weight, *args, tp_group=None, **kwargs):
        group = self.tp_group if tp_group is None else tp_group
        return base._forward_impl(self, input, weight, *args, tp_group=group, **kwargs)

    def forward(self, x):
        if kind == "sequence row" and sequence_parallel():   # megatron's own allocates on the current CUDA device
            return _sequence_row_forward(self, x)
        return base.forward(self, x)[0]   # and a sequence row within whole_sequences: plain TP's all-reduce

    layer = type(base.__name__, (base,), {"forward": forward, "_forward_impl": forward_impl, "matmul": matmul})
    BUILT.add(layer)
    return layer


def matmul(self, x):   # x W_rᵀ (B, n, d_out), no bias or communication: the sequence row's GEMM (FP8 replaces it)
    return F.linear(x, self.weight)


def _sequence_row_forward(self, x):
    """y = reduce-scatter_n(x W_rᵀ) + b: the partial sums (B, n, d_out) of this rank's d_in/TP inputs, summed over TP,
    this rank's n/TP positions kept (B, n/TP, d_out); b added there, its gradient summed over TP."""
    y = reduce_scatter_sequence(self.matmul(x))
    return y if self.bias is None else y + summed_over_tp(self.bias)


# ---- communication in the model's forward ----------------------------------------------------------
def copy_to_tp(x: torch.Tensor) -> torch.Tensor:
    """Identity forward, all-reduce of the gradient backward (input of a column-parallel matmul). Under sequence
    parallelism identity both ways: x is then gather_sequence's output, whose backward sums the gradient over TP."""
    if tp_world() == 1 or sequence_parallel():
        return x
    return mcore().tensor_parallel.copy_to_tensor_model_parallel_region(x)


class _GatherLastDim(torch.autograd.Function):
    """All-gather along the last dim (forward), keep this rank's slice of the gradient (backward).

    megatron's version allocates on `torch.cuda.current_device()`; this one follows the input's device.
    """

    @staticmethod
    def forward(ctx, x):
        parts = [torch.empty_like(x) for _ in range(tp_world())]
        dist.all_gather(parts, x.contiguous(), group=tp_group())
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(tp_world(), dim=-1)[tp_rank()].contiguous()


@torch.no_grad()
def gather_heads(maps: torch.Tensor) -> torch.Tensor:
    """(B, H/TP, n, n) maps of this rank's heads → (B, H, n, n) of every head, in head order (no gradient)."""
    if tp_world() == 1:
        return maps
    parts = [torch.empty_like(maps) for _ in range(tp_world())]
    dist.all_gather(parts, maps.contiguous(), group=tp_group())
    return torch.cat(parts, dim=1)


def gather_last_dim(x: torch.Tensor) -> torch.Tensor:
    return x if tp_world() == 1 else _GatherLastDim.apply(x)


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Per-token loss (B, n) from vocab-sharded logits (B, n, V/TP)."""
    if tp_world() == 1:
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    return mcore().tensor_parallel.vocab_parallel_cross_entropy(logits.float(), targets)


# ---- RNG for dropout on TP-sharded activations -------------------------------------------------------
class RNGTracker:
    """A named RNG stream that differs per TP rank, for dropout on sharded activations (per-head outputs).

    megatron's CudaRNGStatesTracker works only on CUDA; this one swaps the default generator of whatever
    device the activations live on (CPU or an accelerator), and leaves the default stream untouched, so
    dropout on replicated activations stays identical across TP ranks.
    """

    def __init__(self):
        self.states: dict[tuple[str, str], torch.Tensor] = {}
        self.seed = None

    def set_seed(self, seed: int) -> None:
        self.seed, self.states = seed, {}

    @staticmethod
    def _generator_ops(device: torch.device):
        """(get_state, set_state, seed) of the default generator of `device`'s type."""
        if device.type == "cpu":
            g = torch.default_generator
            return g.get_state, g.set_state, g.manual_seed
        mod = torch.get_device_module(device.type)  # cuda, xpu, … share this interface
        return mod.get_rng_state, mod.set_rng_state, mod.manual_seed

    @contextlib.contextmanager
    def fork(self, device: torch.device, name: str = "tensor-parallel"):
        get_state, set_state, seed = self._generator_ops(device)
        saved = get_state()
        key = (device.type, name)
        if key in self.states:
            set_state(self.states[key])
        else:
            # megatron's convention: the model-parallel stream is seeded with seed + 2718 + tp_rank.
            base = self.seed if self.seed is not None else torch.initial_seed()
            seed(int(base) + 2718 + tp_rank())
        try:
            yield
        finally:
            self.states[key] = get_state()
            set_state(saved)

    def checkpoint_contexts(self):
        """(forward, recompute) contexts for torch.utils.checkpoint's `context_fn`: the recomputation in backward
        draws from the streams as they were at the forward (torch restores the default generators, not these)."""
        at_forward = {key: state.clone() for key, state in self.states.items()}

        @contextlib.contextmanager
        def recompute():
            now, self.states = self.states, {key: state.clone() for key, state in at_forward.items()}
            try:
                yield
            finally:
                self.states = now

        return contextlib.nullcontext(), recompute()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "states": dict(self.states)}

    def load_state_dict(self, sd: dict) -> None:
        self.seed, self.states = sd["seed"], dict(sd["states"])


rng_tracker = RNGTracker()


class RegionDropout(nn.Dropout):
    """Dropout on the residual stream. In the sequence-parallel region each rank holds other positions, so its masks
    come from the TP-rank stream (`rng_tracker`, seed + 2718 + tp_rank, megatron's choice): deterministic, different
    on every chunk. They are not the masks of the same run without sequence parallelism (those come from the default
    stream, equal on the TP ranks), only drawn alike."""

    def forward(self, x):
        if not (sequence_parallel() and self.training and self.p > 0):
            return super().forward(x)
        with rng_tracker.fork(x.device):
            return super().forward(x)


def dropout(p: float) -> nn.Dropout:
    return RegionDropout(p)
