#!/usr/bin/env bash
# `make learn-external`: the quickstart job with `trainer = { kind = "external" }`, trained by
# `rollarc train` in another process that speaks only the trainer API, against a real
# `rollarc serve`; then the report and the same learning check as `make learn`
# (FrozenLake >= 0.9, the other tasks >= 1.5x their random-policy rate).
set -euo pipefail
BIN="${BIN:-target/release/rollarc}"
OUT="${OUT:-report/external}"
work="$(mktemp -d)"
# shellcheck source=lib/serve.sh
source "$(dirname "$0")/lib/serve.sh"
start_serve "$work"
# The quickstart, its [trainer] table swapped for an external trainer.
python3 - examples/quickstart.toml >"$work/job.toml" <<'PY'
import sys
text = open(sys.argv[1]).read()
head = text[: text.index("\n[trainer]")]
print(head + '\n[trainer]\nkind = "external"\nlease_s = 60\n')
PY
id="$("$BIN" --service "http://$addr" submit "$work/job.toml" | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])')"
echo "learn-external: job $id on http://$addr; rollarc train with the quickstart's [trainer]"
start=$(date +%s)
"$BIN" --service "http://$addr" train --job "$id" --out "$work/trainer" \
  --trainer examples/quickstart.toml --wait-s 30 | awk 'NR % 20 == 1 || /job ended/'
echo "learn-external: $(( $(date +%s) - start )) s of training"
kill "$pid"; wait "$pid" 2>/dev/null || true
rm -rf "$OUT"
"$BIN" report "$id" --data-dir "$work/data" --out "$OUT"
python3 envs/check_learning.py "$OUT/summary.json"
