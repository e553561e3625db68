"""pretrain/config/: shipped configs, composition, overrides, one-line errors, LR schedule, DeepSpeed dict."""
import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import yaml

from model import variants
from model.config import ConfigError
from pretrain.config import TrainConfig, load_config
from pretrain.distributed import free_local_port
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.engine import lr_lambda
from pretrain.prelaunch import main
from tools import variant_configs

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "configs"
DEMO = CONFIGS / "demo-cpu.yaml"
# The world each shipped config is written for (its header comment says the same); variants run like the demo.
WORLD = {"demo-cpu.yaml": 2, "synth-125m.yaml": 8, "synth-350m.yaml": 16, "synth-1.3b.yaml": 64,
         "study-gpu-50m.yaml": 1}
CLUSTER = ("synth-125m.yaml", "synth-350m.yaml", "synth-1.3b.yaml")
STUDIES = sorted((CONFIGS / "studies").glob("*.yaml"))   # tools/ablate.py presets, not training configs
SHIPPED = sorted(set(CONFIGS.rglob("*.yaml")) - set(STUDIES))


def world_of(path: Path) -> int:
    return WORLD[path.name] if path.parent == CONFIGS else WORLD["demo-cpu.yaml"]


def error_of(fn, *args, **kwargs) -> str:
    with pytest.raises(ConfigError) as e:
        fn(*args, **kwargs)
    msg = str(e.value)
    assert "\n" not in msg, f"multi-line error: {msg!r}"
    return msg


def write(tmp_path: Path, name: str, text: str) -> Path:
    p = tmp_path / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(textwrap.dedent(text))
    return p


# ---- shipped configs ------------------------------------------------------------------------------------------------
def test_every_study_variant_and_size_is_shipped():
    names = {p.relative_to(CONFIGS).as_posix() for p in SHIPPED}
    study = [f"variants/{variant_configs.file_name(v)}" for v in variants.subset("study")]
    assert set(WORLD) | set(study) <= names
    assert len(names) == len(WORLD) + len(study), "a new config needs an intended world size in WORLD"


def test_variant_configs_are_what_the_registry_writes():
    """configs/variants/ holds one file per study variant of model/variants.py, as tools/variant_configs.py writes
    it: a variant registered (or removed) without its config fails here."""
    assert variant_configs.main(["--check"]) == 0, "run: python tools/variant_configs.py"


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.relative_to(CONFIGS).as_posix())
def test_shipped_config_fits_its_world_and_deepspeed_arithmetic(path):
    cfg = load_config(path)
    rt = cfg.check_runtime(world_of(path), cuda=True)
    assert rt.dp * cfg.parallel.tp * cfg.parallel.pp == rt.world_size
    ds = deepspeed_config(cfg, rt.dp)
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * rt.dp
    assert ds["gradient_accumulation_steps"] == rt.grad_accum >= 1
    assert ds["zero_optimization"]["stage"] == cfg.parallel.zero_stage
    if path.name in CLUSTER:  # cluster configs: bf16, ~0.5M tokens per step, GPT-3-style LR
        assert ds["bf16"]["enabled"] and cfg.logging.peak_tflops_per_device is None   # from the device
        assert 0.4e6 <= cfg.tokens_per_step <= 1.1e6
        assert cfg.model.vocab_size == 32000 and cfg.train.min_lr == pytest.approx(cfg.train.lr / 10)
        assert cfg.total_steps() < cfg.train.max_steps  # max_tokens ends these runs, where the cosine ends


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.name)
def test_study_presets_name_a_shipped_config_and_valid_variants(path):
    from tools.ablate import study_settings

    args = study_settings(["--preset", str(path)])
    assert args.seeds >= 1 and args.steps >= 1 and (ROOT / args.config) in SHIPPED
    for variant in args.variants.split(","):
        load_config(ROOT / args.config, [f"model.mixer={variant}"])


def test_demo_values():
    cfg = load_config(DEMO)
    m, t = cfg.model, cfg.train
    assert (m.vocab_size, m.d_model, m.n_layers, m.n_heads, m.max_seq_len) == (4096, 128, 4, 4, 128)
    assert (t.global_batch_size, t.micro_batch_size, t.precision, cfg.parallel.zero_stage) == (16, 8, "fp32", 2)
    assert cfg.check_runtime(2, cuda=False).grad_accum == 1
    assert cfg.data.tokenizer is None  # default: the one beside the shards that their manifest names
    assert cfg.checkpoint.dir == "runs/demo/checkpoints" and cfg.logging.tensorboard_dir == "runs/demo/tensorboard"


def test_deepspeed_own_parser_accepts_the_dicts(monkeypatch):
    """DeepSpeed's DeepSpeedConfig re-checks batch arithmetic (train = micro × accum × dp) and every key's schema. It
    asks torch.distributed for the rank, so pretend rank 0 and hand it the data-parallel size through an mpu."""
    import deepspeed.comm
    from deepspeed.runtime.config import DeepSpeedConfig
    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    for path in (DEMO, CONFIGS / "synth-1.3b.yaml"):
        cfg = load_config(path)
        dp = cfg.check_runtime(world_of(path), cuda=True).dp
        mpu = type("MPU", (), {"get_data_parallel_world_size": lambda self: dp})()
        parsed = DeepSpeedConfig(deepspeed_config(cfg, dp), mpu=mpu)
        assert parsed.world_size == dp
        assert parsed.train_batch_size == cfg.train.global_batch_size
        assert parsed.gradient_accumulation_steps == cfg.train.grad_accum(dp)
        assert parsed.zero_optimization_stage == cfg.parallel.zero_stage
        assert parsed.bfloat16_config.enabled == (cfg.train.precision == "bf16")
        assert parsed.optimizer_name is None  # the trainer's own fused AdamW (pretrain.engine.build_optimizer)
        assert parsed.scheduler_name is None  # the schedule is lr_lambda, not DeepSpeed's


def test_deepspeed_dict_is_the_same_on_every_device():
    """No "optimizer" entry (DeepSpeed would JIT-build FusedAdam on CUDA): the trainer's AdamW is a client optimizer."""
    cfg = load_config(DEMO, ["train.precision=bf16"])
    ds = deepspeed_config(cfg, 2)
    assert "optimizer" not in ds and "scheduler" not in ds
    # the demo's ZeRO-2: GuardedAdamW drops non-finite steps, DeepSpeed's per-tensor check is off; fp32 master weights
    assert ds["bf16"] == {"enabled": True, "check_grad_overflow": False, "bf16_master_weights_and_grads": False,
                          "bf16_optimizer_states": False}
    assert ds["fp16"] == {"enabled": False}
    assert ds["wall_clock_breakdown"] is False and ds["steps_per_print"] >= 10**6
    assert json.loads(json.dumps(ds)) == ds  # plain JSON types only (a tuple would come back as a list)


# ---- composition and overrides --------------------------------------------------------------------------------------
def test_variant_changes_only_mixer_and_run_dir():
    demo, var = load_config(DEMO).to_dict(), load_config(CONFIGS / "variants" / "random_dot.yaml").to_dict()
    assert var["model"]["mixer"] == "random+dot" and var["train"]["run_dir"] == "runs/variants/random_dot"
    assert var["checkpoint"]["dir"] == "runs/variants/random_dot/checkpoints"  # derived after the merge
    for d in (demo, var):
        del d["model"]["mixer"], d["train"]["run_dir"], d["checkpoint"]["dir"], d["logging"]["tensorboard_dir"]
    assert demo == var
    gmlp = load_config(CONFIGS / "variants" / "gmlp.yaml").model
    assert (gmlp.block, gmlp.mixer) == ("gmlp", "sgu")


def test_base_chain_is_relative_to_each_file_and_merges_deeply(tmp_path):
    write(tmp_path, "a/root.yaml", f"base: {os.path.relpath(DEMO, tmp_path / 'a')}\ntrain: {{lr: 1.0e-3, seed: 7}}\n")
    child = write(tmp_path, "b/c/child.yaml", """\
        base: ../../a/root.yaml
        train:
          lr: 2e-3
        checkpoint:
        """)
    cfg = load_config(child)
    assert cfg.train.lr == 2e-3 and isinstance(cfg.train.lr, float)  # `2e-3` is a float, not YAML 1.1's string
    assert cfg.train.seed == 7 and cfg.train.max_steps == 300  # from the middle file and from the demo
    assert cfg.checkpoint.every == 100  # an empty `checkpoint:` in the child does not erase the base's section


def test_base_cycle_and_missing_files_are_one_line_errors(tmp_path):
    write(tmp_path, "x.yaml", "base: y.yaml\n")
    write(tmp_path, "y.yaml", "base: x.yaml\n")
    assert "cycle" in error_of(load_config, tmp_path / "x.yaml")
    assert error_of(load_config, tmp_path / "nope.yaml") == f"config file not found: {tmp_path / 'nope.yaml'}"
    write(tmp_path, "z.yaml", "base: gone.yaml\n")
    assert error_of(load_config, tmp_path / "z.yaml") == (f"config file not found: {tmp_path / 'gone.yaml'} "
                                                          f"(the base: of {tmp_path / 'z.yaml'})")   # who names it
    bad = write(tmp_path, "bad.yaml", "train: [1,\n")
    assert error_of(load_config, bad).startswith(f"{bad}: invalid YAML at line")


def test_missing_required_key_is_named(tmp_path):
    p = write(tmp_path, "p.yaml", f"base: {DEMO}\ntrain: {{max_steps: null}}\n")
    assert error_of(load_config, p).startswith("train.max_steps must be set")
    p = write(tmp_path, "q.yaml", "model: {vocab_size: 8, d_model: 8, n_layers: 1, n_heads: 1, max_seq_len: 8}\n")
    assert error_of(load_config, p).startswith("missing required config key 'data.shard_dir'")


def test_overrides_take_yaml_typed_values():
    cfg = load_config(DEMO, ["train.lr=3e-4", "train.max_steps=50", "model.mixer=[random, dot, dense, random+dot]",
                             "model.tie_embeddings=false", "train.weight_decay=0", "train.max_tokens=null",
                             "train.betas=[0.8, 0.99]", "parallel.tp=2", "logging.sample_prompt=Emma"])
    assert cfg.train.lr == 3e-4 and type(cfg.train.lr) is float
    assert cfg.train.max_steps == 50 and type(cfg.train.max_steps) is int
    assert cfg.model.mixer == ["random", "dot", "dense", "random+dot"]
    assert cfg.model.tie_embeddings is False
    assert cfg.train.weight_decay == 0.0 and type(cfg.train.weight_decay) is float  # int widened to the declared float
    assert cfg.train.max_tokens is None and cfg.train.betas == (0.8, 0.99) and cfg.parallel.tp == 2
    assert cfg.logging.sample_prompt == "Emma"
    assert load_config(DEMO, ["model.mixer=random+dot"]).model.mixer == "random+dot"
    assert load_config(DEMO, ["train.lr=1e-3", "train.lr=2e-3"]).train.lr == 2e-3  # the last one wins


# ---- one-line errors -----------------------------------------------------------------------------------------------
def test_unknown_key_in_file_names_file_and_nearest_key(tmp_path):
    p = write(tmp_path, "x.yaml", f"base: {DEMO}\ntrain:\n  learning_rate: 1.0e-3\n")
    assert error_of(load_config, p) == f"unknown config key 'train.learning_rate' in {p}; did you mean 'train.lr'?"
    p = write(tmp_path, "y.yaml", f"base: {DEMO}\ntrian:\n  lr: 1.0e-3\n")
    assert error_of(load_config, p) == f"unknown config key 'trian' in {p}; did you mean 'train'?"
    # A typo in a base file is reported against that file, not against the variant that includes it.
    write(tmp_path, "base.yaml", f"base: {DEMO}\nmodel:\n  n_layer: 2\n")
    child = write(tmp_path, "child.yaml", "base: base.yaml\n")
    assert error_of(load_config, child) == (f"unknown config key 'model.n_layer' in {tmp_path / 'base.yaml'}; "
                                            "did you mean 'model.n_layers'?")


@pytest.mark.parametrize("item, guess", [
    ("train.learning_rate=3e-4", "train.lr"), ("model.mixr=dot", "model.mixer"), ("train.tp=2", "parallel.tp"),
    ("lr=1e-3", "train.lr"), ("trian.warmup_steps=5", "train.warmup_steps"), ("data.shard=x", "data.shard_dir")])
def test_unknown_override_suggests_nearest_key(item, guess):
    key = item.split("=")[0]
    assert error_of(load_config, DEMO, [item]) == (f"unknown config key '{key}' in override '{item}'; "
                                                   f"did you mean '{guess}'?")
    assert "must look like" in error_of(load_config, DEMO, ["train.lr"])


@pytest.mark.parametrize("item, expect", [
    ("train.lr=-0.001", "train.lr=-0.001"), ("train.min_lr=1", "train.min_lr=1.0"),
    ("train.warmup_steps=301", "train.warmup_steps=301"), ("train.global_batch_size=0", "train.global_batch_size=0"),
    ("train.micro_batch_size=0", "train.micro_batch_size=0"), ("parallel.zero_stage=5", "parallel.zero_stage=5"),
    ("train.precision=fp8", "train.precision='fp8'"), ("train.decay=step", "train.decay='step'"),
    ("train.betas=[0.9, 1.5]", "train.betas=[0.9, 1.5]"), ("data.num_workers=-1", "data.num_workers=-1"),
    ("logging.every=0", "logging.every=0"), ("checkpoint.keep=0", "checkpoint.keep=0"),
    ("parallel.tp=0", "parallel.tp=0"), ("train.max_tokens=0", "train.max_tokens=0")])
def test_out_of_range_names_key_value_and_range(item, expect):
    msg = error_of(load_config, DEMO, [item])
    assert msg.startswith(f"{expect} is out of range; allowed: ")


@pytest.mark.parametrize("item, expect", [
    ("train.max_steps=ten", "train.max_steps='ten' must be of type int"),
    ("train.max_steps=true", "train.max_steps=True must be of type int"),
    ("model.bias=1", "model.bias=1 must be of type bool"), ("train.betas=0.9", "train.betas=0.9 must be a list of 2"),
    ("model.n_heads=3", "model.d_model=128 is not divisible by model.n_heads=3"),  # ModelConfig's own check
    ("parallel.pp=2", "parallel.pp > 1 needs parallel.zero_stage ≤ 1")])  # the demo runs ZeRO-2
def test_wrong_types_and_section_rules(item, expect):
    assert error_of(load_config, DEMO, [item]).startswith(expect)


def test_check_runtime_cross_section_errors():
    demo = load_config(DEMO)
    assert error_of(demo.check_runtime, 3) == ("train.global_batch_size=16 is not divisible by the data-parallel size "
                                               "3: its samples are split evenly over the ranks; data-parallel sizes it "
                                               "can use: 1, 2, 4, 8, 16")
    assert error_of(demo.check_runtime, 4) == ("train.global_batch_size=16 is not divisible by train.micro_batch_size"
                                               " × data-parallel size = 8 × 4 = 32")
    tp2 = load_config(DEMO, ["parallel.tp=2"])
    assert error_of(tp2.check_runtime, 3) == "world size 3 is not divisible by parallel.tp × parallel.cp × parallel.pp = 2 × 1 × 1 = 2"
    assert tp2.check_runtime(4).dp == 2
    assert error_of(load_config(DEMO, ["parallel.tp=8"]).check_runtime, 8) == \
        "model.n_heads=4 is not divisible by parallel.tp=8"
    pp8 = load_config(DEMO, ["parallel.pp=8", "parallel.zero_stage=1"])
    assert error_of(pp8.check_runtime, 8).startswith("model.n_layers < parallel.pp")
    fp16 = load_config(DEMO, ["train.precision=fp16"])  # loads on CPU; refused only when a CPU run would start
    assert "needs CUDA" in error_of(fp16.check_runtime, 2, cuda=False)
    assert fp16.check_runtime(2, cuda=True).grad_accum == 1
    assert "does not exist" in error_of(load_config(DEMO, ["checkpoint.resume=/no/such"]).check_runtime, 2)


def test_bf16_master_weights_are_a_deepspeed_setting_with_one_line_errors():
    """train.master_weights=bf16: DeepSpeed's two flags (weights and moments in bf16), parsed by DeepSpeed itself;
    refused without bf16 compute or outside ZeRO-1/2, in one line naming the key."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(DEMO, ["train.precision=bf16", "train.master_weights=bf16", "parallel.zero_stage=1"])
    ds = deepspeed_config(cfg, cfg.check_runtime(1).dp)
    assert ds["bf16"]["bf16_master_weights_and_grads"] is True and ds["bf16"]["bf16_optimizer_states"] is True
    parsed = DeepSpeedConfig(ds).bfloat16_config   # one process: DeepSpeed's world size is 1
    assert parsed.bf16_master_weights_and_grads and parsed.bf16_optimizer_states
    assert error_of(load_config, DEMO, ["train.master_weights=bf16"]) == (
        "train.master_weights='bf16' needs train.precision='bf16' (it is 'fp32'); set both, or master_weights=fp32")
    assert error_of(load_config, DEMO, ["train.master_weights=fp16"]).startswith("train.master_weights='fp16'")
    zero3 = load_config(DEMO, ["train.precision=bf16", "train.master_weights=bf16", "parallel.zero_stage=3"])
    assert error_of(zero3.check_runtime, 2) == ("train.master_weights='bf16' needs parallel.zero_stage 1 or 2 (it is "
                                                "3); set parallel.zero_stage=1")


def test_autocast_is_deepspeeds_torch_autocast_over_fp32_weights_with_one_line_errors():
    """train.autocast: DeepSpeed's torch_autocast section in bf16, DeepSpeed's bf16 off (the weights stay fp32), and
    the trainer's GuardedAdamW (it guards ZeRO-0 with fp32 weights); refused in one line outside bf16 with fp32
    master weights, ZeRO-0 and TP=1."""
    from deepspeed.runtime.config import DeepSpeedConfig

    cfg = load_config(DEMO, ["train.precision=bf16", "train.autocast=true", "parallel.zero_stage=0"])
    ds = deepspeed_config(cfg, cfg.check_runtime(1).dp)
    assert ds["torch_autocast"] == {"enabled": True, "dtype": "bfloat16"} and ds["bf16"]["enabled"] is False
    assert ds["gradient_clipping"] == 0.0 and ds["zero_allow_untested_optimizer"] is True   # GuardedAdamW clips
    parsed = DeepSpeedConfig(ds)
    assert parsed.torch_autocast_enabled and parsed.torch_autocast_dtype == torch.bfloat16
    assert not parsed.bfloat16_config.enabled
    assert deepspeed_config(load_config(DEMO, ["train.precision=bf16"]), 1)["torch_autocast"]["enabled"] is False
    assert error_of(load_config, DEMO, ["train.autocast=true"]) == (
        "train.autocast=true needs train.precision='bf16' and train.master_weights='fp32' (they are 'fp32', "
        "'fp32'); set them, or train.autocast=false")
    zero1 = load_config(DEMO, ["train.precision=bf16", "train.autocast=true", "parallel.zero_stage=1"])
    assert error_of(zero1.check_runtime, 2).startswith("train.autocast=true needs parallel.zero_stage=0 (it is 1)")
    tp2 = load_config(DEMO, ["train.precision=bf16", "train.autocast=true", "parallel.zero_stage=0", "parallel.tp=2"])
    assert error_of(tp2.check_runtime, 2).startswith("train.autocast=true needs parallel.tp=1 (it is 2)")
    # the memory plan: fp32 weights and moments (12 B a parameter at rest, no master copy), fp32 gradients in the
    # step, and each weight's bf16 copy among the activations
    from pretrain.plan.memory import layout_of, plan

    stage = plan(cfg, layout_of(cfg, 1)).stages[0]
    T = stage.params[0]
    assert stage.states_bytes == 12 * T and stage.step.bytes == 4 * T
    assert any(t.name.startswith("autocast's bf16 copies") and t.bytes == 2 * T for t in stage.activations.kept)


def test_http_headers_from_env_names_environment_variables():
    assert load_config(DEMO, ["data.http_headers_from_env={Authorization: TOKEN}"]).data.http_headers_from_env == {
        "Authorization": "TOKEN"}
    assert error_of(load_config, DEMO, ["data.http_headers_from_env={Authorization: 1bad}"]) == (
        "data.http_headers_from_env={'Authorization': '1bad'} is out of range; allowed: {header: NAME of an "
        "environment variable}, e.g. {Authorization: SHARDS_TOKEN}")


# ---- schedule, serialization, CLI -----------------------------------------------------------------------------------
def test_lr_lambda_warmup_cosine_floor():
    t = load_config(DEMO, ["train.lr=1e-3", "train.min_lr=1e-4", "train.warmup_steps=10",
                           "train.max_steps=110"]).train
    f = lr_lambda(t)
    assert f(0) == 0.0 and f(5) == pytest.approx(0.5) and f(10) == pytest.approx(1.0)
    assert f(35) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi / 4)))  # a quarter of the decay: 0.868
    assert f(60) == pytest.approx(0.55)  # halfway: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    assert lr_lambda(t, total_steps=60)(35) == pytest.approx(0.55)  # a run cut short by max_tokens decays sooner
    lin = load_config(DEMO, ["train.decay=linear", "train.warmup_steps=0", "train.max_steps=100"]).train
    assert lr_lambda(lin)(0) == 1.0 and lr_lambda(lin)(50) == pytest.approx(0.55)
    const = load_config(DEMO, ["train.decay=constant"]).train
    assert lr_lambda(const)(30) == 1.0 and lr_lambda(const)(10**6) == 1.0
    # As the trainer uses it: LambdaLR multiplies train.lr by the factor of the number of steps taken.
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=t.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(t))
    for _ in range(60):
        opt.step(), sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.55e-3)


def test_total_steps_stops_at_max_tokens_first():
    cfg = load_config(DEMO, ["train.max_tokens=204800"])  # 16 × 128 = 2048 tokens per step → 100 steps
    assert cfg.tokens_per_step == 2048 and cfg.total_steps() == 100
    assert load_config(DEMO, ["train.max_tokens=10_000_000"]).total_steps() == 300


def test_to_dict_from_dict_round_trip_through_yaml():
    cfg = load_config(CONFIGS / "variants" / "factorized_dense.yaml", ["model.mixer=[dense, dot, random, dot]"])
    d = cfg.to_dict()
    again = TrainConfig.from_dict(yaml.safe_load(yaml.safe_dump(d)))  # what a checkpoint's config.yaml holds
    assert again == cfg and again.to_dict() == d
    assert again.model.factorized_a * again.model.factorized_b == 128 and again.train.betas == (0.9, 0.95)
    d["train"]["lr"] = -1.0
    assert error_of(TrainConfig.from_dict, d).startswith("train.lr=-1.0")


def test_cli_prints_reloadable_yaml_and_one_line_errors(capsys, tmp_path):
    assert main([str(DEMO), "train.lr=1e-3"]) == 0
    printed = capsys.readouterr().out
    assert TrainConfig.from_dict(yaml.safe_load(printed)) == load_config(DEMO, ["train.lr=1e-3"])
    assert main([str(DEMO), "--deepspeed", "--world-size", "2"]) == 0
    ds = json.loads(capsys.readouterr().out)
    assert ds["train_batch_size"] == 16 and ds["gradient_accumulation_steps"] == 1
    assert main([str(DEMO), "train.learning_rate=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown config key 'train.learning_rate'") and err.count("\n") == 1
    assert main([str(DEMO), "--world-size", "3"]) == 2 and "not divisible" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "--deepspeed" in capsys.readouterr().out


# ---- a real DeepSpeed engine ----------------------------------------------------------------------------------------
ENGINE_SCRIPT = """
import sys, torch, deepspeed
from pretrain.config import load_config
from pretrain.distributed import Layout
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.engine import build_optimizer, lr_lambda
cfg = load_config(sys.argv[1], ["train.max_steps=20", "train.warmup_steps=4"])
rt = cfg.check_runtime(1)
lay = Layout(rank=0, world=1, dp_rank=0, dp=1, tp=1, pp=1, grad_accum=rt.grad_accum, device=torch.device("cpu"))
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
engine, opt, _, sched = deepspeed.initialize(
    model=model, optimizer=build_optimizer(cfg, [{"params": list(model.parameters())}], lay),
    config=deepspeed_config(cfg, rt.dp),
    lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lr_lambda(cfg.train, cfg.total_steps())))
g = torch.Generator().manual_seed(0)
for _ in range(3 * rt.grad_accum):                       # 3 optimizer steps
    x = torch.randn(cfg.train.micro_batch_size, 8, generator=g)
    loss = engine(x).pow(2).mean()
    engine.backward(loss)
    engine.step()
print("RESULT", engine.global_steps, engine.gradient_accumulation_steps(), engine.zero_optimization_stage(),
      type(engine.basic_optimizer).__name__, repr(opt.param_groups[0]["lr"]), repr(cfg.train.lr * lr_lambda(cfg.train,
      cfg.total_steps())(3)), flush=True)
"""


@pytest.mark.slow
def test_deepspeed_initialize_accepts_the_generated_config(tmp_path):
    """One gloo process, the demo's ZeRO-2 fp32 dict (accumulation 2 at dp=1) and our LambdaLR. The first run on a
    machine JIT-builds deepspeed_shm_comm (~65 s); later runs take a few seconds."""
    env = dict(os.environ, RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(free_local_port()),
               PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    script = write(tmp_path, "engine.py", ENGINE_SCRIPT)
    out = subprocess.run([sys.executable, str(script), str(DEMO)], cwd=tmp_path, env=env, capture_output=True,
                         text=True, timeout=600)
    line = [x for x in out.stdout.splitlines() if x.startswith("RESULT")]
    assert out.returncode == 0 and line, out.stdout[-2000:] + out.stderr[-3000:]
    steps, accum, stage, optimizer, lr, expected = line[0].split()[1:]
    assert (int(steps), int(accum), int(stage), optimizer) == (3, 2, 2, "AdamW")  # torch's AdamW: torch_adam honoured
    assert float(lr) == pytest.approx(float(expected)) and float(lr) == pytest.approx(3e-3 * 3 / 4)


def test_init_from_must_be_a_release_of_the_same_architecture(tmp_path):
    from model import build_model
    from model.release import save_release

    assert "is not a release directory" in error_of(
        load_config(DEMO, [f"train.init_from={tmp_path}"]).check_runtime, 2)
    cfg = load_config(DEMO, ["model.n_layers=2"]).model
    save_release(str(tmp_path / "rel"), cfg, dict(build_model(cfg).named_parameters()))
    assert load_config(DEMO, ["model.n_layers=2", f"train.init_from={tmp_path}/rel",
                              "model.dropout=0.1"]).check_runtime(2).dp == 2      # dropout may differ
    assert error_of(load_config(DEMO, [f"train.init_from={tmp_path}/rel"]).check_runtime, 2) == (
        f"train.init_from='{tmp_path}/rel' holds a model with model.n_layers=2 but this config has 4; "
        f"set model.n_layers=2")


def test_mfu_peak_comes_from_the_device_name_unless_a_config_sets_it():
    from pretrain.observe.device_peaks import peak_tflops, peak_tflops_of

    assert peak_tflops_of("NVIDIA H100 80GB HBM3", "bf16") == 989.4
    assert peak_tflops_of("NVIDIA H100 PCIe", "bf16") == 756.0           # the longest matching name wins
    assert peak_tflops_of("NVIDIA A100-SXM4-80GB", "fp32") == 19.5        # per precision
    assert peak_tflops_of("NVIDIA H200", "fp16") == 989.4
    assert peak_tflops_of("Tesla T4", "bf16") is None                     # not in the table: no MFU, not a guess
    cpu = torch.device("cpu")
    assert peak_tflops(cpu, "fp32") is None and peak_tflops(cpu, "bf16", configured=0.5) == 0.5
    assert load_config(DEMO).logging.peak_tflops_per_device is None
    assert "null (from the device) or > 0" in error_of(load_config, DEMO, ["logging.peak_tflops_per_device=0"])
