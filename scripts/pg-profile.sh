#!/usr/bin/env bash
# Where PostgreSQL's time goes, per statement: runs scripts/bench.sh against a private cluster
# with pg_stat_statements loaded (and track_io_timing on), with the machine's server's settings
# otherwise (autovacuum off, shared_buffers 128MB), then prints, for the service's databases, one
# row per statement: calls per booking, mean time, share of the service's statement time, rows
# per call and WAL per booking. For example
#
#   scripts/pg-profile.sh --scenario create --concurrency 8 --duration 10s
#   scripts/pg-profile.sh --scenario baseline --concurrency 8 --duration 10s
#
# A booking is a row of `rides` (the warm-up's too: pg_stat_statements counts them as well).
# Run one scenario at a time: the counts are summed over every measurement of the run. The
# cluster lives in a temporary directory on a free loopback port and is removed at the end.
set -euo pipefail
cd "$(dirname "$0")/.."

bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
dir=$(mktemp -d /tmp/pg-profile.XXXXXX)
chown postgres "$dir"
port=$(python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
as_postgres() { runuser -u postgres -- "$@"; }
stop() { as_postgres "$bin/pg_ctl" -D "$dir/data" -m immediate stop >/dev/null 2>&1 || true; rm -rf "$dir"; }
trap stop EXIT

as_postgres "$bin/initdb" -D "$dir/data" -A trust -U postgres >/dev/null
as_postgres "$bin/pg_ctl" -D "$dir/data" -l "$dir/log" -w start -o "-c listen_addresses=127.0.0.1 \
    -c port=$port -c unix_socket_directories=$dir -c autovacuum=off -c shared_buffers=128MB \
    -c max_connections=100 -c shared_preload_libraries=pg_stat_statements \
    -c pg_stat_statements.track=all -c pg_stat_statements.max=10000 -c track_io_timing=on" >/dev/null
url="postgres://postgres@127.0.0.1:$port/postgres"
psql "$url" -qc "CREATE EXTENSION pg_stat_statements"
echo "pg-profile: private cluster at 127.0.0.1:$port" >&2

DATABASE_URL=$url scripts/bench.sh --keep-databases "$@" >&2

bookings=0
for db in $(psql "$url" -Atc "SELECT datname FROM pg_database WHERE datname LIKE 'bench\_%\_service'"); do
    bookings=$((bookings + $(psql "${url%/postgres}/$db" -Atc "SELECT count(*) FROM rides")))
done
echo "pg-profile: $bookings bookings" >&2
psql "$url" -v bookings="$bookings" -P footer=off --csv <<'SQL'
WITH s AS (
    SELECT regexp_replace(left(query, 90), '\s+', ' ', 'g') AS statement,
           calls, total_exec_time, rows, wal_bytes
    FROM pg_stat_statements JOIN pg_database d ON d.oid = dbid
    WHERE d.datname LIKE 'bench\_%\_service' AND calls > 0
)
SELECT statement,
       round(sum(calls)::numeric / :bookings, 3) AS calls_per_booking,
       round((sum(total_exec_time) / sum(calls))::numeric, 4) AS mean_ms,
       round((100 * sum(total_exec_time) / sum(sum(total_exec_time)) OVER ())::numeric, 1)
           AS share_pct,
       round(sum(rows)::numeric / sum(calls), 2) AS rows_per_call,
       round(sum(wal_bytes) / :bookings) AS wal_bytes_per_booking
FROM s GROUP BY statement
HAVING sum(calls)::numeric / :bookings >= 0.001
ORDER BY sum(total_exec_time) DESC;
SQL
