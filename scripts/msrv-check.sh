#!/usr/bin/env bash
# The libraries' minimum supported Rust version, checked as far as one toolchain can:
#
# - a user on that version, whose cargo picks the newest dependencies that declare support for it
#   (the MSRV-aware resolver: `incompatible-rust-versions = "fallback"`), gets for every crate the
#   two libraries build with a version that declares a `rust-version` no newer than theirs. The
#   lock is made so in a scratch copy of the workspace; the repository's own Cargo.lock, which
#   the services build with, may hold newer versions;
# - the libraries' own code calls no standard-library API newer than it: clippy's
#   `incompatible_msrv` lint reads `rust-version`, and CI runs clippy with warnings as errors.
#
# Language features newer than the declared version are not caught: that needs the old toolchain
# itself, which this machine cannot download (`rustup` reaches no server here).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/lib.sh
SCRIPT=msrv-check
ensure_python3

scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
git ls-files -z | xargs -0 cp --parents -t "$scratch"
(cd "$scratch" && CARGO_RESOLVER_INCOMPATIBLE_RUST_VERSIONS=fallback cargo generate-lockfile -q) ||
    die "cargo could not resolve the workspace for its rust-version"
(cd "$scratch" && cargo metadata --format-version 1 --locked) | python3 -c '
import json, sys

meta = json.load(sys.stdin)
packages = {p["id"]: p for p in meta["packages"]}
nodes = {n["id"]: n for n in meta["resolve"]["nodes"]}

def version(v):
    parts = [int(x) for x in v.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))

failed = False
for root in ("idempotency", "idempotency-axum"):
    (root_id,) = [i for i in meta["workspace_members"] if packages[i]["name"] == root]
    ours = packages[root_id]["rust_version"]
    seen, todo, newer = set(), [root_id], []
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        for dep in nodes[node]["deps"]:
            # Normal and build dependencies are built by a user of the library; dev ones are not.
            if any(k["kind"] in (None, "build") for k in dep["dep_kinds"]):
                todo.append(dep["pkg"])
    for node in sorted(seen):
        p = packages[node]
        if p.get("rust_version") and version(p["rust_version"]) > version(ours):
            newer.append("%s %s needs %s" % (p["name"], p["version"], p["rust_version"]))
    if newer:
        failed = True
        print(f"{root}: rust-version {ours}, but:", *newer, sep="\n  ", file=sys.stderr)
    else:
        print(f"{root}: rust-version {ours}; its {len(seen) - 1} dependencies, resolved for it, need no newer")
sys.exit(1 if failed else 0)
'
