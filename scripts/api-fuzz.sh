#!/usr/bin/env bash
# Fuzz the running service against its own OpenAPI document with schemathesis (pinned below):
# every answer must be documented (status, media type, headers, body schema) and none may be a
# server error.
#
#   scripts/api-fuzz.sh                     # CI runs it from .ci/run
#   API_FUZZ_EXAMPLES=200 scripts/api-fuzz.sh
#
# What it does:
#   1. DATABASE_URL from scripts/postgres.sh; a fresh database `rocket_rides_api_fuzz`.
#   2. cargo build --locked --workspace --bins (the rocket-rides and fakestripe binaries among
#      them); starts fakestripe and
#      `rocket-rides serve` on free loopback ports, migrates, and creates a user for the
#      `Authorization` header; all stopped again when this script exits.
#   3. A venv in target/api-fuzz-venv with schemathesis==$SCHEMATHESIS_VERSION from PyPI.
#   4. `schemathesis run` on /openapi.json, at most $API_FUZZ_EXAMPLES examples per operation.
#
# Network: loopback to our own programs, plus PyPI for the first pip install only.
# Logs: target/api-fuzz/{fakestripe,serve}.log.
set -euo pipefail
cd "$(dirname "$0")/.."

# The newest release when this was written (`pip index versions schemathesis`).
SCHEMATHESIS_VERSION=4.32.5
EXAMPLES=${API_FUZZ_EXAMPLES:-40}
DB_NAME=rocket_rides_api_fuzz
WAIT_SECS=60

TARGET_DIR=${CARGO_TARGET_DIR:-target}
VENV=$TARGET_DIR/api-fuzz-venv
WORK=$TARGET_DIR/api-fuzz

SCRIPT=api-fuzz
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
ensure_python3
mkdir -p -- "$WORK"
[[ $EXAMPLES =~ ^[0-9]+$ ]] && ((EXAMPLES > 0)) || die "API_FUZZ_EXAMPLES must be a positive number"

SERVER_URL=$(scripts/postgres.sh) || die "scripts/postgres.sh found no PostgreSQL server"
DATABASE_URL=$(database_url "$SERVER_URL" "$DB_NAME" fresh)
export DATABASE_URL

# The workspace's debug build, as every script builds it (CI builds once): its rocket-rides has
# the failpoints, inert with none of their variables set.
log "cargo build --locked --workspace --bins"
cargo build --locked --workspace --bins
BIN=$TARGET_DIR/debug

read -r GATEWAY_PORT ADMIN_PORT API_PORT < <(free_ports 3) || die "found no free ports"

PIDS=()
cleanup() {
    local pid
    for pid in "${PIDS[@]}"; do
        kill "$pid" 2>/dev/null || true
        wait "$pid" 2>/dev/null || true
    done
}
trap cleanup EXIT
trap 'exit 130' INT
trap 'exit 143' TERM

NO_COLOR=1 "$BIN/fakestripe" --listen "127.0.0.1:$GATEWAY_PORT" \
    --admin-listen "127.0.0.1:$ADMIN_PORT" </dev/null >"$WORK/fakestripe.log" 2>&1 &
PIDS+=($!)
wait_for_port "$GATEWAY_PORT" "${PIDS[-1]}" "$WORK/fakestripe.log" "$WAIT_SECS"

export STRIPE_API_BASE=http://127.0.0.1:$GATEWAY_PORT NO_COLOR=1
"$BIN/rocket-rides" migrate 2>>"$WORK/serve.log"
USER_JSON=$("$BIN/rocket-rides" users create --email fuzz@example.com --card tok_visa 2>>"$WORK/serve.log")
API_KEY=$(python3 -c 'import json, sys; print(json.loads(sys.argv[1])["api_key"])' "$USER_JSON")

"$BIN/rocket-rides" serve --listen "127.0.0.1:$API_PORT" --metrics-listen 127.0.0.1:0 </dev/null >>"$WORK/serve.log" 2>&1 &
PIDS+=($!)
wait_for_port "$API_PORT" "${PIDS[-1]}" "$WORK/serve.log" "$WAIT_SECS"

venv_with "$VENV" schemathesis "$SCHEMATHESIS_VERSION"

log "schemathesis: at most $EXAMPLES examples per operation against http://127.0.0.1:$API_PORT"
NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" \
    "$VENV/bin/schemathesis" run "http://127.0.0.1:$API_PORT/openapi.json" \
    --header "Authorization: Bearer $API_KEY" \
    --checks not_a_server_error,status_code_conformance,content_type_conformance,response_headers_conformance,response_schema_conformance \
    --phases examples,coverage,fuzzing \
    --max-examples "$EXAMPLES" \
    --seed 20261130 \
    --request-timeout 15 \
    --workers 1 ||
    { tail -n 30 -- "$WORK/serve.log" >&2; die "schemathesis found answers that break the document"; }
log "done"
