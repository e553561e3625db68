"""FP8 training of the linears (train.fp8) through torchao's float8 training (`torchao.float8`), applied from outside
the model by pretrain/engine.py build_engine, before the blocks are compiled:

    check(cfg, device)      a one-line ConfigError where this rank cannot train in FP8 (before the model is touched)
    convert(model, recipe)  each plain linear (nn.Linear, or the model's EngineLinear under a process group) swapped in
                            place for torchao's Float8Linear, and under TP > 1 each of megatron's column- and
                            row-parallel linears given FP8 GEMMs on its shard (`float8_parallel_linear`), megatron's
                            communication unchanged: module and parameter names, and so checkpoints, unchanged;
                            under PP each stage converts its own layers alike

In a Float8Linear the three GEMMs of a linear (forward y = x Wᵀ, backward ∂x = ∂y W and ∂W = ∂yᵀ x) take FP8 operands
(e4m3; torchao's recipes choose where e5m2 goes) with scales computed on the fly, and give bf16 results: twice a bf16
tensor core's peak on an H100. Recipes, by torchao's names: 'tensorwise' (one scale per tensor: the fastest) and
'rowwise' (one scale per row of each operand: more accurate, a little slower). The joint projections (a mixer's
q, k, values in one GEMM: model/parallel.py joint_column) run as one FP8 GEMM each once converted (joint_column calls
each linear of a class it did not build as a module). What stays in bf16: the fused head + loss, attention, norms.

Needs (each a one-line error otherwise): a CUDA GPU of compute capability ≥ 8.9 (FP8 tensor cores: Ada, Hopper),
train.precision = bf16 (the section's own check), and torchao (`pip install 'synthformer[fp8]'`). torch.compile
(train.compile) fuses the scaling and casting kernels; eager FP8 is slower than bf16.
"""
from __future__ import annotations

import functools

import torch

from model.config import ConfigError
from model.parallel import EngineLinear, copy_to_tp
from model.ranks import mcore, tp_world
from pretrain.config import TrainConfig

# FP8 GEMMs take widths that are multiples of 16 (torch._scaled_mm); a linear of other widths stays as it is
ALIGN = 16
MIN_CAPABILITY = (8, 9)


def check(cfg: TrainConfig, device: torch.device) -> None:
    """ConfigError (one line) where train.fp8 is set and this rank cannot run it: no torchao, or not a CUDA device of
    compute capability ≥ MIN_CAPABILITY."""
    recipe = cfg.train.fp8
    if recipe is None:
        return
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise ConfigError(f"train.fp8={recipe!r} needs torchao: pip install 'synthformer[fp8]' (a node without "
                          f"package access: carry its wheel, docs/gpu/README.md); or set train.fp8=null") from None
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability >= MIN_CAPABILITY:
            return
        where = f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]})"
    else:
        where = f"the {device.type}"
    raise ConfigError(f"train.fp8={recipe!r} needs a CUDA GPU of compute capability ≥ "
                      f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} (FP8 tensor cores: H100, H200, L40S); this rank runs "
                      f"on {where}; set train.fp8=null")


def convertible(module: torch.nn.Module, name: str = "") -> bool:
    """A plain linear whose widths FP8 GEMMs take: an nn.Linear, or under a process group (every launch) the model's
    EngineLinear, an nn.Linear with megatron's state-dict keys."""
    return type(module) in PLAIN and module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


PLAIN = (torch.nn.Linear, EngineLinear)


@functools.cache
def engine_float8_linear() -> type:
    """torchao's Float8Linear with EngineLinear's state-dict keys (its `_extra_state` entry), so that a checkpoint of
    an FP8 run loads in a bf16 run and the other way round: the names stay those of the model."""
    from torchao.float8.float8_linear import Float8Linear

    return type("EngineFloat8Linear", (Float8Linear,), {"get_extra_state": EngineLinear.get_extra_state,
                                                        "set_extra_state": EngineLinear.set_extra_state})


def convert(model: torch.nn.Module, recipe: str) -> int:
    """Swap model's plain linears (`convertible`) for torchao's Float8Linear of `recipe`, in place (an EngineLinear for
    the same with its state-dict keys), and give its tensor-parallel linears (`parallel_convertible`) FP8 GEMMs
    (`float8_parallel_linear`); returns how many linears in all."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_linear_utils import swap_linear_layers

    engine = {name for name, m in model.named_modules() if type(m) is EngineLinear and convertible(m)}
    count = sum(1 for m in model.modules() if convertible(m))
    config = Float8LinearConfig.from_recipe_name(recipe)
    convert_to_float8_training(model, config=config, module_filter_fn=convertible)   # torchao's entry: its set-up too
    swap_linear_layers(model, lambda m: engine_float8_linear().from_float(m, config=config),
                       module_filter_fn=lambda m, name: name in engine)
    parallel = [m for m in model.modules() if parallel_convertible(m)]
    # torchao's per-GEMM settings (emulation, fast accumulation, padding) as its Float8Linear derives them from config
    mm_config = Float8Linear(ALIGN, ALIGN, bias=False, config=config, device="meta").linear_mm_config
    for m in parallel:   # the class swapped on the instance (as torch's fully_shard does): names, parameters kept
        m.__class__ = float8_parallel_linear(type(m))
        m.float8_config, m.float8_mm_config = config, mm_config
    return count + len(parallel)


def parallel_convertible(module: torch.nn.Module) -> bool:
    """A tensor-parallel linear (megatron's column- or row-parallel, under TP > 1) whose local widths (this rank's
    shard of the weight) FP8 GEMMs take, not converted yet."""
    if tp_world() == 1:
        return False
    layers = mcore().tensor_parallel
    return (isinstance(module, (layers.ColumnParallelLinear, layers.RowParallelLinear))
            and type(module) not in FLOAT8_PARALLEL and module.weight.shape[0] % ALIGN == 0
            and module.weight.shape[1] % ALIGN == 0)


FLOAT8_PARALLEL: set[type] = set()   # the classes float8_parallel_linear made


@functools.cache
def float8_parallel_linear(base: type) -> type:
    """`base` (model/parallel.py's megatron column- or row-parallel linear) with each of its GEMMs in FP8, by
    torchao's float8 matmul (the autograd function of its Float8Linear: y = x Wᵀ, ∂x = ∂y W, ∂W = ∂yᵀ x, operands cast
    with scales computed on the fly), on this rank's shard: W_c (d_out/TP, d) of a column linear, W_r (d_out, d/TP)
    of a row linear. megatron's communication stays where it was: the column linear's input is copy_to_tp (identity
    forward, ∂x all-reduced over TP backward: megatron's `allreduce_dgrad`, here after the ∂x GEMM rather than
    overlapped with the ∂W one), the row linear's output is all-reduced (or reduce-scattered over the sequence) by
    megatron's forward (model/parallel.py `_sequence_row_forward`) as before, in the GEMM's output dtype.

    Scales are per shard: each rank scales its own W_c or W_r, x slice and ∂y slice (tensorwise: one scale per shard;
    rowwise: per row of the shard). No extra communication, as TransformerEngine's current scaling keeps them local;
    torchtitan's DTensor path all-reduces each amax instead so that TP = k scales as TP = 1 does. So an FP8 run at
    TP = k is not bit-equal to TP = 1's: each differs from bf16 by FP8 rounding."""
    from torchao.float8.float8_linear import matmul_with_hp_or_float8_args

    def matmul(self, x, weight=None):
        """x Wᵀ in FP8, no bias or communication. Under autocast x takes its dtype first, as torchao's Float8Linear
        does (that one on CUDA only), so that the result is in it."""
        kind = x.device.type
        if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
            x = x.to(torch.get_autocast_dtype(kind))
        weight = self.weight if weight is None else weight
        return matmul_with_hp_or_float8_args.apply(x, weight.t(), self.float8_mm_config, self.float8_config)

    def forward_impl(self, input, weight, bias=None, gradient_accumulation_fusion=False, allreduce_dgrad=False,
                     sequence_parallel=False, grad_output_buffer=None, **_):
        if gradient_accumulation_fusion or sequence_parallel or grad_output_buffer is not None:   # never set here
            raise ValueError(f"train.fp8 runs {base.__name__} without megatron's gradient accumulation fusion, "
                             "sequence parallelism or deferred weight gradients (model/parallel.py leaves them off)")
        y = matmul(self, copy_to_tp(input) if allreduce_dgrad else input, weight)
        if bias is not None:
            return y + bias.to(y.dtype)
        # the row linear's output goes to megatron's all-reduce, in place: torchao's matmul returns a view of its
        # own result, which autograd forbids changing in place under torch.compile (a copy of y, not of the GEMM)
        return y.clone() if reduced_in_place else y

    reduced_in_place = issubclass(base, mcore().tensor_parallel.RowParallelLinear)

    layer = type(f"Float8{base.__name__}", (base,), {"matmul": matmul, "_forward_impl": forward_impl})
    FLOAT8_PARALLEL.add(layer)
    return layer
