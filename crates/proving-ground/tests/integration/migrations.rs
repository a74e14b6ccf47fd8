//! Every migration of the three crates keeps to the rule for a live database
//! (docs/operations.md, "Migrations on a live database"):
//!
//! - it bounds its wait for a lock: a migration in a transaction starts with
//!   `SET LOCAL lock_timeout`; a `-- no-transaction` one holds a single statement (PostgreSQL runs
//!   the statements of one query string in one implicit transaction, where `CONCURRENTLY` is
//!   refused) and gets its bound from the migrating connection, which the entry points set;
//! - it rewrites no table under an exclusive lock: no new column with a volatile default or a
//!   stored generated value, no change of a column's type, no `SET NOT NULL`, no backfill of an
//!   existing table in the migration's own transaction;
//! - it builds indexes on existing tables `CONCURRENTLY`, in a `-- no-transaction` migration;
//! - it adds foreign keys and checks to existing tables `NOT VALID`, and validates them in a
//!   migration of their own; unique and primary keys come from an index built beforehand
//!   (`USING INDEX`).
//!
//! Migrations applied before the rule cannot change (sqlx refuses a database whose applied
//! migration's checksum differs from its file), so each is allowed, by name and rule, in
//! `HISTORICAL`, with the reason it is safe to keep: most are applied on a database that has them
//! ahead by an online plan of the same schema (the crate's `src/migrate/plans.rs`, Rocket Rides'
//! `src/db/online.rs`), the others are short or create what did not exist.

use std::path::{Path, PathBuf};

/// What a migration breaks: the rule's name, and the statement.
#[derive(Debug, PartialEq)]
struct Breach {
    rule: Rule,
    statement: String,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Rule {
    /// The first statement of a migration in a transaction is not `SET LOCAL lock_timeout`.
    NoLockTimeout,
    /// A `-- no-transaction` migration with several statements.
    SeveralStatementsWithoutTransaction,
    /// `CREATE INDEX` on an existing table without `CONCURRENTLY`, or `CONCURRENTLY` inside a
    /// transaction (where PostgreSQL refuses it).
    IndexNotConcurrent,
    /// `ADD COLUMN` whose default is volatile or generated, or that carries a check or a
    /// reference: the table is rewritten or scanned under the exclusive lock.
    AddColumnRewrites,
    /// `ALTER COLUMN … TYPE`: the table is rewritten under the exclusive lock.
    ColumnType,
    /// `ALTER COLUMN … SET NOT NULL`: the table is scanned under the exclusive lock.
    SetNotNull,
    /// `ADD CONSTRAINT` (or `ADD PRIMARY KEY`/`UNIQUE`) that checks or indexes the existing rows
    /// under the exclusive lock: a foreign key or check without `NOT VALID`, a key without
    /// `USING INDEX`.
    ConstraintValidated,
    /// `UPDATE`, `DELETE` or `INSERT … SELECT` of an existing table: a backfill in one
    /// transaction, holding its row locks to the end.
    Backfill,
}

/// Migrations applied by released versions before the rule, which cannot be edited: each with
/// the rules it breaks and why keeping it is safe, or what an operator must do.
const HISTORICAL: &[(&str, &[Rule], &str)] = &[
    (
        "idempotency/migrations/20261129000001_idempotency_keys.sql",
        &[Rule::NoLockTimeout],
        "creates the key table and its indexes: nothing exists yet to wait for or to lock",
    ),
    (
        "idempotency/migrations/20261129000002_completer_scan.sql",
        &[
            Rule::NoLockTimeout,
            Rule::AddColumnRewrites,
            Rule::IndexNotConcurrent,
        ],
        "the column's default is a constant (no rewrite, but its CHECK scans the key table) and \
         the partial index covers only the unfinished keys: runs from its file, measured well \
         under a second on 200,000 keys by rocket-rides' live_migration.rs",
    ),
    (
        "idempotency/migrations/20261130000001_request_uuid.sql",
        &[Rule::NoLockTimeout, Rule::AddColumnRewrites],
        "gen_random_uuid() as the default rewrites the key table under an exclusive lock: \
         migrate_with applies it by the crate's online plan (the column without the default, \
         the default for new rows, a backfill in batches, NOT NULL through a validated check)",
    ),
    (
        "idempotency/migrations/20261130000002_user_in_every_key.sql",
        &[Rule::NoLockTimeout, Rule::ConstraintValidated],
        "rebuilds the primary key under an exclusive lock: migrate_with builds both indexes \
         concurrently and swaps the constraints onto them (USING INDEX) in a short transaction",
    ),
    (
        "idempotency/migrations/20261130000003_hot_updates.sql",
        &[Rule::NoLockTimeout, Rule::IndexNotConcurrent],
        "copies the unfinished keys (few: keys finish in milliseconds) into a new table and \
         builds an index on created_at under a lock that blocks writes: runs from its file, \
         measured well under a second on 200,000 keys by rocket-rides' live_migration.rs",
    ),
    (
        "idempotency/migrations/20261202000001_owner_text.sql",
        &[Rule::ColumnType, Rule::ConstraintValidated],
        "turns the owner into text and checks its length, which rewrites the key table under an \
         exclusive lock: migrate_with applies it by the crate's online plan (a new text column \
         kept by a trigger and backfilled, its indexes built concurrently, swapped in by one \
         short transaction that drops user_id and renames the column)",
    ),
    (
        "rocket-rides/migrations/20261129100001_rocket_rides.sql",
        &[Rule::NoLockTimeout],
        "creates the service's tables: nothing exists yet to wait for",
    ),
    (
        "rocket-rides/migrations/20261129100002_ride_receipts.sql",
        &[Rule::NoLockTimeout],
        "creates a table whose reference to rides takes a short SHARE ROW EXCLUSIVE lock",
    ),
    (
        "rocket-rides/migrations/20261130100001_charge_reconciliation.sql",
        &[
            Rule::NoLockTimeout,
            Rule::Backfill,
            Rule::SetNotNull,
            Rule::ConstraintValidated,
            Rule::AddColumnRewrites,
        ],
        "updates every ride and validates constraints under one exclusive lock: rocket-rides \
         migrate applies it by its online plan (src/db/online.rs: columns without their \
         defaults, backfills in batches, checks NOT VALID then validated)",
    ),
    (
        "rocket-rides/migrations/20261130100002_user_in_every_key.sql",
        &[
            Rule::NoLockTimeout,
            Rule::ConstraintValidated,
            Rule::IndexNotConcurrent,
            Rule::Backfill,
            Rule::SetNotNull,
            Rule::AddColumnRewrites,
        ],
        "rebuilds the primary keys of rides, receipts, audit records and staged jobs, and fills \
         the staged jobs' owners, under exclusive locks: rocket-rides migrate applies it by its \
         online plan (indexes built concurrently, keys USING INDEX, references NOT VALID then \
         validated; the staged jobs, a handful in the outbox, as the file does)",
    ),
    (
        "rocket-rides/migrations/20261130100003_one_customer_per_user.sql",
        &[Rule::NoLockTimeout, Rule::ConstraintValidated],
        "a unique index on users, a small table",
    ),
    (
        "rocket-rides/migrations/20261130100004_no_single_column_key_index.sql",
        &[Rule::NoLockTimeout],
        "drops an index: an instant once the lock is taken, and the entry points bound the \
         wait for it",
    ),
    (
        "rocket-rides/migrations/20261202100001_key_owner_text.sql",
        &[Rule::Backfill, Rule::SetNotNull, Rule::ConstraintValidated],
        "fills and checks rides.key_owner under an exclusive lock: rocket-rides migrate applies \
         it by its online plan (a trigger fills new rows, a backfill in batches the old ones, \
         the check and the reference NOT VALID then validated)",
    ),
    (
        "fakestripe/migrations/20261129200001_fakestripe.sql",
        &[Rule::NoLockTimeout],
        "creates the gateway's tables: nothing exists yet to wait for",
    ),
    (
        "fakestripe/migrations/20261130200001_stripe_behaviour.sql",
        &[
            Rule::NoLockTimeout,
            Rule::ConstraintValidated,
            Rule::AddColumnRewrites,
        ],
        "a fake gateway for tests and demos, whose database is made anew for each run",
    ),
    (
        "fakestripe/migrations/20261130200002_account_in_key_reference.sql",
        &[Rule::NoLockTimeout, Rule::ConstraintValidated],
        "a fake gateway's: as above",
    ),
    (
        "fakestripe/migrations/20261202200001_key_owner_text.sql",
        &[Rule::Backfill, Rule::SetNotNull, Rule::ConstraintValidated],
        "a fake gateway's: as above",
    ),
];

#[test]
fn every_migration_keeps_the_rule_or_is_a_historical_one_allowed_by_name() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut broken = Vec::new();
    for file in migration_files(&crates) {
        let name = file
            .strip_prefix(&crates)
            .unwrap()
            .to_str()
            .unwrap()
            .to_owned();
        let allowed: &[Rule] = HISTORICAL
            .iter()
            .find(|(historical, _, _)| *historical == name)
            .map_or(&[], |(_, rules, _)| rules);
        for breach in check(&std::fs::read_to_string(&file).unwrap()) {
            if !allowed.contains(&breach.rule) {
                broken.push(format!(
                    "{name}: {:?} in `{}`",
                    breach.rule, breach.statement
                ));
            }
        }
    }
    assert!(
        broken.is_empty(),
        "migrations break the rule:\n{}",
        broken.join("\n")
    );
}

#[test]
fn every_historical_entry_names_a_file_and_a_rule_it_breaks() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    for (name, rules, _) in HISTORICAL {
        let breaches = check(&std::fs::read_to_string(crates.join(name)).unwrap());
        for rule in *rules {
            assert!(
                breaches.iter().any(|b| b.rule == *rule),
                "{name} is allowed {rule:?} but does not break it: drop it from HISTORICAL"
            );
        }
    }
}

fn migration_files(crates: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for dir in ["idempotency", "rocket-rides", "fakestripe"] {
        for entry in std::fs::read_dir(crates.join(dir).join("migrations")).unwrap() {
            files.push(entry.unwrap().path());
        }
    }
    assert!(
        files.len() > 3,
        "no migrations found under {}",
        crates.display()
    );
    files.sort();
    files
}

/// The breaches of the rule in one migration file.
fn check(sql: &str) -> Vec<Breach> {
    let in_transaction = !sql.starts_with("-- no-transaction");
    let statements = statements(sql);
    let created = created_tables(&statements);
    let mut breaches = Vec::new();
    let mut breach = |rule, statement: &str| {
        breaches.push(Breach {
            rule,
            statement: statement.to_owned(),
        })
    };
    if in_transaction {
        match statements.first() {
            Some(first) if first.starts_with("SET LOCAL LOCK_TIMEOUT") => {}
            first => breach(Rule::NoLockTimeout, first.map_or("", String::as_str)),
        }
    } else if statements.len() != 1 {
        breach(
            Rule::SeveralStatementsWithoutTransaction,
            &statements.join("; "),
        );
    }
    for statement in &statements {
        let target = target_table(statement);
        let existing = target.is_some_and(|t| !created.contains(&t));
        for rule in breaches_of(statement, in_transaction, existing) {
            breach(rule, statement);
        }
    }
    breaches
}

/// The rules one statement breaks; `existing`: it works on a table that this migration did not
/// create (which may hold rows).
fn breaches_of(s: &str, in_transaction: bool, existing: bool) -> Vec<Rule> {
    let mut rules = Vec::new();
    if s.starts_with("CREATE INDEX") || s.starts_with("CREATE UNIQUE INDEX") {
        let concurrent = s.contains(" CONCURRENTLY ");
        if (existing && !concurrent) || (concurrent && in_transaction) {
            rules.push(Rule::IndexNotConcurrent);
        }
    }
    if !existing {
        return rules;
    }
    if s.starts_with("ALTER TABLE") {
        for clause in clauses(s) {
            rules.extend(clause_breach(&clause));
        }
    }
    let backfill = s.starts_with("UPDATE ")
        || s.starts_with("DELETE ")
        || (s.starts_with("INSERT ") && s.contains(" SELECT "));
    if backfill {
        rules.push(Rule::Backfill);
    }
    rules.dedup();
    rules
}

/// Functions whose value differs from row to row: as a new column's default, they make
/// PostgreSQL write every row.
const VOLATILE: [&str; 7] = [
    "GEN_RANDOM_UUID(",
    "UUID_GENERATE_",
    "RANDOM(",
    "CLOCK_TIMESTAMP(",
    "TIMEOFDAY(",
    "NEXTVAL(",
    "TXID_CURRENT(",
];

fn clause_breach(clause: &str) -> Option<Rule> {
    let clause = clause.trim();
    if let Some(column) = clause.strip_prefix("ADD COLUMN ") {
        let rewrites = VOLATILE.iter().any(|f| column.contains(f))
            || column.contains(" GENERATED ALWAYS AS ")
            || column.contains("SERIAL")
            || column.contains(" CHECK ")
            || column.contains(" CHECK(")
            || column.contains(" REFERENCES ");
        return rewrites.then_some(Rule::AddColumnRewrites);
    }
    if clause.starts_with("ALTER COLUMN ") {
        if clause.contains(" TYPE ") {
            return Some(Rule::ColumnType);
        }
        if clause.ends_with(" SET NOT NULL") {
            return Some(Rule::SetNotNull);
        }
        return None;
    }
    if clause.starts_with("ADD CONSTRAINT ")
        || clause.starts_with("ADD PRIMARY KEY")
        || clause.starts_with("ADD UNIQUE")
        || clause.starts_with("ADD FOREIGN KEY")
        || clause.starts_with("ADD CHECK")
    {
        let checked = clause.contains(" FOREIGN KEY") || clause.contains(" CHECK");
        let keyed = clause.contains(" PRIMARY KEY") || clause.contains(" UNIQUE");
        let unsafe_check = checked && !clause.ends_with(" NOT VALID");
        let unsafe_key = keyed && !clause.contains(" USING INDEX ");
        return (unsafe_check || unsafe_key).then_some(Rule::ConstraintValidated);
    }
    None
}

/// The comma-separated clauses of an `ALTER TABLE`, split outside parentheses.
fn clauses(statement: &str) -> Vec<String> {
    // Past "ALTER TABLE [IF EXISTS] [ONLY] name ".
    let mut words = statement.split(' ').skip(2).peekable();
    while words
        .next_if(|w| matches!(*w, "IF" | "EXISTS" | "ONLY"))
        .is_some()
    {}
    let rest = words.skip(1).collect::<Vec<_>>().join(" ");
    let (mut depth, mut current, mut all) = (0_i32, String::new(), Vec::new());
    for c in rest.chars() {
        match c {
            '(' => depth += 1,
            ')' => depth -= 1,
            ',' if depth == 0 => {
                all.push(std::mem::take(&mut current).trim().to_owned());
                continue;
            }
            _ => {}
        }
        current.push(c);
    }
    all.push(current.trim().to_owned());
    all
}

/// The table a statement works on, lower-cased as written.
fn target_table(s: &str) -> Option<String> {
    let words: Vec<&str> = s.split(' ').collect();
    let after = |keyword: &str| {
        let at = words.iter().position(|w| *w == keyword)?;
        words[at + 1..]
            .iter()
            .find(|w| !matches!(**w, "IF" | "EXISTS" | "ONLY" | "NOT"))
            .map(|w| w.trim_end_matches('(').to_lowercase())
    };
    if s.starts_with("ALTER TABLE") {
        return after("TABLE");
    }
    if s.starts_with("CREATE INDEX") || s.starts_with("CREATE UNIQUE INDEX") {
        return after("ON");
    }
    if s.starts_with("UPDATE ") {
        return words.get(1).map(|w| w.to_lowercase());
    }
    if s.starts_with("DELETE ") || s.starts_with("INSERT ") {
        return after(if s.starts_with("DELETE") {
            "FROM"
        } else {
            "INTO"
        });
    }
    None
}

/// Tables this migration creates: empty, so nothing done to them can lock out traffic.
fn created_tables(statements: &[String]) -> Vec<String> {
    statements
        .iter()
        .filter(|s| s.starts_with("CREATE TABLE "))
        .filter_map(|s| {
            s.split(' ')
                .skip(2)
                .find(|w| !matches!(*w, "IF" | "NOT" | "EXISTS"))
                .map(|w| w.trim_end_matches('(').to_lowercase())
        })
        .collect()
}

/// The statements of a migration, comments removed, whitespace collapsed, upper-cased outside
/// string literals; the body of a `DO` block stays one statement.
fn statements(sql: &str) -> Vec<String> {
    let (mut statements, mut current) = (Vec::new(), String::new());
    let mut chars = sql.chars().peekable();
    let (mut quoted, mut dollar) = (false, false);
    while let Some(c) = chars.next() {
        match c {
            '\'' if !dollar => {
                quoted = !quoted;
                current.push(c);
            }
            '$' if !quoted && chars.peek() == Some(&'$') => {
                chars.next();
                dollar = !dollar;
                current.push_str("$$");
            }
            '-' if !quoted && chars.peek() == Some(&'-') => {
                for skipped in chars.by_ref() {
                    if skipped == '\n' {
                        break;
                    }
                }
                current.push(' ');
            }
            ';' if !quoted && !dollar => {
                statements.push(normalise(&current));
                current.clear();
            }
            _ if quoted => current.push(c),
            _ => current.extend(c.to_uppercase()),
        }
    }
    statements.push(normalise(&current));
    statements.retain(|s| !s.is_empty());
    statements
}

fn normalise(statement: &str) -> String {
    statement.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_checker_refuses_each_kind_of_unsafe_migration() {
    let cases: &[(&str, Rule)] = &[
        ("ALTER TABLE rides ADD COLUMN note TEXT;", Rule::NoLockTimeout),
        (
            "SET lock_timeout = '5s'; ALTER TABLE rides ADD COLUMN note TEXT;",
            Rule::NoLockTimeout,
        ),
        (
            "SET LOCAL lock_timeout = '5s';\nCREATE INDEX rides_note_idx ON rides (note);",
            Rule::IndexNotConcurrent,
        ),
        (
            "SET LOCAL lock_timeout = '5s';\nCREATE INDEX CONCURRENTLY rides_note_idx ON rides (note);",
            Rule::IndexNotConcurrent,
        ),
        (
            "-- no-transaction\nSET lock_timeout = '5s';\nCREATE INDEX CONCURRENTLY rides_note_idx ON rides (note);",
            Rule::SeveralStatementsWithoutTransaction,
        ),
        (
            "SET LOCAL lock_timeout = '5s';\nALTER TABLE idempotency_keys\n    ADD COLUMN request_uuid UUID NOT NULL DEFAULT gen_random_uuid();",
            Rule::AddColumnRewrites,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ADD COLUMN n INTEGER CHECK (n > 0);",
            Rule::AddColumnRewrites,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ALTER COLUMN amount_cents TYPE BIGINT;",
            Rule::ColumnType,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ALTER COLUMN note SET NOT NULL;",
            Rule::SetNotNull,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ADD CONSTRAINT c CHECK (amount_cents > 0);",
            Rule::ConstraintValidated,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ADD CONSTRAINT f FOREIGN KEY (user_id) REFERENCES users (id);",
            Rule::ConstraintValidated,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; ALTER TABLE audit_records ADD CONSTRAINT audit_records_pkey PRIMARY KEY (user_id, id);",
            Rule::ConstraintValidated,
        ),
        (
            "SET LOCAL lock_timeout = '5s'; UPDATE rides SET note = '';",
            Rule::Backfill,
        ),
    ];
    for (sql, rule) in cases {
        let found: Vec<Rule> = check(sql).into_iter().map(|b| b.rule).collect();
        assert!(
            found.contains(rule),
            "{rule:?} not found in {sql:?}: {found:?}"
        );
    }
}

#[test]
fn the_checker_accepts_migrations_written_to_the_rule() {
    let safe = [
        // A column without a default, a constant default, a stable one (now() is the
        // transaction's time, one value for every row: no rewrite).
        "SET LOCAL lock_timeout = '5s';\nALTER TABLE rides ADD COLUMN note TEXT, ADD COLUMN n INTEGER NOT NULL DEFAULT 0, ADD COLUMN at TIMESTAMPTZ DEFAULT now();",
        // A check and a foreign key added unchecked, validated apart.
        "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ADD CONSTRAINT c CHECK (n >= 0) NOT VALID, ADD CONSTRAINT f FOREIGN KEY (user_id) REFERENCES users (id) NOT VALID;",
        "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides VALIDATE CONSTRAINT c;",
        // An index built concurrently, alone in a migration without a transaction.
        "-- no-transaction\nCREATE INDEX CONCURRENTLY IF NOT EXISTS rides_note_idx ON rides (note);",
        // A key from an index built beforehand.
        "SET LOCAL lock_timeout = '5s'; ALTER TABLE rides ADD CONSTRAINT rides_pkey PRIMARY KEY USING INDEX rides_new_pkey;",
        // Anything on a table of its own creation.
        "SET LOCAL lock_timeout = '5s'; CREATE TABLE notes (id BIGINT PRIMARY KEY, body TEXT); CREATE INDEX notes_body_idx ON notes (body); ALTER TABLE notes ADD CONSTRAINT b CHECK (body <> '');",
        // A semicolon in a literal or a comment is no statement's end.
        "-- a comment; with a semicolon\nSET LOCAL lock_timeout = '5s'; COMMENT ON TABLE rides IS 'a; b';",
    ];
    for sql in safe {
        assert_eq!(check(sql), Vec::new(), "{sql}");
    }
}
