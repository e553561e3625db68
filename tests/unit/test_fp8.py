"""train.fp8 (pretrain/float8.py): torchao's float8 training of the plain linears, switched on by the config and applied
by build_engine. On the CPU: each setting the GPU, the layout or the install cannot run is refused in one line naming
the key, and (where torchao is installed) the conversion swaps exactly the plain linears, keeps every name, and the
converted model's loss and gradients are the bf16 model's within FP8's rounding."""
import sys

import pytest
import torch

from model import build_model
from model.config import ConfigError
from pretrain import float8
from pretrain.config import load_config
from tests.unit.test_model import config, tokens

DEMO = "configs/demo-cpu.yaml"
BF16 = ["train.precision=bf16", "train.fp8=tensorwise"]


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    message = str(e.value)
    assert "\n" not in message, message
    return message


def test_fp8_settings_the_run_cannot_take_are_one_line_errors(monkeypatch):
    assert error_of(load_config, DEMO, ["train.fp8=fp4"]) == \
        "train.fp8='fp4' is out of range; allowed: null, tensorwise, rowwise"
    assert error_of(load_config, DEMO, ["train.fp8=rowwise"]).startswith(
        "train.fp8='rowwise' needs train.precision='bf16' (it is 'fp32')")
    for layout in (["parallel.tp=2"], ["parallel.pp=2", "parallel.zero_stage=1"]):   # FP8 on TP and PP linears too
        assert load_config(DEMO, BF16 + layout).check_runtime(2).dp == 1   # (tests/distributed/test_fp8_tensor_parallel.py)
    cfg = load_config(DEMO, BF16)
    assert cfg.check_runtime(1).dp == 1
    float8.check(load_config(DEMO, ["train.precision=bf16"]), torch.device("cpu"))   # off: nothing to check
    if "torchao" in sys.modules or _have_torchao():
        assert error_of(float8.check, cfg, torch.device("cpu")) == (
            "train.fp8='tensorwise' needs a CUDA GPU of compute capability ≥ 8.9 (FP8 tensor cores: H100, H200, "
            "L40S); this rank runs on the cpu; set train.fp8=null")
    monkeypatch.setitem(sys.modules, "torchao", None)   # as where it is not installed: `import torchao` fails
    monkeypatch.setitem(sys.modules, "torchao.float8", None)
    assert error_of(float8.check, cfg, torch.device("cpu")).startswith(
        "train.fp8='tensorwise' needs torchao: pip install 'synthformer[fp8]'")


def _have_torchao() -> bool:
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fp8_swaps_the_plain_linears_and_keeps_every_name(recipe):
    """A dense+dot model of aligned widths (d 64, 4 heads): each plain linear becomes a Float8Linear, the others
    (embedding, norms, the mixers' own weights) stay; the state dict's names are unchanged; one step under bf16
    autocast on the CPU (torchao's FP8 GEMM runs here too) gives the unconverted model's loss within 2% and a
    gradient for every parameter, each pointing the unconverted gradient's way (cosine > 0.9) where it is not 0 in
    exact arithmetic."""
    if not _have_torchao():
        pytest.skip("torchao is not installed (pip install 'synthformer[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    cfg = config("dense+dot", d_model=64, n_heads=4, init_std=0.02)
    torch.manual_seed(0)
    ref, fp8 = build_model(cfg), build_model(cfg)
    plain = {n for n, m in ref.named_modules() if float8.convertible(m)}
    assert float8.convert(fp8, recipe) == len(plain) > 0
    assert {n for n, m in fp8.named_modules() if isinstance(m, Float8Linear)} == plain
    assert list(fp8.state_dict()) == list(ref.state_dict())
    x = tokens(2, 16)
    out = []
    for model in (ref, fp8):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = model(x[:, :-1], x[:, 1:])
        loss.backward()
        out.append((loss.item(), {n: p.grad.float().flatten() for n, p in model.named_parameters()}))
    (loss_ref, g_ref), (loss_fp8, g_fp8) = out
    assert abs(loss_fp8 - loss_ref) <= 0.02 * loss_ref, (loss_fp8, loss_ref)
    assert g_fp8.keys() == g_ref.keys()
    top = max(g.norm() for g in g_ref.values())
    for name, g in g_ref.items():
        if g.norm() > 1e-3 * top:   # not a gradient that is 0 in exact arithmetic (a key bias's: softmax ignores it)
            assert torch.nn.functional.cosine_similarity(g_fp8[name], g, dim=0) > 0.9, name


def test_fp8_swaps_the_linears_of_a_model_built_under_a_process_group():
    """Every launch builds its model under a process group, where the plain linears are EngineLinear (megatron's
    state-dict keys): those are converted too (before: `type(m) is nn.Linear` left every one of them in bf16, FP8
    converted nothing in a real run), and the state dict keeps its names, `_extra_state` entries included, so an FP8
    run's checkpoint loads into a bf16 model strictly."""
    if not _have_torchao():
        pytest.skip("torchao is not installed (pip install 'synthformer[fp8]')")
    import torch.distributed as dist

    from model.parallel import EngineLinear

    cfg = config("dense+dot", d_model=64, n_heads=4, init_std=0.02)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        ref, fp8 = build_model(cfg), build_model(cfg)
    finally:
        dist.destroy_process_group()
    engine = {n for n, m in ref.named_modules() if type(m) is EngineLinear}
    assert engine and float8.convert(fp8, "tensorwise") == len(engine)
    assert not any(type(m) is EngineLinear for m in fp8.modules())
    assert list(fp8.state_dict()) == list(ref.state_dict()) and any(k.endswith("_extra_state") for k in ref.state_dict())
    ref.load_state_dict(fp8.state_dict(), strict=True)
    fp8.load_state_dict(ref.state_dict(), strict=True)


def test_every_converted_linear_runs_its_fp8_gemm_the_joint_projections_too():
    """Each converted linear is called as a module in a forward (its FP8 GEMMs run), the joint projections of a mixer
    (q, k, values: one joint GEMM in bf16) included: before, joint_column read their weights and ran them in bf16,
    so the q, k and value linears of this dot model never ran in FP8. Unconverted, the joint GEMM stays (the
    hooks on the plain linears see none of the three)."""
    if not _have_torchao():
        pytest.skip("torchao is not installed (pip install 'synthformer[fp8]')")
    from torchao.float8.float8_linear import Float8Linear

    cfg = config("dot", d_model=64, n_heads=4, init_std=0.02)
    torch.manual_seed(0)
    model = build_model(cfg)
    plain_called = set()
    for name, m in model.named_modules():
        if float8.convertible(m):
            m.register_forward_hook(lambda mod, args, out, name=name: plain_called.add(name))
    x = tokens(2, 16)
    model(x[:, :-1], x[:, 1:])
    converted = float8.convert(model, "tensorwise")
    called = set()
    for name, m in model.named_modules():
        if isinstance(m, Float8Linear):
            m.register_forward_hook(lambda mod, args, out, name=name: called.add(name))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(x[:, :-1], x[:, 1:]).backward()
    assert len(called) == converted > len(plain_called), (converted, sorted(called), sorted(plain_called))
