//! Rocket Rides' integration tests, one binary (one build, one link; `common` compiled once):
//! each module below was a test binary of its own.

mod adversary;
mod attack_session;
mod citus_rules;
mod common;
mod contract;
mod distribution;
mod doubt;
mod edge;
mod gate;
mod gateway;
mod live_migration;
mod observability;
mod online_plans;
mod ops;
mod owner_adversary;
mod pauses;
mod pooler;
mod rides;
mod settings;
mod sync_commit;
mod upgrade;
mod worker;
