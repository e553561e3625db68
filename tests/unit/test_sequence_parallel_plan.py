"""parallel.sequence_parallel in the memory plan, the config check and the DeepSpeed config, without a launch."""
from pathlib import Path

import pytest

from model import ConfigError

from pretrain.config import load_config
from pretrain.config.deepspeed_dict import deepspeed_config
from pretrain.plan.memory import layout_of, plan

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo-cpu.yaml"
TP2 = ["parallel.tp=2", "model.dropout=0.1", "model.n_layers=3", "model.mixer=dense"]


def test_the_plan_counts_norms_dropouts_and_residuals_on_n_over_tp_positions():
    """The activations the plan saves equal, by hand: per layer two layer norms' inputs (a·N·d) and fp32 statistics
    (2·4·N) and two dropout masks (a·N·d on a CPU), the final norm's input and statistics, the embedding's mask — each
    (1 − 1/tp) of it; N = B·n."""
    on, off = (load_config(DEMO, TP2 + [f"parallel.sequence_parallel={v}"]) for v in ("true", "false"))
    stage_on, stage_off = (plan(c, layout_of(c, 2), device="cpu").stages[0] for c in (on, off))
    m, B = on.model, on.train.micro_batch_size
    N, d, a = B * m.max_seq_len, m.d_model, 4
    norm = a * N * d + 2 * 4 * N
    whole = m.n_layers * (2 * norm + 2 * a * N * d) + norm + a * N * d   # a CPU's masks: in the activations' dtype
    assert stage_off.activations.total - stage_on.activations.total == whole - whole // 2
    assert any(note.startswith("sequence parallelism: norms, dropout masks and residual stream on n/2")
               for note in stage_on.notes)
    assert not any("sequence parallelism" in note for note in stage_off.notes)
    layer = {t.name: t.bytes for t in stage_on.breakdown["dense"]}
    assert layer["layer norm inputs and statistics, n/2 positions (sequence parallel)"] == 2 * norm // 2
    assert layer["normed input of the mixer"] == a * N * d   # gathered: the column-parallel linears keep all n


def test_pipeline_buffers_hold_n_over_tp_positions_and_deepspeed_keeps_them_whole():
    """Under PP the activations between stages are this rank's n/tp positions: DeepSpeed must not split them again
    over TP (pipe_partitioned assumes the TP ranks hold the same tensor)."""
    layout = ["parallel.pp=2", "parallel.zero_stage=1"]
    on, off = (load_config(DEMO, TP2 + layout + [f"parallel.sequence_parallel={v}"]) for v in ("true", "false"))
    last_on, last_off = (plan(c, layout_of(c, 4), device="cpu").stages[1] for c in (on, off))
    N, d = on.train.micro_batch_size * on.model.max_seq_len, on.model.d_model
    held = last_off.pipe.bytes // (4 * N * (on.model.vocab_size // 2) + 4 * N * d)
    assert last_off.pipe.bytes - last_on.pipe.bytes == held * 4 * N * d // 2   # the stage's input
    assert deepspeed_config(on, 1)["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    assert "pipeline" not in deepspeed_config(off, 1)


def test_max_seq_len_must_split_over_tp():
    odd = ["parallel.tp=2", "model.max_seq_len=63", "model.n_heads=2"]
    with pytest.raises(ConfigError) as e:
        load_config(DEMO, odd + ["parallel.sequence_parallel=true"]).check_runtime(2)
    msg = str(e.value)
    assert msg.startswith("model.max_seq_len=63 is not divisible by parallel.tp=2") and "\n" not in msg
    assert "parallel.sequence_parallel=false" in msg
    load_config(DEMO, odd).check_runtime(2)   # without it, any length
