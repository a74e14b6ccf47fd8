//! The faults: one table ([`FAULTS`]) names every fault kind the report counts, its family, how
//! often it strikes and how it is injected and counted; the families' own tasks live in a file
//! each, started by [`tasks`]. The table and the kinds' names are here, with nothing of the
//! running stack, because the stack reads them as it starts (the gateway's and the proxies'
//! settings, the crash points); the tasks, which run on that stack, are in this folder's files.
//!
//! | family | injected by | file |
//! |---|---|---|
//! | kill | SIGKILL and SIGSTOP of the processes, leases taken over | [`kill`] |
//! | crash | the service's crash points, armed through its environment | [`crash_spec`] |
//! | gateway | the in-process gateway's faults; keys forgotten, a customer deleted | [`gateway`] |
//! | straddle | charges held across their key's window | [`straddle`] |
//! | network | the loopback proxies | [`network_faults`] |
//! | database | backends terminated, commits cut, PostgreSQL crashed or failed over | [`database`] |
//! | (`--ha patroni`) | the leader's postmaster or agent killed, a switchover | [`patroni`] |
//!
//! Faults drawn by the gateway and the proxies are counted by the sampler ([`tasks`]), which
//! reads their counters every second; the families' tasks, the supervised processes and the
//! scripted requests count their own.

mod database;
mod gateway;
mod kill;
mod patroni;
pub(crate) mod tasks;

use fakestripe::FaultCounters;

use super::options::{ChaosArgs, FaultFamily};
use super::pgproxy::DB_CUT_AFTER_COMMIT;
use super::proxy::{ProxyCounters, ProxyFaults};
use super::{processes, straddle};

/// One fault kind of the report.
pub(crate) struct FaultKind {
    /// Its name in the report.
    pub name: &'static str,
    pub family: FaultFamily,
    /// When a run must have injected it (`every_fault_exercised`).
    pub required: Required,
    /// Added latency rather than a discrete fault: counted, but left out of the timeline.
    pub ambient: bool,
    pub injection: Injection,
}

/// When a run with the kind's family on must inject the kind.
#[derive(Clone, Copy)]
pub(crate) enum Required {
    Always,
    /// Unless `--failover` (the database's death is then the failover).
    WithoutFailover,
    /// With `--failover`, whatever families are off.
    WithFailover,
    /// With `--failover` and its standby synchronous (not `--without sync-replication`).
    WithSynchronousFailover,
    /// With `--ha patroni`, whatever families are off.
    WithPatroni,
    /// When its family is on, unless `--ha patroni` (which makes no straddles, and whose run
    /// in CI is short).
    WithoutPatroni,
    /// When its family and the straddles are on, unless `--ha patroni`: the straddles make the
    /// run outlast the gateway's key TTL.
    WithStraddles,
    /// When the gateway or the network faults are on: a lease is taken over only from a holder
    /// waiting on a slow gateway call, which slow charges or a slow network make.
    WithSlowCalls,
    /// Counted, never required.
    Never,
}

/// How a fault kind is injected, with what probability, and how it is counted.
pub(crate) enum Injection {
    /// Drawn by the in-process gateway for each charge, with the settings `set` writes;
    /// counted from the gateway's counters.
    Gateway {
        set: fn(&mut fakestripe::Faults),
        count: fn(&FaultCounters) -> u64,
    },
    /// Drawn by the loopback proxies for each connection or response, with the settings `set`
    /// writes; counted from the proxies' counters.
    Network {
        set: fn(&mut ProxyFaults),
        count: fn(&ProxyCounters) -> u64,
    },
    /// Drawn by the services' database proxy for each `COMMIT`; counted from its cuts.
    CommitCut { probability: f64 },
    /// A crash point of the service, armed with `probability`; counted by its exit code.
    Failpoint {
        point: &'static str,
        probability: f64,
    },
    /// Injected and counted by a task of the harness: the family's file (or the scripted
    /// requests' file) says how often.
    Task,
}

/// Every fault kind, in the order the audit lists the ones it misses.
pub(crate) const FAULTS: &[FaultKind] = &[
    // Kill (faults/kill.rs): the processes, and the leases they hold.
    task("kill_api", FaultFamily::Kill),
    task("kill_worker", FaultFamily::Kill),
    task(processes::PAUSE_KIND, FaultFamily::Kill),
    FaultKind {
        required: Required::WithSlowCalls,
        ..task(LEASE_STOLEN, FaultFamily::Kill)
    },
    // Crash: the points of the phase machine. The others are drawn often enough that a run of
    // a thousand requests meets each of them several times; a new key generation is rare (a
    // reconciliation that found nothing), so its point is armed more often, and not required.
    failpoint("crash_after_ride_created", "after_ride_created", 0.012),
    FaultKind {
        required: Required::Never,
        ..failpoint("crash_after_new_generation", "after_new_generation", 0.6)
    },
    failpoint("crash_after_gateway_charge", "after_gateway_charge", 0.025),
    failpoint("crash_after_finished", "after_finished", 0.015),
    failpoint("crash_after_receipt_effect", "after_receipt_effect", 0.04),
    // Gateway: drawn by the gateway, or made by faults/gateway.rs (and the straddles, a family
    // of their own, by straddle.rs).
    FaultKind {
        required: Required::Never,
        ambient: true,
        ..gateway(
            "gateway_latency",
            |f| {
                f.latency_ms = 10;
                f.jitter_ms = 40;
            },
            |c| c.latency,
        )
    },
    gateway(
        "gateway_fail_before",
        |f| f.fail_before_charge = 0.03,
        |c| c.fail_before_charge,
    ),
    gateway(
        "gateway_fail_after",
        |f| f.fail_after_charge = 0.03,
        |c| c.fail_after_charge,
    ),
    gateway(
        "gateway_drop_after",
        |f| f.drop_after_charge = 0.03,
        |c| c.drop_after_charge,
    ),
    gateway(
        "gateway_conflict",
        |f| f.conflict_in_flight = 0.02,
        |c| c.conflict_in_flight,
    ),
    gateway(
        "gateway_sticky_500",
        |f| {
            f.sticky_500_before_charge = 0.02;
            f.sticky_500_after_charge = 0.01;
        },
        |c| c.sticky_500_before_charge + c.sticky_500_after_charge,
    ),
    // Made by deleting a customer (faults/gateway.rs), counted as the gateway refuses.
    gateway("gateway_refuse", |_| {}, |c| c.refused),
    // Keys are forgotten 55 s after they finished: a short run without straddles to outlast
    // (under Patroni, or with `--no straddle`) may end first.
    FaultKind {
        required: Required::WithStraddles,
        ..task("gateway_forget_keys", FaultFamily::Gateway)
    },
    gateway(
        "gateway_slow_past_heartbeat",
        |f| {
            f.slow_charges = 0.03;
            f.slow_ms = SLOW_CHARGE_MS;
        },
        |c| c.slow_charges,
    ),
    gateway(
        "gateway_slow_past_timeout",
        |f| {
            f.stalled_charges = 0.02;
            f.stalled_ms = STALLED_CHARGE_MS;
        },
        |c| c.stalled_charges,
    ),
    FaultKind {
        required: Required::WithoutPatroni,
        ..task(straddle::KIND, FaultFamily::Straddle)
    },
    // Drawn by the gateway, and scripted for a few requests (intermediary.rs).
    gateway(
        INTERMEDIARY_ANSWER,
        |f| {
            f.intermediary_before = 0.01;
            f.intermediary_after = 0.01;
        },
        |c| c.intermediary_before + c.intermediary_after,
    ),
    // Only a key that already holds a charge is struck: rare, so drawn often.
    gateway(
        IDEMPOTENCY_ERROR,
        |f| f.idempotency_error_on_replay = 0.1,
        |c| c.idempotency_error_on_replay,
    ),
    // Network.
    FaultKind {
        required: Required::Never,
        ambient: true,
        ..network("net_delay", |f| f.jitter_ms = 20, |c| c.delayed)
    },
    network("net_reset", |f| f.reset_probability = 0.03, |c| c.reset),
    network(
        "net_blackhole",
        |f| f.blackhole_probability = 0.008,
        |c| c.blackholed,
    ),
    network(
        "net_reset_mid_response",
        |f| f.response_reset_probability = 0.01,
        |c| c.response_reset,
    ),
    // Database (faults/database.rs).
    task("pg_terminate", FaultFamily::Database),
    task("pg_terminate_active", FaultFamily::Database),
    FaultKind {
        name: DB_CUT_AFTER_COMMIT,
        family: FaultFamily::Database,
        required: Required::Always,
        ambient: false,
        injection: Injection::CommitCut { probability: 0.01 },
    },
    FaultKind {
        required: Required::WithoutFailover,
        ..task("pg_crash_restart", FaultFamily::Database)
    },
    FaultKind {
        required: Required::WithFailover,
        ..task("pg_failover", FaultFamily::Database)
    },
    FaultKind {
        required: Required::WithSynchronousFailover,
        ..task(CANCEL_SYNC_WAIT, FaultFamily::Database)
    },
    // Patroni (faults/patroni.rs), with --ha patroni.
    patroni(KILL_LEADER),
    patroni(KILL_AGENT),
    patroni(SWITCHOVER),
];

/// The fault kind of a lease taken over under its holder ([`kill`]).
pub(crate) const LEASE_STOLEN: &str = "lease_stolen";
/// The fault kind of a wait for the synchronous standby cancelled (`pg_cancel_backend`,
/// [`database`]).
const CANCEL_SYNC_WAIT: &str = "pg_cancel_sync_wait";
/// SIGKILL of the Patroni leader's postmaster ([`patroni`](mod@patroni)).
const KILL_LEADER: &str = "patroni_kill_leader";
/// SIGKILL of the Patroni leader's agent ([`patroni`](mod@patroni)).
const KILL_AGENT: &str = "patroni_kill_agent";
/// A planned switchover to the Patroni standby ([`patroni`](mod@patroni)).
const SWITCHOVER: &str = "patroni_switchover";
/// The fault kind of an intermediary in front of the gateway answering on its own (HTML or an
/// empty body, 4xx or 5xx), before forwarding or after the charge was made.
const INTERMEDIARY_ANSWER: &str = "gateway_intermediary_answer";
/// The fault kind of a 400 `idempotency_error` for a key whose earlier attempt charged.
const IDEMPOTENCY_ERROR: &str = "gateway_idempotency_error";
/// A slow charge: slower than the heartbeat, within the gateway timeout.
const SLOW_CHARGE_MS: u64 = 2_000;
/// A stalled charge: slower than the gateway timeout; the gateway charges after the service gave
/// up on the call, and answers its retries 409 meanwhile.
const STALLED_CHARGE_MS: u64 = 3_500;

/// The database faults after which one request may honestly answer 500: its backend was
/// terminated, or its commit cut from its answer. (A crashed process answers nothing; while
/// PostgreSQL itself is away, its outage seconds explain the 500s.)
pub(crate) const FAULTS_THAT_ANSWER_500: &[&str] =
    &[DB_CUT_AFTER_COMMIT, "pg_terminate", "pg_terminate_active"];

const fn task(name: &'static str, family: FaultFamily) -> FaultKind {
    FaultKind {
        name,
        family,
        required: Required::Always,
        ambient: false,
        injection: Injection::Task,
    }
}

const fn patroni(name: &'static str) -> FaultKind {
    FaultKind {
        required: Required::WithPatroni,
        ..task(name, FaultFamily::Database)
    }
}

const fn failpoint(name: &'static str, point: &'static str, probability: f64) -> FaultKind {
    FaultKind {
        name,
        family: FaultFamily::Crash,
        required: Required::Always,
        ambient: false,
        injection: Injection::Failpoint { point, probability },
    }
}

const fn gateway(
    name: &'static str,
    set: fn(&mut fakestripe::Faults),
    count: fn(&FaultCounters) -> u64,
) -> FaultKind {
    FaultKind {
        name,
        family: FaultFamily::Gateway,
        required: Required::Always,
        ambient: false,
        injection: Injection::Gateway { set, count },
    }
}

const fn network(
    name: &'static str,
    set: fn(&mut ProxyFaults),
    count: fn(&ProxyCounters) -> u64,
) -> FaultKind {
    FaultKind {
        name,
        family: FaultFamily::Network,
        required: Required::Always,
        ambient: false,
        injection: Injection::Network { set, count },
    }
}

/// The fault kinds `args` configure, each of which the run must inject.
pub(crate) fn configured(args: &ChaosArgs) -> Vec<&'static str> {
    let slow_calls = args.on(FaultFamily::Gateway) || args.on(FaultFamily::Network);
    FAULTS
        .iter()
        .filter(|kind| match kind.required {
            Required::Always => args.on(kind.family),
            Required::WithoutFailover => args.on(kind.family) && !args.failover && !args.patroni(),
            Required::WithFailover => args.failover,
            Required::WithSynchronousFailover => {
                args.failover && !args.without(super::options::Sabotage::SyncReplication)
            }
            Required::WithPatroni => args.patroni(),
            Required::WithoutPatroni => args.on(kind.family) && !args.patroni(),
            Required::WithStraddles => {
                args.on(kind.family) && args.on(FaultFamily::Straddle) && !args.patroni()
            }
            Required::WithSlowCalls => args.on(kind.family) && slow_calls,
            Required::Never => false,
        })
        .map(|kind| kind.name)
        .collect()
}

/// The gateway's faults, as the table sets them, drawn from `seed`.
pub(crate) fn gateway_faults(seed: u64) -> fakestripe::Faults {
    let mut faults = fakestripe::Faults::none();
    for kind in FAULTS {
        if let Injection::Gateway { set, .. } = kind.injection {
            set(&mut faults);
        }
    }
    faults.seed = Some(seed);
    faults
}

/// The proxies' faults, as the table sets them.
pub(crate) fn network_faults() -> ProxyFaults {
    let mut faults = ProxyFaults::default();
    for kind in FAULTS {
        if let Injection::Network { set, .. } = kind.injection {
            set(&mut faults);
        }
    }
    faults
}

/// The probability that a service's `COMMIT` is cut off from its answer.
pub(crate) fn commit_cut_probability() -> f64 {
    FAULTS
        .iter()
        .find_map(|kind| match kind.injection {
            Injection::CommitCut { probability } => Some(probability),
            _ => None,
        })
        .unwrap_or(0.0)
}

/// The service's crash points, as its `FAILPOINTS` setting names them.
pub(crate) fn crash_spec() -> String {
    FAULTS
        .iter()
        .filter_map(|kind| match kind.injection {
            Injection::Failpoint { point, probability } => Some(format!("{point}={probability}")),
            _ => None,
        })
        .collect::<Vec<_>>()
        .join(",")
}
