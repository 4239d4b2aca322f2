#!/usr/bin/env bash
# API fuzz pass (`make fuzz-api`, also run by `make test`): schemathesis against the
# /openapi.json of a fresh `rollarc serve`, every operation, bounded examples, fixed seed.
# Fails on any 5xx, any response that does not match the document (status, content type,
# headers, body schema), or a document schemathesis cannot load.
set -euo pipefail
ST="${ST:?set ST to the schemathesis executable (make setup installs it)}"
BIN="${BIN:-target/debug/rollarc}"
EXAMPLES="${EXAMPLES:-25}"
work="$(mktemp -d)"
# shellcheck source=lib/serve.sh
source "$(dirname "$0")/lib/serve.sh"
start_serve "$work"
cd "$work"
"$ST" run "http://$addr/openapi.json" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
  --max-examples "$EXAMPLES" --seed 1 --workers 1 --request-timeout 20 \
  --report junit --report-dir "$work/report"
