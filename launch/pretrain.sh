#!/usr/bin/env bash
# Pretrain with the DeepSpeed launcher:   launch/pretrain.sh [--max-restarts N] [--dry-run] CONFIG [section.key=value ...]
#
# --dry-run: print the command this script would run on this node, one argument a line, and exit (it checks nothing
# else: `python -m pretrain.config CONFIG ... --world-size N` is the check before a launch).
# --max-restarts N: after a failure (a hung rank ended by train.hang_timeout, a lost rank, a crash; not a config or
# data error) wait (RESTART_BACKOFF s, doubled per failure in a row) and relaunch, at most N times; each relaunch
# resumes from the newest checkpoint and is logged as run/restarts with its cause (pretrain/supervision.py). Under
# SLURM's srun restart the job instead (launch/slurm.sbatch requeues it).
#
# Single machine: one process per GPU, or NPROC CPU processes when there is no GPU (default 2).
# Multi-node, ssh:   HOSTFILE=hostfile launch/pretrain.sh CONFIG        (hostfile lines: "node1 slots=8")
# Multi-node, no ssh (SLURM, or two "nodes" on one host): on every node
#   NNODES=2 NODE_RANK=<i> MASTER_ADDR=<node 0> MASTER_PORT=29500 launch/pretrain.sh CONFIG
# In a rank that a scheduler or another launcher already started (RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR and
# MASTER_PORT set: srun, torchrun --no-python), the same command runs the trainer in that process.
#
# Environment (defaults): NPROC (GPUs on this node, else 2), HOSTFILE, NNODES (1), NODE_RANK (0),
# MASTER_ADDR (127.0.0.1), MASTER_PORT (29500), PYTHON (.venv/bin/python if present, else python3),
# RESTART_BACKOFF (10).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PYTHON="${PYTHON:-$([ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"

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
DS=("$PYTHON" -m deepspeed.launcher.runner --master_addr "${MASTER_ADDR:-127.0.0.1}"
    --master_port "${MASTER_PORT:-29500}")
if [ -n "${HOSTFILE:-}" ]; then
  DS+=(--hostfile "$HOSTFILE")
elif [ "${NNODES:-1}" -gt 1 ]; then
  # One launcher per node, started by the scheduler: no ssh between nodes. The launcher wants a hostfile for the
  # world's shape; with --no_ssh its host names are never contacted.
  HOSTS="$(mktemp)"
  trap 'rm -f "$HOSTS"' EXIT
  for i in $(seq 0 $((NNODES - 1))); do echo "node$i slots=$NPROC"; done > "$HOSTS"
  DS+=(--hostfile "$HOSTS" --no_ssh --node_rank "${NODE_RANK:-0}")
else
  DS+=(--num_gpus "$NPROC")
fi
if [ -n "$DRY_RUN" ]; then
  if [ "$MAX_RESTARTS" -gt 0 ]; then
    printf '%s\n' "$PYTHON" -m pretrain.supervision --max-restarts "$MAX_RESTARTS" --backoff "${RESTART_BACKOFF:-10}" --
  fi
  printf '%s\n' "${DS[@]}" --module pretrain.train "$@"
  exit 0
fi
# Check the config for this world size once, before any process starts (one-line errors, exit 2).
"$PYTHON" -m pretrain.config "$@" --world-size $(( ${NNODES:-1} * NPROC )) > /dev/null || exit 2
if [ "$MAX_RESTARTS" -gt 0 ]; then
  exec "$PYTHON" -m pretrain.supervision --max-restarts "$MAX_RESTARTS" --backoff "${RESTART_BACKOFF:-10}" -- \
    "${DS[@]}" --module pretrain.train "$@"
fi
"${DS[@]}" --module pretrain.train "$@"
