#!/usr/bin/env bash
# Runs N local processes on 127.0.0.1 as one multi-host JAX job on the CPU: the same
# multi-controller code path as a TPU pod or a SLURM cluster, on a laptop (tests use it).
#
# usage: launch/multiprocess_cpu.sh [-n PROCESSES] [-d DEVICES] [-p PORT] [-g GRACE] [--] SUBCOMMAND [ARGS...]
#   -n PROCESSES  processes to start (default 2)
#   -d DEVICES    fake CPU devices per process (default 2); the job has PROCESSES x DEVICES
#   -p PORT       coordinator port on 127.0.0.1 (default: a free port)
#   -g GRACE      seconds the others get after a process fails, then SIGKILL (default 10)
#   SUBCOMMAND ARGS...  run by every process through the entry point $ENTRY
# environment:
#   PYTHON  the interpreter (default: python)
#   ENTRY   the command each process runs (default: "$PYTHON -m joyagents_jax.cli", i.e.
#           `joyagents`); e.g. `check-cluster` runs the cluster check
# Each process gets JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID, JAX_PLATFORMS=cpu
# and XLA_FLAGS with the device count; its output lines are prefixed [pI]. If any process fails,
# the others get SIGTERM, SIGKILL GRACE seconds later, and the script exits with that status:
# `joyagents train` answers SIGTERM by saving at the end of its step, which a dead peer keeps
# from ever coming (its collectives wait for JAX's 100 s heartbeat timeout), and the rerun
# resumes from the last complete checkpoint anyway (orbax commits a checkpoint atomically).
# Ctrl-C (SIGINT) or SIGTERM to this script gives every process one SIGTERM and waits while they
# save and leave (exit 130 / 143); a second one kills them. Each process runs in its own process
# group, so a terminal's Ctrl-C reaches them only through this script, once. A closed terminal
# (SIGHUP, e.g. a dropped ssh session) does the same once (exit 129), and what they print after
# it is dropped; under `nohup` the job goes on.
# example: launch/multiprocess_cpu.sh -n 2 -d 4 check-cluster
set -euo pipefail

procs=2 devices=2 port="" grace=10
while getopts "n:d:p:g:h" opt; do
  case $opt in
    n) procs=$OPTARG ;;
    d) devices=$OPTARG ;;
    p) port=$OPTARG ;;
    g) grace=$OPTARG ;;
    h) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ $grace =~ ^[0-9]+$ ]] || { echo "multiprocess_cpu.sh: -g GRACE takes whole seconds, got '$grace'" >&2; exit 2; }
[[ ${1:-} == "--" ]] && shift

PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-"$PYTHON -m joyagents_jax.cli"}
if [[ -z $port ]]; then
  port=$("$PYTHON" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
fi

pids=()
stop_all() {  # stop_all [SIGNAL]: signal every process still running (default TERM)
  for pid in "${pids[@]}"; do [[ -z $pid ]] || kill "-${1:-TERM}" "$pid" 2>/dev/null || true; done
}
interrupted=""
interrupt() {  # interrupt STATUS: the first INT/TERM asks every process to save and leave
  if [[ -n $interrupted ]]; then
    echo "multiprocess_cpu.sh: interrupted again; sending SIGKILL" >&2
    stop_all KILL
  else
    interrupted=$1
    echo "multiprocess_cpu.sh: interrupted; each process saves at the end of its step (interrupt again to kill)" >&2
    stop_all TERM
  fi
}
hung_up=""
hangup() {  # the terminal closed (it comes twice: shell and kernel): as the first INT/TERM, once
  [[ -z $hung_up ]] || return 0
  hung_up=1
  exec >/dev/null 2>&1  # writes to a closed terminal fail
  [[ -n $interrupted ]] || interrupt 129
}
trap stop_all EXIT
trap 'interrupt 130' INT
trap 'interrupt 143' TERM
trap hangup HUP

set -m  # each process (and its output prefixer) in its own process group
for ((i = 0; i < procs; i++)); do
  (
    export JAX_COORDINATOR_ADDRESS="127.0.0.1:$port" JAX_NUM_PROCESSES=$procs JAX_PROCESS_ID=$i
    export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices ${XLA_FLAGS:-}"
    exec $ENTRY "$@"
  ) > >(while IFS= read -r line; do printf '[p%d] %s\n' "$i" "$line" || true; done) 2>&1 &
  pids+=($!)
done
set +m

# Wait for all; on the first failure stop the rest, and kill those still running GRACE s later.
status=0 kill_at=""
remaining=${#pids[@]}
while ((remaining > 0)); do
  if [[ -n $kill_at ]] && ((SECONDS >= kill_at)); then
    echo "multiprocess_cpu.sh: $remaining process(es) still running ${grace} s after SIGTERM; sending SIGKILL" >&2
    stop_all KILL; kill_at=""
  fi
  for j in "${!pids[@]}"; do
    pid=${pids[$j]}
    [[ -z $pid ]] || kill -0 "$pid" 2>/dev/null && continue
    rc=0; wait "$pid" || rc=$?
    pids[$j]=""; remaining=$((remaining - 1))
    if ((rc != 0 && status == 0)); then
      status=$rc
      echo "multiprocess_cpu.sh: process $j exited with status $rc; stopping the others" >&2
      stop_all; kill_at=$((SECONDS + grace))
    fi
  done
  sleep 0.2 || true  # a Ctrl-C ends the sleep; the trap above has handled it
done
wait  # let the output prefixers drain
((status != 0)) || [[ -z $interrupted ]] || status=$interrupted
exit "$status"
