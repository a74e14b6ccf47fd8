#!/usr/bin/env bash
# Make a PostgreSQL server available for tests/demo and print its DATABASE_URL.
#
#   DATABASE_URL=$(scripts/postgres.sh)     # stdout: the URL only, one line
#   . scripts/postgres.sh                   # sourced: exports DATABASE_URL
#   scripts/postgres.sh --server-binaries   # and install initdb/pg_ctl even when a server answers
#
# Order of preference:
#   1. $DATABASE_URL, if set and it answers `select 1`          -> printed unchanged
#   2. a trust-auth server on 127.0.0.1:${PGPORT_PROBE:-5432}    -> its URL
#      (skipped when ROCKET_RIDES_PRIVATE_PG=1)
#   3. a private cluster started from /usr/lib/postgresql/<newest>/bin
#        data dir  ${ROCKET_RIDES_PGDATA:-/var/tmp/rocket-rides-pg}
#        port      ${ROCKET_RIDES_PGPORT:-54329}, listening on 127.0.0.1 only
#   4. no server binaries: apt-get install postgresql (root or sudo), then 3.
# The server must be PostgreSQL 15 or later: an older one is passed over (2.) or refused.
#
# All progress/diagnostics go to stderr. Idempotent: a second call reuses the
# running server and returns quickly.

# When sourced, run ourselves as a child so `set -euo pipefail` and the fd
# juggling below cannot leak into the caller's shell.
if [[ "${BASH_SOURCE[0]}" != "$0" ]]; then
    if _rr_pg_url=$(bash "${BASH_SOURCE[0]}"); then
        export DATABASE_URL="$_rr_pg_url"
        unset _rr_pg_url
        return 0
    fi
    unset _rr_pg_url
    return 1
fi

set -euo pipefail

# Keep the real stdout on fd 3 for the URL; everything else (apt, initdb,
# pg_ctl chatter) goes to stderr so `$(scripts/postgres.sh)` stays clean.
# Commands that may leave a daemon behind (pg_ctl, apt postinst) get fd 3
# closed (3>&-); otherwise the server would hold the caller's $(...) open.
exec 3>&1 1>&2

log() { printf 'postgres.sh: %s\n' "$*" >&2; }
die() { printf 'postgres.sh: ERROR: %s\n' "$*" >&2; exit 1; }
emit() { printf '%s\n' "$1" >&3; exit 0; }

PRIVATE_DATA=${ROCKET_RIDES_PGDATA:-/var/tmp/rocket-rides-pg}
PRIVATE_PORT=${ROCKET_RIDES_PGPORT:-54329}
PROBE_PORT=${PGPORT_PROBE:-5432}
WAIT_SECS=30

[[ $PRIVATE_PORT =~ ^[0-9]+$ ]] || die "ROCKET_RIDES_PGPORT must be a port number, got '$PRIVATE_PORT'"
[[ $PROBE_PORT =~ ^[0-9]+$ ]] || die "PGPORT_PROBE must be a port number, got '$PROBE_PORT'"

IS_ROOT=0
[[ $(id -u) -eq 0 ]] && IS_ROOT=1

# ---------------------------------------------------------------- helpers

APT_UPDATED=0
apt_install() {
    local sudo=()
    if ((IS_ROOT == 0)); then
        command -v sudo >/dev/null 2>&1 ||
            die "need packages '$*' but not root and sudo is missing; install them: apt-get install -y $*"
        sudo=(sudo)
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "need PostgreSQL ($*) but apt-get is not available; install PostgreSQL manually or set DATABASE_URL"
    if ((APT_UPDATED == 0)); then
        log "apt-get update"
        "${sudo[@]}" apt-get update 3>&- || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install -y $*"
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" 3>&- ||
        die "apt-get install $* failed"
}

# Newest /usr/lib/postgresql/<ver>/bin that has the server tools; empty if none.
newest_bindir() {
    local d
    printf '%s\n' /usr/lib/postgresql/*/bin | sort -V -r | while read -r d; do
        if [[ -x $d/initdb && -x $d/pg_ctl ]]; then
            printf '%s\n' "$d"
            break
        fi
    done
}

# Any psql: the Debian wrapper on PATH, else a versioned one.
find_psql() {
    local p
    if p=$(command -v psql 2>/dev/null); then
        printf '%s\n' "$p"
        return 0
    fi
    for p in /usr/lib/postgresql/*/bin/psql; do
        [[ -x $p ]] && { printf '%s\n' "$p"; return 0; }
    done
    return 1
}

PSQL=""
ensure_psql() {
    [[ -n $PSQL ]] && return 0
    if ! PSQL=$(find_psql); then
        apt_install postgresql-client
        PSQL=$(find_psql) || die "psql still not found after installing postgresql-client"
    fi
}

# Does this connection answer `select 1`? -w: never prompt for a password.
can_query() {
    PGCONNECT_TIMEOUT=5 "$PSQL" -w -Atc 'select 1' "$@" </dev/null >/dev/null 2>&1
}

# The migrations need PostgreSQL 15 or later (ON DELETE SET NULL (column)).
MIN_VERSION_NUM=150000
# Is the server behind this connection new enough?
new_enough() {
    local v
    v=$(PGCONNECT_TIMEOUT=5 "$PSQL" -w -Atc 'show server_version_num' "$@" </dev/null 2>/dev/null) || return 1
    [[ $v =~ ^[0-9]+$ ]] && ((v >= MIN_VERSION_NUM))
}

# --server-binaries: the caller also runs servers of its own (the chaos harness makes, crashes
# and replicates clusters), so the server binaries must be installed whichever server is used.
if [[ ${1:-} == --server-binaries ]]; then
    bindir_major() { local d; d=$(newest_bindir); d=${d%/bin}; printf '%s\n' "${d##*/}"; }
    if [[ -z $(newest_bindir) ]]; then
        apt_install postgresql postgresql-client
    fi
    [[ -n $(newest_bindir) ]] || die "installed postgresql but found no initdb/pg_ctl under /usr/lib/postgresql/*/bin"
    major=$(bindir_major)
    [[ $major =~ ^[0-9]+$ ]] && ((major >= 15)) ||
        die "the newest PostgreSQL server binaries here are version $major; the migrations need 15 or later (install postgresql-15 or newer, e.g. from apt.postgresql.org)"
fi

# ------------------------------------------------- 1. existing DATABASE_URL

if [[ -n ${DATABASE_URL:-} ]]; then
    ensure_psql
    if can_query "$DATABASE_URL"; then
        new_enough "$DATABASE_URL" ||
            die "the server of DATABASE_URL is older than PostgreSQL 15, which the migrations need"
        emit "$DATABASE_URL"
    fi
    log "DATABASE_URL is set but does not answer 'select 1'; looking for another server"
fi

# ------------------------------------ 2. trust-auth server on 127.0.0.1:5432

if [[ ${ROCKET_RIDES_PRIVATE_PG:-0} != 1 ]]; then
    ensure_psql
    if can_query -h 127.0.0.1 -p "$PROBE_PORT" -U postgres -d postgres; then
        if new_enough -h 127.0.0.1 -p "$PROBE_PORT" -U postgres -d postgres; then
            emit "postgres://postgres@127.0.0.1:$PROBE_PORT/postgres"
        fi
        log "the server on 127.0.0.1:$PROBE_PORT is older than PostgreSQL 15; using a private cluster"
    fi
    log "no trust-auth server on 127.0.0.1:$PROBE_PORT; using a private cluster"
fi

# ------------------------------------------------------ 3./4. private cluster

# Relative paths would break once we cd / for runuser.
PRIVATE_DATA=$(realpath -m -- "$PRIVATE_DATA")
LOGFILE=$PRIVATE_DATA/server.log
CONF_NAME=rocket-rides.conf

# 4. No server binaries: install them (Debian's postinst may or may not start
# its own 'main' cluster; we don't rely on it either way).
BINDIR=$(newest_bindir)
if [[ -z $BINDIR ]]; then
    apt_install postgresql postgresql-client
    BINDIR=$(newest_bindir)
    [[ -n $BINDIR ]] || die "installed postgresql but found no initdb/pg_ctl under /usr/lib/postgresql/*/bin"
fi

# An existing cluster must be run by the major version that created it.
if [[ -f $PRIVATE_DATA/PG_VERSION ]]; then
    ver=$(<"$PRIVATE_DATA/PG_VERSION")
    [[ -x /usr/lib/postgresql/$ver/bin/pg_ctl ]] ||
        die "$PRIVATE_DATA was created by PostgreSQL $ver, which is not installed; delete that directory (rm -rf $PRIVATE_DATA) and re-run"
    BINDIR=/usr/lib/postgresql/$ver/bin
fi

# initdb/postgres refuse to run as root: as root, run them as the postgres OS
# user (created if missing); otherwise as ourselves. cd / so the target user
# is not left in an unreadable cwd such as /root.
if ((IS_ROOT)); then
    if ! id -u postgres >/dev/null 2>&1; then
        log "creating system user 'postgres'"
        useradd --system --user-group --home-dir /var/lib/postgresql \
            --no-create-home --shell /bin/bash postgres ||
            die "could not create the 'postgres' OS user"
    fi
    run_pg() { (cd / && runuser -u postgres -- "$@") 3>&-; }
else
    run_pg() { (cd / && "$@") 3>&-; }
fi

# Data directory: must exist, be owned by the run user, mode 0700.
mkdir -p -- "$PRIVATE_DATA" || die "cannot create $PRIVATE_DATA"
if ((IS_ROOT)); then
    [[ $(stat -c %U -- "$PRIVATE_DATA") == postgres ]] ||
        chown -R postgres:postgres -- "$PRIVATE_DATA"
else
    [[ -O $PRIVATE_DATA ]] ||
        die "$PRIVATE_DATA is not owned by $(id -un); set ROCKET_RIDES_PGDATA to a directory you own"
fi
chmod 700 -- "$PRIVATE_DATA"
run_pg test -w "$PRIVATE_DATA" -a -x "$PRIVATE_DATA" ||
    die "the server user cannot write $PRIVATE_DATA (a parent directory is probably not traversable); set ROCKET_RIDES_PGDATA to e.g. /var/tmp/rocket-rides-pg"

if [[ ! -f $PRIVATE_DATA/PG_VERSION ]]; then
    [[ -z $(ls -A -- "$PRIVATE_DATA") ]] ||
        die "$PRIVATE_DATA is not empty but holds no PostgreSQL cluster; remove it or set ROCKET_RIDES_PGDATA"
    log "initializing private cluster in $PRIVATE_DATA ($BINDIR)"
    # trust auth for local + host 127.0.0.1/::1; UTF8 with the C locale works
    # on every machine regardless of which locales are generated.
    run_pg "$BINDIR/initdb" -D "$PRIVATE_DATA" -U postgres --auth=trust \
        --encoding=UTF8 --no-locale >/dev/null ||
        die "initdb failed for $PRIVATE_DATA"
    printf "\n# Settings for the rocket-rides test cluster (written by scripts/postgres.sh)\ninclude_if_exists = '%s'\n" "$CONF_NAME" |
        run_pg tee -a "$PRIVATE_DATA/postgresql.conf" >/dev/null
fi

# Our settings live in a separate include file that is regenerated on every
# run, so changing ROCKET_RIDES_PGPORT takes effect (via restart) later on.
# Unix sockets have a ~107 byte path limit: fall back to /tmp for long paths.
SOCKDIR=$PRIVATE_DATA
((${#SOCKDIR} <= 80)) || SOCKDIR=/tmp
conf_body="# Managed by scripts/postgres.sh; rewritten on every run.
listen_addresses = '127.0.0.1'
port = $PRIVATE_PORT
unix_socket_directories = '$SOCKDIR'
max_connections = 200        # tests open many connection pools
shared_buffers = 128MB"
conf_changed=0
if [[ $(cat -- "$PRIVATE_DATA/$CONF_NAME" 2>/dev/null || true) != "$conf_body" ]]; then
    printf '%s\n' "$conf_body" | run_pg tee "$PRIVATE_DATA/$CONF_NAME" >/dev/null
    conf_changed=1
fi

# pg_ctl status: 0 = running, 3 = not running.
if run_pg "$BINDIR/pg_ctl" status -D "$PRIVATE_DATA" >/dev/null 2>&1; then
    if ((conf_changed)); then
        log "settings changed; restarting private cluster"
        run_pg "$BINDIR/pg_ctl" restart -D "$PRIVATE_DATA" -l "$LOGFILE" -w -t "$WAIT_SECS" -m fast >/dev/null || {
            tail -n 20 -- "$LOGFILE" >&2 || true
            die "could not restart the private cluster (log: $LOGFILE)"
        }
    fi
else
    log "starting private cluster on 127.0.0.1:$PRIVATE_PORT (log: $LOGFILE)"
    run_pg "$BINDIR/pg_ctl" start -D "$PRIVATE_DATA" -l "$LOGFILE" -w -t "$WAIT_SECS" >/dev/null || {
        tail -n 20 -- "$LOGFILE" >&2 || true
        die "could not start the private cluster (is port $PRIVATE_PORT already in use? log: $LOGFILE)"
    }
fi

# Bounded wait until it accepts TCP connections.
for ((i = 0; i < WAIT_SECS; i++)); do
    "$BINDIR/pg_isready" -q -h 127.0.0.1 -p "$PRIVATE_PORT" -U postgres -d postgres && break
    sleep 1
done
PSQL=$BINDIR/psql
can_query -h 127.0.0.1 -p "$PRIVATE_PORT" -U postgres -d postgres ||
    die "private cluster in $PRIVATE_DATA does not accept connections on 127.0.0.1:$PRIVATE_PORT after ${WAIT_SECS}s (log: $LOGFILE; a stale postmaster.pid may need removing)"
new_enough -h 127.0.0.1 -p "$PRIVATE_PORT" -U postgres -d postgres ||
    die "the installed PostgreSQL ($BINDIR) is older than 15, which the migrations need; install PostgreSQL 15 or later, or set DATABASE_URL"

emit "postgres://postgres@127.0.0.1:$PRIVATE_PORT/postgres"
