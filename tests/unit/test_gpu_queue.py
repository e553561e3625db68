"""The GPU measurement queue (benchmarks/gpu_queue.py) on the CPU: part 0 wired to benchmarks/compile_check.py, the
kernel census (benchmarks/kernel_census.py) independent of the widths it shrinks, and which parts' figures stand
read off records."""
import json
import os

from benchmarks.bench import parse_args
from benchmarks.gpu_queue import configurations, planning_args, report, standing
from benchmarks.kernel_census import CENSUS_VERSION, census_of, key

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_part_0_runs_the_compile_check_into_the_parts_folder(tmp_path):
    """--gpu-part 0 plans no bench point and runs compile_check.py with PART0_ARGS into --out; here its cheapest
    check (the fused loss alone under aot_eager, 16 chunks) through the same argument list."""
    from benchmarks.compile_check import PART0_ARGS, main as compile_check

    a = parse_args(["--quick", "--gpu-part", "0", "--out", str(tmp_path)])
    assert a.only == [] and a.gpu_part == 0
    assert compile_check(PART0_ARGS + ["--quick", "--checks", "loss", "--backends", "aot_eager", "--out",
                                       str(tmp_path)]) == 0
    got = json.loads((tmp_path / "compile-check.json").read_text())
    assert got["chunk_elements"] == 2**12 and [r["check"] for r in got["results"]] == ["fused loss alone"]
    assert got["results"][0]["loss_rel"] == 0 and got["results"][0]["grad_rel_max"] == 0
    specs = configurations(0, a)   # what part 0's census counts: the loop's model per mixer, the record's point
    assert [s["kind"] for s in specs] == ["loop"] * 3 and specs[-1]["schedule"] is False and specs[-1]["same_batch"]
    assert [o for s in specs[:2] for o in s["overrides"] if o.startswith("model.mixer")] == \
        ["model.mixer=dot", "model.mixer=dense+dot"]


def test_the_census_counts_the_structure_not_the_widths():
    """One census process: the flagship's engine under train.autocast at the census's shape (2 heads, n 32,
    vocabulary 64) and at twice each (4 heads, n 64, vocabulary 128) counts the same kernels in every phase, and
    records the same beside them; the flagship and dot (another structure) do not. Compiled, its record names what
    is compiled (the blocks, the embedding, the head + loss) over the same counts."""
    over = ["model.vocab_size=32000", "model.d_model=2048", "model.n_layers=1", "model.n_heads=16",
            "model.max_seq_len=2048", "train.micro_batch_size=4", "train.global_batch_size=4", "parallel.tp=1",
            "train.precision=bf16", "parallel.zero_stage=0", "train.autocast=true"]
    flagship = {"kind": "train", "config": "configs/synth-1.3b.yaml", "overrides": over + ["model.mixer=dense+dot"]}
    wider = {**flagship, "overrides": over + ["model.mixer=dense+dot", "model.seed=2"],   # another key, same model
             "census_shape": {"heads_per_rank": 4, "n": 64, "vocab_per_rank": 128}}
    dot = {**flagship, "overrides": over + ["model.mixer=dot"]}
    compiled = {**flagship, "compile": True}
    got = census_of([flagship, wider, dot, compiled], ROOT)
    a, b, c, d = (got[key(s)] for s in (flagship, wider, dot, compiled))
    print({k: {p: sum(n.values()) for p, n in v.items() if p != "beside"} for k, v in (("flagship", a), ("dot", c))})
    assert a == b and set(a) == {"forward", "backward", "optimizer step", "beside"}
    assert a["forward"] != c["forward"] and sum(a["optimizer step"].values()) > 0
    assert a["beside"]["compiled"] == {} and a["beside"]["sdpa"] and a["beside"]["sdpa"] != c["beside"]["sdpa"]
    assert {k: v for k, v in d.items() if k != "beside"} == {k: v for k, v in a.items() if k != "beside"}
    assert sorted(n.split("(")[0] for n in d["beside"]["compiled"]) == ["Block._call_impl", "SynthesizerLM.embed",
                                                                         "SynthesizerLM.head_loss"]


def test_the_queue_says_which_figures_stand_and_which_part_runs_next(tmp_path):
    """Records planted under a docs/gpu of their own: part 1 measured everything it plans with the census of today,
    part 2 one configuration whose census has changed since, part 7 one of its three runs (the other two are its
    ratios' partners: all three run again, side by side); every other part never. Part 0 comes first: never measured,
    it runs next; without it, part 2 (changed). Two records of part 4 on one day: the newer is the later commit in
    git's history (2b137c4 follows 7f38757), not the later folder name. A record made before compiled points had
    keys of their own (part 1's) is keyed again from its specs."""
    planned = {k: configurations(k, planning_args(k, parse_args)) for k in (1, 2, 4, 7)}   # as on an H100
    import torch

    census = {"forward": {"mm": 3}, "backward": {"mm": 6}, "optimizer step": {"_fused_adamw": 1}, "beside": {}}

    def old_key(spec):   # compiled or not left out, as records before CENSUS_VERSION 2 keyed them
        return json.dumps({k: spec[k] for k in ("kind", "config", "overrides")}, sort_keys=True)

    def record(name, part, specs, counts, commit="abc1234", keyed=old_key):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "census.json").write_text(json.dumps({
            "commit": commit, "device": "NVIDIA H100 80GB HBM3", "torch": torch.__version__,
            "census_version": CENSUS_VERSION, "parts": {str(part): [keyed(s) for s in specs]},
            "configurations": {keyed(s): {"spec": s, "census": counts} for s in specs}}))

    record("2026-11-27-abc1234-h100", 1, planned[1], census)
    record("2026-11-28-abc1234-h100", 2, planned[2][:1], {**census, "forward": {"mm": 2}})
    record("2026-11-28-abc1234-h100-b", 7, planned[7][:1], census)
    record("2026-11-29-2b137c4-h100", 4, planned[4], census, commit="2b137c4", keyed=key)
    record("2026-11-29-7f38757-h100", 4, planned[4], {**census, "forward": {"mm": 2}}, commit="7f38757", keyed=key)
    now = lambda specs, tree: {key(s): census for s in specs}   # noqa: E731  today's census: as part 1 recorded it
    states = standing(parse_args, parts=range(9), root=str(tmp_path), count=now, log=lambda *_: None)
    print(report(states))
    assert {k: s["state"] for k, s in states.items()} == {0: "never", 1: "stands", 2: "changed", 3: "partly",
                                                           4: "stands", 5: "never", 6: "never", 7: "partly",
                                                           8: "partly"}   # 8 shares a point of 1; 6 is a script
    assert states[2]["changed"] == [key(planned[2][0])] and len(states[7]["missing"]) == len(planned[7]) == 3
    assert "census changed: forward ops" in states[2]["points"][key(planned[2][0])]["why"]
    assert len(states[3]["stands"]) == 4   # part 1's accumulation-1 points, beside part 3's accumulation 8
    assert report(states).endswith("next: part 0 (make gpu-bench PART=0, or make gpu-window)")
    assert report({k: s for k, s in states.items() if k}).endswith("next: part 2 (make gpu-bench PART=2, or make "
                                                                     "gpu-window)")
