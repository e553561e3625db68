#!/usr/bin/env python
"""A cluster in miniature, on this machine (`make rehearsal`; not in CI): 8 gloo ranks as 2 "nodes" of 4, each node its
own launch/pretrain.sh under its own supervisor (NNODES=2, NODE_RANK, no ssh), a tiny model, two blended sources over
a local HTTP server. It shows, in order:

  1. a kill -9 of one rank → an automatic relaunch → a bit-exact resume (the replayed steps' losses and samples equal
     the first pass's, every rank);
  2. a hang on rank 5 (SYNTHFORMER_FAULTS stall@8@5) → the stacks and flight-recorder dumps of all 8 ranks, and one
     line that names rank 5;
  3. the same hang again in the relaunch (its fault marker removed) → the crash-loop check stops the relaunches (exit
     3); a relaunch by hand finishes the run;
  4. (folded into 9: the move off a slow node is a relayout, checkpoint.relayout=true from 4 ranks to 2, checked
     step for step against the first run's global batches)
  5. a preemption signal (SIGTERM) to every process of both nodes, data.num_workers 2 → a checkpoint, exit 0, and a
     resume whose losses and batches equal the first run's, bit for bit;
  6. rank 3 (node 0) raises a non-data error while the others wait → the verdict names rank 3 (unknown), and node 1's
     supervisor stops its launcher within 60 s (measured);
  7. the shard server down for longer than the retries (SYNTHFORMER_DATA_RETRIES=2) → the launch ends transient and is
     relaunched; after the server returns, the first run's losses, and no shard marked bad;
  8. a data error (source b's shards damaged on the server, same sizes, other content) → no relaunch, exit 2;
  9. a slow node (4 ranks as 2 nodes of 2, rank 2 slowed 3×, fleet.exclude=true) → named, every rank saves, the
     node leaves, the other relaunches alone at dp 2: the same global batches as the first run's (8 ranks; with
     --only exclude, a 2-rank run made first), no sample read twice.

Claims 5-7 share one run, a copy of the first at step 6 (tools/rehearsal_cases.py tells how).

    python tools/rehearsal.py [--out build/rehearsal] [--hang-timeout 20] [--only exclude]

It prints what it does, a PASS or FAIL per claim, the time taken and the peak resident memory of every process it
started (the budget: 12 minutes and 12 GiB on 2 cores); exit status 0 when all pass.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import sys
import time

from tools.rehearsal_cases import exclude_slow_node, hangs_alike, preempt_error_outage
from tools.rehearsal_kit import (ROOT, T0, Memory, Nodes, Shards, damage, logged_step,
                                 replays_agree, say, verdicts, wait_until, write_config)


def rehearse(out: str, hang_timeout: float, only: str | None = None) -> dict[str, tuple[bool, str]]:
    from tools.rehearsal_kit import build_data

    data = build_data(out)
    shards = Shards(data)
    url = shards.url
    say(f"two sources (a 0.6, b 0.4) served from {data} at {url}")
    if only == "exclude":
        return exclude_slow_node(out, shards, hang_timeout)
    results = {}

    # 1-3: kill -9 of rank 6, relaunch; rank 5 stalls at step 8, all watchdogs expire, relaunch; the same stall again
    # (its marker removed), the crash-loop check stops the relaunches; a relaunch by hand trains to step 12
    run = os.path.join(out, "run")
    config = write_config(os.path.join(out, "run.yaml"), run, url, hang_timeout)
    say("launch: 8 ranks as 2 nodes of 4 (launch/pretrain.sh --max-restarts 3 on each), rank 5 set to stall at step 8")
    stall = {"SYNTHFORMER_FAULTS": "stall@8@5"}
    job = Nodes(out, "run", config, 2, 4, "--max-restarts", "3", env=stall)
    wait_until(lambda: logged_step(run) >= 4, 600, job, "step 4")
    victim = job.rank(1, 2)
    say(f"kill -9 of rank 6 (node 1, local rank 2, pid {victim.pid}) after step {logged_step(run)}")
    victim.send_signal(signal.SIGKILL)
    marker = os.path.join(run, "faults", "stall@8@5")
    wait_until(lambda: os.path.exists(marker), 900, job, "rank 5's stall")
    os.remove(marker)   # so that the relaunch stalls again, at the same step
    say("rank 5 stalled at step 8; its fault marker removed, so that the relaunch stalls there again")
    wait_until(lambda: os.path.exists(os.path.join(run, "hang", "rank5.txt")), 900, job, "rank 5's hang")
    say(f"rank 5 hung; every rank's watchdog expired after train.hang_timeout={hang_timeout:g} s")
    codes = job.wait(900)
    lines = job.stderr()
    say(f"both nodes' launchers ended: exit statuses {codes}")
    for line in lines:
        if line.startswith(("error: rank 5 hung", "restart ", "error: rank ", "error: the launch", "error: not rel")) \
                and "made no progress" not in line.split(";")[0]:
            print(f"    {line[:400]}")
    history = verdicts(run)
    hangs = sorted({h["restart"] for h in history if h["class"] == "hang"})
    looped = [line for line in lines if line.startswith("error: not relaunching") and "crash loop" in line]
    loop = (
        codes == [3, 3] and len(hangs) == 2 and len(looped) == 2 and
        not any(h["relaunch"] for h in history if h["restart"] == hangs[-1]),
        f"launches {hangs} hung, exit statuses {codes}; {looped[0][7:200] if looped else 'no crash loop named'}…")
    stacks = [k for k in range(8) if os.path.exists(os.path.join(run, "hang", f"rank{k}.txt"))]
    dumps = [k for k in range(8) if os.path.exists(os.path.join(run, "hang", "flight_recorder", f"rank_{k}"))]
    named = [line for line in lines if line.startswith("error: rank 5 hung; ranks 0-4, 6, 7 wait for it")]
    say("a relaunch by hand (the same command), which trains to step 12")
    codes = Nodes(out, "run-again", config, 2, 4, "--max-restarts", "3", env=stall).wait(900)
    relaunched = [h for h in history if h["relaunch"]]
    ok = codes == [0, 0] and any(h["class"] == "lost rank" for h in relaunched) and logged_step(run) == 12
    agree, words = replays_agree(run, 8)
    results["kill -9 → automatic relaunch → bit-exact resume"] = (ok and agree, f"{words}; by hand: exit {codes}")
    results["hang on rank 5 → stacks of all 8 ranks, one line naming rank 5"] = (
        stacks == dumps == list(range(8)) and named and hangs_alike(named) == 1,
        f"stacks of ranks {stacks}, flight-recorder dumps of ranks {dumps}; the line: {named[0][:160] if named else '-'}…")
    results["the same hang twice → the crash-loop check stops the relaunches"] = loop

    # 5-7: a copy of the run at step 6: preempted, then an error on rank 3, then an outage of the shard server
    results.update(preempt_error_outage(out, shards, run, hang_timeout))

    # 8: source b's shards damaged on the server: the run continued to step 16 meets them, on some rank
    backup = os.path.join(out, "b-backup")
    shutil.rmtree(backup, ignore_errors=True)
    shutil.copytree(os.path.join(data, "b"), backup)
    try:
        say(f"data error: {damage(os.path.join(data, 'b'))} shards of source b damaged on the server (same sizes); "
            f"the run continued to step 16 with --max-restarts 3")
        bad = Nodes(out, "data-error", config, 2, 4, "--max-restarts", "3", "train.max_steps=16")
        codes_bad = bad.wait(900)
        bad_lines = bad.stderr()
    finally:
        shutil.rmtree(os.path.join(data, "b"))
        shutil.move(backup, os.path.join(data, "b"))
    failed = [line for line in bad_lines if "failed first (config or data error)" in line]
    for line in failed[:1] + [line for line in bad_lines if line.startswith("error: not relaunching")][:1]:
        print(f"    {line[:400]}")
    restarts = [line for line in bad_lines if line.startswith("restart ")]
    results["data error → no relaunch"] = (
        codes_bad == [2, 2] and failed and not restarts,
        f"exit statuses {codes_bad}, {len(restarts)} relaunches")

    # 9: fleet.exclude, a slow node moved off
    results.update(exclude_slow_node(out, shards, hang_timeout, reference=run, ranks=8))
    shards.stop()
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(ROOT, "build", "rehearsal"), help="its folder (default "
                                                                                  "build/rehearsal, emptied first)")
    p.add_argument("--hang-timeout", type=float, default=20.0, help="train.hang_timeout of the runs (default 20 s)")
    p.add_argument("--only", choices=["exclude"], help="run only this claim (exclude: 9, the move off a slow node)")
    args = p.parse_args(argv)
    for name in os.listdir(args.out) if os.path.isdir(args.out) else []:
        if name != "data":
            path = os.path.join(args.out, name)
            shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
    os.makedirs(args.out, exist_ok=True)
    memory = Memory()
    results = rehearse(args.out, args.hang_timeout, args.only)
    memory.stop = True
    print()
    for claim, (ok, words) in results.items():
        print(f"{'PASS' if ok else 'FAIL'}  {claim}: {words}")
    elapsed = time.time() - T0
    print(f"rehearsal: {elapsed / 60:.1f} minutes (budget 12), peak resident memory of all its processes "
          f"{memory.peak / 2**30:.1f} GiB (budget 12); outputs in {args.out}")
    return 0 if all(ok for ok, _ in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
