//! The statements Citus can route (docs/scaling.md, "The rules"): every statement the library
//! and the service send is read from their source, as in `distribution.rs`, and each that
//! changes rows of a distributed table (an `UPDATE` or a `DELETE`, in a CTE too) is checked
//! against what Citus's planner refuses or cannot address to one shard:
//!
//! 1. no non-immutable function inside `COALESCE` or `CASE` ("non-IMMUTABLE functions are not
//!    allowed in CASE or COALESCE statements"): the time is `$now` bare, never
//!    `coalesce($n, now())`;
//! 2. no stable function applied to a column ("STABLE functions used in UPDATE queries cannot be
//!    called with column references"): `col - interval …`, `date_trunc(…, col)`;
//! 3. the distribution column compared with a parameter in its `WHERE`, so that Citus prunes the
//!    statement to one shard: a join through a CTE (`u.owner = f.owner`) is not enough, Citus
//!    sends that to every shard. On the service's tables that column is `key_owner`;
//! 4. at most one `INSERT` into a distributed table per statement: Citus plans a second one (an
//!    `INSERT` CTE beside another) as a subplan whose rows go through the coordinator to every
//!    worker, a multi-node commit for one user's rows. Each insert is a statement of its own, in
//!    the same transaction.

use std::path::Path;

use super::distribution::{owner_column, rust_files, string_literals, touched_table, ALL_USERS};

/// Functions and markers that are not immutable: `$now` is `now()` under the database's clock,
/// and `interval` arithmetic on a `timestamptz` is stable (it depends on the time zone).
const NOT_IMMUTABLE: [&str; 10] = [
    "now()",
    "$now",
    "current_timestamp",
    "clock_timestamp",
    "statement_timestamp",
    "transaction_timestamp",
    "random(",
    "nextval(",
    "gen_random_uuid(",
    "interval",
];

/// Stable functions that must not take a column in a modification.
const STABLE_FUNCTIONS: [&str; 6] = [
    "date_trunc(",
    "to_char(",
    "age(",
    "extract(",
    "date_part(",
    "timezone(",
];

/// The tables distributed by owner, with the column Citus prunes by.
fn distribution_column(table: &str) -> &'static str {
    owner_column(table)
}

/// The statement's code, lower case, its SQL comments left out.
fn code_of(sql: &str) -> String {
    sql.lines()
        .map(|line| line.split("--").next().unwrap_or(""))
        .collect::<Vec<_>>()
        .join("\n")
        .to_ascii_lowercase()
}

fn words(code: &str) -> Vec<&str> {
    code.split(|c: char| !(c.is_alphanumeric() || c == '_' || c == '$'))
        .filter(|w| !w.is_empty())
        .collect()
}

/// The modifications in a statement: the table each `UPDATE t` or `DELETE FROM t` writes (not a
/// `SELECT … FOR UPDATE`), with the byte offset of its verb in `code`.
fn modifications(code: &str) -> Vec<(usize, String)> {
    let mut found = Vec::new();
    let mut tokens: Vec<(usize, &str)> = Vec::new();
    let mut start = None;
    for (i, c) in code
        .char_indices()
        .chain(std::iter::once((code.len(), ' ')))
    {
        let in_word = c.is_alphanumeric() || c == '_' || c == '$';
        match (in_word, start) {
            (true, None) => start = Some(i),
            (false, Some(s)) => {
                tokens.push((s, &code[s..i]));
                start = None;
            }
            _ => {}
        }
    }
    for (i, (at, word)) in tokens.iter().enumerate() {
        let previous = i.checked_sub(1).map(|p| tokens[p].1);
        let table = match *word {
            "update" if previous != Some("for") => tokens.get(i + 1),
            "delete" if tokens.get(i + 1).map(|t| t.1) == Some("from") => tokens.get(i + 2),
            _ => None,
        };
        if let Some((_, table)) = table {
            found.push((*at, (*table).to_owned()));
        }
    }
    found
}

/// The text between `open` (just past an opening parenthesis) and its closing one.
fn parenthesised(code: &str, open: usize) -> &str {
    let mut depth = 1;
    for (i, c) in code[open..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' => {
                depth -= 1;
                if depth == 0 {
                    return &code[open..open + i];
                }
            }
            _ => {}
        }
    }
    &code[open..]
}

/// Rule 1: the `COALESCE(…)` and `CASE … END` of `code` that hold a non-immutable function.
fn mutable_in_coalesce_or_case(code: &str) -> Option<String> {
    let mut spans = Vec::new();
    for (at, _) in code.match_indices("coalesce(") {
        spans.push(parenthesised(code, at + "coalesce(".len()).to_owned());
    }
    let w: Vec<&str> = words(code);
    if w.contains(&"case") {
        let start = code.find("case").unwrap_or(0);
        let end = code[start..].find(" end").map_or(code.len(), |e| start + e);
        spans.push(code[start..end].to_owned());
    }
    spans.into_iter().find_map(|span| {
        NOT_IMMUTABLE
            .iter()
            .find(|f| span.contains(*f))
            .map(|f| format!("{f} inside COALESCE or CASE ({span})"))
    })
}

/// Whether a word names a column: not a parameter, a number, a keyword or a function.
fn is_column(word: &str) -> bool {
    const NOT_COLUMNS: [&str; 14] = [
        "interval",
        "null",
        "true",
        "false",
        "and",
        "or",
        "not",
        "is",
        "set",
        "where",
        "from",
        "returning",
        "millisecond",
        "now",
    ];
    !word.starts_with('$')
        && !word.chars().next().is_some_and(|c| c.is_ascii_digit())
        && !NOT_COLUMNS.contains(&word)
}

/// Rule 2: a stable operation applied to a column: `col ± … interval …`, `… interval ± col`, or
/// a stable function with a column among its arguments.
fn stable_on_column(code: &str) -> Option<String> {
    for f in STABLE_FUNCTIONS {
        for (at, _) in code.match_indices(f) {
            let args = parenthesised(code, at + f.len());
            if words(args).iter().any(|w| is_column(w) && *w != "epoch") {
                return Some(format!("{f}…) on a column"));
            }
        }
    }
    // Each `+` or `-` between two operands; an operand runs to the next comparison, comma,
    // parenthesis or keyword.
    let bytes = code.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if !(b == b'+' || b == b'-') || bytes.get(i + 1) == Some(&b'-') {
            continue;
        }
        let stop = |c: char| matches!(c, ',' | '(' | ')' | '=' | '<' | '>' | '\n');
        let left_start = code[..i].rfind(stop).map_or(0, |s| s + 1);
        let right_end = code[i + 1..].find(stop).map_or(code.len(), |e| i + 1 + e);
        let left = &code[left_start..i];
        let right = &code[i + 1..right_end];
        let left_words = words(left);
        let right_words = words(right);
        // The operand next to the operator: the last word on the left, the first on the right.
        let touches_column = left_words.last().is_some_and(|w| is_column(w))
            || right_words.first().is_some_and(|w| is_column(w));
        if touches_column && (left.contains("interval") || right.contains("interval")) {
            return Some(format!(
                "interval arithmetic on a column ({left}{}{right})",
                b as char
            ));
        }
    }
    None
}

/// Rule 3: the `WHERE` of the modification at `at` compares `column` with a parameter.
fn where_names_owner(code: &str, at: usize, column: &str) -> bool {
    // The modification ends where its parenthesis closes (a CTE) or at the statement's end.
    let mut depth = 0i32;
    let mut end = code.len();
    for (i, c) in code[at..].char_indices() {
        match c {
            '(' => depth += 1,
            ')' if depth == 0 => {
                end = at + i;
                break;
            }
            ')' => depth -= 1,
            _ => {}
        }
    }
    let part = &code[at..end];
    let Some(where_at) = part.find("where") else {
        return false;
    };
    let clause = &part[where_at..];
    let clause = clause.split("returning").next().unwrap_or(clause);
    let w = words(clause);
    w.windows(2).enumerate().any(|(i, pair)| {
        let named = pair[0] == column || pair[0].ends_with(&format!(".{column}"));
        // `owner = $1`, `owner = any($1)`: the words after the column, `=` dropped.
        named
            && (pair[1].starts_with('$')
                || (pair[1] == "any" && w.get(i + 2).is_some_and(|p| p.starts_with('$'))))
            && clause.contains(&format!("{} =", pair[0]))
    }) || clause.contains(&format!(".{column} = $"))
        || clause.contains(&format!(" {column} = $"))
}

/// Rule 4: the distributed tables a statement inserts into, one entry per `INSERT INTO`.
fn inserts(code: &str) -> Vec<&'static str> {
    let w = words(code);
    w.windows(3)
        .filter(|t| t[0] == "insert" && t[1] == "into")
        .filter_map(|t| touched_table(&format!("into {}", t[2])))
        .collect()
}

/// What Citus would refuse, or fan out, in a statement; `None` for a statement that passes.
pub(super) fn citus_violation(sql: &str) -> Option<String> {
    let code = code_of(sql);
    let inserted = inserts(&code);
    if inserted.len() > 1 {
        return Some(format!(
            "{} INSERTs into distributed tables ({}) in one statement",
            inserted.len(),
            inserted.join(", ")
        ));
    }
    let modifications = modifications(&code);
    if modifications.is_empty() {
        return None;
    }
    if let Some(why) = mutable_in_coalesce_or_case(&code) {
        return Some(why);
    }
    if let Some(why) = stable_on_column(&code) {
        return Some(why);
    }
    for (at, table) in modifications {
        let Some(table) = touched_table(&format!("update {table}")) else {
            continue;
        };
        let column = distribution_column(table);
        if !sql.contains(ALL_USERS) && !where_names_owner(&code, at, column) {
            return Some(format!(
                "the WHERE of its {table} modification does not compare {column} with a \
                 parameter"
            ));
        }
    }
    None
}

#[test]
fn every_statement_that_modifies_a_distributed_table_is_one_citus_routes() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut files = Vec::new();
    for krate in ["idempotency", "rocket-rides"] {
        rust_files(&crates.join(krate).join("src"), &mut files);
    }
    let (mut checked, mut wrong) = (0, Vec::new());
    for file in &files {
        let source = std::fs::read_to_string(file).unwrap();
        for sql in string_literals(&source) {
            let code = code_of(&sql);
            if touched_table(&sql).is_none()
                || (modifications(&code).is_empty() && inserts(&code).len() < 2)
            {
                continue;
            }
            checked += 1;
            if let Some(why) = citus_violation(&sql) {
                wrong.push(format!("{}: {why}:\n{sql}", file.display()));
            }
        }
    }
    assert!(wrong.is_empty(), "{}", wrong.join("\n\n"));
    // The reader found the modifications it is meant to check: not a test that cannot fail.
    assert!(checked >= 15, "only {checked} modifying statements found");
}

#[test]
fn the_citus_checker_refuses_what_citus_refuses() {
    // Rule 1: a clock in COALESCE or CASE.
    let coalesce = "UPDATE idempotency_keys SET finished_at = coalesce($3::timestamptz, now())
                    WHERE owner = $1 AND id = $2";
    assert!(citus_violation(coalesce).unwrap().contains("COALESCE"));
    let case = "UPDATE rides SET updated_at = CASE WHEN $3 THEN now() ELSE updated_at END
                WHERE user_id = $1 AND id = $2";
    assert!(citus_violation(case).is_some());
    let marker = "DELETE FROM idempotency_keys WHERE owner = $1
                  AND finished_at < coalesce($2, $now)";
    assert!(citus_violation(marker).is_some());
    // Rule 2: a stable function on a column.
    let minus = "UPDATE idempotency_keys SET locked_until = locked_until - interval '1 second'
                 WHERE owner = $1 AND id = $2";
    assert!(citus_violation(minus).unwrap().contains("interval"));
    let plus = "DELETE FROM idempotency_keys WHERE owner = $1
                AND finished_at + $2 * interval '1 millisecond' < $now";
    assert!(citus_violation(plus).is_some());
    let trunc = "UPDATE rides SET updated_at = date_trunc('second', updated_at)
                 WHERE user_id = $1 AND id = $2";
    assert!(citus_violation(trunc).is_some());
    // Rule 3: the owner through a CTE only, or not at all.
    let joined = "WITH f AS (UPDATE idempotency_keys SET finished_at = $now
                             WHERE id = $1 AND owner = $2 RETURNING owner, id)
                  DELETE FROM idempotency_keys_unfinished u USING f
                  WHERE u.owner = f.owner AND u.key_id = f.id";
    assert!(citus_violation(joined)
        .unwrap()
        .contains("idempotency_keys_unfinished"));
    let no_owner = "UPDATE rides SET status = 'paid' WHERE id = $1";
    assert!(citus_violation(no_owner).is_some());
    // The service's tables are distributed by key_owner: user_id alone does not route.
    let by_user_id = "UPDATE rides SET status = 'paid' WHERE user_id = $1 AND id = $2";
    assert!(citus_violation(by_user_id).unwrap().contains("key_owner"));
    // Rule 4: two inserts into distributed tables in one statement, as CTEs.
    let two_inserts = "WITH ride AS (INSERT INTO rides (user_id, key_owner) VALUES ($1, $1::text)
                                     RETURNING id)
                       INSERT INTO audit_records (user_id, key_owner, resource_id)
                       SELECT $1, $1::text, id FROM ride";
    assert!(citus_violation(two_inserts)
        .unwrap()
        .contains("2 INSERTs into distributed tables (rides, audit_records)"));
    let key_and_row = "WITH inserted AS (INSERT INTO idempotency_keys (owner) VALUES ($1)
                                         RETURNING owner, id),
                       tracked AS (INSERT INTO idempotency_keys_unfinished (owner, key_id)
                                   SELECT owner, id FROM inserted)
                       SELECT id FROM inserted";
    assert!(citus_violation(key_and_row).is_some());

    // What passes: the time bare, arithmetic on parameters, the owner as a parameter.
    let fine = [
        "UPDATE idempotency_keys SET locked_until = $now + $4 * interval '1 millisecond',
                last_run_at = $now, lease_token = lease_token + 1
         WHERE id = $1 AND owner = $2 AND lease_token = $3
           AND (locked_until IS NULL OR locked_until <= $now)",
        "DELETE FROM idempotency_keys WHERE owner = $1 AND id = ANY($2)
           AND finished_at < $now - $3 * interval '1 millisecond'",
        "WITH f AS (UPDATE idempotency_keys SET finished_at = $now
                    WHERE id = $1 AND owner = $2 RETURNING owner, id)
         DELETE FROM idempotency_keys_unfinished u USING f
         WHERE u.owner = $2 AND u.owner = f.owner AND u.key_id = f.id",
        "UPDATE rides SET updated_at = now() WHERE id = $1 AND key_owner = $2::text",
        // One insert, or an insert into a table that is not distributed beside one that is.
        "INSERT INTO audit_records (user_id, key_owner, action) VALUES ($1, $1::text, $2)",
        "INSERT INTO failed_jobs (id, user_id) SELECT id, user_id FROM staged_jobs
         WHERE key_owner = $1 AND id = $2",
        // A SELECT may use COALESCE with a clock: Citus runs it on the shard as it is.
        "SELECT coalesce(charge_attempted_at, $now) FROM rides WHERE user_id = $1 FOR UPDATE",
    ];
    for sql in fine {
        assert_eq!(citus_violation(sql), None, "{sql}");
    }
}

#[sqlx::test(migrations = false)]
async fn distribute_refuses_a_server_without_citus_and_changes_nothing(pool: sqlx::PgPool) {
    use rocket_rides::db::distribute::{distribute, WITHOUT_CITUS};
    rocket_rides::db::migrate(&pool).await.unwrap();
    let constraints = "SELECT string_agg(conname::text, ',' ORDER BY conname) FROM pg_constraint
                       WHERE conrelid = ANY('{rides,ride_receipts,users}'::regclass[])";
    let before: String = sqlx::query_scalar(constraints)
        .fetch_one(&pool)
        .await
        .unwrap();
    let refused = distribute(&pool).await.unwrap_err();
    assert_eq!(refused.to_string(), WITHOUT_CITUS);
    let after: String = sqlx::query_scalar(constraints)
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, before);
    // The constraints the command would change are there to be changed.
    assert!(before.contains("rides_charge_id_key"), "{before}");
}

/// Citus's catalog of distributed tables, empty, in the test's schema: on plain PostgreSQL it
/// lets `distribute`'s preparation read "nothing is distributed yet".
async fn no_table_distributed_yet(pool: &sqlx::PgPool) {
    sqlx::query(
        "CREATE TABLE pg_dist_partition (logicalrelid regclass, partmethod \"char\",
                                         repmodel \"char\")",
    )
    .execute(pool)
    .await
    .unwrap();
}

#[sqlx::test(migrations = false)]
async fn distribute_prepares_every_table_in_an_order_postgres_accepts_and_a_rerun_does_nothing(
    pool: sqlx::PgPool,
) {
    use rocket_rides::db::distribute::{prepare_statements, KEYS, REFERENCES, TABLES};
    rocket_rides::db::migrate(&pool).await.unwrap();
    no_table_distributed_yet(&pool).await;
    let mut tx = pool.begin().await.unwrap();
    let statements = prepare_statements(&mut tx).await.unwrap();
    // Run in this order, each succeeds: a key that a foreign key still used could not be
    // dropped ("cannot drop constraint rides_pkey … because other objects depend on it").
    for statement in &statements {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .unwrap_or_else(|e| panic!("{statement}: {e}\n{statements:#?}"));
    }
    tx.commit().await.unwrap();
    let position = |needle: &str| {
        statements
            .iter()
            .position(|s| s.contains(needle))
            .unwrap_or_else(|| panic!("no {needle}: {statements:#?}"))
    };
    assert!(
        position("DROP CONSTRAINT ride_receipts_ride_fkey")
            < position("DROP CONSTRAINT rides_pkey")
    );

    // Every primary key and unique index of a distributed table includes its column.
    let indexes: Vec<(String, String, Vec<String>)> = sqlx::query_as(
        "SELECT t.relname::text, i.relname::text, array_agg(a.attname::text)
         FROM pg_index x
         JOIN pg_class i ON i.oid = x.indexrelid
         JOIN pg_class t ON t.oid = x.indrelid
         JOIN pg_attribute a ON a.attrelid = t.oid AND a.attnum = ANY(x.indkey)
         WHERE x.indisunique AND t.relname = ANY($1)
         GROUP BY t.relname, i.relname",
    )
    .bind(TABLES.iter().map(|(t, _)| *t).collect::<Vec<_>>())
    .fetch_all(&pool)
    .await
    .unwrap();
    assert_eq!(indexes.len(), KEYS.len() + 3, "{indexes:?}");
    for (table, index, columns) in &indexes {
        let column = TABLES.iter().find(|(t, _)| t == table).unwrap().1;
        assert!(
            columns.iter().any(|c| c == column),
            "{table}.{index} {columns:?} lacks {column}"
        );
    }
    // No foreign key is left among them, no trigger, and key_owner is never empty.
    let left: i64 = sqlx::query_scalar(
        "SELECT (SELECT count(*) FROM pg_constraint WHERE contype = 'f'
                   AND conrelid::regclass::text = ANY($1))
              + (SELECT count(*) FROM pg_trigger WHERE NOT tgisinternal
                   AND tgrelid::regclass::text = ANY($1))
              + (SELECT count(*) FROM pg_attribute WHERE attname = 'key_owner'
                   AND NOT attnotnull AND attrelid::regclass::text = ANY($1))",
    )
    .bind(TABLES.iter().map(|(t, _)| *t).collect::<Vec<_>>())
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, 0);
    // A second run (after a failure in step 4: nothing has foreign keys again yet) finds
    // nothing left to prepare.
    let mut conn = pool.acquire().await.unwrap();
    assert_eq!(
        prepare_statements(&mut conn).await.unwrap(),
        Vec::<String>::new()
    );
    // The foreign keys of the distributed layout can be added to what it prepared; once every
    // table is distributed, a run (after a failure in step 5) leaves them.
    for (table, name, definition) in REFERENCES {
        sqlx::query(&format!(
            "ALTER TABLE {table} ADD CONSTRAINT {name} {definition}"
        ))
        .execute(&mut *conn)
        .await
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    }
    sqlx::query(
        "INSERT INTO pg_dist_partition
         SELECT t::regclass, 'h', 's' FROM unnest($1::text[]) t
         UNION ALL SELECT 'users'::regclass, 'n', 't'",
    )
    .bind(TABLES.iter().map(|(t, _)| *t).collect::<Vec<_>>())
    .execute(&mut *conn)
    .await
    .unwrap();
    assert_eq!(
        prepare_statements(&mut conn).await.unwrap(),
        Vec::<String>::new()
    );
}

#[sqlx::test(migrations = false)]
async fn key_owner_is_filled_for_an_earlier_versions_inserts_and_for_rows_from_before(
    pool: sqlx::PgPool,
) {
    rocket_rides::db::migrate(&pool).await.unwrap();
    let user: i64 = sqlx::query_scalar("INSERT INTO users (email) VALUES ('a@b.c') RETURNING id")
        .fetch_one(&pool)
        .await
        .unwrap();
    // A row from before the migration: written without the trigger.
    sqlx::query("ALTER TABLE staged_jobs DISABLE TRIGGER staged_jobs_key_owner")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("INSERT INTO staged_jobs (user_id, job_name, job_args) VALUES ($1, 'x', '{}')")
        .bind(user)
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("ALTER TABLE staged_jobs ENABLE TRIGGER staged_jobs_key_owner")
        .execute(&pool)
        .await
        .unwrap();
    // An earlier version's insert, which does not name the column, while the new one runs.
    sqlx::query(
        "INSERT INTO audit_records (user_id, action, resource_type, resource_id)
                 VALUES ($1, 'a', 'ride', 1)",
    )
    .bind(user)
    .execute(&pool)
    .await
    .unwrap();
    let empty = "SELECT (SELECT count(*) FROM staged_jobs WHERE key_owner IS NULL)
                      + (SELECT count(*) FROM audit_records WHERE key_owner IS DISTINCT FROM $1)";
    let before: i64 = sqlx::query_scalar(empty)
        .bind(user.to_string())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        before, 1,
        "the row from before is empty until migrate fills it"
    );
    rocket_rides::db::migrate(&pool).await.unwrap();
    let after: i64 = sqlx::query_scalar(empty)
        .bind(user.to_string())
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(after, 0);
    // The check holds the column to the user.
    let wrong = sqlx::query(
        "INSERT INTO audit_records (user_id, key_owner, action, resource_type, resource_id)
         VALUES ($1, 'someone else', 'a', 'ride', 1)",
    )
    .bind(user)
    .execute(&pool)
    .await
    .unwrap_err();
    assert!(
        wrong
            .to_string()
            .contains("audit_records_key_owner_is_the_user"),
        "{wrong}"
    );
}
