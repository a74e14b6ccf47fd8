#!/usr/bin/env bash
# Prove that a real Stripe client library works against fakestripe with only its API base
# changed: Stripe's own Python library (`stripe`, pinned below), driven by
# scripts/stripe_sdk_check.py.
#
#   scripts/stripe-sdk-check.sh            # CI runs it from .ci/run
#
# What it does:
#   1. DATABASE_URL from scripts/postgres.sh; a database `fakestripe_sdk_check` on that server
#      (created if missing; old data is fine, the checks make their own objects).
#   2. cargo build --locked --workspace --bins; start fakestripe on 127.0.0.1 (12121/12122, or free
#      ports) in the background, stopped again when this script exits.
#   3. A venv in target/stripe-sdk-venv with stripe==$STRIPE_VERSION from PyPI (reused later).
#   4. The Python checks against http://127.0.0.1:<port>; their last line is
#      "N passed, M failed", and any failure exits non-zero.
#
# Network: loopback to our own fakestripe, plus PyPI for the first pip install only.
# fakestripe's log: target/stripe-sdk-check/fakestripe.log (its tail is shown on failure).
set -euo pipefail
cd "$(dirname "$0")/.."

# stripe-python, the newest release when this was written (`pip index versions stripe`).
STRIPE_VERSION=16.1.0
DB_NAME=fakestripe_sdk_check
WAIT_SECS=60

TARGET_DIR=${CARGO_TARGET_DIR:-target}
VENV=$TARGET_DIR/stripe-sdk-venv
WORK=$TARGET_DIR/stripe-sdk-check
LOG=$WORK/fakestripe.log

SCRIPT=stripe-sdk-check
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
ensure_python3
mkdir -p -- "$WORK"

# ------------------------------------------------------------------ database

SERVER_URL=$(scripts/postgres.sh) || die "scripts/postgres.sh found no PostgreSQL server"
DATABASE_URL=$(database_url "$SERVER_URL" "$DB_NAME")
export DATABASE_URL

# ------------------------------------------------------------------ fakestripe

# The workspace's debug build, as every script builds it (CI builds once).
log "cargo build --locked --workspace --bins (waits if another build holds the lock)"
cargo build --locked --workspace --bins
BIN=$TARGET_DIR/debug/fakestripe
[[ -x $BIN ]] || die "$BIN was not built"

# Two free loopback ports, 12121/12122 when they are free.
read -r API_PORT ADMIN_PORT < <(free_ports 2 12121 12122) || die "found no free ports"
[[ $API_PORT =~ ^[0-9]+$ && $ADMIN_PORT =~ ^[0-9]+$ ]] || die "found no free ports"

FAKESTRIPE_PID=""
cleanup() {
    if [[ -n $FAKESTRIPE_PID ]]; then
        kill "$FAKESTRIPE_PID" 2>/dev/null || true
        wait "$FAKESTRIPE_PID" 2>/dev/null || true
    fi
}
trap cleanup EXIT
# Turn Ctrl-C and kill into an ordinary exit, so that the EXIT trap stops fakestripe then too.
trap 'exit 130' INT
trap 'exit 143' TERM

show_log() {
    log "last lines of $LOG:"
    tail -n 30 -- "$LOG" >&2 || true
}

log "starting fakestripe on 127.0.0.1:$API_PORT (admin 127.0.0.1:$ADMIN_PORT), database $DB_NAME"
NO_COLOR=1 "$BIN" --listen "127.0.0.1:$API_PORT" --admin-listen "127.0.0.1:$ADMIN_PORT" \
    </dev/null >"$LOG" 2>&1 &
FAKESTRIPE_PID=$!

# fakestripe migrates before it binds, so an open port means it is ready.
wait_for_port "$API_PORT" "$FAKESTRIPE_PID" "$LOG" "$WAIT_SECS"

# ------------------------------------------------------------------ the Python library

venv_with "$VENV" stripe "$STRIPE_VERSION"

# ------------------------------------------------------------------ the checks

log "running scripts/stripe_sdk_check.py against http://127.0.0.1:$API_PORT"
# Keep the library's traffic on loopback even when the environment names an HTTP proxy.
if ! NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" \
    "$VENV/bin/python" scripts/stripe_sdk_check.py "http://127.0.0.1:$API_PORT"; then
    show_log
    die "the Stripe library checks failed"
fi
log "done"
