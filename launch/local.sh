#!/usr/bin/env bash
# Runs one process on this machine's devices: a CPU laptop, one GPU host or one TPU VM host.
#
# usage: launch/local.sh [-d DEVICES] [--] SUBCOMMAND [ARGS...]
#   -d DEVICES    simulate DEVICES devices on the CPU (to try a mesh without accelerators)
#   SUBCOMMAND ARGS...  run through the entry point $ENTRY
# environment:
#   PYTHON  the interpreter (default: python)
#   ENTRY   the command to run (default: "$PYTHON -m joyagents_jax.cli", i.e. `joyagents`)
# example: launch/local.sh -d 8 plan --config 3b+3b --mesh fsdp=4,tensor=2
set -euo pipefail

devices=""
while getopts "d:h" opt; do
  case $opt in
    d) devices=$OPTARG ;;
    h) sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 0 ;;
    *) exit 2 ;;
  esac
done
shift $((OPTIND - 1))
[[ ${1:-} == "--" ]] && shift

PYTHON=${PYTHON:-python}
ENTRY=${ENTRY:-"$PYTHON -m joyagents_jax.cli"}
export JOYAGENTS_CLUSTER=none
if [[ -n $devices ]]; then
  export JAX_PLATFORMS=cpu XLA_FLAGS="--xla_force_host_platform_device_count=$devices ${XLA_FLAGS:-}"
fi
exec $ENTRY "$@"
