#!/usr/bin/env bash
# The tests, in two tiers.
#
#   scripts/test.sh           the fast tier: every unit and database test of every crate, the
#                             protocol model, the doctests, the PgBouncer pass below, and one
#                             seeded chaos run (every fault family, 1000 requests, seed 42).
#                             Leaves out only the chaos harness's negative controls and runs under
#                             PgBouncer and Patroni, and the benchmark's end-to-end tests
#                             (.config/nextest.toml, profile `fast`).
#   scripts/test.sh --heavy   every test of the workspace, those included (what CI's test step
#                             runs; it installs Patroni, etcd and HAProxy where missing, as
#                             root), without the seeded chaos run: CI runs two of its own.
#   scripts/test.sh --full    everything CI runs (.ci/run): formatting, lints, docs, packages, the
#                             scripts' checks, the chaos runs, --heavy, the benchmark.
#
# Makes PostgreSQL available (scripts/postgres.sh), then runs the tests against it with
# cargo-nextest (installed with `cargo install` where missing): each test in a process of its
# own, as many at once as there are cores, the heavy ones (clusters, chaos, the benchmark) one at
# a time (.config/nextest.toml). Each database test gets a fresh database of its own
# (crates/testdb: cloned from a template migrated once; or #[sqlx::test]). Then the doctests,
# which nextest does not run, and the PgBouncer pass below.
#
# Ends with the slowest test binaries and tests, and one line that totals every result:
# "N passed, M failed". Further arguments go to every `cargo nextest run` (a filter,
# `--no-capture`, …).
set -euo pipefail
cd "$(dirname "$0")/.."

. scripts/lib.sh
SCRIPT=test.sh

# The tier: `fast` (the nextest profile without the heavy end-to-end runs) or `default` (every
# test).
profile=fast
case ${1:-} in
--full) exec .ci/run ;;
--heavy)
    profile=default
    shift
    ;;
esac

if ! cargo nextest --version >/dev/null 2>&1; then
    log "cargo-nextest not found; cargo install --locked cargo-nextest"
    cargo install --locked cargo-nextest || die "cargo install cargo-nextest failed"
fi
ensure_python3

# The heavy tier's runs under Patroni need Patroni, etcd and HAProxy: installed where missing
# (root only). Where they cannot be, those tests say they are skipped, except under CI
# (CI=true), where they fail.
if [[ $profile == default ]] && ! scripts/patroni-install.sh; then
    log "Patroni, etcd or HAProxy is missing: the tests under Patroni will be skipped"
fi

# The chaos harness's tests make PostgreSQL clusters of their own: the server binaries too.
DATABASE_URL=$(scripts/postgres.sh --server-binaries)
export DATABASE_URL
log "using $DATABASE_URL"

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
runs=0
# One nextest run, bounded by `timeout $bound` when set; its JUnit report (.config/nextest.toml)
# is kept for the summary.
nextest() {
    runs=$((runs + 1))
    ${bound:+timeout "$bound"} cargo nextest run --profile "$profile" --locked --no-fail-fast \
        "$@" || status=1
    cp "target/nextest/$profile/junit.xml" "$work/run-$runs.xml" 2>/dev/null ||
        log "no JUnit report from run $runs"
}
# Every cargo command here selects the whole workspace (`--workspace`, narrowed by nextest's
# filters, never by `-p` or `--exclude`): cargo resolves the dependencies' features over the
# packages it selects, so another selection builds sqlx and its dependents again (CI lost 86 s
# to `--exclude protocol-model` and 54 s and 47 s to each `-p` run through PgBouncer below).
# The protocol model's checks (every reachable state of the real protocol, and each protection's
# absence found as a counterexample) are in this run, beside the heavy tests, and print their
# state counts, times and traces (.config/nextest.toml).
nextest --workspace "$@"
cargo test --workspace --locked --doc 2>&1 | tee "$work/doc.log" || status=1
# The store's tests again, through a PgBouncer in transaction pooling (scripts/pgbouncer.sh,
# installed where missing), with the store's Statements::Unnamed (store, expiry, handover);
# tests/integration/pooler.rs also checks that the default statements fail there. Then Rocket
# Rides through the same PgBouncer with --database-pooler transaction
# (crates/rocket-rides/tests/integration/pooler.rs, with its control). Bounded: PgBouncer stops
# when they end.
if pooler_url=$(scripts/pgbouncer.sh "$DATABASE_URL"); then
    log "the store's tests and Rocket Rides' through $pooler_url"
    IDEMPOTENCY_TEST_POOLER_URL=$pooler_url bound=600 nextest --workspace \
        -E 'binary_id(idempotency::integration) & test(/^(store|expiry|handover|pooler)::/)' "$@"
    ROCKET_RIDES_TEST_POOLER_URL=$pooler_url bound=600 nextest --workspace \
        -E 'binary_id(rocket-rides::integration) & test(/^pooler::/)' "$@"
    scripts/pgbouncer.sh --stop "$pooler_url"
else
    log "could not start PgBouncer for the store's tests through it"
    status=1
fi

# The fast tier's one chaos run: every fault family, seeded as CI's first run (.ci/run), which
# must pass its audit. The negative controls, which show that the audit can fail, are in the
# heavy tier; the auditor's own unit tests (each check passing and failing on made-up evidence)
# ran above.
if [[ $profile == fast ]]; then
    log "one seeded chaos run (scripts/chaos.sh --requests 1000 --seed 42)"
    chaos_start=$SECONDS
    if scripts/chaos.sh --requests 1000 --seed 42 >"$work/chaos.log" 2>&1; then
        log "the chaos run passed its audit in $((SECONDS - chaos_start)) s (report in target/chaos)"
    else
        status=1
        tail -n 40 "$work/chaos.log" >&2
        log "the chaos run FAILED after $((SECONDS - chaos_start)) s (report in target/chaos)"
    fi
fi

# Where the time went, and the total. Each JUnit file is one nextest run; cargo test prints one
# "test result: ok. 12 passed; 0 failed; …" line for the doctests of each crate.
python3 - "$work" <<'PY'
import glob, os, re, sys
import xml.etree.ElementTree as ET

work = sys.argv[1]
tests, binaries = [], {}
passed = failed = 0
for path in sorted(glob.glob(os.path.join(work, "run-*.xml"))):
    for case in ET.parse(path).getroot().iter("testcase"):
        binary, name, secs = case.get("classname"), case.get("name"), float(case.get("time") or 0)
        if case.find("skipped") is not None:
            continue
        bad = case.find("failure") is not None or case.find("error") is not None
        failed += bad
        passed += not bad
        tests.append((secs, binary, name))
        binaries[binary] = binaries.get(binary, 0.0) + secs
with open(os.path.join(work, "doc.log"), errors="replace") as log:
    for line in log:
        m = re.match(r"test result: \w+\. (\d+) passed; (\d+) failed", line)
        if m:
            passed += int(m.group(1))
            failed += int(m.group(2))
print("\nslowest test binaries (seconds, the sum of their tests' times):")
for binary, secs in sorted(binaries.items(), key=lambda b: -b[1])[:10]:
    print(f"  {secs:8.1f}  {binary}")
print("slowest tests (seconds):")
for secs, binary, name in sorted(tests, reverse=True)[:15]:
    print(f"  {secs:8.1f}  {binary} {name}")
print(f"{passed} passed, {failed} failed")
PY
exit "$status"
