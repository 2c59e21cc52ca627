#!/bin/bash
# One node of deploy/slurm/train.sbatch: this node's promoter, torchrun, then the final drain. The
# batch script starts it once per node (srun, one task per node) with the training script and its
# flags as arguments, and exports CONFIG, MASTER_ADDR, MASTER_PORT, METRICS_PORT, NPROC_PER_NODE,
# SAVE_TIMEOUT and DRAIN_TIMEOUT.
#
# Why the drain runs here and not in a step of its own: after a cancel or at the time limit Slurm
# refuses new job steps, so only a step that is already running can still promote the final save.
#
# Signals: Slurm signals every process of a step, not only this script. SIGUSR1 (forwarded by srun
# from the batch script) and SIGTERM (a pre-emption, the hard time limit) reach torchrun and its
# workers directly, so this script never forwards them: a second signal would cut torchrun's
# graceful shutdown short. It notes the stop, waits until torchrun is gone (the workers save,
# commit and exit), drains, stops the promoter. The promoter and the drain ignore SIGUSR1.
#
# Exit status: 0 training finished; 75 stopped on a signal after the final save and the drain
# (train.sbatch requeues on 75); 78 the promoter could not start, so this node never trained;
# otherwise torchrun's status.

set -uo pipefail

# shellcheck source-path=SCRIPTDIR source=lib.sh
source "$(dirname "$0")/lib.sh"

readonly STOPPED=75 NO_PROMOTER=78
PROMOTER_START_TIMEOUT=${PROMOTER_START_TIMEOUT:-120}
PROMOTER_RESTART_DELAY=${PROMOTER_RESTART_DELAY:-10}
# After SIGTERM, the drain and the promoter get promote.grace_period (30 s) for their files in
# flight, and this much before SIGKILL: a promoter stuck in a hung mount must not hold the node.
STOP_GRACE=${STOP_GRACE:-35}
node=${SLURM_NODEID}

say() {
  echo "node ${node}: $*" >&2
}

stopping=0
stopped_at=0
# shellcheck disable=SC2329  # invoked by the trap
note_stop() {
  if [ "${stopping}" = 0 ]; then
    stopping=1
    stopped_at=${SECONDS}
    say "$1: the trainer saves and exits, then this node drains"
  fi
}
# shellcheck disable=SC2329  # invoked by launch_unless
stop_noted() {
  [ "${stopping}" = 1 ]
}
trap 'note_stop SIGUSR1' USR1
trap 'note_stop SIGTERM' TERM
trap 'note_stop SIGINT' INT

# Derived from the job id by train.sbatch; another job on this node may hold it already. With no
# free port near it, the promoter tries the derived one and its bind error names it.
port=$(free_port "${METRICS_PORT}") || port=${METRICS_PORT}
[ "${port}" = "${METRICS_PORT}" ] || say "port ${METRICS_PORT} is in use here: metrics on ${port}"

start_promoter() {
  # --metrics-addr 0.0.0.0: Prometheus scrapes from another host.
  (trap '' USR1 && exec tierstore --config "${CONFIG}" --node "${node}" promote \
    --metrics-port "${port}" --metrics-addr 0.0.0.0) &
  promoter=$!
}

# 0 once the promoter listens on its port (or a stop came first); else the promoter exited first
# (e.g. the port was taken after all, or the configuration is wrong: its message says which).
promoter_serving() {
  local waited=0 status
  until listens "${promoter}" "${port}" || [ "${stopping}" = 1 ]; do
    if ! kill -0 "${promoter}" 2>/dev/null; then
      wait_for "${promoter}"
      status=$?
      say "the promoter exited with status ${status} before serving on port ${port}"
      return 1
    fi
    if [ "${waited}" -ge "${PROMOTER_START_TIMEOUT}" ]; then
      say "the promoter is not serving on port ${port} after ${waited} s; training anyway"
      return 0
    fi
    pause 1
    waited=$((waited + 1))
  done
}

start_promoter
if ! promoter_serving; then
  say "the promoter could not start (its error is above): no node trains without one; stopping" \
    "the job step on every node"
  (trap '' USR1 && exec scancel --signal=USR1 "${SLURM_JOB_ID}.${SLURM_STEP_ID}")
  exit "${NO_PROMOTER}"
fi
[ "${stopping}" = 1 ] || say "promoter serving /metrics, /healthz and /readyz on $(hostname -f):${port}"
sd_file=
if [ -n "${METRICS_SD_DIR:-}" ]; then  # a Prometheus file_sd_configs directory: scrape this node
  sd_file="${METRICS_SD_DIR}/tierstore-${SLURM_JOB_ID}-${node}.json"
  printf '[{"targets": ["%s:%s"], "labels": {"slurm_job_id": "%s", "node": "%s"}}]\n' \
    "$(hostname -f)" "${port}" "${SLURM_JOB_ID}" "${node}" >"${sd_file}.tmp" &&
    mv "${sd_file}.tmp" "${sd_file}"
fi

status=${STOPPED}
if [ "${stopping}" = 0 ]; then
  # Static rendezvous on the first node: torchrun's node rank (GROUP_RANK) is SLURM_NODEID, so the
  # trainer and the promoter of this node agree on its node index. torchrun forwards SIGUSR1 to the
  # workers only when told to handle it (by default SIGUSR1 kills it); --shutdown-timeout is the
  # time the workers get to save before SIGKILL.
  # launch_unless (lib.sh): a stop that comes while torchrun starts reaches it, or stops the launch.
  launch_unless stop_noted \
    torchrun --nnodes "${SLURM_JOB_NUM_NODES}" --nproc-per-node "${NPROC_PER_NODE}" \
    --node-rank "${node}" --master-addr "${MASTER_ADDR}" --master-port "${MASTER_PORT}" \
    --signals-to-handle SIGTERM,SIGINT,SIGUSR1 --shutdown-timeout "${SAVE_TIMEOUT}" "$@"
  trainer=${LAUNCHED}
  restarts=0
  reminded=0
  while kill -0 "${trainer}" 2>/dev/null; do
    # torchrun ends at most --shutdown-timeout after a stop: one still running well past it cannot
    # have seen it (it came in the microseconds between the launcher's last look and its exec).
    # Only then is the stop sent to it, once: a second signal would cut a graceful shutdown short.
    if [ "${stopping}" = 1 ] && [ "${reminded}" = 0 ] &&
      [ $((SECONDS - stopped_at)) -gt $((SAVE_TIMEOUT + STOP_GRACE)) ]; then
      reminded=1
      say "torchrun still runs $((SECONDS - stopped_at)) s after the stop, past its" \
        "--shutdown-timeout: it started as the stop came and missed it; sending it SIGUSR1"
      kill -USR1 "${trainer}" 2>/dev/null
    fi
    if [ "${stopping}" = 0 ] && ! kill -0 "${promoter}" 2>/dev/null; then
      wait_for "${promoter}"
      say "the promoter exited with status $? during training; restart $((++restarts)) in" \
        "${PROMOTER_RESTART_DELAY} s (a restart finishes or redoes its work)"
      pause "${PROMOTER_RESTART_DELAY}"
      [ "${stopping}" = 1 ] || start_promoter
    fi
    pause 2
  done
  wait_for "${trainer}"
  status=$?
  # Only a stop that came while torchrun ran made its workers save: one that comes after a crash
  # (the other nodes being stopped) must not turn that crash into "stopped, saved, drained".
  stopped_training=${stopping}
  say "torchrun exited with status ${status}"
else
  stopped_training=1
fi

# Promote what the last save left in host memory and on the NVMe: the next allocation may land on
# other nodes. Beside the running promoter this is safe (two promoters never both commit a copy).
# On timeout the drain finishes its files in flight within promote.grace_period, then stops.
say "draining the final save down the tiers (at most ${DRAIN_TIMEOUT} s)"
(trap '' USR1 && exec timeout --kill-after="${STOP_GRACE}" "${DRAIN_TIMEOUT}" \
  tierstore --config "${CONFIG}" --node "${node}" promote --once) &
wait_for "$!" || say "the drain did not finish (status $?); the next run's promoters retry"

# SIGTERM: the promoter finishes its files in flight within promote.grace_period and exits 0;
# SIGKILL after STOP_GRACE if it is stuck (a hung mount).
if kill -0 "${promoter}" 2>/dev/null; then
  kill -TERM "${promoter}"
  waited=0
  while kill -0 "${promoter}" 2>/dev/null && [ "${waited}" -lt "${STOP_GRACE}" ]; do
    pause 1
    waited=$((waited + 1))
  done
  if kill -0 "${promoter}" 2>/dev/null; then
    say "the promoter did not stop within ${STOP_GRACE} s of SIGTERM; killing it"
    kill -KILL "${promoter}" 2>/dev/null
  fi
fi
wait_for "${promoter}"
[ -z "${sd_file}" ] || rm -f "${sd_file}"

# torchrun exits 1 after a handled signal even when every worker saved.
if [ "${status}" != 0 ] && [ "${stopped_training}" = 1 ]; then
  status=${STOPPED}
fi
# train.sbatch requeues only if every node stopped: srun reports the highest status, and 75 is
# higher than a crashed node's 1.
[ -z "${NODE_STATUS_DIR:-}" ] || echo "${status}" >"${NODE_STATUS_DIR}/node-${node}"
exit "${status}"
