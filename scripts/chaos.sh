#!/usr/bin/env bash
# The chaos demo: builds rocket-rides with its failpoints and the harness (crates/proving-ground),
# makes PostgreSQL available, and runs `chaos` with the given options (default: a run of about a
# minute). Exits non-zero when an invariant failed. Reports land in target/chaos/.
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=$(scripts/postgres.sh)
export DATABASE_URL
cargo build --locked -p rocket-rides -p proving-ground --features rocket-rides/failpoints \
    --bin rocket-rides --bin chaos
exec target/debug/chaos "$@"
