"""The rehearsal's preemption, error and outage claims (tools/rehearsal.py runs them), on one run of 8 ranks as 2 nodes
of 4 with data.num_workers 2: a copy of the first run at its checkpoint of step 6 (rehearsal_kit.fork_run), whose
steps 7-12 that run has already trained, so that every loss after a resume is compared with that pass's, bit for bit.

  launch A   SIGTERM to every process of both nodes (supervisors, launchers, ranks, loader workers) once step 8 is
             logged: every rank saves the step it finished and exits 0, and so does each node's supervisor;
  launch B   the same command again under supervisors with --max-restarts 3. Its launch 0: rank 3 (node 0) raises a
             RuntimeError before its first step (SYNTHFORMER_FAULTS raise@S@3) while the others wait in the step's
             first collective: the verdict names rank 3 (unknown), and node 1's supervisor stops its launcher (the time
             from rank 3's line on the run's board to node 1's launch ending is measured). Then the shard server goes
             down (its socket closed) before the relaunch, with SYNTHFORMER_DATA_RETRIES=2: launch 1 ends transient and
             is relaunched; the server comes back, and launch 2 trains to step 12 with data.bad_shards=skip, which
             would skip (and log) any shard an outage marked bad.

And the move off a slow node (fleet.exclude, `exclude_slow_node`), on a run of its own: 4 ranks as 2 nodes of 2.
"""
from __future__ import annotations

import os
import signal
import time

from tools.rehearsal_kit import (Nodes, Shards, board, fork_run, ids_by_step, jsonl, last_records, logged_step,
                                 losses, say, same_as, verdicts, wait_until, write_config)

STOP_WITHIN_S = 60.0   # a failure on node 0 to node 1's launcher stopped: the claim's bound


def preempt_error_outage(out: str, shards: Shards, reference: str, hang_timeout: float) -> dict[str, tuple]:
    """The three claims' verdicts: {claim: (passed, what was seen)}."""
    run = fork_run(reference, os.path.join(out, "preempt"), 6)
    config = write_config(os.path.join(out, "preempt.yaml"), run, shards.url, hang_timeout)
    workers = "data.num_workers=2"
    say("preemption: a copy of the run at step 6, data.num_workers 2; SIGTERM to every process of both nodes after "
        "step 8")
    job = Nodes(out, "preempt", config, 2, 4, workers)
    wait_until(lambda: logged_step(run) >= 8, 600, job, "step 8")
    sent = job.signal_all(signal.SIGTERM)
    say(f"SIGTERM sent to {sent} processes (supervisors, launchers, ranks, loader workers) after step "
        f"{logged_step(run)}")
    codes = job.wait(600)
    records = last_records(run, 8)
    stopped = sorted({r["step"] for r in records.values()})
    latest = open(os.path.join(run, "checkpoints", "latest")).read().strip()
    at = stopped[0] if len(stopped) == 1 else None
    preempted = len(records) == 8 and all(r["cls"] == "preempted" for r in records.values())
    checkpointed = at is not None and latest == f"step_{at:08d}" and \
        os.path.exists(os.path.join(run, "checkpoints", latest, "complete.json"))
    say(f"both nodes ended: exit statuses {codes}; records {sorted({r['cls'] for r in records.values()})} at steps "
        f"{stopped}; latest checkpoint {latest}")
    if at is None:
        return {"preemption (SIGTERM to every process, loader workers) → checkpoint, exit 0, bit-exact resume":
                (False, f"the ranks stopped at steps {stopped} (exit statuses {codes})")}

    say(f"resume under --max-restarts 3: rank 3 raises before step {at + 1}; then the shard server goes down "
        f"(SYNTHFORMER_DATA_RETRIES=2) until launch 1 has failed")
    ours, history_before = len(board(run)), len(verdicts(run))   # the lines of launch A are not launch B's
    again = Nodes(out, "resume", config, 2, 4, "--max-restarts", "3", workers, "data.bad_shards=skip",
                  env={"SYNTHFORMER_FAULTS": f"raise@{at + 1}@3", "SYNTHFORMER_DATA_RETRIES": "2"})
    seen: dict[str, float] = {}
    deadline = time.time() + 900
    while any(p.poll() is None for p in again.procs) and time.time() < deadline:
        lines, now = board(run)[ours:], time.monotonic()
        if "failed" not in seen and any(b.get("event") == "failed" and b.get("rank") == 3 for b in lines):
            seen["failed"] = now
        if "stopped" not in seen and any(b.get("event") == "ended" and b.get("node") == 1 and b["restart"] == 0
                                         for b in lines):
            seen["stopped"] = now
        ended = {b.get("node") for b in lines if b.get("event") == "ended" and b["restart"] == 0}
        if "down" not in seen and ended == {0, 1}:
            shards.stop()
            seen["down"] = now
            say("launch 0 ended on both nodes: the shard server is down")
        if "up" not in seen and "down" in seen and any(v["class"] == "transient"
                                                       for v in verdicts(run)[history_before:]):
            shards.restart()
            seen["up"] = now
            say(f"launch 1 ended transient after {now - seen['down']:.0f} s of outage: the shard server is back")
        time.sleep(0.1)
    if "up" not in seen:
        shards.restart()
    codes2 = again.wait(60)
    errs = again.stderr()
    history = verdicts(run)[history_before:]
    for line in errs:
        if line.startswith(("restart ", "error: the launch", "error: rank ", "node 1: ")) and \
                "made no progress" not in line:
            print(f"    {line[:300]}")
    exact, words = same_as(run, reference, range(7, 13), 8)
    results = {}
    results["preemption (SIGTERM to every process, loader workers) → checkpoint, exit 0, bit-exact resume"] = (
        codes == [0, 0] and preempted and checkpointed and codes2 == [0, 0] and exact,
        f"exit statuses {codes}, all 8 ranks' records preempted at step {at}, checkpoint {latest}; the resume: "
        f"exit statuses {codes2}, {words}")

    named = [line for line in errs if line.startswith("error: rank 3 failed first (unknown)")]
    row0 = [v for v in history if v["restart"] == 0]
    took = seen["stopped"] - seen["failed"] if {"failed", "stopped"} <= seen.keys() else None
    by = [b.get("stopped") for b in board(run)[ours:] if b.get("event") == "ended" and b.get("node") == 1 and
          b["restart"] == 0]
    results["rank 3 raises (node 0) → the verdict names rank 3 (unknown); node 1's launcher stopped within 60 s"] = (
        len(named) == 2 and row0 and all(v["rank"] == 3 and v["class"] == "unknown" for v in row0) and
        took is not None and took <= STOP_WITHIN_S,
        f"both nodes' verdicts: {named[0][6:140] if named else '-'}…; node 1's launch ended "
        f"{'-' if took is None else f'{took:.1f}'} s after rank 3's failure reached the board"
        f"{' (stopped by its supervisor)' if by and by[0] else ' (its ranks ended first)' if by else ''}")

    transient = [v for v in history if v["class"] == "transient"]
    skipped = [line for line in errs + log_lines(run) if "skipping" in line and "bad_shards=skip" in line]
    results["shard server down past the retries → transient, relaunched, the same losses, no shard marked bad"] = (
        bool(transient) and all(v["relaunch"] for v in transient) and "up" in seen and codes2 == [0, 0] and exact and
        not skipped,
        f"launch {transient[0]['restart'] if transient else '-'} ended {transient[0]['class'] if transient else '?'} "
        f"({transient[0]['line'][:110] if transient else '-'}…), relaunched; {words.split(': ', 1)[-1]}; "
        f"{len(skipped)} shards skipped as bad")
    return results


def log_lines(run: str) -> list[str]:
    """Every line of the ranks' logs (logs/rank<k>.log)."""
    folder, lines = os.path.join(run, "logs"), []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        if name.endswith(".log"):
            with open(os.path.join(folder, name), errors="replace") as f:
                lines += f.read().splitlines()
    return lines


def hangs_alike(lines: list[str]) -> int:
    """How many different hang lines the supervisors printed, the numbers that change by the second left out."""
    from pretrain.supervision.classes import steady

    return len({steady(line) for line in lines})



def exclude_slow_node(out: str, shards: Shards, hang_timeout: float, reference: str | None = None,
                      ranks: int = 2) -> dict[str, tuple]:
    """fleet.exclude: 4 ranks as 2 "nodes" of 2, node 1's rank 2 slowed 3× (SYNTHFORMER_FAULTS slow@1@2), named
    within a few windows (fleet.every 2, fleet.windows 2, fleet.exclude_after_s 0); every rank saves and stops, both
    supervisors read the move, node 1's leaves, node 0's converts the checkpoint and relaunches alone at dp 2. Against
    a run that never had node 1 (`reference`, of `ranks` ranks: the full rehearsal's first run, 8 ranks, whose global
    batches are those of any data-parallel size; else one of 2 ranks, dp 2, trained here first): the same global batch
    at every step, no sample read twice, and the losses within float rounding (other reduction orders)."""
    if reference is None:
        reference = os.path.join(out, "exclude-reference")
        say("fleet.exclude: a reference run on 1 node of 2 ranks (dp 2), 12 steps")
        Nodes(out, "exclude-reference", write_config(os.path.join(out, "exclude-reference.yaml"), reference,
                                                     shards.url, hang_timeout), 1, 2).wait(600)
    run = os.path.join(out, "exclude")
    config = write_config(os.path.join(out, "exclude.yaml"), run, shards.url, hang_timeout)
    say("fleet.exclude: 4 ranks as 2 nodes of 2, rank 2 (node 1) slowed 3× from step 1; fleet.exclude=true")
    job = Nodes(out, "exclude", config, 2, 2, "fleet.exclude=true", "fleet.every=2", "fleet.windows=2",
                "fleet.exclude_after_s=0", env={"SYNTHFORMER_FAULTS": "slow@1@2"}, named=True)
    codes = job.wait(600)
    lines = job.stderr()
    for line in lines:
        if line.startswith(("fleet.exclude", "node node1 leaves", "error:")) or "converting" in line:
            print(f"    {line[:300]}")
    said = [line for line in lines if line.startswith("fleet.exclude: node node1 leaves")]
    steps = range(1, 13)   # (the first run goes on to step 16 in the data-error claim)
    ids = ids_by_step(run, range(4))
    ref_ids = {s: batch for s, batch in ids_by_step(reference, range(ranks)).items() if s in steps}
    stops = {k: max((r["step"] for r in jsonl(os.path.join(run, "sample_ids", f"rank{k}.jsonl"))), default=0)
             for k in range(4)}
    every = [i for step in sorted(ids) for i in ids[step]]
    mine, theirs = losses(run), losses(reference)
    worst = max((abs(mine[s] - theirs[s]) / abs(theirs[s]) for s in steps if s in mine and s in theirs),
                default=float("nan"))
    kept = open(os.path.join(run, "fleet", "excluded_nodes")).read() if \
        os.path.exists(os.path.join(run, "fleet", "excluded_nodes")) else ""
    ok = (codes == [0, 0] and bool(said) and kept.startswith("node1  # ") and
          sorted(ids) == list(steps) and ids == ref_ids and len(every) == len(set(every)) and
          stops[0] == stops[1] == 12 and stops[2] == stops[3] < 12 and worst <= 1e-4)
    return {"a slow node → excluded, relaid out 4 → 2 ranks → the same global batches at dp 2": (
        ok, f"exit statuses {codes}; {said[0][:150] if said else 'no line named node1'}…; ranks 2-3 stopped after "
            f"step {stops[2]}, ranks 0-1 trained to step {stops[0]}; steps 1-12 read the global batches of a run of "
            f"{ranks} ranks that never had it: {ids == ref_ids}, {len(every)} samples, {len(every) - len(set(every))} "
            f"read twice; losses within {worst:.1e} (relative) of that run's; excluded_nodes: "
            f"{kept.split('#')[0].strip() or '-'}")}
