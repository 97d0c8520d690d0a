#!/usr/bin/env bash
# Start a PS on loopback (python: `python -m embstore.ps serve`; cpp: the example server
# binary given as $2), run the load client's smoke against it, stop the server.
set -euo pipefail
cd "$(dirname "$0")/.."
kind="${1:-python}"
port="${PS_SMOKE_PORT:-50651}"
config="$(mktemp)"
# Two small tables of one dim: the smoke's batches are small.
echo '{"tables": {"t0": {"dim": 8, "capacity": 20000}, "t1": {"dim": 8, "capacity": 20000}}}' >"$config"
if [ "$kind" = cpp ]; then
  timeout 300 "$2" --port "$port" --tables t0,t1 --dim 8 --capacity 20000 &
else
  timeout 300 python -m embstore.ps serve --config "$config" --port "$port" &
fi
server=$!
trap 'kill "$server" 2>/dev/null || true; rm -f "$config"' EXIT
for _ in $(seq 1 100); do  # wait (at most 20 s) for the port
  python - "$port" <<'PY' && break
import socket, sys
s = socket.socket()
try:
    s.connect(("127.0.0.1", int(sys.argv[1])))
except OSError:
    sys.exit(1)
PY
  sleep 0.2
done
timeout 240 python -m embstore.ps load --target "127.0.0.1:$port" --smoke >/dev/null
echo "ps smoke ($kind) passed"
