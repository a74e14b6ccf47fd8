//! A PgBouncer in transaction pooling, started by `scripts/pgbouncer.sh` in front of a server
//! and stopped when dropped: the benchmark's pooled scenarios and `chaos --pooler pgbouncer`
//! run the service behind one.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::Context;

/// `scripts/pgbouncer.sh` of the source tree this program was built from.
pub(crate) const DEFAULT_SCRIPT: &str =
    concat!(env!("CARGO_MANIFEST_DIR"), "/../../scripts/pgbouncer.sh");

/// A running PgBouncer, stopped on every way out of its owner (errors and panics included).
pub(crate) struct PgBouncer {
    script: PathBuf,
    /// `postgres://user@127.0.0.1:port/database`: any database name works through it.
    url: String,
    /// Who started it, for the messages (`bench`, `chaos`).
    program: &'static str,
}

impl PgBouncer {
    /// Runs `script` in front of the server of `server_url`; `advice` says what to do when it
    /// cannot start. The script's own messages go to stderr.
    pub(crate) fn start(
        program: &'static str,
        script: &Path,
        server_url: &str,
        advice: &str,
    ) -> anyhow::Result<Self> {
        let output = Command::new(script)
            .arg(server_url)
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .with_context(|| format!("run {}: {advice}", script.display()))?;
        let url = String::from_utf8_lossy(&output.stdout).trim().to_owned();
        anyhow::ensure!(
            output.status.success() && !url.is_empty(),
            "{} could not start a PgBouncer ({}; its messages are above): {advice}",
            script.display(),
            output.status
        );
        eprintln!("{program}: PgBouncer in transaction pooling at {url}");
        Ok(Self {
            script: script.to_owned(),
            url,
            program,
        })
    }

    pub(crate) fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let stopped = Command::new(&self.script)
            .args(["--stop", &self.url])
            .stdin(Stdio::null())
            .status();
        if !matches!(stopped, Ok(status) if status.success()) {
            eprintln!(
                "{}: could not stop the PgBouncer at {}",
                self.program, self.url
            );
        }
    }
}
