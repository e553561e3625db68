"""`python -m pretrain.supervision --max-restarts N [--backoff S] [--run-dir DIR] [--nodes N --node-rank I] --
COMMAND…`: run a launch command under the supervisor (relaunch.py), with --nodes as one of N, one a node.
`--classify --run-dir DIR --restart K (--mark FILE | --since T) --exit-status S`: the verdict on a launch that has
ended (a SLURM job step: launch/slurm.sbatch), one line, and exit status 0 where a relaunch can fix it, 1 where not;
`--mark FILE --run-dir DIR` before the launch writes where its records will begin (no clock involved)."""
import argparse
import json
import sys

from pretrain.supervision import classes, relaunch


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pretrain.supervision", description="Run a launch command and relaunch "
                                "it after a failure that a relaunch can fix (a hang, a lost rank, an unknown error, "
                                "an outage of the data), "
                                "with backoff, deciding by each rank's failure record in the run directory. "
                                "launch/pretrain.sh runs the DeepSpeed launcher or torchrun under it.")
    p.add_argument("--max-restarts", type=int, default=0, help="relaunches at most (default 0)")
    p.add_argument("--backoff", type=float, default=10.0,
                   help=f"seconds before the first relaunch, doubled per failure in a row, at most "
                        f"{relaunch.MAX_BACKOFF_S} (default 10)")
    p.add_argument("--run-dir", help="the run's directory (train.run_dir), where the ranks write their records "
                                     "(default: from the trainer's arguments in the command; none there: the exit "
                                     "status alone decides)")
    p.add_argument("--nodes", type=int, default=1, help="one supervisor of this many, one a node, each around its "
                   "node's launcher (needs --run-dir): a failure on any node stops every node's launcher, and they "
                   "relaunch together (default 1)")
    p.add_argument("--node-rank", type=int, default=0, help="with --nodes: this node's rank (default 0)")
    p.add_argument("--stop-grace", type=float, default=relaunch.STOP_GRACE_S,
                   help=f"with --nodes: seconds from a failure on another node to stopping this node's launcher, "
                        f"for its own ranks' records (default {relaunch.STOP_GRACE_S:g})")
    p.add_argument("--classify", action="store_true", help="judge a launch that has ended instead of running one")
    p.add_argument("--restart", type=int, default=0, help="with --classify: the launch's number (0 the first)")
    p.add_argument("--mark", metavar="FILE", help="without a command: write to FILE where each rank's record file "
                   "ends now, before a launch; with --classify: judge the records appended after that (no clock "
                   "compared, unlike --since)")
    p.add_argument("--since", type=float, default=0.0, help="with --classify and no --mark: when it started (epoch "
                                                            "seconds; records more than 5 s older are left out)")
    p.add_argument("--exit-status", type=int, default=1, help="with --classify: its exit status")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command and its arguments")
    args = p.parse_args(argv)
    if args.mark and not args.classify:
        if not args.run_dir:
            p.error("give --run-dir with --mark")
        with open(args.mark, "w") as f:
            json.dump(classes.mark(args.run_dir), f)
        return 0
    if args.classify:
        since = json.load(open(args.mark)) if args.mark else args.since
        verdict, stop = relaunch.judge(args.run_dir, args.restart, since, args.exit_status, [])
        print(relaunch.failure_line(verdict, args.run_dir).removeprefix("error: ") +
              (f"; not relaunching: {stop}" if stop else ""))
        return 1 if stop else 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.max_restarts < 0 or args.backoff < 0:
        p.error("give --max-restarts ≥ 0, --backoff ≥ 0 and, after --, the command to run")
    if args.nodes > 1 and not (args.run_dir and 0 <= args.node_rank < args.nodes and args.stop_grace >= 0):
        p.error(f"--nodes {args.nodes} needs --run-dir (the shared run directory), --node-rank in 0..{args.nodes - 1} "
                f"and --stop-grace ≥ 0")
    node = relaunch.Node(args.nodes, args.node_rank, args.stop_grace) if args.nodes > 1 else None
    return relaunch.relaunch(command, args.max_restarts, args.backoff, args.run_dir, node)


if __name__ == "__main__":
    sys.exit(main())
