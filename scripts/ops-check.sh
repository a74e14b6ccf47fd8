#!/usr/bin/env bash
# Check the operations kit in ops/: the Prometheus alerting rules and their unit tests, and the
# Grafana dashboard's queries.
#
#   scripts/ops-check.sh            # CI runs it from .ci/run
#
# What it does:
#   1. promtool (Debian's `prometheus` package, which also brings the `prometheus` binary that
#      the scrape test in crates/rocket-rides/tests uses) and PyYAML (`python3-yaml`), installed
#      with apt-get when missing (as root, or with sudo).
#   2. promtool check rules ops/prometheus/alerts.yml.
#   3. promtool test rules ops/prometheus/alerts.test.yml.
#   4. Every alert has a test that fires it and one that does not, and each of those tests can
#      fail: with the alert's expression replaced by one that never fires, its firing tests
#      must fail; replaced by one that always fires, its quiet tests must fail.
#   5. ops/grafana/rocket-rides.json is JSON, and every query in it parses as PromQL (written
#      into a rules file, with Grafana's $__rate_interval as 5m, for promtool check rules).
#
# Network: apt's mirrors, for the first install only.
set -euo pipefail
cd "$(dirname "$0")/.."

SCRIPT=ops-check
# shellcheck source=scripts/lib.sh
. scripts/lib.sh

RULES=ops/prometheus/alerts.yml
TESTS=ops/prometheus/alerts.test.yml
DASHBOARD=ops/grafana/rocket-rides.json

# ------------------------------------------------------------------ tools

APT_UPDATED=0
apt_install() {
    local sudo=()
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null 2>&1 ||
            die "need packages '$*' but not root and sudo is missing; install them: apt-get install -y $*"
        sudo=(sudo)
    fi
    command -v apt-get >/dev/null 2>&1 ||
        die "need packages '$*' but apt-get is not available; install Prometheus (promtool) and PyYAML by hand"
    if ((APT_UPDATED == 0)); then
        log "apt-get update"
        "${sudo[@]}" apt-get update >&2 || die "apt-get update failed"
        APT_UPDATED=1
    fi
    log "apt-get install -y $*"
    # The package's postinst may try to start a daemon; without an init system it does not.
    "${sudo[@]}" env DEBIAN_FRONTEND=noninteractive apt-get install -y "$@" >&2 ||
        die "apt-get install $* failed"
}

missing=()
command -v promtool >/dev/null 2>&1 && command -v prometheus >/dev/null 2>&1 || missing+=(prometheus)
ensure_python3
python3 -c 'import yaml' 2>/dev/null || missing+=(python3-yaml)
((${#missing[@]} == 0)) || apt_install "${missing[@]}"
log "$(promtool --version 2>&1 | head -n 1)"

WORK=$(mktemp -d)
trap 'rm -rf -- "$WORK"' EXIT

# ------------------------------------------------------------------ rules and their tests

promtool check rules "$RULES"
promtool test rules "$TESTS"

log "every alert has a test that fires it and one that does not, and each can fail"
python3 - "$RULES" "$TESTS" "$WORK" <<'PY'
import copy, os, subprocess, sys, yaml

rules_path, tests_path, work = sys.argv[1:]
rules = yaml.safe_load(open(rules_path))
tests = yaml.safe_load(open(tests_path))
NEVER, ALWAYS = "vector(1) == 0", "vector(1)"

def groups_of(alert, firing):
    """The test groups with an evaluation of `alert` that expects it firing (or quiet)."""
    chosen = []
    for group in tests["tests"]:
        cases = [c for c in group.get("alert_rule_test", []) if c["alertname"] == alert]
        if any(bool(c.get("exp_alerts")) == firing for c in cases):
            chosen.append(group)
    return chosen

def passes(alert, expr, groups):
    """Runs `groups` against the rules with `alert`'s expression replaced by `expr`."""
    mutated = copy.deepcopy(rules)
    for group in mutated["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                rule["expr"] = expr
    with open(os.path.join(work, "rules.yml"), "w") as f:
        yaml.safe_dump(mutated, f)
    suite = {k: v for k, v in tests.items() if k != "tests"}
    suite["rule_files"] = ["rules.yml"]
    suite["tests"] = groups
    with open(os.path.join(work, "tests.yml"), "w") as f:
        yaml.safe_dump(suite, f)
    run = subprocess.run(["promtool", "test", "rules", os.path.join(work, "tests.yml")],
                         capture_output=True, text=True)
    return run.returncode == 0

failures = []
alerts = [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]
for alert in alerts:
    for firing, mutant in ((True, NEVER), (False, ALWAYS)):
        kind = "fires it" if firing else "does not fire it"
        groups = groups_of(alert, firing)
        if not groups:
            failures.append(f"{alert}: no test that {kind}")
        elif passes(alert, mutant, groups):
            failures.append(f"{alert}: the tests that expect it {'firing' if firing else 'quiet'} "
                            f"still pass with its expression replaced by {mutant!r}")
for failure in failures:
    print(f"ops-check: {failure}", file=sys.stderr)
if failures:
    sys.exit(1)
print(f"ops-check: {len(alerts)} alerts, each with a firing and a quiet test that can fail",
      file=sys.stderr)
PY

# ------------------------------------------------------------------ dashboard

log "the dashboard is JSON and its queries parse"
python3 - "$DASHBOARD" "$WORK/dashboard-rules.yml" <<'PY'
import json, sys, yaml

dashboard = json.load(open(sys.argv[1]))
exprs = []
def walk(panels):
    for panel in panels:
        walk(panel.get("panels", []))
        for target in panel.get("targets", []):
            exprs.append((panel["title"], target["expr"]))
walk(dashboard["panels"])
if not exprs:
    sys.exit("ops-check: the dashboard has no queries")
rules = [{"record": f"dashboard_query_{i}", "expr": expr.replace("$__rate_interval", "5m")}
         for i, (_, expr) in enumerate(exprs)]
yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}, open(sys.argv[2], "w"))
print(f"ops-check: {len(exprs)} dashboard queries", file=sys.stderr)
PY
promtool check rules "$WORK/dashboard-rules.yml"
log "ok"
