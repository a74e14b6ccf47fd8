//! A TCP proxy in front of PostgreSQL that reads the protocol the client speaks, enough to see a
//! `COMMIT` go by, and can cut the connection right after it: the server commits, the client never
//! learns it did. It can also stall every connection (the replication stream of a failover
//! run), and be pointed at another server for new connections (the promoted standby).
//!
//! ```text
//!  service ──► PgProxy ──► upstream (switchable)
//!               │ client → server: startup, then typed messages; a simple-query `COMMIT`
//!               │   drawn for a cut is forwarded, the server's answer is swallowed, and both
//!               │   sockets are aborted a moment later
//!               └ paused: neither direction moves until resumed
//! ```
//!
//! The server must not use TLS on this path (the run's clusters do not): the proxy reads the
//! client's messages in clear. sqlx commits with a simple query, which is what it looks for.

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::{JoinHandle, JoinSet};

/// Fault kind of a connection cut right after its `COMMIT` went to the server.
pub(crate) const DB_CUT_AFTER_COMMIT: &str = "db_cut_after_commit";

/// How long a cut connection waits, at most, for the server's answer to its `COMMIT` (which is
/// swallowed) before both sockets are aborted; a server that does not answer in time is cut all
/// the same.
const CUT_GRACE: Duration = Duration::from_millis(200);

/// The protocol codes of the untyped requests that may precede a startup message.
const SSL_REQUEST: i32 = 80_877_103;
const GSSENC_REQUEST: i32 = 80_877_104;
const CANCEL_REQUEST: i32 = 80_877_102;

/// A message longer than this is not from a client we know: the connection is just copied.
const MAX_MESSAGE: usize = 64 * 1024 * 1024;

struct Shared {
    upstream: Mutex<SocketAddr>,
    cut_probability: Mutex<f64>,
    rng: Mutex<StdRng>,
    paused: watch::Sender<bool>,
    cuts: AtomicU64,
}

/// A running proxy; dropping it closes the listener and every connection.
pub(crate) struct PgProxy {
    local_addr: SocketAddr,
    shared: Arc<Shared>,
    accept_task: JoinHandle<()>,
}

impl PgProxy {
    /// Listens on `127.0.0.1:0` and forwards to `upstream`, cutting after a `COMMIT` with
    /// `cut_probability`.
    pub(crate) async fn start(
        upstream: SocketAddr,
        cut_probability: f64,
        seed: u64,
    ) -> io::Result<Self> {
        if !upstream.ip().is_loopback() || !(0.0..=1.0).contains(&cut_probability) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a loopback upstream and a probability in [0, 1]",
            ));
        }
        let listener = TcpListener::bind((std::net::Ipv4Addr::LOCALHOST, 0)).await?;
        let local_addr = listener.local_addr()?;
        let shared = Arc::new(Shared {
            upstream: Mutex::new(upstream),
            cut_probability: Mutex::new(cut_probability),
            rng: Mutex::new(StdRng::seed_from_u64(seed)),
            paused: watch::channel(false).0,
            cuts: AtomicU64::new(0),
        });
        let accept_task = tokio::spawn(accept_loop(listener, shared.clone()));
        Ok(Self {
            local_addr,
            shared,
            accept_task,
        })
    }

    pub(crate) fn local_addr(&self) -> SocketAddr {
        self.local_addr
    }

    /// New connections go to `upstream` from now on.
    pub(crate) fn set_upstream(&self, upstream: SocketAddr) {
        *self
            .shared
            .upstream
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = upstream;
    }

    pub(crate) fn set_cut_probability(&self, p: f64) {
        *self
            .shared
            .cut_probability
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = p.clamp(0.0, 1.0);
    }

    /// Stops (`true`) or resumes every connection's traffic, the open ones included.
    pub(crate) fn set_paused(&self, paused: bool) {
        self.shared.paused.send_replace(paused);
    }

    /// Connections cut after a `COMMIT` so far.
    pub(crate) fn cuts(&self) -> u64 {
        self.shared.cuts.load(Ordering::Relaxed)
    }
}

impl Drop for PgProxy {
    fn drop(&mut self) {
        self.accept_task.abort();
    }
}

async fn accept_loop(listener: TcpListener, shared: Arc<Shared>) {
    let mut connections = JoinSet::new();
    loop {
        tokio::select! {
            accepted = listener.accept() => {
                let Ok((client, _)) = accepted else {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                };
                let upstream = *shared.upstream.lock().unwrap_or_else(PoisonError::into_inner);
                connections.spawn(serve(client, upstream, shared.clone()));
            }
            Some(_) = connections.join_next(), if !connections.is_empty() => {}
        }
    }
}

async fn serve(mut client: TcpStream, upstream: SocketAddr, shared: Arc<Shared>) {
    let Ok(Ok(mut server)) =
        tokio::time::timeout(Duration::from_secs(5), TcpStream::connect(upstream)).await
    else {
        // The server is down (crashed, restarting): the client sees its connection closed.
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let muted = Mute::default();
    let result = {
        let (mut client_read, mut client_write) = client.split();
        let (mut server_read, mut server_write) = server.split();
        tokio::try_join!(
            requests(&mut client_read, &mut server_write, &shared, &muted),
            answers(&mut server_read, &mut client_write, &shared, &muted),
        )
    };
    if result.is_err() {
        // Reset both sides rather than close them cleanly, as a failed network would.
        let _ = client.set_zero_linger();
        let _ = server.set_zero_linger();
    }
}

/// The answer to a `COMMIT` about to be cut: it never reaches the client, and its arrival is
/// signalled, so that the cut follows the server's commit.
#[derive(Default)]
struct Mute {
    on: AtomicBool,
    swallowed: tokio::sync::Notify,
}

/// Why a connection's forwarding stopped early.
enum Stop {
    /// A `COMMIT` was cut on purpose.
    Cut,
    /// A socket failed.
    Io,
}

impl From<io::Error> for Stop {
    fn from(_: io::Error) -> Self {
        Self::Io
    }
}

/// Waits while the proxy is paused.
async fn unpaused(shared: &Shared) {
    let mut paused = shared.paused.subscribe();
    let _ = paused.wait_for(|p| !*p).await;
}

/// Client to server: the startup requests, then typed messages, one by one.
async fn requests<R, W>(from: &mut R, to: &mut W, shared: &Shared, muted: &Mute) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Untyped: SSL or GSS requests (answered with one byte by the server), then the startup
    // message, or a cancel request and nothing else.
    loop {
        let Some(message) = read_untyped(from).await? else {
            to.shutdown().await?;
            return Ok(());
        };
        unpaused(shared).await;
        to.write_all(&message).await?;
        let code = i32::from_be_bytes([message[4], message[5], message[6], message[7]]);
        match code {
            SSL_REQUEST | GSSENC_REQUEST => continue,
            CANCEL_REQUEST => return copy(from, to, shared, None).await,
            _ => break,
        }
    }
    loop {
        let Some((kind, message)) = read_typed(from).await? else {
            to.shutdown().await?;
            return Ok(());
        };
        unpaused(shared).await;
        let commit = kind == b'Q' && is_commit(&message[5..]);
        let cut = commit && {
            let p = *shared
                .cut_probability
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            let mut rng = shared.rng.lock().unwrap_or_else(PoisonError::into_inner);
            rng.random::<f64>() < p
        };
        if cut {
            // The answer must never reach the client: mute it before the server can send it.
            muted.on.store(true, Ordering::SeqCst);
        }
        to.write_all(&message).await?;
        if cut {
            to.flush().await?;
            let _ = tokio::time::timeout(CUT_GRACE, muted.swallowed.notified()).await;
            shared.cuts.fetch_add(1, Ordering::Relaxed);
            return Err(Stop::Cut);
        }
    }
}

/// Server to client: copied as it comes, unless muted.
async fn answers<R, W>(from: &mut R, to: &mut W, shared: &Shared, muted: &Mute) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    copy(from, to, shared, Some(muted)).await
}

/// Copies what comes until the end of the stream, holding while paused, swallowing it (and
/// saying so) while `muted` is on.
async fn copy<R, W>(
    from: &mut R,
    to: &mut W,
    shared: &Shared,
    muted: Option<&Mute>,
) -> Result<(), Stop>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        unpaused(shared).await;
        let n = from.read(&mut buf).await?;
        if n == 0 {
            to.shutdown().await?;
            return Ok(());
        }
        match muted {
            Some(mute) if mute.on.load(Ordering::SeqCst) => mute.swallowed.notify_one(),
            _ => to.write_all(&buf[..n]).await?,
        }
    }
}

/// An untyped message (length, then body): `None` at a clean end of stream.
async fn read_untyped<R: AsyncRead + Unpin>(from: &mut R) -> io::Result<Option<Vec<u8>>> {
    let mut length = [0u8; 4];
    if !read_exact_or_end(from, &mut length).await? {
        return Ok(None);
    }
    let len = i32::from_be_bytes(length);
    let len = usize::try_from(len)
        .ok()
        .filter(|l| (8..=MAX_MESSAGE).contains(l))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad startup length"))?;
    let mut message = length.to_vec();
    message.resize(len, 0);
    from.read_exact(&mut message[4..]).await?;
    Ok(Some(message))
}

/// A typed message (kind, length, body), whole: `None` at a clean end of stream.
async fn read_typed<R: AsyncRead + Unpin>(from: &mut R) -> io::Result<Option<(u8, Vec<u8>)>> {
    let mut header = [0u8; 5];
    if !read_exact_or_end(from, &mut header).await? {
        return Ok(None);
    }
    let len = i32::from_be_bytes([header[1], header[2], header[3], header[4]]);
    let len = usize::try_from(len)
        .ok()
        .filter(|l| (4..=MAX_MESSAGE).contains(l))
        .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidData, "bad message length"))?;
    let mut message = header.to_vec();
    message.resize(1 + len, 0);
    from.read_exact(&mut message[5..]).await?;
    Ok(Some((header[0], message)))
}

/// Fills `buf`; `false` if the stream ended before its first byte.
async fn read_exact_or_end<R: AsyncRead + Unpin>(from: &mut R, buf: &mut [u8]) -> io::Result<bool> {
    let mut filled = 0;
    while filled < buf.len() {
        let n = from.read(&mut buf[filled..]).await?;
        if n == 0 {
            return if filled == 0 {
                Ok(false)
            } else {
                Err(io::ErrorKind::UnexpectedEof.into())
            };
        }
        filled += n;
    }
    Ok(true)
}

/// A simple query's text (NUL-terminated) that is a `COMMIT` (or `END`).
fn is_commit(query: &[u8]) -> bool {
    let text = query.split(|&b| b == 0).next().unwrap_or_default();
    let text = String::from_utf8_lossy(text);
    let word = text
        .trim()
        .trim_end_matches(';')
        .trim()
        .to_ascii_uppercase();
    word == "COMMIT" || word == "END" || word.starts_with("COMMIT ")
}

#[cfg(test)]
mod tests {
    use sqlx::postgres::{PgConnectOptions, PgSslMode};
    use sqlx::{ConnectOptions, Connection, PgPool};

    use super::*;

    #[test]
    fn commits_are_recognised_in_their_spellings() {
        for yes in [
            "COMMIT\0",
            "commit;\0",
            " COMMIT \0",
            "END\0",
            "COMMIT AND NO CHAIN\0",
        ] {
            assert!(is_commit(yes.as_bytes()), "{yes:?}");
        }
        for no in ["SELECT 1\0", "BEGIN\0", "ROLLBACK\0", "COMMITTED\0", "\0"] {
            assert!(!is_commit(no.as_bytes()), "{no:?}");
        }
    }

    /// The options of the test server, reached through `proxy` in clear.
    fn through(pool: &PgPool, proxy: SocketAddr) -> PgConnectOptions {
        pool.connect_options()
            .as_ref()
            .clone()
            .host("127.0.0.1")
            .port(proxy.port())
            .ssl_mode(PgSslMode::Disable)
    }

    #[sqlx::test(migrations = false)]
    async fn a_cut_commit_is_committed_and_its_client_never_hears_of_it(pool: PgPool) {
        sqlx::query("CREATE TABLE t (n INT)")
            .execute(&pool)
            .await
            .unwrap();
        let server: SocketAddr = format!("127.0.0.1:{}", pool.connect_options().get_port())
            .parse()
            .unwrap();
        let proxy = PgProxy::start(server, 1.0, 1).await.unwrap();
        let mut conn = through(&pool, proxy.local_addr()).connect().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        sqlx::query("INSERT INTO t VALUES (1)")
            .execute(&mut *tx)
            .await
            .unwrap();
        assert!(tx.commit().await.is_err(), "the client learnt the outcome");
        assert_eq!(proxy.cuts(), 1);
        let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM t")
            .fetch_one(&pool)
            .await
            .unwrap();
        assert_eq!(rows, 1, "the server did not commit");
    }

    #[sqlx::test(migrations = false)]
    async fn without_cuts_the_proxy_is_transparent_and_pauses_on_demand(pool: PgPool) {
        let server: SocketAddr = format!("127.0.0.1:{}", pool.connect_options().get_port())
            .parse()
            .unwrap();
        let proxy = PgProxy::start(server, 0.0, 1).await.unwrap();
        let mut conn = through(&pool, proxy.local_addr()).connect().await.unwrap();
        let mut tx = conn.begin().await.unwrap();
        let one: i32 = sqlx::query_scalar("SELECT 1")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        tx.commit().await.unwrap();
        assert_eq!(one, 1);
        proxy.set_paused(true);
        let stalled = tokio::time::timeout(
            Duration::from_millis(300),
            sqlx::query_scalar::<_, i32>("SELECT 2").fetch_one(&mut conn),
        )
        .await;
        assert!(stalled.is_err(), "a paused proxy let a query through");
        proxy.set_paused(false);
        assert_eq!(proxy.cuts(), 0);
    }
}
