//! The database: connecting into the `fakestripe` schema, migrating, and every statement on
//! fakestripe's own tables.
//!
//! The idempotency keys are the `idempotency` crate's business: this file never touches
//! `idempotency_keys` except through the foreign key `charges.idempotency_key_id`.

use serde_json::Value;
use sqlx::postgres::{PgConnectOptions, PgPoolOptions, PgRow};
use sqlx::types::Json;
use sqlx::{Connection, PgConnection, PgPool, Row};
use time::OffsetDateTime;

use crate::model::{Charge, Customer, Source};
use crate::{ids, Error};

/// The schema that holds every fakestripe table, the idempotency keys included.
pub const SCHEMA: &str = "fakestripe";

/// Connections per pool. A keyed charge holds one for its whole transaction, which includes the
/// injected latency and the test gate, so this bounds the charges in progress at once.
const MAX_CONNECTIONS: u32 = 64;

/// How long a statement waits for a row lock before failing. A request whose key another request
/// is inserting, uncommitted, waits this long and is then answered 409 (key in use) instead of
/// waiting out the other's latency.
const LOCK_TIMEOUT: &str = "200ms";

/// Connects to the database `database_url` names, creates the `fakestripe` schema if needed,
/// and returns a pool whose connections use it, with every migration applied.
pub async fn connect(database_url: &str) -> Result<PgPool, Error> {
    let options: PgConnectOptions = database_url
        .parse()
        .map_err(Error::db("parse the database URL"))?;
    connect_with(options).await
}

/// [`connect`] from parsed options (tests get them from `#[sqlx::test]`).
pub async fn connect_with(options: PgConnectOptions) -> Result<PgPool, Error> {
    create_schema(&options).await?;
    // search_path is set at connection start-up, so every statement of every pooled connection
    // (the idempotency crate's included) resolves unqualified names in our schema.
    let in_schema = options.options([("search_path", SCHEMA)]);
    let context = || format!("connect to the database with schema {SCHEMA}");
    // Migrations wait for sqlx's advisory lock as long as another migrator holds it (a service
    // migrating the same database as it starts), so they run without the lock timeout.
    let migrations = PgPoolOptions::new()
        .max_connections(1)
        .connect_with(in_schema.clone())
        .await
        .map_err(Error::db(context()))?;
    migrate(&migrations).await?;
    migrations.close().await;
    // The requests' connections give up on a held lock after LOCK_TIMEOUT.
    PgPoolOptions::new()
        .max_connections(MAX_CONNECTIONS)
        .connect_with(in_schema.options([("lock_timeout", LOCK_TIMEOUT)]))
        .await
        .map_err(Error::db(context()))
}

/// `CREATE SCHEMA IF NOT EXISTS` on a connection of its own, before any pooled connection
/// needs the schema.
async fn create_schema(options: &PgConnectOptions) -> Result<(), Error> {
    let context = || format!("create schema {SCHEMA}");
    let mut conn = PgConnection::connect_with(options)
        .await
        .map_err(Error::db(context()))?;
    let created = sqlx::query(&format!("CREATE SCHEMA IF NOT EXISTS {SCHEMA}"))
        .execute(&mut conn)
        .await;
    match created {
        Ok(_) => {}
        // IF NOT EXISTS is not atomic: two gateways starting together can both try to create
        // the schema, and the loser fails on pg_namespace's unique index. The schema exists.
        Err(sqlx::Error::Database(e)) if matches!(e.code().as_deref(), Some("23505" | "42P06")) => {
        }
        Err(e) => return Err(Error::db(context())(e)),
    }
    conn.close().await.map_err(Error::db(context()))
}

/// Applies the idempotency crate's migrations and fakestripe's, in the pool's schema, in the
/// order of their versions (`idempotency::migrate_with`), so that `charges` references
/// `idempotency_keys` as each version of the crate's table allows.
///
/// The crate keeps its own bookkeeping (`idempotency_schema_migrations`), so sqlx's table holds
/// only fakestripe's.
pub async fn migrate(pool: &PgPool) -> Result<(), Error> {
    Ok(idempotency::migrate_with(pool, &sqlx::migrate!("./migrations")).await?)
}

/// The account of a secret key, created on first use.
pub(crate) async fn account_for_key(pool: &PgPool, secret_key: &str) -> Result<i64, Error> {
    let context = || "find or create the account of a secret key".to_owned();
    // Read first: after its first request an account always exists, and a plain read writes
    // nothing. When the insert loses a race to a concurrent one it returns no row, and the
    // second read sees the winner's committed row.
    for _ in 0..2 {
        let id: Option<i64> = sqlx::query_scalar("SELECT id FROM accounts WHERE secret_key = $1")
            .bind(secret_key)
            .fetch_optional(pool)
            .await
            .map_err(Error::db(context()))?;
        if let Some(id) = id {
            return Ok(id);
        }
        let id: Option<i64> = sqlx::query_scalar(
            "INSERT INTO accounts (secret_key) VALUES ($1)
             ON CONFLICT (secret_key) DO NOTHING
             RETURNING id",
        )
        .bind(secret_key)
        .fetch_optional(pool)
        .await
        .map_err(Error::db(context()))?;
        if let Some(id) = id {
            return Ok(id);
        }
    }
    // Unreachable in practice: accounts are never deleted, so the second read finds the row.
    Err(Error::db(context())(sqlx::Error::RowNotFound))
}

/// What a new customer is made of, validated.
#[derive(Debug, Clone)]
pub(crate) struct NewCustomer {
    pub(crate) email: Option<String>,
    pub(crate) description: Option<String>,
    pub(crate) source: Option<Source>,
    pub(crate) metadata: Value,
}

const CUSTOMER_COLUMNS: &str = "id, email, description, source, metadata, deleted, created";

fn customer_from_row(row: &PgRow) -> Result<Customer, sqlx::Error> {
    let source: Option<String> = row.try_get("source")?;
    // The column's CHECK admits only the tokens `Source` knows.
    let source = source
        .map(|token| {
            Source::from_token(&token)
                .ok_or_else(|| sqlx::Error::Decode(format!("unknown source {token:?}").into()))
        })
        .transpose()?;
    Ok(Customer {
        id: row.try_get("id")?,
        email: row.try_get("email")?,
        description: row.try_get("description")?,
        source,
        metadata: row.try_get::<Json<Value>, _>("metadata")?.0,
        deleted: row.try_get("deleted")?,
        created: row.try_get("created")?,
    })
}

/// Inserts a customer of `account_id`.
pub(crate) async fn insert_customer(
    conn: &mut PgConnection,
    account_id: i64,
    new: &NewCustomer,
) -> Result<Customer, Error> {
    let id = ids::customer();
    let row = sqlx::query(&format!(
        "INSERT INTO customers (id, account_id, email, description, source, metadata)
         VALUES ($1, $2, $3, $4, $5, $6)
         RETURNING {CUSTOMER_COLUMNS}"
    ))
    .bind(&id)
    .bind(account_id)
    .bind(&new.email)
    .bind(&new.description)
    .bind(new.source.map(Source::token))
    .bind(Json(&new.metadata))
    .fetch_one(&mut *conn)
    .await
    .map_err(Error::db(format!(
        "insert customer {id} of account {account_id}"
    )))?;
    customer_from_row(&row).map_err(Error::db(format!("decode customer {id}")))
}

/// A customer of `account_id`, deleted or not; another account's customers do not exist for it.
pub(crate) async fn find_customer(
    db: impl sqlx::PgExecutor<'_>,
    account_id: i64,
    id: &str,
) -> Result<Option<Customer>, Error> {
    let context = || format!("read customer {id:?} of account {account_id}");
    let row = sqlx::query(&format!(
        "SELECT {CUSTOMER_COLUMNS} FROM customers WHERE account_id = $1 AND id = $2"
    ))
    .bind(account_id)
    .bind(id)
    .fetch_optional(db)
    .await
    .map_err(Error::db(context()))?;
    row.as_ref()
        .map(customer_from_row)
        .transpose()
        .map_err(Error::db(context()))
}

/// Marks a customer of `account_id` deleted; false when there is no such customer, or it is
/// deleted already.
pub(crate) async fn delete_customer(
    pool: &PgPool,
    account_id: i64,
    id: &str,
) -> Result<bool, Error> {
    let deleted = sqlx::query(
        "UPDATE customers SET deleted = true WHERE account_id = $1 AND id = $2 AND NOT deleted",
    )
    .bind(account_id)
    .bind(id)
    .execute(pool)
    .await
    .map_err(Error::db(format!(
        "delete customer {id:?} of account {account_id}"
    )))?;
    Ok(deleted.rows_affected() == 1)
}

/// What a new charge is made of, validated.
#[derive(Debug, Clone)]
pub(crate) struct NewCharge {
    pub(crate) customer_id: String,
    pub(crate) amount: i64,
    pub(crate) currency: String,
    pub(crate) description: Option<String>,
    pub(crate) metadata: Value,
}

const CHARGE_COLUMNS: &str = "id, account_id, customer_id, amount, currency, description, \
    metadata, status, failure_code, failure_message, idempotency_key_id, created";

fn charge_from_row(row: &PgRow) -> Result<Charge, sqlx::Error> {
    Ok(Charge {
        id: row.try_get("id")?,
        account_id: row.try_get("account_id")?,
        customer: row.try_get("customer_id")?,
        amount: row.try_get("amount")?,
        currency: row.try_get("currency")?,
        description: row.try_get("description")?,
        metadata: row.try_get::<Json<Value>, _>("metadata")?.0,
        status: row.try_get("status")?,
        failure_code: row.try_get("failure_code")?,
        failure_message: row.try_get("failure_message")?,
        idempotency_key_id: row.try_get("idempotency_key_id")?,
        created: row.try_get("created")?,
    })
}

fn charges_from_rows(rows: &[PgRow], context: &str) -> Result<Vec<Charge>, Error> {
    rows.iter()
        .map(charge_from_row)
        .collect::<Result<_, _>>()
        .map_err(Error::db(context))
}

/// Inserts a charge (`succeeded`, or `pending` when `pending`), tied to the idempotency key
/// whose request made it, if any.
///
/// Inside a key's final phase, `charges.idempotency_key_id UNIQUE` is the database's own
/// guarantee of one charge per key, whatever happened to the lease.
pub(crate) async fn insert_charge(
    conn: &mut PgConnection,
    account_id: i64,
    new: &NewCharge,
    pending: bool,
    idempotency_key_id: Option<i64>,
) -> Result<Charge, Error> {
    let id = ids::charge();
    let row = sqlx::query(&format!(
        "INSERT INTO charges (id, account_id, customer_id, amount, currency, description,
                              metadata, status, idempotency_key_id, key_owner)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $2::text)
         RETURNING {CHARGE_COLUMNS}"
    ))
    .bind(&id)
    .bind(account_id)
    .bind(&new.customer_id)
    .bind(new.amount)
    .bind(&new.currency)
    .bind(&new.description)
    .bind(Json(&new.metadata))
    .bind(if pending { "pending" } else { "succeeded" })
    .bind(idempotency_key_id)
    .fetch_one(&mut *conn)
    .await
    .map_err(Error::db(format!(
        "insert charge {id} of account {account_id}"
    )))?;
    charge_from_row(&row).map_err(Error::db(format!("decode charge {id}")))
}

/// A charge of `account_id`.
pub(crate) async fn find_charge(
    pool: &PgPool,
    account_id: i64,
    id: &str,
) -> Result<Option<Charge>, Error> {
    let context = format!("read charge {id:?} of account {account_id}");
    let row = sqlx::query(&format!(
        "SELECT {CHARGE_COLUMNS} FROM charges WHERE account_id = $1 AND id = $2"
    ))
    .bind(account_id)
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(context.clone()))?;
    row.as_ref()
        .map(charge_from_row)
        .transpose()
        .map_err(Error::db(context))
}

/// Where a page of charges starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Cursor {
    /// The newest charges.
    Newest,
    /// Charges older than this one (`starting_after`).
    After(String),
    /// Charges newer than this one (`ending_before`).
    Before(String),
}

impl Cursor {
    /// The charge the page starts from, if any.
    pub(crate) fn id(&self) -> Option<&str> {
        match self {
            Cursor::Newest => None,
            Cursor::After(id) | Cursor::Before(id) => Some(id),
        }
    }
}

/// A page of charges, newest first.
#[derive(Debug)]
pub(crate) enum Page {
    /// The charges, and whether more exist beyond them in the direction of travel.
    Found {
        charges: Vec<Charge>,
        has_more: bool,
    },
    /// The cursor names no charge of the account.
    NoSuchCursor,
}

/// The `created` filter of a list: `[from, until)`, either end open.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct CreatedRange {
    /// Charges created at or after this instant.
    pub(crate) from: Option<OffsetDateTime>,
    /// Charges created before this instant.
    pub(crate) until: Option<OffsetDateTime>,
}

/// Lists an account's charges, optionally of one customer and of a `created` range, newest
/// first, by keyset pagination on `(created, id)`: a total order, since ids are unique, and
/// stable, since neither column ever changes (settling a pending charge changes its status only).
pub(crate) async fn list_charges(
    pool: &PgPool,
    account_id: i64,
    customer: Option<&str>,
    created_range: CreatedRange,
    cursor: &Cursor,
    limit: i64,
) -> Result<Page, Error> {
    let context = || format!("list charges of account {account_id}");
    let older = !matches!(cursor, Cursor::Before(_));
    let position: Option<(OffsetDateTime, String)> = match cursor.id() {
        None => None,
        Some(id) => {
            let created: Option<OffsetDateTime> =
                sqlx::query_scalar("SELECT created FROM charges WHERE account_id = $1 AND id = $2")
                    .bind(account_id)
                    .bind(id)
                    .fetch_optional(pool)
                    .await
                    .map_err(Error::db(context()))?;
            match created {
                Some(created) => Some((created, id.to_owned())),
                None => return Ok(Page::NoSuchCursor),
            }
        }
    };
    let (created, id) = position.unzip();
    // One more row than asked tells whether there are more. Going backwards (ending_before)
    // reads oldest first from the cursor, so that the LIMIT keeps the rows nearest to it, and
    // the page is reversed below.
    let sql = if older {
        format!(
            "SELECT {CHARGE_COLUMNS} FROM charges
             WHERE account_id = $1
               AND ($2::text IS NULL OR customer_id = $2)
               AND ($3::timestamptz IS NULL OR (created, id) < ($3, $4::text))
               AND ($6::timestamptz IS NULL OR created >= $6)
               AND ($7::timestamptz IS NULL OR created < $7)
             ORDER BY created DESC, id DESC
             LIMIT $5"
        )
    } else {
        format!(
            "SELECT {CHARGE_COLUMNS} FROM charges
             WHERE account_id = $1
               AND ($2::text IS NULL OR customer_id = $2)
               AND (created, id) > ($3, $4::text)
               AND ($6::timestamptz IS NULL OR created >= $6)
               AND ($7::timestamptz IS NULL OR created < $7)
             ORDER BY created ASC, id ASC
             LIMIT $5"
        )
    };
    let rows = sqlx::query(&sql)
        .bind(account_id)
        .bind(customer)
        .bind(created)
        .bind(id)
        .bind(limit + 1)
        .bind(created_range.from)
        .bind(created_range.until)
        .fetch_all(pool)
        .await
        .map_err(Error::db(context()))?;
    let mut charges = charges_from_rows(&rows, &context())?;
    let has_more = charges.len() as i64 > limit;
    charges.truncate(limit as usize);
    if !older {
        charges.reverse();
    }
    Ok(Page::Found { charges, has_more })
}

/// Settles every pending charge as `succeeded`, or as `failed` with a decline's code and
/// message; returns how many were settled. (Stripe settles a pending charge on its own; the fake
/// does it when told, so that a test decides when.)
pub(crate) async fn settle_pending_charges(pool: &PgPool, succeeded: bool) -> Result<u64, Error> {
    let (status, code, message) = if succeeded {
        ("succeeded", None, None)
    } else {
        (
            "failed",
            Some("card_declined"),
            Some(crate::messages::CARD_DECLINED),
        )
    };
    let settled = sqlx::query(
        "UPDATE charges SET status = $1, failure_code = $2, failure_message = $3
         WHERE status = 'pending'",
    )
    .bind(status)
    .bind(code)
    .bind(message)
    .execute(pool)
    .await
    .map_err(Error::db("settle pending charges"))?;
    Ok(settled.rows_affected())
}

/// How many charges exist, in every account: for audits and tests.
pub async fn count_charges(pool: &PgPool) -> Result<i64, Error> {
    sqlx::query_scalar("SELECT count(*) FROM charges")
        .fetch_one(pool)
        .await
        .map_err(Error::db("count charges"))
}

/// Every charge of a customer, oldest first: for audits and tests.
pub async fn charges_of_customer(pool: &PgPool, customer_id: &str) -> Result<Vec<Charge>, Error> {
    let context = format!("list charges of customer {customer_id:?}");
    let rows = sqlx::query(&format!(
        "SELECT {CHARGE_COLUMNS} FROM charges WHERE customer_id = $1 ORDER BY created, id"
    ))
    .bind(customer_id)
    .fetch_all(pool)
    .await
    .map_err(Error::db(context.clone()))?;
    charges_from_rows(&rows, &context)
}

/// Every charge of every account, oldest first: for audits and tests.
pub async fn all_charges(pool: &PgPool) -> Result<Vec<Charge>, Error> {
    let rows = sqlx::query(&format!(
        "SELECT {CHARGE_COLUMNS} FROM charges ORDER BY created, id"
    ))
    .fetch_all(pool)
    .await
    .map_err(Error::db("list all charges"))?;
    charges_from_rows(&rows, "list all charges")
}

/// One charge by id, in any account: for audits and tests.
pub async fn charge_by_id(pool: &PgPool, id: &str) -> Result<Option<Charge>, Error> {
    let context = format!("read charge {id:?}");
    let row = sqlx::query(&format!(
        "SELECT {CHARGE_COLUMNS} FROM charges WHERE id = $1"
    ))
    .bind(id)
    .fetch_optional(pool)
    .await
    .map_err(Error::db(context.clone()))?;
    row.as_ref()
        .map(charge_from_row)
        .transpose()
        .map_err(Error::db(context))
}
