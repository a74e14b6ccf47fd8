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
# and HAProxy are installed with apt-get where missing (root only), and only when asked for.
ensure_patroni() {
    local missing=() program
    for program in patroni:patroni etcd:etcd-server haproxy:haproxy; do
        command -v "${program%%:*}" >/dev/null 2>&1 || missing+=("${program#*:}")
    done
    [[ ${#missing[@]} -eq 0 ]] && return 0
    if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
        log "--ha patroni: installing ${missing[*]} with apt-get"
        apt-get update >&2 || die "apt-get update failed"
        DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >&2 ||
            die "apt-get install ${missing[*]} failed"
    else
        die "--ha patroni needs ${missing[*]} (Debian: apt-get install -y ${missing[*]}, as root)"
    fi
}
previous=
for arg in "$@"; do
    if [[ $arg == --ha=patroni || ($previous == --ha && $arg == patroni) ]]; then
        ensure_patroni
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
