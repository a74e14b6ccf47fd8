#!/usr/bin/env bash
# Installs what `chaos --ha patroni` needs beside PostgreSQL, where missing: Patroni, etcd and
# HAProxy (Debian's patroni, etcd-server and haproxy), with apt-get, as root. Used by
# scripts/chaos.sh (for --ha patroni) and by scripts/test.sh --heavy (CI's test step, whose Patroni
# tests must run under CI). Exits non-zero, saying what is missing, where it cannot install them.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
SCRIPT=patroni-install

missing=()
for program in patroni:patroni etcd:etcd-server haproxy:haproxy; do
    command -v "${program%%:*}" >/dev/null 2>&1 || missing+=("${program#*:}")
done
[[ ${#missing[@]} -eq 0 ]] && exit 0
if [[ $(id -u) -eq 0 ]] && command -v apt-get >/dev/null 2>&1; then
    log "installing ${missing[*]} with apt-get"
    apt-get update >&2 || die "apt-get update failed"
    DEBIAN_FRONTEND=noninteractive apt-get install -y "${missing[@]}" >&2 ||
        die "apt-get install ${missing[*]} failed"
else
    die "--ha patroni needs ${missing[*]} (Debian: apt-get install -y ${missing[*]}, as root)"
fi
