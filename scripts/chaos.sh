#!/usr/bin/env bash
# The chaos demo: builds rocket-rides with its failpoints and the harness (crates/proving-ground),
# makes PostgreSQL available (the server of DATABASE_URL holds the gateway's database; the
# service's runs in a cluster of the run's own, made from the installed server binaries), and
# runs `chaos` with the given options (default: a run of about a minute and a half). Exits non-zero when an
# invariant failed. Reports land in target/chaos/.
set -euo pipefail
cd "$(dirname "$0")/.."

# The run's own PostgreSQL (which it crashes, and with --failover replicates) is made from the
# installed server binaries, whichever server DATABASE_URL names.
DATABASE_URL=$(scripts/postgres.sh --server-binaries)
export DATABASE_URL
cargo build --locked -p rocket-rides -p proving-ground --features rocket-rides/failpoints \
    --bin rocket-rides --bin chaos
exec target/debug/chaos "$@"
