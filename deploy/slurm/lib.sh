# shellcheck shell=bash
# Shell functions train.sbatch and node.sh share (sourced, not run).

# listeners PORT: the socket inodes listening on PORT on this host, on any address (IPv4 or IPv6).
# Reads /proc/net/tcp{,6} (state 0A is LISTEN), so it needs no ss, netstat or lsof.
listeners() {
  awk -v port="$(printf ':%04X' "$1")" '$4 == "0A" && substr($2, length($2) - 4) == port {
    print $10 }' /proc/net/tcp /proc/net/tcp6 2>/dev/null
}

# port_in_use PORT: true when a socket on this host listens on PORT.
port_in_use() {
  [ -n "$(listeners "$1")" ]
}

# listens PID PORT: true when process PID itself holds a socket listening on PORT.
listens() {
  local inode
  for inode in $(listeners "$2"); do
    readlink "/proc/$1/fd/"* 2>/dev/null | grep -qx "socket:\[${inode}\]" && return 0
  done
  return 1
}

# free_port PORT: PORT, or the next one above it that nothing listens on, within PORT_SEARCH (100)
# ports: the callers' ranges are chosen so that the search never reaches the next range or the
# kernel's ephemeral ports. Fails, naming the range, when every port in it is taken.
PORT_SEARCH=100
free_port() {
  local port=$1
  while port_in_use "${port}"; do
    port=$((port + 1))
    if [ "${port}" -ge $(($1 + PORT_SEARCH)) ]; then
      echo "no free port in $1-$((port - 1)): every one has a listener on this host" >&2
      return 1
    fi
  done
  echo "${port}"
}

# stopped_status DIR NODES: 75 when every node left 75 ("stopped, saved, drained") or 0 in DIR/node-N,
# else the first other status found: srun reports only the highest status, and 75 is higher than a
# crashed node's 1. A node that left none (DIR not on a shared file system) cannot tell: it counts as
# stopped, with a warning.
stopped_status() {
  local n found
  for ((n = 0; n < $2; n++)); do
    found=$(cat "$1/node-${n}" 2>/dev/null || echo unknown)
    case "${found}" in
      0 | 75) ;;
      unknown) echo "node ${n} left no exit status in $1: counted as stopped" >&2 ;;
      *)
        echo "node ${n} exited with status ${found}, not stopped by the signal: not requeued" >&2
        echo "${found}"
        return
        ;;
    esac
  done
  echo 75
}

# wait_for PID: the exit status of the child PID, once it has ended; a trapped signal meanwhile
# runs its trap and the wait goes on. It never calls `wait` on a child still running: when a trapped
# signal reaches bash (5.2 here) just as its `wait` builtin reaps a child, with waitpid(-1), so any
# child, bash leaves for the trap before it records that child's status, and every later `wait` for
# it blocks until some other child changes state: beside a promoter that runs until it is told to
# stop, for ever. A child that bash reaps anywhere else keeps its status, and `wait` returns it at
# once; asked again if a trap cut that short.
wait_for() {
  local status again
  while kill -0 "$1" 2>/dev/null; do  # a zombie too, until bash reaps it during the pause
    pause 0.2
  done
  wait "$1"
  status=$?
  if [ "${status}" -gt 128 ]; then
    wait "$1" 2>/dev/null
    again=$?
    [ "${again}" = 127 ] || status=${again}  # 127: bash no longer knows the pid
  fi
  return "${status}"
}

# pause SECONDS: sleep. A stop signal sent to this script's process group, as Slurm signals every
# process of a step, ends the sleep at once and its trap runs; one sent to this shell alone runs its
# trap when the sleep ends. The sleep runs in a command substitution, not in the background under
# `wait`, which can lose another child's status (wait_for), and holds no output of this script open.
pause() {
  : "$(sleep "$1" 2>/dev/null)"
}

# launch_unless STOPPED CMD...: CMD in the background, its PID in LAUNCHED, unless the command
# STOPPED succeeds; then the launcher exits 75 and CMD never runs. Why not `STOPPED || CMD &`:
# Slurm signals the processes a step has at that moment, so a stop between that check and CMD's
# start would reach only this shell, and CMD would run on, deaf to it. Here the launcher traps
# the stop signals first, and STOPPED is asked only once it can see them: a stop before that is
# noted by this shell's trap, which runs before STOPPED is asked; a stop after it reaches the
# launcher (which exits 75) or CMD itself.
launch_unless() {
  local stopped=$1 handshake
  shift
  if ! handshake=$(mktemp -d "${TMPDIR:-/tmp}/launch.XXXXXX"); then
    # Without a handshake, start as before, and say what is lost: the caller's LAUNCHED stays set.
    echo "no handshake directory in ${TMPDIR:-/tmp} (mktemp's error is above): starting $1 without" \
      "it; a stop that comes as it starts may reach only this shell" >&2
    if "${stopped}"; then (exit 75) & else "$@" & fi
    LAUNCHED=$!
    return 0
  fi
  (
    trap 'rm -rf "${handshake}"; exit 75' USR1 TERM INT
    : >"${handshake}/ready"
    until [ -e "${handshake}/verdict" ]; do sleep 0.02; done
    verdict=$(<"${handshake}/verdict")
    rm -rf "${handshake}"
    [ "${verdict}" = go ] || exit 75
    exec "$@"
  ) &
  LAUNCHED=$!
  until [ -e "${handshake}/ready" ] || ! kill -0 "${LAUNCHED}" 2>/dev/null; do
    pause 0.02
  done
  if "${stopped}"; then echo stop; else echo go; fi 2>/dev/null >"${handshake}/verdict.tmp" &&
    mv "${handshake}/verdict.tmp" "${handshake}/verdict" 2>/dev/null
  # A launcher killed before it could trap (the stop's default action) leaves its handshake here.
  kill -0 "${LAUNCHED}" 2>/dev/null || rm -rf "${handshake}"
}
