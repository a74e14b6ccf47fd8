//! What the services' logs say of their leases: every renewal that found its lease taken over,
//! and every write made after it under the same key and fencing token by the same process; and,
//! for the leases the harness took over, whether their holder went on to a write after the call
//! it was in (the write the fence refused: its token had moved on). The library logs writes and
//! lost renewals on `idempotency::LEASE_LOG` (JSON lines, as the run configures them); a process
//! writes its log in order, so "after" is "further down its file".

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

/// What the logs say of the run's leases.
#[derive(Debug, Default)]
pub(crate) struct LeaseLog {
    /// Every renewal that found its lease taken over, and what its holder wrote after.
    pub lost: Vec<LostLease>,
    /// The leases the harness took over (key id, token) whose holder logged a write after the
    /// gateway call it was in when its lease was taken: the harness takes a lease only from a
    /// holder that renewed it during a call, so that write came after, under a token that had
    /// moved on, and the fence refused it. The holder found out there, not at a renewal: its
    /// call ended before its next beat.
    pub fenced: Vec<(i64, i64)>,
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

/// Reads every process log (`*.log`) in the run's directory; `stolen` are the leases the harness
/// took over (key id, the holder's token). Lines that are not the services' JSON (a panic's
/// text, another target, a line torn by a kill) are passed over.
pub(crate) fn read(dir: &Path, stolen: &[(i64, i64)]) -> anyhow::Result<LeaseLog> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .with_context(|| format!("read {}", dir.display()))?
        .filter_map(|entry| entry.ok()?.file_name().into_string().ok())
        .filter(|name| name.ends_with(".log"))
        .collect();
    names.sort();
    let mut log = LeaseLog::default();
    let mut after_call = HashMap::new();
    for name in names {
        let bytes = std::fs::read(dir.join(&name))
            .with_context(|| format!("read {}", dir.join(&name).display()))?;
        let scanned = scan(&name, &String::from_utf8_lossy(&bytes));
        log.lost.extend(scanned.lost);
        after_call.extend(scanned.after_call);
    }
    log.fenced = fenced(stolen, &after_call);
    Ok(log)
}

/// What one process's log says.
struct Scanned {
    lost: Vec<LostLease>,
    /// Per lease (key id, token) that made a call: the writes logged after its last call.
    after_call: HashMap<(i64, i64), Vec<String>>,
}

/// The leases of `stolen` whose holder logged a write after its last call.
fn fenced(stolen: &[(i64, i64)], after_call: &HashMap<(i64, i64), Vec<String>>) -> Vec<(i64, i64)> {
    stolen
        .iter()
        .filter(|lease| {
            after_call
                .get(lease)
                .is_some_and(|writes| !writes.is_empty())
        })
        .copied()
        .collect()
}

fn scan(log: &str, text: &str) -> Scanned {
    let mut lost: Vec<LostLease> = Vec::new();
    let mut by_lease: HashMap<(i64, i64), usize> = HashMap::new();
    let mut after_call: HashMap<(i64, i64), Vec<String>> = HashMap::new();
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
                if write == "call" {
                    after_call.insert((key_id, token), Vec::new());
                } else if let Some(writes) = after_call.get_mut(&(key_id, token)) {
                    writes.push(write.clone());
                }
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
    Scanned { lost, after_call }
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
        let lost = scan("api-0.log", &text).lost;
        assert_eq!(lost.len(), 2);
        assert_eq!((lost[0].key_id, lost[0].token), (7, 1));
        assert!(lost[0].writes_after.is_empty(), "{lost:?}");
        assert_eq!((lost[1].key_id, lost[1].token), (9, 4));
        assert_eq!(lost[1].writes_after, ["phase"]);
        assert_eq!(lost[1].log, "api-0.log");
    }

    #[test]
    fn a_stolen_leases_write_after_its_call_is_found_and_nothing_else_is() {
        let text = [
            // Key 7, token 1: a call, then a phase (the fence refused it: the lease was stolen).
            line(7, 1, Some("phase")),
            line(7, 1, Some("call")),
            line(7, 1, Some("phase")),
            // Key 8, token 2: stolen during its call, and its holder wrote nothing after (killed).
            line(8, 2, Some("phase")),
            line(8, 2, Some("call")),
            // Key 9, token 4: a write after its call, but its lease was never stolen.
            line(9, 4, Some("call")),
            line(9, 4, Some("final_phase")),
            // Key 10, token 5: stolen, but it never made a call: nothing to go on.
            line(10, 5, Some("phase")),
        ]
        .join("\n");
        let scanned = scan("api-1.log", &text);
        assert!(scanned.lost.is_empty());
        let stolen = [(7, 1), (8, 2), (10, 5)];
        assert_eq!(fenced(&stolen, &scanned.after_call), [(7, 1)]);
        // Another token of key 7 (another holder) is not the stolen one.
        assert!(fenced(&[(7, 2)], &scanned.after_call).is_empty());
    }
}
