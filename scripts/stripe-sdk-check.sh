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
#   2. cargo build --locked --bin fakestripe; start it on 127.0.0.1 (12121/12122, or free
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

log() { printf 'stripe-sdk-check: %s\n' "$*" >&2; }
die() {
    printf 'stripe-sdk-check: ERROR: %s\n' "$*" >&2
    exit 1
}

# A fresh Debian or Ubuntu with only Rust may have no Python at all.
if ! command -v python3 >/dev/null 2>&1; then
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "python3 not found; installing python3 and python3-venv with apt-get"
        apt-get update >&2 || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv >&2 ||
            die "apt-get install python3 python3-venv failed"
    else
        die "python3 is needed (Debian: apt-get install -y python3 python3-venv, as root)"
    fi
fi
mkdir -p -- "$WORK"

# ------------------------------------------------------------------ database

SERVER_URL=$(scripts/postgres.sh) || die "scripts/postgres.sh found no PostgreSQL server"

PSQL=$(command -v psql 2>/dev/null || true)
if [[ -z $PSQL ]]; then
    for p in /usr/lib/postgresql/*/bin/psql; do
        [[ -x $p ]] && PSQL=$p
    done
fi
[[ -n $PSQL ]] || die "psql not found (Debian: apt-get install -y postgresql-client)"

psql_at() { PGCONNECT_TIMEOUT=10 "$PSQL" -w -X -q -v ON_ERROR_STOP=1 -At "$@" </dev/null; }

db_exists() {
    [[ $(psql_at -c "select 1 from pg_database where datname = '$DB_NAME'" "$SERVER_URL") == 1 ]]
}
if ! db_exists; then
    log "creating database $DB_NAME"
    # Another run may create it at the same moment: then the second `create` fails, and the
    # database exists all the same.
    psql_at -c "create database $DB_NAME" "$SERVER_URL" || db_exists ||
        die "could not create database $DB_NAME"
fi

# The same server and credentials, another database (query parameters are kept).
DATABASE_URL=$(python3 - "$SERVER_URL" "$DB_NAME" <<'EOF'
import sys
from urllib.parse import urlsplit, urlunsplit
url = urlsplit(sys.argv[1])
print(urlunsplit(url._replace(path="/" + sys.argv[2])))
EOF
)
export DATABASE_URL

# ------------------------------------------------------------------ fakestripe

log "cargo build --locked --bin fakestripe (waits if another build holds the lock)"
cargo build --locked --bin fakestripe
BIN=$TARGET_DIR/debug/fakestripe
[[ -x $BIN ]] || die "$BIN was not built"

# Two free loopback ports, 12121/12122 when they are free.
read -r API_PORT ADMIN_PORT < <(python3 - <<'EOF'
import socket

def free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

def any_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

ports = [p for p in (12121, 12122) if free(p)]
while len(ports) < 2:
    p = any_port()
    if p not in ports:
        ports.append(p)
print(*ports)
EOF
) || die "found no free ports"
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
ready=0
for ((i = 0; i < WAIT_SECS * 10; i++)); do
    if ! kill -0 "$FAKESTRIPE_PID" 2>/dev/null; then
        show_log
        die "fakestripe exited before accepting connections"
    fi
    if (exec 3<>"/dev/tcp/127.0.0.1/$API_PORT") 2>/dev/null; then
        ready=1
        break
    fi
    sleep 0.1
done
if ((ready == 0)); then
    show_log
    die "fakestripe did not accept connections on 127.0.0.1:$API_PORT within ${WAIT_SECS}s"
fi

# ------------------------------------------------------------------ the Python library

venv_ok() { [[ -x $VENV/bin/python ]] && "$VENV/bin/python" -c 'import sys' >/dev/null 2>&1; }

if ! venv_ok; then
    log "creating a Python venv in $VENV"
    rm -rf -- "$VENV"
    if ! python3 -m venv "$VENV"; then
        rm -rf -- "$VENV"
        # Debian's python3 ships without ensurepip until python3-venv is installed.
        if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
            log "python3 -m venv failed; installing python3-venv with apt-get"
            apt-get update || die "apt-get update failed"
            DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv ||
                die "apt-get install python3-venv failed"
            python3 -m venv "$VENV" || die "python3 -m venv $VENV failed even with python3-venv installed"
        else
            die "python3 -m venv failed; install the venv module (Debian: apt-get install -y python3-venv, as root) and re-run"
        fi
    fi
fi

installed=$("$VENV/bin/python" -c 'import importlib.metadata as m; print(m.version("stripe"))' 2>/dev/null || true)
if [[ $installed != "$STRIPE_VERSION" ]]; then
    log "pip install stripe==$STRIPE_VERSION into $VENV"
    "$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "stripe==$STRIPE_VERSION" ||
        die "pip install stripe==$STRIPE_VERSION failed"
fi

# ------------------------------------------------------------------ the checks

log "running scripts/stripe_sdk_check.py against http://127.0.0.1:$API_PORT"
# Keep the library's traffic on loopback even when the environment names an HTTP proxy.
if ! NO_PROXY="127.0.0.1,localhost${NO_PROXY:+,$NO_PROXY}" no_proxy="127.0.0.1,localhost${no_proxy:+,$no_proxy}" \
    "$VENV/bin/python" scripts/stripe_sdk_check.py "http://127.0.0.1:$API_PORT"; then
    show_log
    die "the Stripe library checks failed"
fi
log "done"
