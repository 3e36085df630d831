# Sourced by scripts/test.sh and scripts/conformance.sh (as root): a private checkpoint
# agent for a test run, started with `start_test_agent NAME` and stopped with
# `stop_test_agent` (also on exit). Sets AGENT_DIR and AGENT_SOCKET.
#
# The agent refuses a socket or state directory that anyone but root could write, up to
# /: its own under /tmp (root's, sticky), 0755 so that the test user reaches the socket.
# Its kernels end with it (--kernels-on-stop kill): nothing of the run outlives it.

agent_pid=
stop_test_agent() {
  if [ -n "$agent_pid" ]; then
    kill -TERM "$agent_pid" 2>/dev/null || true
    wait "$agent_pid" 2>/dev/null || true
    agent_pid=
  fi
  rm -rf "$AGENT_DIR"
}

start_test_agent() {
  AGENT_DIR=$(mktemp -d "/tmp/cedana-$1-agent.XXXXXX")
  trap stop_test_agent EXIT
  chmod 0755 "$AGENT_DIR"
  install -d -m 0755 "$AGENT_DIR/run"
  install -d -m 0700 "$AGENT_DIR/state"
  AGENT_SOCKET=$AGENT_DIR/run/agent.sock
  (cd / && exec "$ROOT/.venv/bin/python" -m jupyter_cedana.agent --socket "$AGENT_SOCKET" \
    --state-dir "$AGENT_DIR/state" --kernels-on-stop kill \
    >"$AGENT_DIR/agent.out" 2>"$AGENT_DIR/agent.log") &
  agent_pid=$!
  # It says `listening` once it accepts connections, or exits with the reason.
  for _ in $(seq 600); do
    grep -q listening "$AGENT_DIR/agent.out" && break
    kill -0 "$agent_pid" 2>/dev/null || break
    sleep 0.2
  done
  if ! grep -q listening "$AGENT_DIR/agent.out"; then
    echo "the checkpoint agent did not start:" >&2
    cat "$AGENT_DIR/agent.log" >&2
    exit 1
  fi
}
