//! The library's integration tests, one binary (one build, one link): each module below was a
//! test binary of its own. Database tests get a fresh database each; see each module's opening.

mod adversary;
mod attack_session;
mod executor;
mod expiry;
mod handover;
mod lease;
mod lease_log;
mod migrations;
mod observe;
mod owner_adversary;
mod pooled;
mod pooler;
mod rfc8785;
mod store;
mod support;
mod workflow;
mod workflow_expert;

/// The template of the tests that begin by migrating (`#[testdb::test(template = …)]`): the
/// crate's migrations, run once per test binary instead of once per test.
async fn migrated(pool: sqlx::PgPool) {
    idempotency::migrate(&pool).await.unwrap();
}
