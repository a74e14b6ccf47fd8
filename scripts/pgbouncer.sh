#!/usr/bin/env bash
# Start a PgBouncer in transaction pooling in front of a PostgreSQL server, and print its URL.
#
#   POOLER_URL=$(scripts/pgbouncer.sh "$DATABASE_URL")   # stdout: the URL only, one line
#   scripts/pgbouncer.sh --stop "$POOLER_URL"            # stops the one this script started there
#
# The URL has the server's user and database; any database name works through it (the config's
# `*` entry forwards every name to the server), so tests that make a database each can reach
# theirs. It listens on a free loopback port, with its config, log and pid file under
# target/pgbouncer/<port>/. Installs Debian's pgbouncer with apt-get where it is missing (root).
#
# The settings that matter (docs/operations.md, "Running behind PgBouncer"):
#   pool_mode = transaction           what the library's Statements::Unnamed is for
#   ignore_startup_parameters = extra_float_digits
#                                     sqlx sends it at startup; PgBouncer refuses the connection
#                                     unless told to ignore it
#   auth_type = trust                 the test server trusts loopback; never in production
set -euo pipefail
cd "$(dirname "$0")/.."
# shellcheck source=scripts/lib.sh
. scripts/lib.sh
SCRIPT=pgbouncer.sh
# The URL alone on stdout; apt's and pgbouncer's chatter on stderr.
exec 3>&1 1>&2

find_pgbouncer() {
    PGBOUNCER=$(command -v pgbouncer 2>/dev/null || true)
    [[ -z $PGBOUNCER && -x /usr/sbin/pgbouncer ]] && PGBOUNCER=/usr/sbin/pgbouncer
    [[ -n $PGBOUNCER ]] && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "pgbouncer not found; installing it with apt-get"
        apt-get update >&2 || die "apt-get update failed"
        # 3>&-: the package's postinst may start a daemon, which must not hold our stdout.
        DEBIAN_FRONTEND=noninteractive apt-get install -y pgbouncer >&2 3>&- ||
            die "apt-get install pgbouncer failed"
        # Debian's package starts a system-wide one on 6432; ours are started below.
        if command -v systemctl >/dev/null 2>&1; then systemctl stop pgbouncer 3>&- || true; fi
        PGBOUNCER=/usr/sbin/pgbouncer
    else
        die "pgbouncer is needed (Debian: apt-get install -y pgbouncer, as root)"
    fi
}

# host port user database of a postgres:// URL, one a line.
url_parts() {
    ensure_python3
    python3 - "$1" <<'PY'
import sys
from urllib.parse import urlsplit
u = urlsplit(sys.argv[1])
print(u.hostname or "127.0.0.1")
print(u.port or 5432)
print(u.username or "postgres")
print(u.path.lstrip("/") or "postgres")
PY
}

if [[ ${1:-} == --stop ]]; then
    [[ $# -eq 2 ]] || die "usage: scripts/pgbouncer.sh --stop POOLER_URL"
    mapfile -t parts < <(url_parts "$2")
    dir=target/pgbouncer/${parts[1]}
    if [[ -f $dir/pgbouncer.pid ]]; then
        kill "$(cat "$dir/pgbouncer.pid")" 2>/dev/null || true
        rm -f "$dir/pgbouncer.pid"
    fi
    exit 0
fi

[[ $# -eq 1 ]] || die "usage: scripts/pgbouncer.sh DATABASE_URL"
[[ $1 == postgres://* || $1 == postgresql://* ]] ||
    die "usage: scripts/pgbouncer.sh DATABASE_URL (a postgres:// URL), or --stop POOLER_URL; got ${1@Q}"
server=$1
find_pgbouncer
mapfile -t parts < <(url_parts "$server")
host=${parts[0]} port=${parts[1]} user=${parts[2]} db=${parts[3]}
read -r listen < <(free_ports 1)
dir=$PWD/target/pgbouncer/$listen
mkdir -p "$dir"
cat >"$dir/pgbouncer.ini" <<INI
[databases]
; Every database name goes to the same server, as the same user.
* = host=$host port=$port user=$user

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $listen
unix_socket_dir =
auth_type = trust
auth_file = $dir/userlist.txt
pool_mode = transaction
; sqlx sets extra_float_digits at startup: without this, PgBouncer refuses its connections.
ignore_startup_parameters = extra_float_digits
default_pool_size = 20
max_client_conn = 500
; Tests drop their databases at the end: idle server connections to them must not linger long.
server_idle_timeout = 2
; A test's database is dropped at its end and made again, under the same name, by the next run of
; the test: PgBouncer sees the dropped one fail a login, and by default refuses every client of
; that name for 15 s after. Here it tries again at once.
server_login_retry = 0
logfile = $dir/pgbouncer.log
pidfile = $dir/pgbouncer.pid
INI
printf '"%s" ""\n' "$user" >"$dir/userlist.txt"
# PgBouncer refuses to run as root; postgres owns the files it writes then.
run=()
if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || die "running as root: a postgres user is needed to run pgbouncer as"
    chown -R postgres "$dir"
    run=(runuser -u postgres --)
fi
"${run[@]}" "$PGBOUNCER" -d "$dir/pgbouncer.ini" 3>&- || die "pgbouncer did not start (log: $dir/pgbouncer.log)"
for ((i = 0; i < 50; i++)); do
    [[ -s $dir/pgbouncer.pid ]] && break
    sleep 0.1
done
[[ -s $dir/pgbouncer.pid ]] || die "pgbouncer wrote no pid file (log: $dir/pgbouncer.log)"
wait_for_port "$listen" "$(cat "$dir/pgbouncer.pid")" "$dir/pgbouncer.log" 10
log "pgbouncer (transaction pooling) on 127.0.0.1:$listen in front of $host:$port; log: $dir/pgbouncer.log"
printf 'postgres://%s@127.0.0.1:%s/%s\n' "$user" "$listen" "$db" >&3
