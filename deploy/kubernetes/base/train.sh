#!/usr/bin/env bash
# The trainer container's entry point (PID 1), mounted from the ConfigMap at /etc/tierstore/train.sh.
#
# Why a script and not torchrun itself as PID 1: after the trainer exits this container drains the
# final save (`tierstore promote --once`) before the pod goes away. The kubelet's SIGTERM reaches PID 1
# only, so the script forwards it to torchrun, which forwards it to its workers (torchrun handles
# SIGTERM by default); the workers save at the next step all ranks agree on, wait for the commit and
# exit 0. --shutdown-timeout is how long torchrun lets them do so before SIGKILL (default 30 s).
#
# The stop budget, inside the pod's terminationGracePeriodSeconds (120 s, a reclaimed spot VM's
# notice at most): the save, then the drain (SIGTERM at DRAIN_TIMEOUT, SIGKILL 5 s later: a killed
# promotion is redone by the next run), then the promoter sidecar's promote.grace_period (30 s)
# after this container exits. With a 30 s notice only the save into host memory is sure to finish.
set -uo pipefail

CONFIG=/etc/tierstore/tierstore.yaml
SAVE_TIMEOUT=45
DRAIN_TIMEOUT=30

torchrun \
  --nnodes "${NNODES}" --nproc-per-node "${NPROC_PER_NODE}" \
  --node-rank "${TIERSTORE_NODE}" --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
  --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout "${SAVE_TIMEOUT}" \
  /opt/tierstore/examples/train_gpt.py \
  --config "${CONFIG}" --run-dir "${RUN_DIR}" --steps "${STEPS}" --save-every "${SAVE_EVERY}" \
  --global-batch "${GLOBAL_BATCH}" --micro-batch "${MICRO_BATCH}" &
trainer=$!

forwarded=0
# shellcheck disable=SC2329  # invoked by the trap
forward() {
  # Once: a second SIGTERM would interrupt torchrun's own graceful shutdown of its workers.
  if [ "${forwarded}" = 0 ]; then
    forwarded=1
    kill -TERM "${trainer}" 2>/dev/null || true
  fi
}
trap forward TERM INT

# Never `wait` on torchrun while it may run: a `wait` that the trapped SIGTERM cuts short returns 143,
# and when torchrun exits at that moment its own status is lost (bash 5.2 can even reap it and run the
# trap before it records the status), so a torchrun that exited 0 after its save would fail the pod
# with 143. So poll (kill -0 sees a zombie too, until bash reaps it and keeps its status), then `wait`
# once to collect it. The sleep runs in a command substitution, not in the background under `wait`,
# which has the same race; a SIGTERM to this shell alone runs its trap when the sleep ends, 0.1 s at
# most later. (deploy/slurm/lib.sh's wait_for, which this script, mounted alone, cannot source.)
while kill -0 "${trainer}" 2>/dev/null; do
  : "$(sleep 0.1 2>/dev/null)"
done
wait "${trainer}"
status=$?
if [ "${status}" -gt 128 ]; then  # perhaps a trap cut even this wait short: ask again
  wait "${trainer}" 2>/dev/null
  again=$?
  [ "${again}" = 127 ] || status=${again}  # 127: bash no longer knows the pid
fi

# Promote what the last save left in host memory and on the NVMe before the pod (and its memory-backed
# emptyDir) is gone. The sidecar may be promoting the same checkpoint: promotion is idempotent and two
# promoters cannot both commit it. --node defaults to $TIERSTORE_NODE.
timeout --kill-after=5 "${DRAIN_TIMEOUT}" tierstore --config "${CONFIG}" promote --once ||
  echo "train.sh: the final promotion did not finish (exit $?); the next run's promoters retry" >&2
exit "${status}"
