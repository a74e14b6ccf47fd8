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
            }
            message = control.recv() => {
                let _ = child.start_kill();
                let _ = child.wait().await;
                match message {
                    Some(Control::Kill) => recorder.fault(spec.kill_kind, 1),
                    Some(Control::Stop) | None => return,
                }
            }
        }
        tokio::select! {
            _ = tokio::time::sleep(spec.restart_delay) => {}
            message = control.recv() => match message {
                Some(Control::Kill) => {}
                Some(Control::Stop) | None => return,
            },
        }
    }
}
