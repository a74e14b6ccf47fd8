#!/usr/bin/env bash
# The whole test suite: makes PostgreSQL available (scripts/postgres.sh), then runs every test of
# the workspace against it. Each database test gets a fresh database of its own (#[sqlx::test]).
set -euo pipefail
cd "$(dirname "$0")/.."

DATABASE_URL=$(scripts/postgres.sh)
export DATABASE_URL
echo "test.sh: using $DATABASE_URL" >&2

cargo test --workspace --locked "$@"
