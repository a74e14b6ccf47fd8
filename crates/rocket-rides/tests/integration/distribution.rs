//! Ready to be distributed by user (docs/scaling.md): every statement the library and the
//! service send to the keys, rides, audit records, staged jobs and receipts names its user, and
//! every unique index of those tables includes it: the library's key tables by their `owner`,
//! the service's tables by `key_owner` (the same text, `user_id::text`) in their statements, and
//! by `user_id` or `key_owner` in their keys.
//!
//! The statements are read from the crates' source: every string literal that touches one of
//! the tables is checked. A statement that reads across users on purpose (a maintenance scan of
//! candidates, an operator's listing) says so with an `-- all users:` comment, and must then be
//! a plain read: no write, no row lock.

use std::path::{Path, PathBuf};

use sqlx::PgPool;

const TABLES: [&str; 6] = [
    "idempotency_keys",
    "idempotency_keys_unfinished",
    "rides",
    "audit_records",
    "staged_jobs",
    "ride_receipts",
];

/// The column that names a table's user, and distributes it on Citus: the key's owner on the
/// library's key tables, the same text in `key_owner` on the service's (`user_id::text`).
pub(super) fn owner_column(table: &str) -> &'static str {
    if table.starts_with("idempotency_keys") {
        "owner"
    } else {
        "key_owner"
    }
}

/// The marker of a statement that reads across users on purpose.
pub(super) const ALL_USERS: &str = "-- all users:";

/// Unique indexes that do not include user_id, each for a reason docs/scaling.md gives.
const UNIQUE_WITHOUT_USER: [&str; 1] = [
    // "A charge is recorded on at most one ride": kept across users by the database itself.
    // (The library's UNIQUE (id) is dropped by this application's migrations, which reference
    // (owner, id) only.)
    "rides_charge_id_key",
];

/// Every string literal of a Rust source, comments and char literals skipped.
pub(super) fn string_literals(source: &str) -> Vec<String> {
    let chars: Vec<char> = source.chars().collect();
    let (mut i, mut found) = (0, Vec::new());
    while i < chars.len() {
        match chars[i] {
            '/' if chars.get(i + 1) == Some(&'/') => {
                while i < chars.len() && chars[i] != '\n' {
                    i += 1;
                }
            }
            '/' if chars.get(i + 1) == Some(&'*') => {
                i += 2;
                while i + 1 < chars.len() && !(chars[i] == '*' && chars[i + 1] == '/') {
                    i += 1;
                }
                i += 2;
            }
            '\'' => {
                // A char literal ('x', '\n', '"') or a lifetime ('a).
                if chars.get(i + 1) == Some(&'\\') {
                    i += 2;
                    while i < chars.len() && chars[i] != '\'' {
                        i += 1;
                    }
                    i += 1;
                } else if chars.get(i + 2) == Some(&'\'') {
                    i += 3;
                } else {
                    i += 1;
                }
            }
            'r' if matches!(chars.get(i + 1), Some('#' | '"'))
                && (i == 0 || !chars[i - 1].is_alphanumeric()) =>
            {
                let mut hashes = 0;
                let mut j = i + 1;
                while chars.get(j) == Some(&'#') {
                    hashes += 1;
                    j += 1;
                }
                if chars.get(j) != Some(&'"') {
                    i += 1;
                    continue;
                }
                let start = j + 1;
                let mut k = start;
                loop {
                    if k >= chars.len() {
                        break;
                    }
                    if chars[k] == '"' && (0..hashes).all(|h| chars.get(k + 1 + h) == Some(&'#')) {
                        break;
                    }
                    k += 1;
                }
                found.push(chars[start..k.min(chars.len())].iter().collect());
                i = k + 1 + hashes;
            }
            '"' => {
                let mut literal = String::new();
                i += 1;
                while i < chars.len() && chars[i] != '"' {
                    if chars[i] == '\\' {
                        i += 1;
                    }
                    if let Some(c) = chars.get(i) {
                        literal.push(*c);
                    }
                    i += 1;
                }
                found.push(literal);
                i += 1;
            }
            _ => i += 1,
        }
    }
    found
}

pub(super) fn rust_files(dir: &Path, into: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            rust_files(&path, into);
        } else if path.extension().is_some_and(|e| e == "rs") && !is_migration_plan(&path) {
            into.push(path);
        }
    }
}

/// The online plans of migrations (the crate's and the service's): migrations, like the `.sql`
/// files this check does not read, whose backfills go over every user's rows by design.
fn is_migration_plan(path: &Path) -> bool {
    path.ends_with("src/migrate/plans.rs") || path.ends_with("src/db/online.rs")
}

/// The table a statement touches, if it is one of ours.
pub(super) fn touched_table(sql: &str) -> Option<&'static str> {
    let words: Vec<String> = sql
        .split(|c: char| !(c.is_alphanumeric() || c == '_'))
        .filter(|w| !w.is_empty())
        .map(str::to_ascii_lowercase)
        .collect();
    words.windows(2).find_map(|pair| {
        let verb = matches!(pair[0].as_str(), "from" | "into" | "update" | "join");
        TABLES.iter().copied().find(|t| verb && pair[1] == *t)
    })
}

/// What is wrong with a statement on one of the tables, if anything.
fn violation(sql: &str) -> Option<String> {
    // What the statement does, its SQL comments left out.
    let code: String = sql
        .lines()
        .map(|line| line.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n");
    let upper = code.to_ascii_uppercase();
    let writes = ["INSERT", "UPDATE ", "DELETE", "FOR UPDATE"]
        .iter()
        .any(|w| upper.contains(w));
    if sql.contains(ALL_USERS) {
        return writes.then(|| "reads across users but writes or locks".to_owned());
    }
    let lower = code.to_ascii_lowercase();
    let column = owner_column(touched_table(sql)?);
    let filters = [" = ", "=", " in"]
        .iter()
        .any(|op| lower.contains(&format!("{column}{op}")));
    let inserts_owner = upper.contains("INSERT") && lower.contains(column);
    (!filters && !inserts_owner).then(|| "does not name its user".to_owned())
}

#[test]
fn every_statement_on_the_distributed_tables_names_its_user() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in ["idempotency", "rocket-rides"] {
        rust_files(&crates.join(krate).join("src"), &mut files);
    }
    let mut checked = 0;
    let mut across_users = 0;
    let mut wrong = Vec::new();
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        for sql in string_literals(&source) {
            if touched_table(&sql).is_none() {
                continue;
            }
            checked += 1;
            across_users += usize::from(sql.contains(ALL_USERS));
            if let Some(why) = violation(&sql) {
                wrong.push(format!("{}: {why}:\n{sql}", file.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    // The reader found the statements it is meant to check: not a test that cannot fail.
    assert!(checked >= 30, "only {checked} statements found");
    assert!(
        (1..=8).contains(&across_users),
        "{across_users} cross-user reads"
    );
}

#[test]
fn the_checker_catches_a_statement_without_its_user() {
    assert_eq!(
        touched_table("SELECT id FROM rides WHERE id = $1"),
        Some("rides")
    );
    assert!(violation("SELECT id FROM rides WHERE id = $1").is_some());
    assert!(violation("UPDATE rides SET status = 'paid' WHERE id = $1").is_some());
    assert!(violation("-- all users: a scan\nDELETE FROM staged_jobs WHERE id = $1").is_some());
    assert!(violation("-- all users: a scan\nSELECT id FROM rides FOR UPDATE").is_some());
    assert!(violation("SELECT id FROM rides WHERE key_owner = $1 AND id = $2").is_none());
    // The service's tables name their user by key_owner, the column that distributes them.
    assert!(violation("SELECT id FROM rides WHERE user_id = $1 AND id = $2").is_some());
    assert!(violation(
        "INSERT INTO audit_records (user_id, key_owner, action) VALUES ($1, $2, $3)"
    )
    .is_none());
    assert!(violation("INSERT INTO audit_records (user_id, action) VALUES ($1, $2)").is_some());
    // The key tables name their user as the key's owner; user_id there is no filter.
    assert!(violation("SELECT id FROM idempotency_keys WHERE owner = $1 AND id = $2").is_none());
    assert!(violation("SELECT id FROM idempotency_keys WHERE user_id = $1 AND id = $2").is_some());
    assert!(touched_table("SELECT id FROM users WHERE api_key_hash = $1").is_none());
    let literals = string_literals("let c = '\"'; // \"not sql\"\nlet s = r#\"a \"b\" c\"#;");
    assert_eq!(literals, vec!["a \"b\" c".to_owned()]);
}

#[sqlx::test(migrations = false)]
async fn every_unique_index_of_the_distributed_tables_includes_its_user(pool: PgPool) {
    rocket_rides::db::migrate(&pool).await.unwrap();
    let indexes: Vec<(String, String, Vec<String>)> = sqlx::query_as(
        "SELECT t.relname::text, i.relname::text,
                array_agg(a.attname::text ORDER BY a.attnum)
         FROM pg_index x
         JOIN pg_class i ON i.oid = x.indexrelid
         JOIN pg_class t ON t.oid = x.indrelid
         JOIN pg_namespace n ON n.oid = t.relnamespace AND n.nspname = current_schema()
         JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = ANY(x.indkey)
         WHERE x.indisunique AND t.relname = ANY($1)
         GROUP BY t.relname, i.relname",
    )
    .bind(&TABLES[..])
    .fetch_all(&pool)
    .await
    .unwrap();
    assert!(indexes.len() >= 8, "{indexes:?}");
    for (table, index, columns) in &indexes {
        if UNIQUE_WITHOUT_USER.contains(&index.as_str()) {
            continue;
        }
        // On one PostgreSQL the service's keys name the user by user_id, which each table's
        // check holds equal to key_owner; `distribute` puts key_owner in its place
        // (citus_rules.rs checks that layout).
        let column = owner_column(table);
        assert!(
            columns.iter().any(|c| c == column || c == "user_id"),
            "{table}.{index} ({columns:?}) does not include {column}"
        );
    }
    for exception in UNIQUE_WITHOUT_USER {
        assert!(
            indexes.iter().any(|(_, index, _)| index == exception),
            "the exception {exception} no longer exists: remove it from the list"
        );
    }
}
