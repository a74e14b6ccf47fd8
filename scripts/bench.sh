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
# BENCH_BUILD=debug runs the debug programs instead (CI: the correctness checks, not the figures).
#
# Prints a table; writes target/bench/<run>/report.json. Exits non-zero only when a correctness
# check of the run failed (a storm key booked twice, a charge without its ride), never on speed.
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=$(scripts/postgres.sh)
export DATABASE_URL
if [[ ${BENCH_BUILD:-release} == debug ]]; then
    # For the run's correctness checks alone (CI), whose figures nobody reads: the workspace's
    # debug build, rocket-rides with the baseline route added (and, as in every debug build of
    # the workspace, its inert failpoints). Copied aside, so that target/debug/rocket-rides stays
    # the build the other scripts and the tests run.
    cargo build --locked --workspace --bins --features rocket-rides/bench
    programs=target/bench-debug
    mkdir -p "$programs"
    cp target/debug/rocket-rides target/debug/fakestripe target/debug/bench "$programs/"
    cargo build --locked --workspace --bins
    exec "$programs/bench" "$@"
fi
[[ ${BENCH_BUILD:-release} == release ]] || { echo "bench.sh: BENCH_BUILD is release or debug" >&2; exit 2; }
# Two builds: the service without failpoints (the driver's own dependency on the service
# library turns them on, and the service measured must be the production build plus the
# baseline route).
cargo build --release --locked -p rocket-rides --features bench --bin rocket-rides
cargo build --release --locked -p fakestripe --bin fakestripe -p proving-ground --bin bench
exec target/release/bench "$@"
