//! What both programs need to run processes on loopback: a free port, and waiting for a process
//! to answer.

use std::time::Duration;

/// A port free on 127.0.0.1 that the OS will not hand to anybody else before our child binds it.
///
/// Binding port 0 and closing the socket (what this did before) returns a port from the kernel's
/// ephemeral range, from which the kernel also picks every other `bind` to port 0 and the local
/// port of every outgoing connection. On CI, the light tests run beside a chaos run and bind
/// port 0 all the time; a Patroni standby's port, chosen seconds before its PostgreSQL starts
/// (after the leader's bootstrap and the base backup), was taken meanwhile often enough to fail
/// a run ("not healthy after 90s"). So the port is drawn at random *outside* the ephemeral
/// range (read from `/proc/sys/net/ipv4/ip_local_port_range`), where only an explicit bind can
/// take it, checked free by binding it, and never handed out twice by one process. Where no
/// such range is left (an ephemeral range that covers nearly every port), the old way serves.
pub(crate) fn free_port() -> std::io::Result<u16> {
    static GIVEN: std::sync::Mutex<std::collections::BTreeSet<u16>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    let ranges = outside_ephemeral(ephemeral_range());
    let size: u32 = ranges.iter().map(|r| u32::from(r.1 - r.0) + 1).sum();
    if size >= MIN_PRIVATE_PORTS {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::from_os_rng();
        for _ in 0..1000 {
            let mut n = rng.random_range(0..size);
            let port = ranges
                .iter()
                .find_map(|&(low, high)| {
                    let len = u32::from(high - low) + 1;
                    if n < len {
                        // `n < len <= 65536 - low`, so the sum is a port.
                        u16::try_from(u32::from(low) + n).ok()
                    } else {
                        n -= len;
                        None
                    }
                })
                .unwrap_or(ranges[0].0);
            if given.contains(&port) {
                continue;
            }
            if std::net::TcpListener::bind(("127.0.0.1", port)).is_ok() {
                given.insert(port);
                return Ok(port);
            }
        }
    }
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        if given.insert(port) {
            return Ok(port);
        }
    }
}

/// The least number of ports outside the ephemeral range for [`free_port`] to draw from them.
const MIN_PRIVATE_PORTS: u32 = 1000;
/// The lowest port [`free_port`] draws: above the registered services most machines run.
const LOWEST_PRIVATE_PORT: u16 = 10_000;

/// The kernel's ephemeral port range; Linux's default when it cannot be read.
fn ephemeral_range() -> (u16, u16) {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| {
            let mut fields = text.split_whitespace().map(str::parse::<u16>);
            Some((fields.next()?.ok()?, fields.next()?.ok()?))
        })
        .filter(|(low, high)| low <= high)
        .unwrap_or((32_768, 60_999))
}

/// The ports from [`LOWEST_PRIVATE_PORT`] up that lie outside `ephemeral` (inclusive bounds).
fn outside_ephemeral((low, high): (u16, u16)) -> Vec<(u16, u16)> {
    let mut ranges = Vec::new();
    if low > LOWEST_PRIVATE_PORT {
        ranges.push((LOWEST_PRIVATE_PORT, low - 1));
    }
    if high < u16::MAX {
        ranges.push(((high + 1).max(LOWEST_PRIVATE_PORT), u16::MAX));
    }
    ranges
}

/// Waits, for at most ten seconds, until `url` answers with a success status.
pub(crate) async fn wait_until_answering(url: &str) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(1))
        .build()?;
    for _ in 0..200 {
        if let Ok(response) = http.get(url).send().await {
            if response.status().is_success() {
                return Ok(());
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    anyhow::bail!("{url} did not answer within 10 s (see the process's log)")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_ports_drawn_lie_outside_the_ephemeral_range_and_differ() {
        let (low, high) = ephemeral_range();
        let mut seen = std::collections::BTreeSet::new();
        for _ in 0..50 {
            let port = free_port().unwrap();
            assert!(port < low || port > high, "{port} in {low}-{high}");
            assert!(seen.insert(port), "{port} handed out twice");
        }
    }

    #[test]
    fn the_ranges_outside_the_ephemeral_one_leave_it_out() {
        assert_eq!(
            outside_ephemeral((32_768, 60_999)),
            vec![(10_000, 32_767), (61_000, 65_535)]
        );
        assert_eq!(outside_ephemeral((1024, 65_535)), vec![]);
        assert_eq!(outside_ephemeral((5000, 9000)), vec![(10_000, 65_535)]);
    }
}
