#!/usr/bin/env bash
# The restore drill's entry point (components/restore-drill), mounted from the ConfigMap at
# /etc/tierstore/drill.sh. Runs `tierstore drill` against S3 with the training job's own flags
# (STEPS, GLOBAL_BATCH, MICRO_BATCH: the same model, data and LR schedule), then pushes the drill's
# Prometheus lines to PUSHGATEWAY_URL when it is set. Exits with the drill's status (1: the restored
# run does not continue the logged losses), so the Job's own status says pass or fail as well.
set -uo pipefail

CONFIG=/etc/tierstore/tierstore.yaml
PROM_FILE=${TMPDIR:-/tmp}/tierstore-drill.prom

# One process draws the dropout masks the training ranks drew apart: the losses are close to the
# log, not equal (a drill at the training's world size passes at 1e-4).
tierstore --config "${CONFIG}" drill --tier s3 --world-size 1 \
  --entry /opt/tierstore/examples/train_gpt.py:drill_entry --loss-log "${RUN_DIR}/loss.jsonl" \
  --steps 3 --tolerance 0.01 --prom-file "${PROM_FILE}" \
  -- --config "${CONFIG}" --steps "${STEPS}" --global-batch "${GLOBAL_BATCH}" \
  --micro-batch "${MICRO_BATCH}"
status=$?

if [ -n "${PUSHGATEWAY_URL:-}" ] && [ -s "${PROM_FILE}" ]; then
  # One group per namespace: each push replaces the last drill's metrics.
  python3 - "${PUSHGATEWAY_URL%/}/metrics/job/tierstore_drill/namespace/${POD_NAMESPACE}" \
    "${PROM_FILE}" <<'PUSH' || echo "drill.sh: pushing to ${PUSHGATEWAY_URL} failed" >&2
import sys
import urllib.request

url, path = sys.argv[1], sys.argv[2]
with open(path, "rb") as lines:
    request = urllib.request.Request(url, data=lines.read(), method="PUT")
request.add_header("Content-Type", "text/plain; version=0.0.4")
urllib.request.urlopen(request, timeout=30).close()
PUSH
fi
exit "${status}"
