//! The gateway family's tasks: finished keys forgotten past their TTL, and one customer deleted
//! so that its later charges are refused for good. The gateway's own faults, drawn per charge,
//! are set and counted from the table ([`super::FAULTS`]).

use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use rand::Rng;
use tokio::task::JoinSet;

use crate::chaos::clients::ClientUser;
use crate::chaos::options::FaultFamily;
use crate::chaos::services::GATEWAY_SECRET;
use crate::chaos::stack::Stack;

/// How long the run's gateway remembers a finished key: longer than the services' window plus
/// their processing bound, as Stripe's 24 hours are longer than the default 23 h window plus
/// its 5 min bound.
const GATEWAY_KEY_TTL: Duration = Duration::from_secs(55);
/// How often the gateway forgets the keys past their TTL.
const GATEWAY_FORGET_EVERY: Duration = Duration::from_secs(2);

/// Starts the family's tasks, if it is on; the customer to delete is one of `users`' good cards.
pub(super) async fn start(
    stack: &Arc<Stack>,
    users: &[ClientUser],
    tasks: &mut JoinSet<()>,
) -> anyhow::Result<()> {
    if !stack.args.on(FaultFamily::Gateway) {
        return Ok(());
    }
    tasks.spawn(forget_keys(stack.clone()));
    let good: Vec<&ClientUser> = users.iter().filter(|u| !u.declines).collect();
    if good.len() > 1 {
        let victim = good[stack.rng().random_range(0..good.len())].id;
        let customer: String =
            sqlx::query_scalar("SELECT stripe_customer_id FROM users WHERE id = $1")
                .bind(victim)
                .fetch_one(&stack.pool)
                .await?;
        tasks.spawn(refuse(stack.clone(), victim, customer));
    }
    Ok(())
}

/// The gateway forgets finished keys past their TTL, as Stripe does after 24 hours; it counts as
/// the fault only while keys of the service are left unfinished.
async fn forget_keys(stack: Arc<Stack>) {
    while !stack.stop.load(Ordering::Relaxed) {
        tokio::time::sleep(GATEWAY_FORGET_EVERY).await;
        let unfinished: i64 =
            sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE finished_at IS NULL")
                .fetch_one(&stack.pool)
                .await
                .unwrap_or(0);
        if let Ok(forgotten) = stack.gateway.forget_keys(GATEWAY_KEY_TTL).await {
            if forgotten > 0 && unfinished > 0 {
                stack.recorder.fault("gateway_forget_keys", forgotten);
            }
        }
    }
}

/// Permanent refusals: a good card's customer is deleted at the gateway a third of the way into
/// the run, so that its later charges are refused for good.
async fn refuse(stack: Arc<Stack>, victim: i64, customer: String) {
    if !stack.reached(stack.args.requests / 3).await {
        return;
    }
    // Counted as refused before the call: a refusal answered meanwhile is then already
    // explained.
    stack
        .refused_users
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(victim);
    let url = format!("http://{}/v1/customers/{customer}", stack.gateway_addr);
    let deleted = reqwest::Client::new()
        .delete(url)
        .bearer_auth(GATEWAY_SECRET)
        .send()
        .await;
    if !deleted.is_ok_and(|r| r.status().is_success()) {
        eprintln!("chaos: could not delete the customer of user {victim}");
    }
}
