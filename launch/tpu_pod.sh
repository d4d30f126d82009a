#!/usr/bin/env bash
# Runs a command on every worker of a Cloud TPU VM (a pod slice) at once, as one JAX job.
#
# usage: launch/tpu_pod.sh TPU_NAME ZONE [--project PROJECT] [--setup | --kill] [--] SUBCOMMAND [ARGS...]
#   TPU_NAME ZONE  the TPU VM, as in `gcloud compute tpus tpu-vm create TPU_NAME --zone ZONE`
#   --project P    the Google Cloud project (default: gcloud's configured project)
#   --setup        first copy this checkout (git HEAD) to all workers and pip install it with
#                  jax[tpu]; needed once per TPU VM and after code changes
#   --kill         stop joyagents processes left on the workers (they keep the TPU busy)
#   SUBCOMMAND ARGS...  run on all workers through the entry point $ENTRY (after --setup,
#                  only if given)
# environment:
#   REMOTE_DIR  the checkout on the workers (default: joyagents_jax, in the home directory)
#   ENTRY       the command on the workers (default: "python3 -m joyagents_jax.cli")
# Every worker runs with JOYAGENTS_CLUSTER=tpu, so distributed.initialize() calls
# jax.distributed.initialize(), which finds the pod's coordinator and process ids by itself.
# Only process 0 logs; every worker's output comes back through this terminal.
# example: launch/tpu_pod.sh my-v5p-64 us-east5-a --setup plan --config 7b+3b --mesh fsdp=-1
set -euo pipefail

if (($# < 2)); then sed -n '2,/^[^#]/{/^#/p}' "$0"; exit 2; fi
tpu=$1 zone=$2
shift 2
gcloud_args=(--zone "$zone")
action=run setup=""
while (($#)); do
  case $1 in
    --project) gcloud_args+=(--project "$2"); shift 2 ;;
    --setup) setup=1; shift ;;
    --kill) action=kill; shift ;;
    --) shift; break ;;
    *) break ;;
  esac
done
REMOTE_DIR=${REMOTE_DIR:-joyagents_jax}
ENTRY=${ENTRY:-"python3 -m joyagents_jax.cli"}

on_all_workers() {
  gcloud compute tpus tpu-vm ssh "$tpu" "${gcloud_args[@]}" --worker=all --command "$1"
}

if [[ $action == kill ]]; then
  on_all_workers "pkill -f '[j]oyagents_jax' || true"  # [j]: do not match this shell
  exit 0
fi
if [[ -n $setup ]]; then
  tmp=$(mktemp -d)
  git -C "$(dirname "$0")/.." archive --format=tar.gz -o "$tmp/joyagents.tar.gz" HEAD
  gcloud compute tpus tpu-vm scp "$tmp/joyagents.tar.gz" "$tpu:joyagents.tar.gz" \
    "${gcloud_args[@]}" --worker=all
  rm -rf "$tmp"
  on_all_workers "mkdir -p $REMOTE_DIR && tar xzf joyagents.tar.gz -C $REMOTE_DIR && \
    python3 -m pip install -q -U 'jax[tpu]' -e $REMOTE_DIR"
fi
if (($#)) || [[ -z $setup ]]; then
  on_all_workers "cd $REMOTE_DIR && JOYAGENTS_CLUSTER=tpu $ENTRY $(printf '%q ' "$@")"
fi
