#!/usr/bin/env bash
# Pretrain:   launch/pretrain.sh [--max-restarts N] [--dry-run] CONFIG [section.key=value ...]
#
# The ranks start under the DeepSpeed launcher (LAUNCHER=deepspeed, the default) or torchrun (LAUNCHER=torchrun, run
# with --max-restarts 0: the project's supervisor decides). Either way the launch runs under the supervisor
# (pretrain/supervision/): when it ends, each rank's failure record in <run_dir>/logs/ says what ended it, the failed
# rank's first error line and log file are printed, and with --max-restarts N a failure a relaunch can fix (a hang, a
# lost rank, an unknown error; not a config or data error, not a training stop, not a crash loop) is relaunched after
# RESTART_BACKOFF s (doubled per failure in a row), at most N times; each relaunch resumes from the newest checkpoint
# and is logged as run/restarts with its cause. Under SLURM the job is requeued instead (launch/slurm.sbatch). Each
# rank's output also goes to <run_dir>/logs/rank<k>.log. PyTorch's flight recorder is on (TORCH_FR_BUFFER_SIZE); a
# hung rank's dump lands in <run_dir>/hang/.
# --dry-run: print the command this script would run on this node, one argument a line, and exit (it checks nothing
# else: `python -m pretrain.config CONFIG ... --world-size N` is the check before a launch).
#
# Single machine: one process per GPU, or NPROC CPU processes when there is no GPU (default 2).
# Multi-node, ssh (DeepSpeed):  HOSTFILE=hostfile launch/pretrain.sh CONFIG    (hostfile lines: "node1 slots=8")
# Multi-node, no ssh (SLURM, or two "nodes" on one host): on every node, each with its own supervisor (a failure on
# any node stops every node's launcher, and they relaunch together)
#   NNODES=2 NODE_RANK=<i> MASTER_ADDR=<node 0> MASTER_PORT=29500 launch/pretrain.sh CONFIG
# A preemption signal (train.preempt_signals), to this script or to every process of the job, stops the ranks after
# their step with a checkpoint, and everything exits 0 (the launchers never act on it).
# In a rank that a scheduler or another launcher already started (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT set: srun one task a GPU, torchrun --no-python), the same command runs the trainer in that process;
# restarts are that launcher's.
#
# Environment (defaults): LAUNCHER (deepspeed), NPROC (GPUs on this node, else 2), HOSTFILE, NNODES (1),
# NODE_RANK (0), MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), PYTHON (.venv/bin/python if present, else python3),
# RESTART_BACKOFF (10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# PyTorch's flight recorder (NCCL's, and gloo's): the last collectives of every process group, per rank (torch < 2.7
# reads TORCH_NCCL_TRACE_BUFFER_SIZE: the trainer sets it there, and where they land: supervision/flight_recorder.py)
export TORCH_FR_BUFFER_SIZE="${TORCH_FR_BUFFER_SIZE:-2000}" TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"

MAX_RESTARTS=0 ARGS=() DRY_RUN=
while [ $# -gt 0 ]; do   # --max-restarts N and --dry-run, anywhere: the rest goes to the trainer
  case "$1" in
    --max-restarts) MAX_RESTARTS="${2:-}"; shift $(( $# > 1 ? 2 : 1 )) ;;
    --max-restarts=*) MAX_RESTARTS="${1#*=}"; shift ;;
    --dry-run) DRY_RUN=1; shift ;;
    *) ARGS+=("$1"); shift ;;
  esac
done
set -- ${ARGS[@]+"${ARGS[@]}"}
if ! [[ "$MAX_RESTARTS" =~ ^[0-9]+$ ]]; then
  echo "error: --max-restarts '$MAX_RESTARTS' must be a whole number of relaunches (0: none)" >&2
  exit 2
fi

if [ $# -lt 1 ] || [ "$1" = "-h" ] || [ "$1" = "--help" ]; then
  awk 'NR > 1 && !/^#/ { exit } NR > 1' "$0" | sed 's/^# \{0,1\}//'
  exit $([ $# -lt 1 ] && echo 2 || echo 0)
fi
if [ ! -f "$1" ]; then
  echo "error: config file '$1' not found; pass a YAML from configs/, e.g. configs/demo-cpu.yaml" >&2
  exit 2
fi

# Already one rank of a launched job: run the trainer in this process (restarts are the job's launcher's).
if [ -n "${RANK:-}" ] && [ -n "${LOCAL_RANK:-}" ]; then
  if [ "$MAX_RESTARTS" -gt 0 ] && [ "$RANK" = 0 ]; then
    echo "note: --max-restarts is ignored in a rank started by a scheduler: restart the job there" >&2
  fi
  [ -n "$DRY_RUN" ] && printf '%s\n' "$PYTHON" -m pretrain.train "$@" && exit 0
  exec "$PYTHON" -m pretrain.train "$@"
fi

if [ -z "${NPROC:-}" ]; then   # one process per GPU, else 2 on the CPU (torch is imported only to count GPUs)
  GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  NPROC=$([ "$GPUS" -gt 0 ] && echo "$GPUS" || echo 2)
fi
NNODES="${NNODES:-1}" NODE_RANK="${NODE_RANK:-0}" ADDR="${MASTER_ADDR:-127.0.0.1}" PORT="${MASTER_PORT:-29500}"
# One launcher a node (no HOSTFILE): this node's supervisor is one of NNODES, and a failure on any node stops them all
NODES=()
[ -n "${HOSTFILE:-}" ] || [ "$NNODES" -le 1 ] || NODES=(--nodes "$NNODES" --node-rank "$NODE_RANK")
case "${LAUNCHER:-deepspeed}" in
  torchrun)   # static rendezvous at MASTER_ADDR:MASTER_PORT; restarts are the supervisor's, so torchrun makes none
    [ -z "${HOSTFILE:-}" ] || { echo "error: HOSTFILE is the DeepSpeed launcher's; under LAUNCHER=torchrun start" \
                                     "one launch/pretrain.sh a node with NNODES and NODE_RANK" >&2; exit 2; }
    LAUNCH=("$PYTHON" -m torch.distributed.run --nproc-per-node "$NPROC" --nnodes "$NNODES" --node-rank "$NODE_RANK"
            --master-addr "$ADDR" --master-port "$PORT" --max-restarts 0 -m pretrain.train) ;;
  deepspeed)
    LAUNCH=("$PYTHON" -m deepspeed.launcher.runner --master_addr "$ADDR" --master_port "$PORT")
    if [ -n "${HOSTFILE:-}" ]; then
      LAUNCH+=(--hostfile "$HOSTFILE")
    elif [ "$NNODES" -gt 1 ]; then
      # One launcher per node, started by the scheduler: no ssh between nodes. The launcher wants a hostfile for the
      # world's shape (read again at each relaunch; with --no_ssh its host names are never contacted).
      HOSTS="${TMPDIR:-/tmp}/synthformer-hosts-$(id -u)-$PORT-node$NODE_RANK"   # this job's (its port), this node's
      [ -n "$DRY_RUN" ] || for i in $(seq 0 $((NNODES - 1))); do echo "node$i slots=$NPROC"; done > "$HOSTS"
      LAUNCH+=(--hostfile "$HOSTS" --no_ssh --node_rank "$NODE_RANK")
    else
      LAUNCH+=(--num_gpus "$NPROC")
    fi
    LAUNCH+=(--module pretrain.train) ;;
  *) echo "error: LAUNCHER='$LAUNCHER' is not a launcher this script knows: deepspeed (the default) or torchrun" >&2
     exit 2 ;;
esac
# The supervisor, given the run's directory (train.run_dir: where the ranks' records are) by the check below
SUPERVISE=("$PYTHON" -m pretrain.supervision --max-restarts "$MAX_RESTARTS" --backoff "${RESTART_BACKOFF:-10}"
           ${NODES[@]+"${NODES[@]}"})
if [ -n "$DRY_RUN" ]; then
  printf '%s\n' "${SUPERVISE[@]}" -- "${LAUNCH[@]}" "$@"
  exit 0
fi
# Check the config for this world size once, before any process starts (one-line errors, exit 2); it prints the
# run's directory last. Exit 6: the data's server is out (the class `transient`): with --max-restarts N the check is
# tried again, at most N times, after the supervisor's wait for an outage (6 × RESTART_BACKOFF, doubled, ≤ 900 s).
TRIES=0 WAIT=$(( 6 * ${RESTART_BACKOFF:-10} ))
until RUN_DIR="$("$PYTHON" -m pretrain.config "$@" --world-size $(( NNODES * NPROC )) --run-dir | tail -n 1)"; do
  CHECK=$?
  if [ "$CHECK" -ne 6 ] || [ "$TRIES" -ge "$MAX_RESTARTS" ]; then exit "$CHECK"; fi
  TRIES=$(( TRIES + 1 ))
  echo "the data's server is out: checking again in ${WAIT} s (try $TRIES of at most $MAX_RESTARTS)" >&2
  sleep "$WAIT"
  WAIT=$(( WAIT * 2 > 900 ? 900 : WAIT * 2 ))
done
exec "${SUPERVISE[@]}" --run-dir "$RUN_DIR" -- "${LAUNCH[@]}" "$@"
