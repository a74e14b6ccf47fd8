//! Settings: every time limit named, defaulted, validated, and checked against the others.

use std::time::Duration;

use clap::Args;

use crate::stripe::{DEFAULT_CONNECT_TIMEOUT, DEFAULT_GATEWAY_TIMEOUT};

/// How much longer than the gateway timeout the lease must be: the time of the phase that records
/// the charge after the call returns, with room for a slow database.
pub const LEASE_MARGIN: Duration = Duration::from_secs(5);

/// Where the payment gateway is and how long to wait for it.
#[derive(Debug, Clone, Args)]
pub struct GatewayArgs {
    /// Base URL of the Stripe-compatible API (Stripe itself, or a fakestripe).
    #[arg(
        long,
        env = "STRIPE_API_BASE",
        default_value = "http://127.0.0.1:12111"
    )]
    pub stripe_api_base: String,
    /// Secret key for the gateway.
    #[arg(long, env = "STRIPE_API_KEY", default_value = "sk_test_rocketrides")]
    pub stripe_api_key: String,
    /// TCP connect timeout for the gateway (e.g. 2s, 500ms).
    #[arg(long, env = "GATEWAY_CONNECT_TIMEOUT", value_parser = parse_duration,
          default_value = "2s")]
    pub gateway_connect_timeout: Duration,
    /// Time limit of one gateway call; must stay below the lease TTL minus 5 s.
    #[arg(long, env = "GATEWAY_TIMEOUT", value_parser = parse_duration, default_value = "10s")]
    pub gateway_timeout: Duration,
}

/// The idempotency lease.
#[derive(Debug, Clone, Args)]
pub struct LeaseArgs {
    /// How long a request holds its key before another attempt may take it over.
    #[arg(long, env = "LEASE_TTL", value_parser = parse_duration, default_value = "30s")]
    pub lease_ttl: Duration,
}

impl Default for GatewayArgs {
    fn default() -> Self {
        Self {
            stripe_api_base: "http://127.0.0.1:12111".into(),
            stripe_api_key: "sk_test_rocketrides".into(),
            gateway_connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            gateway_timeout: DEFAULT_GATEWAY_TIMEOUT,
        }
    }
}

impl Default for LeaseArgs {
    fn default() -> Self {
        Self {
            lease_ttl: idempotency::DEFAULT_LEASE_TTL,
        }
    }
}

/// Checks the relations between the limits; the message says which one fails and how to fix it.
pub fn validate(gateway: &GatewayArgs, lease: &LeaseArgs) -> Result<(), String> {
    if gateway.gateway_connect_timeout.is_zero() || gateway.gateway_timeout.is_zero() {
        return Err("gateway timeouts must be greater than zero".into());
    }
    if gateway.gateway_connect_timeout > gateway.gateway_timeout {
        return Err(format!(
            "--gateway-connect-timeout ({:?}) must not exceed --gateway-timeout ({:?})",
            gateway.gateway_connect_timeout, gateway.gateway_timeout
        ));
    }
    if lease.lease_ttl < gateway.gateway_timeout + LEASE_MARGIN {
        return Err(format!(
            "--lease-ttl ({:?}) must be at least --gateway-timeout ({:?}) + {:?}: otherwise a lease \
             can expire while its holder still waits on a charge",
            lease.lease_ttl, gateway.gateway_timeout, LEASE_MARGIN
        ));
    }
    let http = gateway.stripe_api_base.starts_with("http://")
        || gateway.stripe_api_base.starts_with("https://");
    if !http {
        return Err(format!(
            "--stripe-api-base {:?} must be an http:// or https:// URL",
            gateway.stripe_api_base
        ));
    }
    Ok(())
}

/// Parses `250ms`, `10s`, `5m`, `2h` or a bare number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let number: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 500ms, 10s, 5m or 2h"))?;
    let unit_millis = match unit {
        "ms" => 1,
        "" | "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        _ => return Err(format!("{text:?} has an unknown unit: use ms, s, m or h")),
    };
    number
        .checked_mul(unit_millis)
        .map(Duration::from_millis)
        .ok_or_else(|| format!("{text:?} is too long"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("250ms"), Ok(Duration::from_millis(250)));
        assert_eq!(parse_duration("10s"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("2m"), Ok(Duration::from_secs(120)));
        assert!(parse_duration("ten").is_err());
        assert!(parse_duration("10d").is_err());
        assert!(parse_duration("-1s").is_err());
    }

    #[test]
    fn lease_must_outlast_the_gateway_timeout() {
        let gateway = GatewayArgs::default();
        assert_eq!(validate(&gateway, &LeaseArgs::default()), Ok(()));
        let short = LeaseArgs {
            lease_ttl: Duration::from_secs(12),
        };
        let err = validate(&gateway, &short).unwrap_err();
        assert!(err.contains("--lease-ttl"), "{err}");
    }

    #[test]
    fn connect_timeout_must_not_exceed_the_call_timeout() {
        let gateway = GatewayArgs {
            gateway_connect_timeout: Duration::from_secs(11),
            ..Default::default()
        };
        assert!(validate(&gateway, &LeaseArgs::default()).is_err());
    }
}
