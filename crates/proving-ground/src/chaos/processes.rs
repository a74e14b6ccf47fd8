//! Child processes under supervision: started, killed on purpose, restarted, and told apart when
//! they crash at a failpoint (by exit code).

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::process::{Child, Command};
use tokio::sync::mpsc;

use super::recorder::Recorder;

/// What to run.
#[derive(Debug, Clone)]
pub(crate) struct ProcessSpec {
    /// `api-0`, `worker`: names the log file and the events.
    pub name: String,
    /// The fault kind recorded when the harness kills it (`kill_api`, `kill_worker`).
    pub kill_kind: &'static str,
    pub program: PathBuf,
    pub args: Vec<String>,
    pub env: Vec<(String, String)>,
    pub log: PathBuf,
    /// Pause before a restart, as an orchestrator would take.
    pub restart_delay: Duration,
}

enum Control {
    Kill,
    Pause(Duration),
    Stop,
}

/// A supervised process: it runs, and comes back after every death until stopped.
pub(crate) struct Supervised {
    control: mpsc::UnboundedSender<Control>,
    task: tokio::task::JoinHandle<()>,
}

impl Supervised {
    pub(crate) fn start(spec: ProcessSpec, recorder: Recorder) -> Self {
        let (control, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(supervise(spec, rx, recorder));
        Self { control, task }
    }

    /// SIGKILL now; it restarts after its delay.
    pub(crate) fn kill(&self) {
        let _ = self.control.send(Control::Kill);
    }

    /// SIGSTOP now, SIGCONT `how_long` later, as a long garbage collection or a frozen virtual
    /// machine would: the process holds its leases and connections and does nothing. Kills
    /// meanwhile are not carried out (one paused process is the fault, not a dead one).
    pub(crate) fn pause(&self, how_long: Duration) {
        let _ = self.control.send(Control::Pause(how_long));
    }

    /// SIGKILL and no restart.
    pub(crate) async fn stop(self) {
        let _ = self.control.send(Control::Stop);
        let _ = self.task.await;
    }
}

/// Starts the `generation`-th life of the process. Its failpoint seed differs per life: with the
/// same seed, a restarted process would redo the same work, draw the same numbers and crash at
/// the same place again, forever.
fn spawn(spec: &ProcessSpec, generation: u64) -> std::io::Result<Child> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(&spec.log)?;
    let env = spec.env.iter().map(|(key, value)| {
        let value = match (key.as_str(), value.parse::<u64>()) {
            (rocket_rides::failpoints::FAILPOINT_SEED_ENV, Ok(seed)) => {
                seed.wrapping_add(generation).to_string()
            }
            _ => value.clone(),
        };
        (key, value)
    });
    Command::new(&spec.program)
        .args(&spec.args)
        .envs(env)
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        .kill_on_drop(true)
        .spawn()
}

async fn supervise(
    spec: ProcessSpec,
    mut control: mpsc::UnboundedReceiver<Control>,
    recorder: Recorder,
) {
    // A pause asked for while the process was dead waits for its next life.
    let mut pending_pause = None;
    for generation in 0.. {
        let mut child = match spawn(&spec, generation) {
            Ok(child) => child,
            Err(e) => {
                // Counted as an unexpected exit, so that the audit fails rather than passing
                // over a process that never ran.
                tracing::error!(name = %spec.name, error = %e, "cannot start process");
                recorder.unexpected_exit();
                return;
            }
        };
        if let Some(how_long) = pending_pause.take() {
            if !pause(&spec, &mut child, how_long, &mut control, &recorder).await {
                let _ = child.start_kill();
                let _ = child.wait().await;
                return;
            }
        }
        let stop = loop {
            tokio::select! {
                status = child.wait() => {
                    let code = status.ok().and_then(|s| s.code());
                    match code.and_then(rocket_rides::failpoints::point_of_exit_code) {
                        Some(point) => recorder.fault(&format!("crash_{point}"), 1),
                        None => {
                            tracing::warn!(name = %spec.name, ?code, "process exited on its own");
                            recorder.unexpected_exit();
                        }
                    }
                    break false;
                }
                message = control.recv() => match message {
                    Some(Control::Pause(how_long)) => {
                        if !pause(&spec, &mut child, how_long, &mut control, &recorder).await {
                            break true;
                        }
                    }
                    Some(Control::Kill) => {
                        let _ = child.start_kill();
                        let _ = child.wait().await;
                        recorder.fault(spec.kill_kind, 1);
                        break false;
                    }
                    Some(Control::Stop) | None => break true,
                },
            }
        };
        if stop {
            let _ = child.start_kill();
            let _ = child.wait().await;
            return;
        }
        let delay = tokio::time::sleep(spec.restart_delay);
        tokio::pin!(delay);
        loop {
            tokio::select! {
                _ = &mut delay => break,
                message = control.recv() => match message {
                    // Nothing runs to kill.
                    Some(Control::Kill) => {}
                    Some(Control::Pause(how_long)) => pending_pause = Some(how_long),
                    Some(Control::Stop) | None => return,
                },
            }
        }
    }
}

/// Stops `child` for `how_long` and lets it go on; false when told to stop meanwhile. Kills and
/// pauses that arrive meanwhile are dropped. The pause counts once the process goes on: one cut
/// short by the end of the run tested nothing.
async fn pause(
    spec: &ProcessSpec,
    child: &mut Child,
    how_long: Duration,
    control: &mut mpsc::UnboundedReceiver<Control>,
    recorder: &Recorder,
) -> bool {
    let Some(pid) = child.id() else {
        return true;
    };
    if let Err(e) = signal(pid, "STOP").await {
        tracing::error!(name = %spec.name, error = %e, "cannot pause process");
        recorder.unexpected_exit();
        return true;
    }
    let deadline = tokio::time::Instant::now() + how_long;
    let go_on = loop {
        tokio::select! {
            _ = tokio::time::sleep_until(deadline) => break true,
            message = control.recv() => match message {
                Some(Control::Kill | Control::Pause(_)) => {}
                Some(Control::Stop) | None => break false,
            },
        }
    };
    match signal(pid, "CONT").await {
        Ok(()) if go_on => recorder.fault(PAUSE_KIND, 1),
        Ok(()) => {}
        Err(e) => {
            tracing::error!(name = %spec.name, error = %e, "cannot resume process");
            recorder.unexpected_exit();
        }
    }
    go_on
}

/// The fault kind of a pause.
pub(crate) const PAUSE_KIND: &str = "pause_api";

/// Sends `signal` (`STOP`, `CONT`, `KILL`) to a process of ours, or to a server of the run's
/// PostgreSQL (which runs as us, or as `postgres` when we are root).
pub(crate) async fn signal(pid: u32, signal: &str) -> anyhow::Result<()> {
    let status = Command::new("/bin/sh")
        .args([
            "-c",
            &format!("kill -s {signal} \"$1\""),
            "sh",
            &pid.to_string(),
        ])
        .stdin(Stdio::null())
        .status()
        .await?;
    anyhow::ensure!(status.success(), "kill -s {signal} {pid}: {status}");
    Ok(())
}
