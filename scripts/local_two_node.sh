#!/usr/bin/env bash
# A real two-node DeepSpeed job on one machine: one launcher per "node", both over loopback.
#
#   scripts/local_two_node.sh [-n RANKS_PER_NODE] [-p PORT] -- ARGS FOR bigtrain/run.py
#   scripts/local_two_node.sh -- --model gpt2 --size tiny --steps 20 --out runs/two_node
#
# The hostfile lists `localhost` and `127.0.0.1`, two names for this machine, so DeepSpeed sees
# two nodes. Each launcher gets `--no_ssh --node_rank R` (no ssh or pdsh needed), exactly as on
# a cluster where every node starts its own launcher (see docs/multinode.md and
# scripts/slurm_train.sbatch). Output lines are prefixed with [node R]. Exit status: the first
# non-zero status of the two launchers, else 0. DEEPSPEED=path picks the launcher binary.
set -euo pipefail

REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
RANKS_PER_NODE=1
PORT=""
GRACE=60  # seconds the second node may take to stop after the first one failed

usage() { sed -n '2,5p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
while getopts "n:p:h" opt; do
  case "$opt" in
    n) RANKS_PER_NODE="$OPTARG" ;;
    p) PORT="$OPTARG" ;;
    *) usage ;;
  esac
done
shift $((OPTIND - 1))
[[ "${1:-}" == "--" ]] && shift
[[ $# -gt 0 ]] || usage

DEEPSPEED="${DEEPSPEED:-}"
if [[ -z "$DEEPSPEED" ]]; then
  if [[ -x "$REPO/.venv/bin/deepspeed" ]]; then DEEPSPEED="$REPO/.venv/bin/deepspeed"; else DEEPSPEED="$(command -v deepspeed)"; fi
fi
PYTHON="$(dirname "$DEEPSPEED")/python"
[[ -x "$PYTHON" ]] || PYTHON="$(command -v python3)"
if [[ -z "$PORT" ]]; then
  PORT="$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
fi
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" PYTHONUNBUFFERED=1

WORK="$(mktemp -d)"
trap 'rm -rf "$WORK"' EXIT
printf 'localhost slots=%s\n127.0.0.1 slots=%s\n' "$RANKS_PER_NODE" "$RANKS_PER_NODE" > "$WORK/hostfile"

declare -A PIDS=()
start_node() {  # each launcher in a session of its own: DeepSpeed's runner does not forward SIGTERM
  local rank="$1"; shift
  setsid "$DEEPSPEED" --hostfile "$WORK/hostfile" --no_ssh --node_rank "$rank" \
    --master_addr 127.0.0.1 --master_port "$PORT" "$REPO/bigtrain/run.py" "$@" \
    > >(sed -u "s/^/[node $rank] /") 2>&1 &
  PIDS[$rank]=$!
}
signal_nodes() {
  for pid in "${PIDS[@]}"; do kill "-$1" -- "-$pid" 2>/dev/null || true; done
}
trap 'signal_nodes TERM' INT TERM

start_node 0 "$@"
start_node 1 "$@"
echo "local two-node job: hostfile $WORK/hostfile, master 127.0.0.1:$PORT, launchers ${PIDS[*]}" >&2

status=0
wait -n "${PIDS[@]}" || status=$?
if [[ $status != 0 ]]; then
  echo "local two-node job: a node failed (status $status); giving the other ${GRACE} s to stop" >&2
  for _ in $(seq "$GRACE"); do
    alive=0
    for pid in "${PIDS[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [[ $alive == 0 ]] && break
    sleep 1
  done
  signal_nodes KILL
fi
for pid in "${PIDS[@]}"; do
  wait "$pid" || { rc=$?; [[ $status == 0 ]] && status=$rc; }
done
exit "$status"
