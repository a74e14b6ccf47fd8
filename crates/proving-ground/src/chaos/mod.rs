//! `chaos`: starts the real programs, sends payments through them while killing and
//! cutting them, then proves from the databases and the clients' records that every invariant
//! held.
//!
//! ```text
//!  clients ──proxy──► api-0 ┐                       ┌─ fakestripe (in-process, faults on)
//!  clients ──proxy──► api-1 ├─proxy─► gateway ──────┘    its database on DATABASE_URL's server
//!  clients ──proxy──► api-2 ┘        (network faults, per connection and per response)
//!             worker (completer, drain, reaper)
//!  api-i, worker ──PgProxy (cuts after COMMIT)──► the run's own PostgreSQL cluster
//!                                                  (pg_terminate_backend, crash and restart;
//!                                                   --failover: a synchronous standby, promoted;
//!                                                   --ha patroni: HAProxy → the Patroni leader)
//!  killers: SIGKILL api-i / worker at random · failpoints: crash at exact points (exit codes)
//! ```
//!
//! The run: a PostgreSQL cluster of its own for the service (see [`postgres`]), a fresh database
//! for the gateway, K API processes and a worker (the `rocket-rides` binary, built with
//! failpoints), users (some with declining cards), C clients sending N requests with fresh keys,
//! every fault on. Then the faults stop, a calm worker finishes what was abandoned, every request
//! is asked once more (the replay must equal the first answer), and the auditor checks the
//! invariants, one of which is that every configured fault kind was injected. The exit status is
//! 0 only if all of them hold.
//!
//! | file | what it holds |
//! |---|---|
//! | [`options`] | the options, the fault families and the protections `--without` takes away |
//! | [`stack`] | the stack's start, and the context every task shares |
//! | [`services`] | the service's processes: settings, crash points, sabotage switches |
//! | [`faults`] | the table of fault kinds, the sampler, and a file per family's tasks |
//! | [`scenario`] | the phases: requests, calm, late questions, audit and report |
//! | [`audit`] | the invariants, one function each |
//! | [`patroni`] | `--ha patroni`: the database in a Patroni cluster behind HAProxy |

mod audit;
mod clients;
mod cluster;
mod faults;
pub mod html;
mod intermediary;
mod leases;
mod options;
mod patroni;
mod pgproxy;
mod postgres;
mod processes;
pub mod proxy;
mod recorder;
pub mod report;
mod scenario;
mod services;
mod stack;
mod straddle;

use anyhow::Context;
use rand::rngs::StdRng;
use rand::SeedableRng;

pub use self::options::{ChaosArgs, FaultFamily, Ha, Sabotage};
use self::report::Report;
use self::stack::Stack;

/// Runs the scenario and returns its report; `report.passed` says whether every invariant held.
pub async fn run(args: ChaosArgs) -> anyhow::Result<Report> {
    let seed = args.seed.unwrap_or_else(|| {
        use rand::TryRngCore;
        // A fresh seed from the OS, printed below so that the run can be repeated.
        rand::rngs::OsRng
            .try_next_u64()
            .expect("the OS random generator works")
    });
    let rng = StdRng::seed_from_u64(seed);
    let started_at = time::OffsetDateTime::now_utc();
    args.check()?;
    // Checked before anything starts: a build without failpoints would ignore them.
    let program = services::service_binary(args.service_bin.as_deref())?;
    // The process id too: two runs with one seed may start within the same second.
    let run_name = format!(
        "chaos-{}-{seed}-{}",
        started_at.unix_timestamp(),
        std::process::id()
    );
    let dir = args.report_dir.join(&run_name);
    std::fs::create_dir_all(&dir).with_context(|| format!("create {}", dir.display()))?;
    eprintln!(
        "chaos: seed {seed}, {} requests, {} clients, {} API processes; reports in {}",
        args.requests,
        args.concurrency,
        args.api_instances,
        dir.display()
    );

    let (stack, cast, teardown) = Stack::start(args, program, &run_name, &dir, rng).await?;
    let spared = cast.straddlers.iter().map(|(user, _)| user.id).collect();
    let fault_tasks = faults::tasks::start(&stack, &cast.users, spared).await?;
    let mut sent = scenario::send(&stack, cast, seed).await?;
    let calm = scenario::calm(stack, fault_tasks, &mut sent).await?;
    scenario::audit_and_report(calm, sent, seed, started_at, &dir, teardown).await
}

/// Exit status of `chaos`: the table is printed, and failure is an error.
pub async fn run_and_print(args: ChaosArgs) -> anyhow::Result<()> {
    let report = run(args).await?;
    println!("{}", report.table());
    anyhow::ensure!(report.passed, "the audit failed: see the invariants above");
    Ok(())
}
