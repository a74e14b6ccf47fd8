#!/usr/bin/env bash
# The benchmark: builds release programs (rocket-rides with its `bench` feature, which adds the
# baseline route; fakestripe; the `bench` driver from crates/proving-ground), makes PostgreSQL
# available, and runs `bench` with the given options, for example
#
#   scripts/bench.sh                                   # every scenario at c1, c8, c32, 5 s each
#   scripts/bench.sh --duration 20s --concurrency 8 --scenario create,baseline
#
# The pooled scenarios (create_pooled, replay_pooled: the service behind a PgBouncer in
# transaction pooling with DATABASE_POOLER=transaction) are in the default set; the run starts
# that PgBouncer through scripts/pgbouncer.sh (which installs pgbouncer where it is missing) and
# stops it at its end, and fails if it cannot start one.
#
# `open` (bookings offered at 0.5x, 1x and 2x the capacity create measured, Poisson arrivals) runs
# after the closed-loop scenarios; `create_large` and `replay_large` run last, on tables preloaded
# with --preload-keys finished bookings (a million by default: about 2 minutes and 1 GB here).
#
# Prints a table; writes target/bench/<run>/report.json. Exits non-zero only when a correctness
# check of the run failed (a storm key booked twice, a charge without its ride), never on speed.
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=$(scripts/postgres.sh)
export DATABASE_URL
# Two builds: the service without failpoints (the driver's own dependency on the service
# library turns them on, and the service measured must be the production build plus the
# baseline route).
cargo build --release --locked -p rocket-rides --features bench --bin rocket-rides
cargo build --release --locked -p fakestripe --bin fakestripe -p proving-ground --bin bench
exec target/release/bench "$@"
