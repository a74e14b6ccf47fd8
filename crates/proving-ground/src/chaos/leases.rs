//! What the services' logs say of their leases: every renewal that found its lease taken over,
//! and every write made after it under the same key and fencing token by the same process. The
//! library logs both on `idempotency::LEASE_LOG` (JSON lines, as the run configures
//! them); a process writes its log in order, so "after" is "further down its file".

use std::collections::HashMap;
use std::path::Path;

use anyhow::Context;
use serde::Deserialize;

/// A renewal that lost its lease, and what its holder wrote afterwards (nothing, if it stopped).
#[derive(Debug)]
pub(crate) struct LostLease {
    /// The log it was found in (`api-1.log`).
    pub log: String,
    pub key_id: i64,
    pub token: i64,
    /// The writes (`phase`, `final_phase`, `call`, `release`, `abandon`) logged under the lost key
    /// and token after the loss: each was about to be made.
    pub writes_after: Vec<String>,
}

#[derive(Deserialize)]
struct Line {
    target: String,
    fields: Fields,
}

#[derive(Deserialize)]
struct Fields {
    key_id: Option<i64>,
    token: Option<i64>,
    write: Option<String>,
    #[serde(default)]
    lost_on_renewal: bool,
}

/// Reads every process log (`*.log`) in the run's directory. Lines that are not the services'
/// JSON (a panic's text, another target, a line torn by a kill) are passed over.
pub(crate) fn read(dir: &Path) -> anyhow::Result<Vec<LostLease>> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.ends_with(".log"))
        .collect();
    names.sort();
    let mut lost = Vec::new();
    for name in names {
        let bytes = std::fs::read(dir.join(&name))
            .with_context(|| format!("read {}", dir.join(&name).display()))?;
        lost.extend(scan(&name, &String::from_utf8_lossy(&bytes)));
    }
    Ok(lost)
}

fn scan(log: &str, text: &str) -> Vec<LostLease> {
    let mut lost: Vec<LostLease> = Vec::new();
    let mut by_lease: HashMap<(i64, i64), usize> = HashMap::new();
    for line in text.lines() {
        let Ok(line) = serde_json::from_str::<Line>(line) else {
            continue;
        };
        if line.target != idempotency::LEASE_LOG {
            continue;
        }
        let (Some(key_id), Some(token)) = (line.fields.key_id, line.fields.token) else {
            continue;
        };
        match line.fields.write {
            Some(write) => {
                if let Some(&i) = by_lease.get(&(key_id, token)) {
                    lost[i].writes_after.push(write);
                }
            }
            None if line.fields.lost_on_renewal => {
                by_lease.insert((key_id, token), lost.len());
                lost.push(LostLease {
                    log: log.to_owned(),
                    key_id,
                    token,
                    writes_after: Vec::new(),
                });
            }
            None => {}
        }
    }
    lost
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line as the services' JSON formatter writes it: a write when `write` is given, else a
    /// lost renewal.
    fn line(key_id: i64, token: i64, write: Option<&str>) -> String {
        let mut fields = serde_json::json!({ "message": "…", "key_id": key_id, "token": token });
        match write {
            Some(write) => fields["write"] = write.into(),
            None => fields["lost_on_renewal"] = true.into(),
        }
        serde_json::json!({
            "timestamp": "2026-11-30T17:00:00Z",
            "level": "DEBUG",
            "target": idempotency::LEASE_LOG,
            "fields": fields,
        })
        .to_string()
    }

    #[test]
    fn a_write_after_the_loss_under_the_same_lease_is_found_and_others_are_not() {
        let text = [
            line(7, 1, Some("call")),
            line(7, 1, None),
            "thread 'main' panicked: not json".to_owned(),
            // Another holder of the key, with its own token: not the lost holder's write.
            line(7, 2, Some("phase")),
            line(9, 4, None),
            line(9, 4, Some("phase")),
        ]
        .join("\n");
        let lost = scan("api-0.log", &text);
        assert_eq!(lost.len(), 2);
        assert_eq!((lost[0].key_id, lost[0].token), (7, 1));
        assert!(lost[0].writes_after.is_empty(), "{lost:?}");
        assert_eq!((lost[1].key_id, lost[1].token), (9, 4));
        assert_eq!(lost[1].writes_after, ["phase"]);
        assert_eq!(lost[1].log, "api-0.log");
    }
}
