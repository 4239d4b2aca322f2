# Sourced by the test scripts: `start_serve WORK` starts `$BIN serve` on a free port with its
# data directory in WORK, sets `pid` and `addr` (HOST:PORT), and stops it on exit.
start_serve() {
  local work="$1"
  "$BIN" serve --addr 127.0.0.1:0 --data-dir "$work/data" 2>"$work/serve.log" &
  pid=$!
  trap 'kill "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "'"$work"'"' EXIT
  addr=""
  for _ in $(seq 300); do
    addr="$(grep -o 'addr=[0-9.:]*' "$work/serve.log" | head -1 | cut -d= -f2 || true)"
    [ -n "$addr" ] && return 0
    sleep 0.1
  done
  echo "the service did not start"; cat "$work/serve.log"; exit 1
}
