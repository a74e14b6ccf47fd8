//! What the migration tests share: the crate's migrations as an earlier version held them.

use sqlx::migrate::Migrator;

/// A migrator over a temporary directory holding the files of `dir` (under the crate) whose
/// versions are below `below`, plus `extra` (file name, contents): what an earlier version of
/// the crate, or of an application, held.
pub(crate) async fn migrator_of(dir: &str, below: i64, extra: &[(&str, &str)]) -> Migrator {
    let from = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(dir);
    let to = std::env::temp_dir().join(format!(
        "idempotency-migrations-{}-{}",
        std::process::id(),
        idempotency::Uuid::new_v4()
    ));
    std::fs::create_dir_all(&to).unwrap();
    for entry in std::fs::read_dir(&from).unwrap() {
        let name = entry.unwrap().file_name();
        let version: i64 = name.to_str().unwrap()[..14].parse().unwrap();
        if version < below {
            std::fs::copy(from.join(&name), to.join(&name)).unwrap();
        }
    }
    for (name, sql) in extra {
        std::fs::write(to.join(name), sql).unwrap();
    }
    let migrator = Migrator::new(to.as_path()).await.unwrap();
    std::fs::remove_dir_all(&to).unwrap();
    migrator
}
