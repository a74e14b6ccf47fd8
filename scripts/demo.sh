#!/usr/bin/env bash
# Rocket Rides end to end on this machine: PostgreSQL, fakestripe, migrations, a user, the API.
# Prints a curl that books a ride; Ctrl-C stops everything.
set -euo pipefail
cd "$(dirname "$0")/.."

API_ADDR=${API_ADDR:-127.0.0.1:8080}
METRICS_ADDR=${METRICS_ADDR:-127.0.0.1:8081}
GATEWAY_ADDR=${GATEWAY_ADDR:-127.0.0.1:12111}
GATEWAY_ADMIN_ADDR=${GATEWAY_ADMIN_ADDR:-127.0.0.1:12112}
DEMO_DB=${DEMO_DB:-rocket_rides_demo}

# The curl printed below needs curl; a minimal Debian has none.
if ! command -v curl >/dev/null; then
    if [ "$(id -u)" = 0 ]; then apt-get update -qq && apt-get install -y -qq curl >&2
    else echo "demo: install curl to run the printed command (apt-get install curl)" >&2; fi
fi

server_url=$(scripts/postgres.sh)
# A database of its own, next to whatever the server holds already.
admin_url=$server_url
psql "$admin_url" -Atqc "SELECT 1 FROM pg_database WHERE datname = '$DEMO_DB'" | grep -q 1 ||
    psql "$admin_url" -qc "CREATE DATABASE $DEMO_DB"
DATABASE_URL="${server_url%/*}/$DEMO_DB"
export DATABASE_URL

echo "demo: building (the first build takes a few minutes)" >&2
cargo build --locked -p rocket-rides -p fakestripe --bin rocket-rides --bin fakestripe
bin=target/debug

pids=()
cleanup() { for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done; wait 2>/dev/null || true; }
trap cleanup EXIT INT TERM

export STRIPE_API_BASE="http://$GATEWAY_ADDR" STRIPE_API_KEY=sk_test_rocketrides
"$bin/fakestripe" --listen "$GATEWAY_ADDR" --admin-listen "$GATEWAY_ADMIN_ADDR" &
pids+=($!)

"$bin/rocket-rides" migrate
# Wait for fakestripe to accept connections before creating the user's customer there.
for _ in $(seq 100); do
    (exec 3<>"/dev/tcp/${GATEWAY_ADDR%:*}/${GATEWAY_ADDR##*:}") 2>/dev/null && break
    sleep 0.1
done
user=$("$bin/rocket-rides" users create --email "rider-$(date +%s)@example.com" --card tok_visa)
api_key=$(printf '%s' "$user" | sed -n 's/.*"api_key":"\([^"]*\)".*/\1/p')

"$bin/rocket-rides" serve --listen "$API_ADDR" --metrics-listen "$METRICS_ADDR" &
pids+=($!)

cat <<MSG

Rocket Rides is up on http://$API_ADDR (fakestripe on http://$GATEWAY_ADDR, admin on http://$GATEWAY_ADMIN_ADDR).
User: $user

Book a ride (run it twice: the second answer is the replay, with Idempotent-Replayed: true):

  curl -i http://$API_ADDR/rides \\
    -H 'Authorization: Bearer $api_key' \\
    -H 'Idempotency-Key: ride-$(date +%s)' \\
    -H 'Content-Type: application/json' \\
    -d '{"origin_lat": 37.77, "origin_lon": -122.42, "target_lat": 37.80, "target_lon": -122.27, "amount_cents": 2000}'

Metrics:            curl http://$METRICS_ADDR/metrics
Inspect the keys:   DATABASE_URL=$DATABASE_URL $bin/rocket-rides keys list
Ctrl-C stops everything.
MSG
wait "${pids[@]}"
