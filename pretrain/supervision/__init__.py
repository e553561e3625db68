"""A run that looks after itself, on a cluster: what ends a rank and whether a relaunch can fix it, timeouts that
agree, and the evidence a hang leaves.

    classes.py          the failure classes (done, preempted, exclude, config or data error, training stopped, hang,
                        unknown, transient, lost rank), each rank's record of how it ended, and the launch's verdict from all
                        of them (the first cause, not its echoes)
    relaunch.py         the supervisor around a launcher (launch/pretrain.sh --max-restarts N; `python -m
                        pretrain.supervision`): relaunches what a relaunch can fix, stops a crash loop
    exclude.py          fleet.exclude: the launch command without a slow node (its node's part ended, new node ranks,
                        the hostfile cut, the checkpoint relaid out), and an excluded node kept out of later launches
    nodes.py            what the supervisors and ranks of a run tell each other in its directory: the launch's number
                        for ranks the supervisor's environment does not reach, and the nodes' board of failures
    rank.py             what a rank does: its log, its record, the timeouts set, the watchdog wrapped around the trainer
    watchdog.py         the hang watchdog (train.hang_timeout) and what counts as progress
    flight_recorder.py  PyTorch's flight recorder, on, and dumped beside the stacks of a hung rank
    ranklog.py          each rank's own log file, <run_dir>/logs/rank<k>.log

The collective timeout itself, C, is pretrain/timeouts.py's, a floor below: pretrain/config checks its margins,
distributed.init computes it once, and rank.py's `supervise` sets every group to it once the engine is built.
Nothing is imported here: the supervisor process (relaunch.py) starts without torch.
"""
