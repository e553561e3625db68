"""train.fp8 under tensor parallelism (pretrain/float8.py `float8_parallel_linear`) on two real gloo processes: every
column- and row-parallel linear runs its three GEMMs in FP8 (counted: torchao's `_scaled_mm`, three a linear), names
and state-dict keys unchanged, and the loss and gradients equal a reference computed another way, on one process: the
TP = 1 model whose linears run torchao's float8 matmul on the TP shards of their weights (a column linear's output
rows, a row linear's input columns) and concatenate or sum the results. FP8 scales are per shard (each rank scales
its own shard, x slice and ∂y slice), so TP = 2 with FP8 is that reference, not the TP = 1 FP8 model; against the
latter it differs by FP8 rounding only (bounded below). Both recipes (tensorwise: a scale a shard; rowwise: a scale
a row of a shard); with sequence parallelism (the row linears' sequence reduce-scatter) the numbers are the same."""
import pytest
import torch
import torch.distributed as dist

from model import ModelConfig, build_model
from model import parallel as tp
from pretrain import float8
from tests.support.distributed import run_distributed

torchao = pytest.importorskip("torchao.float8", reason="torchao is not installed (pip install 'synthformer[fp8]')")

TP = 2
# widths FP8 takes on each shard: q, k, v and the MLP's fc (64 → 32 and 256 → 128 a rank), out and proj (32, 128 → 64)
CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, max_seq_len=16, init_std=0.2, seed=7,
                  mixer="dot")
LINEARS = 12   # per block: q, k, v, out, fc, proj


def batch():
    return torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))


def gemm_count(prof) -> int:
    return sum(e.count for e in prof.key_averages() if e.key == "aten::_scaled_mm")


def full(t: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """The full tensor of a (possibly TP-sharded) parameter or its gradient."""
    if not tp.is_sharded(param):
        return t.detach().clone()
    parts = [torch.empty_like(t) for _ in range(tp.tp_world())]
    dist.all_gather(parts, t.detach().contiguous(), group=tp.tp_group())
    return torch.cat(parts, dim=param.partition_dim)


def fp8_worker(rank, world, cases):
    """Per (recipe, sequence parallelism) case: the TP model converted, one forward and backward, FP8 GEMMs counted."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    out = {}
    for recipe, sequence_parallel in cases:
        tp.set_sequence_parallel(sequence_parallel)
        try:
            model = build_model(CFG)
            keys = list(model.state_dict())
            converted = float8.convert(model, recipe)
            tokens = batch()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                loss = model(tokens[:, :-1], tokens[:, 1:])
                loss.backward()
        finally:
            tp.set_sequence_parallel(False)
        out[recipe, sequence_parallel] = {
            "converted": converted, "keys": keys, "keys_after": list(model.state_dict()), "gemms": gemm_count(prof),
            "fp8_classes": sorted({type(m).__name__ for m in model.modules() if type(m) in float8.FLOAT8_PARALLEL}),
            "loss": loss.item(), "grads": {n: full(p.grad, p) for n, p in model.named_parameters()}}
    parallel_state.destroy_model_parallel()
    return out


def compile_worker(rank, world):
    """The FP8 MLP of a TP block (a column then a row linear): output and input gradient, eager and compiled
    (aot_eager: dynamo's and autograd's tracing, no inductor)."""
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    mlp = build_model(CFG).blocks[0].mlp
    float8.convert(mlp, "tensorwise")
    x = torch.randn(2, 8, CFG.d_model, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = []
    for fn in (mlp, torch.compile(mlp, backend="aot_eager")):
        y = fn(x)
        (dx,) = torch.autograd.grad(y.square().sum(), x)
        out.append((y.detach(), dx))
    parallel_state.destroy_model_parallel()
    return out


@pytest.mark.slow
def test_fp8_tensor_parallel_linears_compile():
    """train.compile with FP8 under TP: compiled equals eager. Before, torch.compile refused the row linear: torchao's
    matmul returns a view, which megatron's all-reduce changes in place."""
    for (y, dx), (y_compiled, dx_compiled) in run_distributed(compile_worker, TP):
        assert torch.allclose(y_compiled, y, rtol=1e-6, atol=1e-6 * y.abs().max().item())
        assert torch.allclose(dx_compiled, dx, rtol=1e-6, atol=1e-6 * dx.abs().max().item())


class ShardedFloat8Linear(torch.nn.Linear):
    """The reference: y = x Wᵀ + b by torchao's float8 matmul on each of the TP shards of W, as megatron splits it
    (model/parallel.py `partition_dim`: 0 column, 1 row), the outputs concatenated (column) or summed (row)."""

    def __init__(self, linear: torch.nn.Linear, config):
        from torchao.float8.float8_linear import Float8Linear

        super().__init__(linear.in_features, linear.out_features, bias=False, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.config = config
        self.mm_config = Float8Linear(16, 16, bias=False, config=config, device="meta").linear_mm_config

    def forward(self, x):
        from torchao.float8.float8_linear import matmul_with_hp_or_float8_args as mm

        dim = self.weight.partition_dim
        shards = self.weight.chunk(TP, dim=dim)
        if dim == 0:   # column: each shard's outputs
            y = torch.cat([mm.apply(x, w.t(), self.mm_config, self.config) for w in shards], dim=-1)
        else:          # row: each shard's partial sums over its slice of x
            y = sum(mm.apply(xs, w.t(), self.mm_config, self.config) for xs, w in zip(x.chunk(TP, dim=-1), shards))
        return y if self.bias is None else y + self.bias


def reference(recipe: str, sharded: bool) -> tuple[float, dict]:
    """Loss and gradients of the TP = 1 model with FP8 linears: per TP shard (`sharded`) or torchao's own."""
    from torchao.float8 import Float8LinearConfig
    from torchao.float8.float8_linear_utils import swap_linear_layers

    model = build_model(CFG)
    if sharded:
        config = Float8LinearConfig.from_recipe_name(recipe)
        swap_linear_layers(model, lambda m: ShardedFloat8Linear(m, config),
                           module_filter_fn=lambda m, name: isinstance(m, torch.nn.Linear))
    else:
        float8.convert(model, recipe)
    tokens = batch()
    loss = model(tokens[:, :-1], tokens[:, 1:])
    loss.backward()
    return loss.item(), {n: p.grad for n, p in model.named_parameters()}


def test_tp2_runs_every_tensor_parallel_linear_in_fp8_as_the_sharded_reference():
    cases = [("tensorwise", False), ("rowwise", True)]
    results = run_distributed(fp8_worker, TP, cases)
    for recipe, sequence_parallel in cases:
        loss_ref, grads_ref = reference(recipe, sharded=True)
        loss_tp1, _ = reference(recipe, sharded=False)
        top = max(g.abs().max().item() for g in grads_ref.values())
        for r in range(TP):
            got, case = results[r][recipe, sequence_parallel], f"{recipe}, sequence parallel {sequence_parallel}"
            assert got["converted"] == LINEARS, (case, got["converted"])
            assert got["fp8_classes"] == ["Float8ColumnParallelLinear", "Float8RowParallelLinear"], case
            assert got["gemms"] == 3 * LINEARS, (case, got["gemms"])   # forward, ∂x and ∂W of each: all in FP8
            assert got["keys_after"] == got["keys"], case
            assert abs(got["loss"] - loss_ref) <= 1e-5 * loss_ref, (case, got["loss"], loss_ref)
            assert got["grads"].keys() == grads_ref.keys()
            for name, g in grads_ref.items():
                err = (got["grads"][name] - g).abs().max().item()
                assert err <= 1e-5 * top, f"{case}, rank {r}: grad of {name} differs by {err} (largest {top})"
        # per-shard scales against one scale a tensor (or a row): FP8 rounding apart (e4m3: 2⁻⁴ relative), not equal
        assert loss_tp1 != loss_ref and abs(loss_tp1 - loss_ref) <= 0.02 * loss_ref, (case, loss_tp1, loss_ref)


def pipeline_worker(rank, world, tp_size):
    """This rank's pipeline stage (TP × PP = world, PP 2), converted; its forward on its own input (tokens on the
    first stage, hidden states on the last) and a backward: FP8 GEMMs counted."""
    import deepspeed
    from megatron.core import parallel_state

    from pretrain.pipeline import build_pipeline

    deepspeed.init_distributed(dist_backend="gloo")   # over the process group already there
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp_size, pipeline_model_parallel_size=2)
    try:
        stage = build_pipeline(CFG, tp_size, 2, 1, "uniform")
        keys = list(stage.state_dict())
        converted = float8.convert(stage, "tensorwise")
        first = parallel_state.get_pipeline_model_parallel_rank() == 0
        tokens = batch()[:, :-1]
        x = tokens if first else torch.randn(2, 16, CFG.d_model, requires_grad=True)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            stage(x).float().square().mean().backward()
        return {"converted": converted, "gemms": gemm_count(prof), "same_keys": list(stage.state_dict()) == keys}
    finally:
        parallel_state.destroy_model_parallel()


def test_each_pipeline_stage_runs_its_tensor_parallel_linears_in_fp8():
    """TP 2 × PP 2 on four processes: each stage converts the linears of its block (megatron's: the plain ones of a
    TP = 1 stage are torchao's own swap, tested at PP = 1), and each of them runs its three GEMMs in FP8; names
    unchanged."""
    for got in run_distributed(pipeline_worker, 4, 2):
        assert got == {"converted": LINEARS // 2, "gemms": 3 * LINEARS // 2, "same_keys": True}, got
