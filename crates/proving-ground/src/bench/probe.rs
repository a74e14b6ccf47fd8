//! What the measurements read besides the clients' clocks: PostgreSQL's own statistics (per
//! database, and WAL for the whole server) and the CPU time of the processes from `/proc`.

use std::time::Duration;

use anyhow::Context;
use sqlx::{Connection, PgConnection};

use super::stack::Databases;

/// Clock ticks per second of `/proc/<pid>/stat` (`USER_HZ`): 100 on every Linux architecture.
const TICKS_PER_SECOND: f64 = 100.0;

/// Cumulative counters of one database.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct DatabaseCounters {
    pub(crate) transactions: i64,
    pub(crate) rows_written: i64,
}

/// Cumulative counters at one moment.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Counters {
    pub(crate) service: DatabaseCounters,
    pub(crate) gateway: DatabaseCounters,
    /// Bytes of WAL the server has written, all databases together.
    pub(crate) wal_bytes: i64,
    /// Updates of `idempotency_keys` in the service's database, and how many were HOT.
    pub(crate) key_updates: i64,
    pub(crate) key_hot_updates: i64,
}

impl Counters {
    pub(crate) fn since(self, before: Self) -> Self {
        let db = |a: DatabaseCounters, b: DatabaseCounters| DatabaseCounters {
            transactions: a.transactions - b.transactions,
            rows_written: a.rows_written - b.rows_written,
        };
        Self {
            service: db(self.service, before.service),
            gateway: db(self.gateway, before.gateway),
            wal_bytes: self.wal_bytes - before.wal_bytes,
            key_updates: self.key_updates - before.key_updates,
            key_hot_updates: self.key_hot_updates - before.key_hot_updates,
        }
    }

    /// These counters less a fixed cost measured the same way (a life of the stack without
    /// load), never below zero.
    pub(crate) fn less(self, fixed: Self) -> Self {
        let db = |a: DatabaseCounters, b: DatabaseCounters| DatabaseCounters {
            transactions: (a.transactions - b.transactions).max(0),
            rows_written: (a.rows_written - b.rows_written).max(0),
        };
        Self {
            service: db(self.service, fixed.service),
            gateway: db(self.gateway, fixed.gateway),
            wal_bytes: (self.wal_bytes - fixed.wal_bytes).max(0),
            key_updates: (self.key_updates - fixed.key_updates).max(0),
            key_hot_updates: (self.key_hot_updates - fixed.key_hot_updates).max(0),
        }
    }
}

/// Reads the counters once the stack is down. A backend reports its statistics when it ends,
/// so the read waits until no backend of either database is left and two reads agree. The
/// key table's counters are read last, on a connection of their own to the service's database:
/// its one transaction lands in the next measurement, and the fixed cost subtracts it.
pub(crate) async fn counters_at_rest(databases: &mut Databases) -> anyhow::Result<Counters> {
    let (service, gateway) = (databases.service.clone(), databases.gateway.clone());
    for _ in 0..100 {
        let left: i64 =
            sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE datname IN ($1, $2)")
                .bind(&service)
                .bind(&gateway)
                .fetch_one(databases.admin())
                .await?;
        if left == 0 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut counters = read_server(databases).await?;
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(150)).await;
        let now = read_server(databases).await?;
        let settled = now.service.transactions == counters.service.transactions
            && now.gateway.transactions == counters.gateway.transactions;
        counters = now;
        if settled {
            break;
        }
    }
    let (key_updates, key_hot_updates) = read_key_table(databases).await?;
    Ok(Counters {
        key_updates,
        key_hot_updates,
        ..counters
    })
}

/// What the server's own database shows: both databases' counters, and the WAL position.
async fn read_server(databases: &mut Databases) -> anyhow::Result<Counters> {
    let names = [databases.service.clone(), databases.gateway.clone()];
    let admin = databases.admin();
    // A fresh snapshot of the statistics on every read (they are cached per transaction).
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut *admin)
        .await?;
    let mut counters = [DatabaseCounters::default(); 2];
    for (name, counters) in names.iter().zip(counters.iter_mut()) {
        let (transactions, rows_written): (i64, i64) = sqlx::query_as(
            "SELECT (xact_commit + xact_rollback)::bigint,
                    (tup_inserted + tup_updated + tup_deleted)::bigint
             FROM pg_stat_database WHERE datname = $1",
        )
        .bind(name)
        .fetch_one(&mut *admin)
        .await
        .with_context(|| format!("read the statistics of {name}"))?;
        *counters = DatabaseCounters {
            transactions,
            rows_written,
        };
    }
    let wal_bytes: i64 = sqlx::query_scalar("SELECT (pg_current_wal_lsn() - '0/0')::bigint")
        .fetch_one(&mut *admin)
        .await?;
    Ok(Counters {
        service: counters[0],
        gateway: counters[1],
        wal_bytes,
        ..Counters::default()
    })
}

/// Updates of the key table, and the HOT ones: table statistics are per database, so they are
/// read there.
async fn read_key_table(databases: &Databases) -> anyhow::Result<(i64, i64)> {
    let mut conn: PgConnection = databases.connect_service().await?;
    let updates: (i64, i64) = sqlx::query_as(
        "SELECT coalesce(sum(n_tup_upd), 0)::bigint, coalesce(sum(n_tup_hot_upd), 0)::bigint
         FROM pg_stat_user_tables WHERE relname = 'idempotency_keys'",
    )
    .fetch_one(&mut conn)
    .await?;
    conn.close().await?;
    Ok(updates)
}

/// CPU seconds used so far by the service, the gateway, PostgreSQL and the load's clients (this
/// process: on a small machine they compete for the same cores).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Cpu {
    pub(crate) service: f64,
    pub(crate) gateway: f64,
    pub(crate) clients: f64,
    /// `None` when the server's processes cannot be read (another host, another namespace).
    pub(crate) postgres: Option<f64>,
}

impl Cpu {
    pub(crate) fn since(self, before: Self) -> Self {
        Self {
            service: self.service - before.service,
            gateway: self.gateway - before.gateway,
            clients: self.clients - before.clients,
            postgres: self.postgres.zip(before.postgres).map(|(a, b)| a - b),
        }
    }
}

/// Reads the CPU time of the two processes and of PostgreSQL: the postmaster's children alive
/// now, plus what its children that ended have used (`cutime`, `cstime`).
pub(crate) fn cpu(service: Option<u32>, gateway: Option<u32>, postmaster: Option<u32>) -> Cpu {
    let own = |pid: Option<u32>| pid.and_then(stat).map_or(0.0, |s| s.own);
    let postgres = postmaster.and_then(|postmaster| {
        let parent = stat(postmaster)?;
        let mut total = parent.own + parent.children;
        for entry in std::fs::read_dir("/proc").ok()?.flatten() {
            let Some(pid) = entry
                .file_name()
                .to_str()
                .and_then(|n| n.parse::<u32>().ok())
            else {
                continue;
            };
            if let Some(child) = stat(pid).filter(|s| s.parent == postmaster) {
                total += child.own;
            }
        }
        Some(total)
    });
    Cpu {
        service: own(service),
        gateway: own(gateway),
        clients: own(Some(std::process::id())),
        postgres,
    }
}

/// The PostgreSQL server's main process, if its processes are visible from here: the parent of
/// the backend serving `conn`.
pub(crate) async fn postmaster(conn: &mut PgConnection) -> Option<u32> {
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(conn)
        .await
        .ok()?;
    let backend = stat(u32::try_from(backend).ok()?)?;
    Some(backend.parent)
}

struct Stat {
    parent: u32,
    /// utime + stime, in seconds.
    own: f64,
    /// cutime + cstime: the ended children's, in seconds.
    children: f64,
}

fn stat(pid: u32) -> Option<Stat> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name is in parentheses and may hold spaces; the fields follow the last ')'.
    let fields: Vec<&str> = text.rsplit_once(')')?.1.split_whitespace().collect();
    // After the name: state(0) ppid(1) … utime(11) stime(12) cutime(13) cstime(14).
    let number = |i: usize| fields.get(i).and_then(|f| f.parse::<f64>().ok());
    Some(Stat {
        parent: fields.get(1)?.parse().ok()?,
        own: (number(11)? + number(12)?) / TICKS_PER_SECOND,
        children: (number(13)? + number(14)?) / TICKS_PER_SECOND,
    })
}
