//! A TCP proxy on loopback that breaks connections on purpose: delay, reset mid-stream, blackhole.
//!
//! The chaos run puts one proxy in front of every API process (clients → API) and one in front of
//! the payment gateway (API → fakestripe), so that the network between the real processes fails
//! the way real networks do, without root, `tc` or iptables:
//!
//! ```text
//! client ──► Proxy 127.0.0.1:<random> ──► upstream 127.0.0.1:<port>
//!              │
//!              └─ at accept, one draw from the proxy's seeded RNG fixes the connection's fate:
//!                   blackhole  swallow what the client sends, forward nothing, hold it open
//!                   forward    after `delay_ms + jitter`, copy both ways; with `reset_probability`
//!                              abort both sockets with an RST after a random number of bytes in a
//!                              random direction (mid-request or mid-response)
//! ```
//!
//! The fate is decided once per connection, in accept order, by [`decide`], which consumes the
//! same sequence of draws whatever the outcome: the same seed, faults and accept order give the
//! same fates. (Accept order itself depends on the scheduler; the run's reproducibility stops at
//! the kernel.)
//!
//! A connection that lives for many exchanges (a service's keep-alive connection to its
//! gateway) would meet its one fate on its first exchange only. So with `response_reset_probability`
//! the proxy also reads the HTTP/1.1 responses going back to the client, one by one (their head,
//! then `Content-Length` bytes), and draws for every response whether to abort the connection
//! inside it: anywhere from its first byte to one byte before its end, that last byte being
//! drawn a quarter of the time. A response it cannot frame (chunked, or delimited by the close)
//! ends the per-response draws for its connection.
//!
//! Faults reach the report in two ways: [`Proxy::counters`] (totals, also observable as a
//! [`watch`] channel through [`Proxy::watch_counters`], so tests wait for a count instead of
//! sleeping), and [`Proxy::take_events`], which drains the timestamped fault events for the
//! report's timeline.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Fault kind of a delayed connection, as it appears in the report.
pub const NET_DELAY: &str = "net_delay";
/// Fault kind of a connection aborted with an RST mid-stream.
pub const NET_RESET: &str = "net_reset";
/// Fault kind of a blackholed connection.
pub const NET_BLACKHOLE: &str = "net_blackhole";
/// Fault kind of a connection aborted inside one of its HTTP responses, drawn per response.
pub const NET_RESET_MID_RESPONSE: &str = "net_reset_mid_response";

/// The longest response head the per-response framing reads; a longer one ends the framing of
/// its connection (it is forwarded untouched).
const MAX_RESPONSE_HEAD: usize = 64 * 1024;

/// How long a blackholed connection is held open at most, unless the client closes it first.
///
/// It must stay larger than every request timeout on the path (the chaos clients' and the API's
/// gateway timeout), so that the peer experiences a blackhole as a timeout, not as a closed
/// connection; and it is bounded so that a peer that never gives up cannot pin a task forever.
pub const BLACKHOLE_HOLD: Duration = Duration::from_secs(30);

/// How long the proxy waits for its upstream to accept a connection.
///
/// Loopback connects either succeed or are refused at once (the upstream process is dead); only a
/// full accept backlog makes the kernel drop the SYN and retry for seconds. Past this bound the
/// client connection is closed, as if the upstream were down.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// Exclusive upper bound of the byte offset at which a reset fires.
///
/// The service's requests and responses are a few hundred bytes each (headers and a small JSON
/// body), so offsets below this land inside the first request or response of the connection:
/// the server sees half a request, or the client half an answer, which is the case worth testing.
const RESET_MAX_OFFSET: u64 = 512;

/// Pause after a failed `accept` (e.g. out of file descriptors), so that a persistent error does
/// not turn the accept loop into a busy loop.
const ACCEPT_ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// Size of the copy buffer of each direction of a forwarded connection.
const COPY_BUFFER: usize = 16 * 1024;

/// The faults a proxy injects into each new connection.
///
/// The default injects nothing: a plain proxy.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct ProxyFaults {
    /// Delay, in milliseconds, before a connection's first bytes go upstream.
    pub delay_ms: u64,
    /// Extra delay drawn uniformly from `0..=jitter_ms` per connection, added to `delay_ms`.
    pub jitter_ms: u64,
    /// Probability in `[0, 1]` that a forwarded connection is aborted with an RST mid-stream.
    pub reset_probability: f64,
    /// Probability in `[0, 1]` that a connection is blackholed (checked before the reset).
    pub blackhole_probability: f64,
    /// Probability in `[0, 1]`, drawn for every HTTP response on every connection, that the
    /// connection is aborted inside that response.
    #[serde(default)]
    pub response_reset_probability: f64,
}

impl ProxyFaults {
    /// Checks that both probabilities are numbers in `[0, 1]`.
    pub fn validate(&self) -> io::Result<()> {
        for (name, p) in [
            ("reset_probability", self.reset_probability),
            ("blackhole_probability", self.blackhole_probability),
            (
                "response_reset_probability",
                self.response_reset_probability,
            ),
        ] {
            // `contains` is false for NaN too.
            if !(0.0..=1.0).contains(&p) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidInput,
                    format!("proxy fault {name} must be in [0, 1], got {p}"),
                ));
            }
        }
        Ok(())
    }
}

/// What a proxy did since it started.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct ProxyCounters {
    /// Connections accepted from clients.
    pub connections: u64,
    /// Connections whose first bytes were held back (`delay_ms + jitter > 0`).
    pub delayed: u64,
    /// Connections aborted with an RST. A connection drawn for a reset that closed before its
    /// chosen byte offset is not counted: no reset happened.
    pub reset: u64,
    /// Connections blackholed.
    pub blackholed: u64,
    /// Connections aborted inside one of their responses by the per-response draw.
    pub response_reset: u64,
}

/// A running proxy. Dropping it (or [`Proxy::shutdown`]) closes the listener and aborts every
/// connection it still carries.
pub struct Proxy {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    /// Owns the listener and, in a [`JoinSet`], every connection task: aborting it drops the set,
    /// which aborts the connections, so nothing outlives the proxy.
    accept_task: JoinHandle<()>,
}

impl Proxy {
    /// Binds `127.0.0.1:0` and forwards every accepted connection to `upstream` until the proxy is
    /// dropped or shut down.
    ///
    /// `name` labels the proxy in logs. `seed` seeds the RNG that decides each connection's fate.
    /// Fails with [`io::ErrorKind::InvalidInput`] when `upstream` is not a loopback address (the
    /// chaos traffic must stay on this machine) or when `faults` is invalid.
    pub async fn start(
        name: &str,
        upstream: SocketAddr,
        faults: ProxyFaults,
        seed: u64,
    ) -> io::Result<Proxy> {
        if !upstream.ip().is_loopback() {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("proxy {name}: upstream {upstream} is not a loopback address"),
            ));
        }
        faults.validate()?;
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let local_addr = listener.local_addr()?;
        let (counters, _) = watch::channel(ProxyCounters::default());
        let shared = Arc::new(Shared {
            name: name.to_owned(),
            upstream,
            faults: Mutex::new(faults),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            counters,
            events: Mutex::new(Vec::new()),
        });
        let accept_task = tokio::spawn(accept_loop(listener, Arc::clone(&shared)));
        tracing::debug!(proxy = name, %local_addr, %upstream, ?faults, "proxy started");
        Ok(Proxy {
            local_addr,
            shared,
            accept_task,
        })
    }

    /// The address clients connect to.
    pub fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// The address connections are forwarded to.
    pub fn upstream(&self) -> SocketAddr {
        self.shared.upstream
    }

    /// The name given at [`Proxy::start`].
    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// The faults applied to new connections.
    pub fn faults(&self) -> ProxyFaults {
        *lock(&self.shared.faults)
    }

    /// Replaces the faults for connections accepted from now on; open connections keep their fate.
    /// The run calms the network this way before the final audit. An invalid `faults` is refused
    /// and changes nothing.
    pub fn set_faults(&self, faults: ProxyFaults) -> io::Result<()> {
        faults.validate()?;
        *lock(&self.shared.faults) = faults;
        tracing::debug!(proxy = %self.shared.name, ?faults, "proxy faults changed");
        Ok(())
    }

    /// What the proxy did so far.
    pub fn counters(&self) -> ProxyCounters {
        *self.shared.counters.borrow()
    }

    /// The counters as a channel that changes with every connection and fault, so that a caller
    /// can wait for a count (`wait_for`) instead of sleeping.
    pub fn watch_counters(&self) -> watch::Receiver<ProxyCounters> {
        self.shared.counters.subscribe()
    }

    /// Drains the fault events recorded since the previous call: when each fault happened and its
    /// kind ([`NET_DELAY`], [`NET_RESET`], [`NET_BLACKHOLE`]), oldest first.
    ///
    /// Events accumulate (one at most per connection) until taken; the run drains them
    /// periodically or once at the end and places them in the report's timeline.
    pub fn take_events(&self) -> Vec<(Instant, &'static str)> {
        std::mem::take(&mut *lock(&self.shared.events))
    }

    /// Stops accepting, aborts every open connection and waits until the listener is closed.
    pub async fn shutdown(mut self) {
        self.accept_task.abort();
        // The task only ends by this abort; its result says nothing more.
        let _ = (&mut self.accept_task).await;
    }
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

impl fmt::Debug for Proxy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Proxy")
            .field("name", &self.shared.name)
            .field("local_addr", &self.local_addr)
            .field("upstream", &self.shared.upstream)
            .field("faults", &self.faults())
            .finish_non_exhaustive()
    }
}

/// The fate of one connection, fixed at accept.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fate {
    /// Accept, read and discard what the client sends, forward nothing.
    Blackhole,
    /// Wait `delay`, then copy both ways; abort both sockets at `reset`, if any.
    Forward {
        delay: Duration,
        reset: Option<ResetPoint>,
    },
}

/// Where a forwarded connection is aborted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ResetPoint {
    /// The direction whose byte count triggers the reset.
    pub(crate) direction: Direction,
    /// Bytes of that direction forwarded before the reset; 0 aborts on its first bytes.
    pub(crate) after_bytes: u64,
}

/// A direction of a forwarded connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Direction {
    /// Client to upstream: the reset cuts a request.
    ToUpstream,
    /// Upstream to client: the reset cuts a response, after the upstream may have acted on it.
    ToClient,
}

/// Draws the fate of one connection.
///
/// Every call consumes the same sequence of draws whatever the outcome, so that one connection's
/// fate never shifts the draws of the next: the fates of a run follow from the seed.
pub(crate) fn decide(faults: &ProxyFaults, rng: &mut StdRng) -> Fate {
    let blackhole = rng.random::<f64>() < faults.blackhole_probability;
    let reset = rng.random::<f64>() < faults.reset_probability;
    let direction = if rng.random::<bool>() {
        Direction::ToUpstream
    } else {
        Direction::ToClient
    };
    let after_bytes = rng.random_range(0..RESET_MAX_OFFSET);
    let jitter_ms = rng.random_range(0..=faults.jitter_ms);
    if blackhole {
        return Fate::Blackhole;
    }
    Fate::Forward {
        delay: Duration::from_millis(faults.delay_ms.saturating_add(jitter_ms)),
        reset: reset.then_some(ResetPoint {
            direction,
            after_bytes,
        }),
    }
}

/// State shared by the proxy handle, its accept loop and its connections.
struct Shared {
    name: String,
    upstream: SocketAddr,
    faults: Mutex<ProxyFaults>,
    rng: Mutex<StdRng>,
    counters: watch::Sender<ProxyCounters>,
    events: Mutex<Vec<(Instant, &'static str)>>,
}

impl Shared {
    /// Counts a new connection and draws its fate, in accept order.
    fn admit(&self) -> Fate {
        let faults = *lock(&self.faults);
        let fate = decide(&faults, &mut lock(&self.rng));
        self.counters.send_modify(|c| c.connections += 1);
        match fate {
            Fate::Blackhole => self.record(NET_BLACKHOLE, |c| c.blackholed += 1),
            Fate::Forward { delay, .. } if !delay.is_zero() => {
                self.record(NET_DELAY, |c| c.delayed += 1)
            }
            Fate::Forward { .. } => {}
        }
        fate
    }

    /// Draws, for one response of `len` bytes, the offset at which to abort its connection, if
    /// any: uniform over the response, or its last byte (one byte before its end) a quarter of
    /// the time. Every call consumes the same draws.
    fn draw_response_reset(&self, len: u64) -> Option<u64> {
        let probability = lock(&self.faults).response_reset_probability;
        let mut rng = lock(&self.rng);
        let reset = rng.random::<f64>() < probability;
        let last_byte = rng.random_range(0..4) == 0;
        let anywhere = rng.random_range(0..len.max(1));
        (reset && len > 0).then(|| if last_byte { len - 1 } else { anywhere })
    }

    /// Records a fault event and bumps its counter.
    fn record(&self, kind: &'static str, count: impl FnOnce(&mut ProxyCounters)) {
        lock(&self.events).push((Instant::now(), kind));
        self.counters.send_modify(count);
        tracing::debug!(proxy = %self.name, fault = kind, "network fault injected");
    }
}

/// Locks a mutex that holds plain values: a panic while it was held cannot have left them
/// half-updated, so a poisoned lock is used as is.
fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok((client, _)) => {
                    let fate = shared.admit();
                    connections.spawn(serve(client, fate, Arc::clone(&shared)));
                }
                Err(err) => {
                    tracing::warn!(proxy = %shared.name, %err, "proxy accept failed");
                    tokio::time::sleep(ACCEPT_ERROR_BACKOFF).await;
                }
            },
            // Reap finished connections, so that the set holds only open ones.
            Some(joined) = connections.join_next(), if !connections.is_empty() => {
                if let Err(err) = joined {
                    tracing::error!(proxy = %shared.name, %err, "proxy connection task failed");
                }
            }
        }
    }
}

async fn serve(client: TcpStream, fate: Fate, shared: Arc<Shared>) {
    match fate {
        Fate::Blackhole => blackhole(client).await,
        Fate::Forward { delay, reset } => {
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
            }
            let upstream =
                match tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect(shared.upstream))
                    .await
                {
                    Ok(Ok(upstream)) => upstream,
                    // The upstream is down (killed, restarting): the client sees its connection
                    // closed, as behind a real load balancer with no healthy backend.
                    Ok(Err(err)) => {
                        tracing::debug!(proxy = %shared.name, %err, "upstream connect failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(proxy = %shared.name, "upstream connect timed out");
                        return;
                    }
                };
            forward(client, upstream, reset, &shared).await;
        }
    }
}

/// Swallows what the client sends until it closes or [`BLACKHOLE_HOLD`] passes.
async fn blackhole(mut client: TcpStream) {
    let deadline = tokio::time::Instant::now() + BLACKHOLE_HOLD;
    let mut buf = [0u8; 4096];
    loop {
        match tokio::time::timeout_at(deadline, client.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) | Err(_) => return,
            Ok(Ok(_)) => {}
        }
    }
}

/// How one direction of a forwarded connection ended early.
#[derive(Debug)]
enum PipeError {
    /// The direction reached its reset point.
    Reset,
    /// A response reached the reset point drawn for it.
    ResponseReset,
    /// A socket failed (often: reset by a killed process).
    Io(io::Error),
}

impl From<io::Error> for PipeError {
    fn from(err: io::Error) -> Self {
        PipeError::Io(err)
    }
}

async fn forward(
    mut client: TcpStream,
    mut upstream: TcpStream,
    reset: Option<ResetPoint>,
    shared: &Shared,
) {
    // HTTP requests are small writes that wait for an answer: Nagle would only add latency.
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (to_upstream_limit, to_client_limit) = match reset {
        None => (None, None),
        Some(ResetPoint {
            direction: Direction::ToUpstream,
            after_bytes,
        }) => (Some(after_bytes), None),
        Some(ResetPoint {
            direction: Direction::ToClient,
            after_bytes,
        }) => (None, Some(after_bytes)),
    };
    let per_response = lock(&shared.faults).response_reset_probability > 0.0;
    let result = {
        let (mut client_read, mut client_write) = client.split();
        let (mut upstream_read, mut upstream_write) = upstream.split();
        tokio::try_join!(
            pipe(&mut client_read, &mut upstream_write, to_upstream_limit),
            async {
                if per_response && to_client_limit.is_none() {
                    pipe_responses(&mut upstream_read, &mut client_write, shared).await
                } else {
                    pipe(&mut upstream_read, &mut client_write, to_client_limit).await
                }
            },
        )
    };
    match result {
        // Both sides closed their writing half: the connection ends normally.
        Ok(((), ())) => {}
        Err(PipeError::Reset) => {
            shared.record(NET_RESET, |c| c.reset += 1);
            abort(client, upstream);
        }
        Err(PipeError::ResponseReset) => {
            shared.record(NET_RESET_MID_RESPONSE, |c| c.response_reset += 1);
            abort(client, upstream);
        }
        // One side failed; pass the failure on to the other as a reset rather than a clean close,
        // which would read as a complete (truncated) message.
        Err(PipeError::Io(err)) => {
            tracing::debug!(proxy = %shared.name, %err, "proxied connection failed");
            abort(client, upstream);
        }
    }
}

/// Closes both sockets with an RST: a zero linger makes the kernel drop unsent data and reset.
fn abort(client: TcpStream, upstream: TcpStream) {
    let _ = client.set_zero_linger();
    let _ = upstream.set_zero_linger();
}

/// Copies one direction until EOF (then half-closes the other side) or until `reset_after` bytes
/// went through (then stops with [`PipeError::Reset`]).
async fn pipe<R, W>(from: &mut R, to: &mut W, reset_after: Option<u64>) -> Result<(), PipeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; COPY_BUFFER];
    let mut forwarded: u64 = 0;
    loop {
        let n = from.read(&mut buf).await?;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        if let Some(limit) = reset_after {
            // `forwarded < limit` holds here: reaching the limit returns below.
            let room = limit - forwarded;
            if n as u64 >= room {
                // `room <= n`, so the cast cannot truncate.
                to.write_all(&buf[..room as usize]).await?;
                to.flush().await?;
                return Err(PipeError::Reset);
            }
        }
        to.write_all(&buf[..n]).await?;
        forwarded += n as u64;
    }
}

/// Copies HTTP/1.1 responses from `from` to `to` one by one, drawing for each whether to abort
/// the connection inside it ([`Shared::draw_response_reset`]). Bytes it cannot frame are copied
/// as they come.
async fn pipe_responses<R, W>(from: &mut R, to: &mut W, shared: &Shared) -> Result<(), PipeError>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut pending: Vec<u8> = Vec::new();
    let mut buf = vec![0u8; COPY_BUFFER];
    loop {
        // The head of the next response.
        let head_len = loop {
            if let Some(end) = find_head_end(&pending) {
                break Some(end);
            }
            if pending.len() > MAX_RESPONSE_HEAD {
                break None;
            }
            let n = from.read(&mut buf).await?;
            if n == 0 {
                to.write_all(&pending).await?;
                to.shutdown().await?;
                return Ok(());
            }
            pending.extend_from_slice(&buf[..n]);
        };
        let Some(total) =
            head_len.and_then(|head| response_len(&pending[..head]).map(|b| head + b))
        else {
            // Not a response it can frame: forward the rest untouched.
            to.write_all(&pending).await?;
            return pipe(from, to, None).await;
        };
        let total = total as u64;
        let reset_at = shared.draw_response_reset(total);
        // Forward this response, stopping at the drawn offset.
        let mut sent: u64 = 0;
        loop {
            let room = reset_at.unwrap_or(total).min(total) - sent;
            let chunk = (pending.len() as u64).min(room) as usize;
            to.write_all(&pending[..chunk]).await?;
            pending.drain(..chunk);
            sent += chunk as u64;
            if Some(sent) == reset_at {
                to.flush().await?;
                return Err(PipeError::ResponseReset);
            }
            if sent == total {
                break;
            }
            let n = from.read(&mut buf).await?;
            if n == 0 {
                to.shutdown().await?;
                return Ok(());
            }
            pending.extend_from_slice(&buf[..n]);
        }
    }
}

/// The length of a response head ending with its blank line, once `bytes` holds all of it.
fn find_head_end(bytes: &[u8]) -> Option<usize> {
    bytes
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map(|i| i + 4)
}

/// The body length of a response with this head, when its framing is a `Content-Length` (or no
/// body at all); `None` for chunked or close-delimited bodies, and heads it cannot read.
fn response_len(head: &[u8]) -> Option<usize> {
    let head = std::str::from_utf8(head).ok()?;
    let mut lines = head.split("\r\n");
    let status: u16 = lines.next()?.split(' ').nth(1)?.parse().ok()?;
    if (100..200).contains(&status) || status == 204 || status == 304 {
        return Some(0);
    }
    let mut length = None;
    for line in lines {
        let Some((name, value)) = line.split_once(':') else {
            continue;
        };
        if name.trim().eq_ignore_ascii_case("transfer-encoding") {
            return None;
        }
        if name.trim().eq_ignore_ascii_case("content-length") {
            length = Some(value.trim().parse().ok()?);
        }
    }
    length
}

#[cfg(test)]
mod tests {
    use std::net::Ipv4Addr;

    use super::*;

    /// Generous bound for waits that succeed at once unless the proxy is broken.
    const TEST_BOUND: Duration = Duration::from_secs(10);

    /// A loopback echo server: each connection gets back what it sent, then EOF.
    async fn echo_server() -> SocketAddr {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                tokio::spawn(async move {
                    let (mut r, mut w) = stream.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
        addr
    }

    /// Sends `payload`, half-closes, and reads until EOF or an error; returns what came back.
    async fn round_trip(proxy: SocketAddr, payload: &[u8]) -> Vec<u8> {
        let mut stream = TcpStream::connect(proxy).await.unwrap();
        // The proxy may reset while we are still writing; what matters is what comes back.
        let _ = stream.write_all(payload).await;
        let _ = stream.shutdown().await;
        let mut received = Vec::new();
        let mut buf = [0u8; 4096];
        loop {
            match tokio::time::timeout(TEST_BOUND, stream.read(&mut buf)).await {
                Ok(Ok(0)) | Ok(Err(_)) => return received,
                Ok(Ok(n)) => received.extend_from_slice(&buf[..n]),
                Err(_) => panic!("no EOF from the proxy within {TEST_BOUND:?}"),
            }
        }
    }

    fn payload(len: usize) -> Vec<u8> {
        (0..len).map(|i| (i % 251) as u8).collect()
    }

    /// A loopback HTTP server that answers every request on a connection with the same
    /// `Content-Length` response (requests are read as any bytes: each read is one request).
    async fn http_server(body_len: usize) -> (SocketAddr, usize) {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let addr = listener.local_addr().unwrap();
        let response = format!(
            "HTTP/1.1 200 OK\r\ncontent-length: {body_len}\r\n\r\n{}",
            "x".repeat(body_len)
        );
        let len = response.len();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                let response = response.clone();
                tokio::spawn(async move {
                    let mut buf = [0u8; 1024];
                    while let Ok(n) = stream.read(&mut buf).await {
                        if n == 0 || stream.write_all(response.as_bytes()).await.is_err() {
                            return;
                        }
                    }
                });
            }
        });
        (addr, len)
    }

    /// Sends `exchanges` requests on one connection, each after the previous answer; returns how
    /// many full responses came back and how many bytes of the one cut short.
    async fn exchanges(proxy: SocketAddr, exchanges: usize, len: usize) -> (usize, usize) {
        let mut stream = TcpStream::connect(proxy).await.unwrap();
        let mut buf = vec![0u8; len];
        for done in 0..exchanges {
            if stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.is_err() {
                return (done, 0);
            }
            let mut got = 0;
            while got < len {
                match tokio::time::timeout(TEST_BOUND, stream.read(&mut buf[got..])).await {
                    Ok(Ok(0)) | Ok(Err(_)) => return (done, got),
                    Ok(Ok(n)) => got += n,
                    Err(_) => panic!("no answer from the proxy within {TEST_BOUND:?}"),
                }
            }
        }
        (exchanges, 0)
    }

    #[tokio::test]
    async fn responses_are_cut_anywhere_on_long_lived_connections_and_counted() {
        let (server, len) = http_server(300).await;
        let faults = ProxyFaults {
            response_reset_probability: 0.25,
            ..ProxyFaults::default()
        };
        let proxy = Proxy::start("test", server, faults, 9).await.unwrap();
        let (mut cut, mut later_than_first, mut last_byte) = (0, 0, 0);
        for _ in 0..40 {
            let (full, partial) = exchanges(proxy.local_addr(), 20, len).await;
            if full < 20 {
                cut += 1;
                assert!(partial < len);
                later_than_first += usize::from(full > 0);
                last_byte += usize::from(partial == len - 1);
            }
        }
        assert_eq!(proxy.counters().response_reset, cut as u64);
        assert!(cut > 30, "only {cut} of 40 connections were cut");
        assert!(
            later_than_first > 0,
            "no connection was cut after its first exchange"
        );
        assert!(last_byte > 0, "no response was cut one byte before its end");
    }

    #[test]
    fn responses_are_framed_by_their_content_length() {
        let head = b"HTTP/1.1 201 Created\r\nContent-Length: 12\r\nx: y\r\n\r\n";
        assert_eq!(find_head_end(head), Some(head.len()));
        assert_eq!(response_len(head), Some(12));
        assert_eq!(response_len(b"HTTP/1.1 204 No Content\r\n\r\n"), Some(0));
        assert_eq!(
            response_len(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n"),
            None
        );
        assert_eq!(response_len(b"HTTP/1.1 200 OK\r\n\r\n"), None);
        assert_eq!(find_head_end(b"HTTP/1.1 200 OK\r\n"), None);
    }

    #[tokio::test]
    async fn plain_proxy_forwards_bytes_both_ways() {
        let proxy = Proxy::start("test", echo_server().await, ProxyFaults::default(), 1)
            .await
            .unwrap();
        let sent = payload(100_000);

        let received = round_trip(proxy.local_addr(), &sent).await;

        assert_eq!(received, sent);
        assert_eq!(
            proxy.counters(),
            ProxyCounters {
                connections: 1,
                ..ProxyCounters::default()
            }
        );
        assert!(proxy.take_events().is_empty());
    }

    #[tokio::test]
    async fn reset_cuts_the_echo_short_and_is_counted() {
        let faults = ProxyFaults {
            reset_probability: 1.0,
            ..ProxyFaults::default()
        };
        let proxy = Proxy::start("test", echo_server().await, faults, 2)
            .await
            .unwrap();
        // Longer than any reset offset, in either direction.
        let sent = payload(4 * RESET_MAX_OFFSET as usize);

        let received = round_trip(proxy.local_addr(), &sent).await;

        assert!(
            received.len() < RESET_MAX_OFFSET as usize,
            "{} bytes came back through a reset connection",
            received.len()
        );
        assert_eq!(received[..], sent[..received.len()]);
        // The proxy counts the reset before it aborts the sockets, so the count is there already.
        assert_eq!(proxy.counters().reset, 1);
        let events = proxy.take_events();
        assert_eq!(
            events.iter().map(|(_, kind)| *kind).collect::<Vec<_>>(),
            [NET_RESET]
        );
    }

    #[tokio::test]
    async fn blackhole_returns_nothing_and_is_counted() {
        let faults = ProxyFaults {
            blackhole_probability: 1.0,
            ..ProxyFaults::default()
        };
        let proxy = Proxy::start("test", echo_server().await, faults, 3)
            .await
            .unwrap();
        let mut counters = proxy.watch_counters();
        let mut stream = TcpStream::connect(proxy.local_addr()).await.unwrap();
        stream.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();

        // Checking that nothing arrives needs some window; a blackhole holds for much longer.
        let mut buf = [0u8; 64];
        let read = tokio::time::timeout(Duration::from_millis(300), stream.read(&mut buf)).await;

        assert!(read.is_err(), "a blackholed connection answered: {read:?}");
        tokio::time::timeout(TEST_BOUND, counters.wait_for(|c| c.blackholed == 1))
            .await
            .expect("blackhole counted")
            .unwrap();
        assert_eq!(proxy.counters().reset, 0);
        assert_eq!(proxy.take_events()[0].1, NET_BLACKHOLE);
    }

    #[tokio::test]
    async fn delay_holds_the_first_bytes_back_and_is_counted() {
        let faults = ProxyFaults {
            delay_ms: 50,
            ..ProxyFaults::default()
        };
        let proxy = Proxy::start("test", echo_server().await, faults, 4)
            .await
            .unwrap();
        let started = Instant::now();

        let received = round_trip(proxy.local_addr(), b"ping").await;

        assert_eq!(received, b"ping");
        // A lower bound only: a sleep never ends early.
        assert!(started.elapsed() >= Duration::from_millis(50));
        assert_eq!(proxy.counters().delayed, 1);
        assert_eq!(proxy.take_events()[0].1, NET_DELAY);
    }

    #[tokio::test]
    async fn new_faults_apply_to_new_connections() {
        let faults = ProxyFaults {
            blackhole_probability: 1.0,
            ..ProxyFaults::default()
        };
        let proxy = Proxy::start("test", echo_server().await, faults, 5)
            .await
            .unwrap();

        proxy.set_faults(ProxyFaults::default()).unwrap();

        assert_eq!(round_trip(proxy.local_addr(), b"calm").await, b"calm");
        assert_eq!(proxy.counters().blackholed, 0);
    }

    #[tokio::test]
    async fn unreachable_upstream_closes_the_client_connection() {
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await.unwrap();
        let dead = listener.local_addr().unwrap();
        drop(listener);
        let proxy = Proxy::start("test", dead, ProxyFaults::default(), 6)
            .await
            .unwrap();

        assert!(round_trip(proxy.local_addr(), b"anyone?").await.is_empty());
    }

    #[tokio::test]
    async fn non_loopback_upstream_is_refused() {
        let upstream: SocketAddr = "192.0.2.1:80".parse().unwrap();

        let err = Proxy::start("test", upstream, ProxyFaults::default(), 7)
            .await
            .unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
    }

    #[tokio::test]
    async fn invalid_probabilities_are_refused_and_change_nothing() {
        let upstream = echo_server().await;
        for p in [-0.1, 1.5, f64::NAN] {
            let faults = ProxyFaults {
                reset_probability: p,
                ..ProxyFaults::default()
            };
            let err = Proxy::start("test", upstream, faults, 8).await.unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        }
        let proxy = Proxy::start("test", upstream, ProxyFaults::default(), 8)
            .await
            .unwrap();

        let err = proxy
            .set_faults(ProxyFaults {
                blackhole_probability: 2.0,
                ..ProxyFaults::default()
            })
            .unwrap_err();

        assert_eq!(err.kind(), io::ErrorKind::InvalidInput);
        assert_eq!(proxy.faults(), ProxyFaults::default());
    }

    fn fates(seed: u64, faults: &ProxyFaults, n: usize) -> Vec<Fate> {
        let mut rng = StdRng::seed_from_u64(seed);
        (0..n).map(|_| decide(faults, &mut rng)).collect()
    }

    #[test]
    fn same_seed_gives_the_same_fates() {
        let faults = ProxyFaults {
            delay_ms: 5,
            jitter_ms: 20,
            reset_probability: 0.3,
            blackhole_probability: 0.2,
            response_reset_probability: 0.1,
        };

        let first = fates(42, &faults, 200);

        assert_eq!(first, fates(42, &faults, 200));
        assert_ne!(first, fates(43, &faults, 200));
        // The mix is really mixed, so the equality above compares something.
        assert!(first.contains(&Fate::Blackhole));
        assert!(first
            .iter()
            .any(|f| matches!(f, Fate::Forward { reset: Some(_), .. })));
        assert!(first
            .iter()
            .any(|f| matches!(f, Fate::Forward { reset: None, .. })));
    }

    #[test]
    fn certain_and_impossible_faults_are_exact() {
        let never = ProxyFaults::default();
        assert!(fates(1, &never, 100).iter().all(|f| *f
            == Fate::Forward {
                delay: Duration::ZERO,
                reset: None
            }));
        let always = ProxyFaults {
            delay_ms: 10,
            jitter_ms: 5,
            reset_probability: 1.0,
            blackhole_probability: 0.0,
            response_reset_probability: 0.0,
        };
        for fate in fates(1, &always, 100) {
            let Fate::Forward {
                delay,
                reset: Some(point),
            } = fate
            else {
                panic!("expected a delayed reset, got {fate:?}");
            };
            assert!((10..=15).contains(&delay.as_millis()));
            assert!(point.after_bytes < RESET_MAX_OFFSET);
        }
    }
}
