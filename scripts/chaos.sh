#!/usr/bin/env bash
# The chaos demo: builds rocket-rides with its failpoints and the harness (crates/proving-ground),
# makes PostgreSQL available (the server of DATABASE_URL holds the gateway's database; the
# service's runs in a cluster of the run's own, made from the installed server binaries), and
# runs `chaos` with the given options (default: a run of about a minute and a half). Exits non-zero when an
# invariant failed. Reports land in target/chaos/.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
SCRIPT=chaos

# `--ha patroni` runs the service's database in a Patroni cluster behind HAProxy: Patroni, etcd
# and HAProxy are installed with apt-get where missing (root only, scripts/patroni-install.sh),
# and only when asked for.
previous=
for arg in "$@"; do
    if [[ $arg == --ha=patroni || ($previous == --ha && $arg == patroni) ]]; then
        scripts/patroni-install.sh
    fi
    previous=$arg
done

# The run's own PostgreSQL (which it crashes, and with --failover replicates) is made from the
# installed server binaries, whichever server DATABASE_URL names.
DATABASE_URL=$(scripts/postgres.sh --server-binaries)
export DATABASE_URL
# The workspace's debug build (its features, so that CI's one build serves every script): the
# harness's own dependency on the service turns the failpoints on.
cargo build --locked --workspace --bins --features rocket-rides/failpoints
exec target/debug/chaos "$@"
