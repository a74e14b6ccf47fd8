//! What a run can be told: the options of `chaos`, the fault families it can switch off, and
//! the protections it can take away (the negative controls).

use std::path::PathBuf;
use std::time::Duration;

use clap::{Args, ValueEnum};

/// What `--without` can take away, to show that the auditor catches the damage.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Sabotage {
    /// Call the gateway under a fresh key per attempt instead of the key derived from the key
    /// row: retries after "charged, then no answer" charge twice.
    DerivedKey,
    /// Run the worker with a completer grace of 1000 hours, so it never takes a key: requests
    /// whose clients gave up stay unfinished.
    Completer,
    /// With `--failover`: replicate asynchronously, and stall the replication stream before the
    /// primary dies, so that commits it acknowledged are lost with it. With `--ha patroni`:
    /// `synchronous_mode: false`, and the standby's WAL receiver stopped before the leader's
    /// agent and postmaster are killed.
    SyncReplication,
    /// Take a charge whose outcome is unknown (no answer within the gateway timeout, a
    /// connection cut before its answer was whole, a 5xx) for a decline: the request answers 402
    /// though the gateway may have charged the card.
    UnknownOutcome,
    /// Commit a new key at its first recovery point (`ride_created`) before its ride is inserted,
    /// in a transaction of its own: a commit whose answer is lost, or a backend killed in
    /// between, leaves a key naming a ride that does not exist.
    AtomicPhase,
    /// Let a holder whose lease renewal found the lease taken over go on with its gateway call
    /// and its next write (which the fencing token then refuses).
    LeaseStop,
    /// Reconcile at once, without waiting for the last call under the key to be older than the
    /// gateway's processing bound: a charge still being made when its key's window passes is in
    /// no list yet, and a new generation of the key charges again.
    InFlightGuard,
    /// Take an answer without the gateway's error object (an intermediary's HTML page or empty
    /// body, status 4xx) for the gateway's refusal: the request stores a 502 "nothing charged",
    /// though the charge behind the intermediary may have been made.
    UnknownAnswers,
    /// Run the services without the commit watch: with `--failover`, the commits whose wait for
    /// the stalled standby the harness cancels just before the primary dies report success, and
    /// the bookings acknowledged on them are lost with the primary.
    CommitWatch,
    /// Commit asynchronously (`synchronous_commit = off` on the services' connections), and stop
    /// the WAL writer for a second before PostgreSQL crashes, so that commits it acknowledged are
    /// lost with it. Needs the crash: the database faults on, without `--failover`.
    DurableCommit,
    /// With `--pooler pgbouncer`: run the services as they run against PostgreSQL itself (named
    /// prepared statements, statements outside transactions) behind the transaction pooler,
    /// which hands each transaction to whichever server connection is free.
    UnnamedStatements,
}

/// Where the service's database lives (`--ha`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Ha {
    /// A PostgreSQL cluster of the run's own, which the harness crashes (or with `--failover`
    /// replicates and promotes by hand).
    #[default]
    None,
    /// A Patroni cluster: two PostgreSQL nodes, one etcd member, HAProxy routing to the leader
    /// by Patroni's REST health check; the services reach the database only through HAProxy.
    Patroni,
}

/// What stands between the services and their database (`--pooler`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, ValueEnum)]
pub enum Pooler {
    /// The services reach PostgreSQL itself (through the proxy that cuts after `COMMIT`).
    #[default]
    None,
    /// A PgBouncer in transaction pooling between the services' proxy and the run's
    /// PostgreSQL, started by `scripts/pgbouncer.sh`; the services run with
    /// `DATABASE_POOLER=transaction`.
    Pgbouncer,
}

/// A fault family that can be switched off.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum FaultFamily {
    /// SIGKILL of API processes and of the worker; API processes stopped (SIGSTOP) for longer
    /// than their leases, so that their keys are taken over while they hold them; leases taken
    /// over in the database while their holders wait on a slow gateway call.
    Kill,
    /// Process crashes at exact points of the phase machine (failpoints).
    Crash,
    /// Gateway latency, errors before and after charging, dropped connections, 409 in flight,
    /// refusals, intermediaries' answers, forgotten keys.
    Gateway,
    /// Charges that straddle their key's window: scripted requests whose charge is still being
    /// made when the window has passed. A run with them lasts at least the window (42 s), so a
    /// run that tests something else can switch them off.
    Straddle,
    /// Delay, reset and blackhole on the loopback proxies.
    Network,
    /// `pg_terminate_backend` of the service's database connections (idle ones, and ones in
    /// the middle of their work), connections cut right after their `COMMIT`, and a crash of
    /// PostgreSQL itself, restarted with crash recovery.
    Database,
}

/// `chaos` options.
#[derive(Debug, Clone, Args)]
pub struct ChaosArgs {
    /// PostgreSQL server URL; the run creates a fresh database on that server.
    #[arg(long, env = "DATABASE_URL", hide_env_values = true)]
    pub database_url: String,
    /// Requests to send (each with a fresh key, retried with it).
    #[arg(long, default_value_t = 1000, value_parser = clap::value_parser!(u64).range(1..=1_000_000))]
    pub requests: u64,
    /// Seed of every random choice of the run (faults, schedule, payloads). Random if not given.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Concurrent clients.
    #[arg(long, default_value_t = 24, value_parser = clap::value_parser!(u32).range(1..=512))]
    pub concurrency: u32,
    /// API processes (separate OS processes on loopback ports).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=16))]
    pub api_instances: u32,
    /// Users to spread the requests over; a fifth of them have declining cards.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=1000))]
    pub users: u32,
    /// Switch a fault family off (repeatable).
    #[arg(long = "no", value_enum)]
    pub no: Vec<FaultFamily>,
    /// Sabotage a protection, to show the auditor catches it (the negative control).
    #[arg(long = "without", value_enum)]
    pub without: Vec<Sabotage>,
    /// A client gives up on a request after this long; the completer must then finish it.
    /// Shorter than the API's lease (8 s), so that requests caught by a crash are often
    /// abandoned by their clients and left to the completer.
    #[arg(long, value_parser = rocket_rides::config::parse_duration, default_value = "6s")]
    pub give_up_after: Duration,
    /// The `rocket-rides` binary to run as the API and worker processes; it must be built with
    /// the `failpoints` feature (`scripts/chaos.sh` builds it). Default: the `rocket-rides` next
    /// to this program.
    #[arg(long, env = "ROCKET_RIDES_BIN")]
    pub service_bin: Option<PathBuf>,
    /// Where the report, the HTML page and the processes' logs go.
    #[arg(long, default_value = "target/chaos")]
    pub report_dir: PathBuf,
    /// Keep the run's database afterwards. By default it is dropped when the audit passes and
    /// kept for inspection when it fails.
    #[arg(long, conflicts_with = "drop_database")]
    pub keep_database: bool,
    /// Drop the run's database afterwards even when the audit fails (tests of the harness).
    #[arg(long)]
    pub drop_database: bool,
    /// Give the run's PostgreSQL a streaming standby with synchronous replication, and fail over
    /// to it half-way through the run: the primary is killed, the standby promoted, and the
    /// services reach it through the same address (instead of the crash and restart).
    ///
    /// Kept beside `--ha patroni`: it proves the asynchronous loss (its control) on a stream
    /// cut at a known moment, with no daemon but PostgreSQL's, and the promotion it does by hand
    /// is the bare mechanism Patroni automates.
    #[arg(long)]
    pub failover: bool,
    /// Run the service's database under high availability: `patroni` (Patroni, etcd and
    /// HAProxy, which must be installed; `scripts/chaos.sh --ha patroni` installs them). Its
    /// leader is killed, its agent is killed and a switchover is made during the run.
    #[arg(long, value_enum, default_value_t = Ha::None)]
    pub ha: Ha,
    /// Put a connection pooler between the services and their database: `pgbouncer` (PgBouncer
    /// in transaction pooling, installed by `scripts/pgbouncer.sh` where missing). The harness
    /// and the migrations reach PostgreSQL directly.
    #[arg(long, value_enum, default_value_t = Pooler::None)]
    pub pooler: Pooler,
    /// The script that starts the PgBouncer of `--pooler pgbouncer` in front of a server, prints
    /// its URL, and stops it with `--stop URL`.
    #[arg(long, env = "PGBOUNCER_SCRIPT", default_value = crate::pgbouncer::DEFAULT_SCRIPT)]
    pub pgbouncer_script: PathBuf,
}

impl ChaosArgs {
    /// Whether `family`'s faults are on (not switched off with `--no`).
    pub(crate) fn on(&self, family: FaultFamily) -> bool {
        !self.no.contains(&family)
    }

    /// Whether `protection` is taken away (`--without`).
    pub(crate) fn without(&self, protection: Sabotage) -> bool {
        self.without.contains(&protection)
    }

    /// Whether the database runs under Patroni (`--ha patroni`).
    pub(crate) fn patroni(&self) -> bool {
        self.ha == Ha::Patroni
    }

    /// Whether the services reach their database through PgBouncer (`--pooler pgbouncer`).
    pub(crate) fn pgbouncer(&self) -> bool {
        self.pooler == Pooler::Pgbouncer
    }

    /// How the services reach their database, as the report names it.
    pub(crate) fn database(&self) -> &'static str {
        match (self.ha, self.pooler, self.failover) {
            (Ha::Patroni, _, _) => "patroni",
            (_, Pooler::Pgbouncer, _) => "pgbouncer",
            (_, _, true) => "failover",
            _ => "postgres",
        }
    }

    /// Refuses the combinations that would prove nothing, before anything starts.
    pub(crate) fn check(&self) -> anyhow::Result<()> {
        anyhow::ensure!(
            self.failover || self.patroni() || !self.without(Sabotage::SyncReplication),
            "--without sync-replication sabotages a failover: give --failover or --ha patroni too"
        );
        anyhow::ensure!(
            !(self.failover && self.patroni()),
            "--failover promotes a standby by hand; under --ha patroni Patroni does that: give \
             one of them"
        );
        anyhow::ensure!(
            !self.without(Sabotage::CommitWatch)
                || (self.failover && !self.without(Sabotage::SyncReplication)),
            "--without commit-watch shows what a cancelled wait for the synchronous standby \
             loses: it needs --failover, with its standby synchronous"
        );
        anyhow::ensure!(
            !self.without(Sabotage::DurableCommit)
                || (self.on(FaultFamily::Database) && !self.failover && !self.patroni()),
            "--without durable-commit shows what a crash of PostgreSQL loses: it needs the database \
             faults on (no --no database), no --failover and no --ha patroni"
        );
        anyhow::ensure!(
            !self.pgbouncer() || (!self.failover && !self.patroni()),
            "--pooler pgbouncer fronts the run's own PostgreSQL, which a failover replaces: give \
             it without --failover and --ha patroni"
        );
        anyhow::ensure!(
            !(self.pgbouncer() && self.without(Sabotage::DurableCommit)),
            "--without durable-commit sets synchronous_commit in the services' startup \
             options, which PgBouncer refuses: give it without --pooler pgbouncer"
        );
        anyhow::ensure!(
            !self.without(Sabotage::UnnamedStatements) || self.pgbouncer(),
            "--without unnamed-statements shows what a transaction pooler does to named \
             statements: it needs --pooler pgbouncer"
        );
        Ok(())
    }
}
