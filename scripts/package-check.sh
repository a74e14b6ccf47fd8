#!/usr/bin/env bash
# The libraries package for crates.io and compile from their tarballs, migrations included (the
# compile reads them, through `sqlx::migrate!`); CI runs it from .ci/run.
#
# `cargo package` would verify by building each tarball in a target directory of its own, cold
# (about 7 minutes on two cores: every dependency again): a reused one is no answer, since cargo
# takes the packaged idempotency, which no registry holds yet, for any earlier build of its name
# and version, and would verify idempotency-axum against an old one. So: `cargo package
# --no-verify` (the tarballs and their lists of files), then the tarballs unpacked into a scratch
# workspace where idempotency-axum's `idempotency` is patched to the unpacked tarball (a path,
# whose changes cargo sees), checked (`cargo check`: everything but code generation, which a
# library's tarball cannot break) against the repository's own target directory, with the
# repository's lock and profile: the dependencies' metadata is the one `cargo doc` of the two
# libraries made, and only the two tarballs are compiled.
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
SCRIPT=package-check

TARGET_DIR=${CARGO_TARGET_DIR:-$PWD/target}
# --allow-dirty checks a local tree as it stands.
cargo package --locked --allow-dirty --no-verify -p idempotency -p idempotency-axum
version() { cargo pkgid -p "$1" | sed 's/.*[#@]//'; }
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
for crate in idempotency idempotency-axum; do
    tar -xzf "$TARGET_DIR/package/$crate-$(version "$crate").crate" -C "$scratch" ||
        die "could not unpack the $crate tarball"
done
{
    echo '[workspace]'
    echo 'resolver = "2"'
    echo "members = [\"idempotency-$(version idempotency)\", \"idempotency-axum-$(version idempotency-axum)\"]"
    echo
    echo '[patch.crates-io]'
    echo "idempotency = { path = \"idempotency-$(version idempotency)\" }"
    echo
    # The repository's profiles, so that the dependencies' metadata is the one already made.
    sed -n '/^\[profile/,$p' Cargo.toml
} >"$scratch/Cargo.toml"
cp Cargo.lock "$scratch/Cargo.lock"
# Not --locked: the scratch workspace drops the services' entries from the lock; every version
# it keeps is the repository's.
CARGO_TARGET_DIR=$TARGET_DIR cargo check --manifest-path "$scratch/Cargo.toml" --workspace ||
    die "a packaged library does not compile from its tarball"
log "both libraries compile from their tarballs"
