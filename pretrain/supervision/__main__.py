"""`python -m pretrain.supervision --max-restarts N [--backoff S] [--run-dir DIR] -- COMMAND…`: run a launch command
under the supervisor (relaunch.py). `--classify --run-dir DIR --restart K --since T --exit-status S`: the verdict on a
launch that has ended (a SLURM job step: launch/slurm.sbatch), one line, and exit status 0 where a relaunch can fix it,
1 where not."""
import argparse
import sys

from pretrain.supervision import relaunch


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
    p.add_argument("--classify", action="store_true", help="judge a launch that has ended instead of running one")
    p.add_argument("--restart", type=int, default=0, help="with --classify: the launch's number (0 the first)")
    p.add_argument("--since", type=float, default=0.0, help="with --classify: when it started (epoch seconds)")
    p.add_argument("--exit-status", type=int, default=1, help="with --classify: its exit status")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- the launch command and its arguments")
    args = p.parse_args(argv)
    if args.classify:
        verdict, stop = relaunch.judge(args.run_dir, args.restart, args.since, args.exit_status, [])
        print(relaunch.failure_line(verdict, args.run_dir).removeprefix("error: ") +
              (f"; not relaunching: {stop}" if stop else ""))
        return 1 if stop else 0
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command or args.max_restarts < 0 or args.backoff < 0:
        p.error("give --max-restarts ≥ 0, --backoff ≥ 0 and, after --, the command to run")
    return relaunch.relaunch(command, args.max_restarts, args.backoff, args.run_dir)


if __name__ == "__main__":
    sys.exit(main())
