#!/usr/bin/env bash
# The whole test suite: makes PostgreSQL available (scripts/postgres.sh), then runs every test of
# the workspace against it. Each database test gets a fresh database of its own (#[sqlx::test]).
# Ends with one line that totals every test binary's result: "N passed, M failed".
set -euo pipefail
cd "$(dirname "$0")/.."

# The chaos harness's tests make PostgreSQL clusters of their own: the server binaries too.
DATABASE_URL=$(scripts/postgres.sh --server-binaries)
export DATABASE_URL
echo "test.sh: using $DATABASE_URL" >&2

log=$(mktemp)
trap 'rm -f "$log"' EXIT
status=0
cargo test --workspace --locked --no-fail-fast "$@" 2>&1 | tee "$log" || status=$?
# The store's tests again, through a PgBouncer in transaction pooling (scripts/pgbouncer.sh,
# installed where missing), with the store's Statements::Unnamed (store, expiry, handover); tests/integration/pooler.rs also checks
# that the default statements fail there. Then Rocket Rides through the same PgBouncer with
# --database-pooler transaction (crates/rocket-rides/tests/integration/pooler.rs, with its control). Bounded:
# PgBouncer stops when they end.
if pooler_url=$(scripts/pgbouncer.sh "$DATABASE_URL"); then
    echo "test.sh: the store's tests and Rocket Rides' through $pooler_url" >&2
    IDEMPOTENCY_TEST_POOLER_URL=$pooler_url timeout 600 \
        cargo test -p idempotency --locked --no-fail-fast --test integration "$@" -- store:: expiry:: handover:: pooler:: 2>&1 |
        tee -a "$log" || status=$?
    ROCKET_RIDES_TEST_POOLER_URL=$pooler_url timeout 600 \
        cargo test -p rocket-rides --locked --no-fail-fast --test integration "$@" -- pooler:: 2>&1 |
        tee -a "$log" || status=$?
    scripts/pgbouncer.sh --stop "$pooler_url"
else
    echo "test.sh: could not start PgBouncer for the store's tests through it" >&2
    status=1
fi
# cargo prints one "test result: ok. 12 passed; 0 failed; …" line per test binary.
sed -n 's/^test result: [a-zA-Z]*\. \([0-9]*\) passed; \([0-9]*\) failed.*/\1 \2/p' "$log" |
    awk '{ p += $1; f += $2 } END { printf "%d passed, %d failed\n", p, f }'
exit "$status"
