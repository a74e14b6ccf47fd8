# Helpers shared by the scripts that start the real programs (sourced, not run).
#
#   . scripts/lib.sh; SCRIPT=name
#
# Every helper writes its diagnostics to stderr, prefixed by $SCRIPT.

log() { printf '%s: %s\n' "${SCRIPT:-script}" "$*" >&2; }
die() {
    printf '%s: ERROR: %s\n' "${SCRIPT:-script}" "$*" >&2
    exit 1
}

# python3 with venv support; installed with apt-get when missing (root only), since a fresh
# Debian or Ubuntu with only Rust may have no Python at all.
ensure_python3() {
    command -v python3 >/dev/null 2>&1 && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "python3 not found; installing python3 and python3-venv with apt-get"
        apt-get update >&2 || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y python3 python3-venv >&2 ||
            die "apt-get install python3 python3-venv failed"
    else
        die "python3 is needed (Debian: apt-get install -y python3 python3-venv, as root)"
    fi
}

# A venv at $1 with the pinned package $2==$3 (reused when it already has that version).
venv_with() {
    local venv=$1 package=$2 version=$3 installed
    ensure_python3
    if ! [[ -x $venv/bin/python ]] || ! "$venv/bin/python" -c 'import sys' >/dev/null 2>&1; then
        log "creating a Python venv in $venv"
        rm -rf -- "$venv"
        if ! python3 -m venv "$venv"; then
            rm -rf -- "$venv"
            # Debian's python3 ships without ensurepip until python3-venv is installed.
            if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
                log "python3 -m venv failed; installing python3-venv with apt-get"
                apt-get update >&2 || die "apt-get update failed"
                DEBIAN_FRONTEND=noninteractive apt-get install -y python3-venv >&2 ||
                    die "apt-get install python3-venv failed"
                python3 -m venv "$venv" || die "python3 -m venv $venv failed even with python3-venv installed"
            else
                die "python3 -m venv failed; install the venv module (Debian: apt-get install -y python3-venv, as root) and re-run"
            fi
        fi
    fi
    installed=$("$venv/bin/python" -c "import importlib.metadata as m; print(m.version('$package'))" 2>/dev/null || true)
    if [[ $installed != "$version" ]]; then
        log "pip install $package==$version into $venv"
        "$venv/bin/python" -m pip install --quiet --disable-pip-version-check "$package==$version" ||
            die "pip install $package==$version failed"
    fi
}

# A psql client, in $PSQL.
find_psql() {
    PSQL=$(command -v psql 2>/dev/null || true)
    if [[ -z $PSQL ]]; then
        for p in /usr/lib/postgresql/*/bin/psql; do
            [[ -x $p ]] && PSQL=$p
        done
    fi
    [[ -n $PSQL ]] || die "psql not found (Debian: apt-get install -y postgresql-client)"
}

psql_at() { PGCONNECT_TIMEOUT=10 "$PSQL" -w -X -q -v ON_ERROR_STOP=1 -At "$@" </dev/null; }

# Prints the URL of database $2 on the server of URL $1 (same credentials and parameters),
# creating the database if it is missing; with $3 = fresh, dropping it first.
database_url() {
    local server=$1 name=$2 fresh=${3:-}
    find_psql
    if [[ $fresh == fresh ]]; then
        psql_at -c "drop database if exists $name with (force)" "$server" ||
            die "could not drop database $name"
    fi
    if [[ $(psql_at -c "select 1 from pg_database where datname = '$name'" "$server") != 1 ]]; then
        log "creating database $name"
        # Another run may create it at the same moment: the database exists all the same.
        psql_at -c "create database $name" "$server" ||
            [[ $(psql_at -c "select 1 from pg_database where datname = '$name'" "$server") == 1 ]] ||
            die "could not create database $name"
    fi
    python3 - "$server" "$name" <<'PY'
import sys
from urllib.parse import urlsplit, urlunsplit
url = urlsplit(sys.argv[1])
print(urlunsplit(url._replace(path="/" + sys.argv[2])))
PY
}

# Prints $1 free loopback ports; $2… are ports to prefer when they are free.
free_ports() {
    local count=$1
    shift
    python3 - "$count" "$@" <<'PY'
import socket, sys

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

count = int(sys.argv[1])
ports = [p for p in map(int, sys.argv[2:]) if free(p)][:count]
while len(ports) < count:
    p = any_port()
    if p not in ports:
        ports.append(p)
print(*ports)
PY
}

# Waits (bounded, $4 seconds) until 127.0.0.1:$1 accepts connections, while process $2 lives;
# shows the tail of its log $3 when it does not.
wait_for_port() {
    local port=$1 pid=$2 logfile=$3 secs=${4:-60} i
    for ((i = 0; i < secs * 10; i++)); do
        if ! kill -0 "$pid" 2>/dev/null; then
            tail -n 30 -- "$logfile" >&2 || true
            die "the process logging to $logfile exited before accepting connections"
        fi
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            return 0
        fi
        sleep 0.1
    done
    tail -n 30 -- "$logfile" >&2 || true
    die "nothing accepted connections on 127.0.0.1:$port within ${secs}s (log: $logfile)"
}
