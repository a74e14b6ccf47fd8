//! The HTTP face's integration tests, one binary (one build, one link): each module below was a
//! test binary of its own.

mod adversary;
mod attack_session;
mod http;
mod layer;
mod retire;
mod run;
mod transactional;
mod wait;

/// The template of the tests that begin by migrating (`#[testdb::test(template = …)]`): the
/// store's migrations, run once per test binary instead of once per test.
async fn migrated(pool: sqlx::PgPool) {
    idempotency::migrate(&pool).await.unwrap();
}
