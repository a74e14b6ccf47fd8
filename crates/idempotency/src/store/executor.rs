//! The store's statement mode for the application's own queries, applied once to a connection
//! instead of to every query.
//!
//! Behind a pooler in transaction mode every statement must be unnamed ([`Statements::Unnamed`],
//! see `statements.rs` for why). sqlx decides that per query (`Execute::persistent`), so
//! without help every query of an application would have to say `.persistent(…)`, and the one
//! that forgets works on a direct connection and fails, or runs another client's SQL, only
//! behind the pooler. A pool setting does not help: with `statement_cache_capacity(0)` sqlx
//! still prepares a *named* statement for a persistent query, and never closes it.
//!
//! [`StatementsOn`] wraps an executor (`&mut PgConnection`, a transaction's connection, a
//! `&PgPool`) and wraps each query sent through it in turn, so that the query is unnamed
//! whenever the mode says so: the mode is chosen where the connection is obtained
//! ([`Store::statements_on`]) and the query code never mentions it.

use std::fmt;

use futures_core::future::BoxFuture;
use futures_core::stream::BoxStream;
use sqlx::postgres::{PgQueryResult, PgRow, PgStatement, PgTypeInfo};
use sqlx::{Describe, Either, Execute, Executor, PgConnection, Postgres};

use super::model::Store;
use super::statements::Statements;

/// An executor that sends every query in a statement mode ([`Statements`]): built by
/// [`Store::statements_on`] (the store's mode) or [`Statements::on`].
///
/// It is an [`Executor`] by value for any inner executor, and by `&mut` when it holds a
/// `&mut PgConnection`, so that one wrapper serves every query of a transaction as the
/// connection itself would:
///
/// ```no_run
/// # async fn example(store: &idempotency::Store, conn: &mut sqlx::PgConnection)
/// # -> Result<(), sqlx::Error> {
/// // `conn`: a phase's (`phase.conn()`), an autocommit's, a transaction's (`&mut *tx`).
/// let mut db = store.statements_on(conn);
/// sqlx::query("INSERT INTO audit (what) VALUES ($1)")
///     .bind("ride.created")
///     .execute(&mut db)
///     .await?;
/// let rides: i64 = sqlx::query_scalar("SELECT count(*) FROM rides")
///     .fetch_one(&mut db)
///     .await?;
/// # let _ = rides;
/// # Ok(())
/// # }
/// ```
///
/// With [`Statements::Unnamed`] every query is unnamed, whatever it says itself, and
/// [`Executor::prepare`] and [`Executor::describe`] are refused: sqlx prepares and describes with
/// a named statement, which the pooler loses. One thing the wrapper cannot undo: sqlx looks a
/// query's text up in its connection's cache of named statements before it asks whether the
/// query is persistent, so a text that the same connection once sent *outside* the wrapper as a
/// named statement is sent by that name again. In a service behind a transaction pooler, send
/// every query of the connection through the wrapper (or `.persistent(false)`): then the cache
/// stays empty. With [`Statements::Prepared`] each query keeps its own choice (named and cached, as
/// sqlx does by default, unless it was built with `.persistent(false)`).
///
/// The wrapper makes statements unnamed; it does not open a transaction. Behind a transaction
/// pooler a statement that stands alone also needs one ([`Store::autocommit`]): wrap the
/// connection of a phase, of an [`Autocommit`](super::Autocommit) or of a transaction, not a
/// `&PgPool`, there.
#[derive(Clone, Copy)]
pub struct StatementsOn<E> {
    inner: E,
    persistent: bool,
}

impl<E> StatementsOn<E> {
    /// The executor it wraps: its queries are sent as they say, not in the wrapper's mode.
    pub fn into_inner(self) -> E {
        self.inner
    }

    /// The mode it sends its queries in.
    pub fn statements(&self) -> Statements {
        if self.persistent {
            Statements::Prepared
        } else {
            Statements::Unnamed
        }
    }
}

impl StatementsOn<&mut PgConnection> {
    /// The same connection in the same mode, for a call that takes its executor by value
    /// (`&mut wrapper` does that too; this names the type, for a function's argument).
    pub fn reborrow(&mut self) -> StatementsOn<&mut PgConnection> {
        StatementsOn {
            inner: &mut *self.inner,
            persistent: self.persistent,
        }
    }
}

impl<E> fmt::Debug for StatementsOn<E> {
    // `Executor` asks for `Debug`; a connection's own is long and says nothing of the mode.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StatementsOn")
            .field("statements", &self.statements())
            .finish_non_exhaustive()
    }
}

impl Statements {
    /// `executor`, sending every query in this mode ([`StatementsOn`]).
    pub fn on<E>(self, executor: E) -> StatementsOn<E> {
        StatementsOn {
            inner: executor,
            persistent: self == Statements::Prepared,
        }
    }
}

impl Store {
    /// `executor`, sending every query in the store's mode ([`Store::with_statements`]): how an
    /// application's own queries follow the store's statements without saying so one by one.
    /// Wrap the connection once where it is obtained (a phase's, an
    /// [`Autocommit`](super::Autocommit)'s, a transaction's) and send the queries through it.
    pub fn statements_on<E>(&self, executor: E) -> StatementsOn<E> {
        self.statements().on(executor)
    }
}

/// A query sent through [`StatementsOn`]: the query itself, with the mode's `persistent`.
struct InMode<Q> {
    query: Q,
    persistent: bool,
}

impl<'q, Q: Execute<'q, Postgres>> Execute<'q, Postgres> for InMode<Q> {
    fn sql(&self) -> &'q str {
        self.query.sql()
    }

    fn statement(&self) -> Option<&PgStatement<'q>> {
        self.query.statement()
    }

    fn take_arguments(
        &mut self,
    ) -> Result<Option<sqlx::postgres::PgArguments>, sqlx::error::BoxDynError> {
        self.query.take_arguments()
    }

    fn persistent(&self) -> bool {
        // Unnamed wins: a query cannot opt back into a named statement the pooler would lose.
        self.persistent && self.query.persistent()
    }
}

/// The error of [`Executor::prepare`] and [`Executor::describe`] on an executor in
/// [`Statements::Unnamed`].
const PREPARE_REFUSED: &str =
    "sqlx prepares and describes with a named statement, which a transaction pooler loses: \
     with Statements::Unnamed send the query itself";

/// The answer of [`Executor::prepare_with`] and [`Executor::describe`] in
/// [`Statements::Unnamed`].
fn refused<'e, T: Send + 'e>() -> BoxFuture<'e, Result<T, sqlx::Error>> {
    Box::pin(async { Err(sqlx::Error::Configuration(PREPARE_REFUSED.into())) })
}

impl<'c, E> Executor<'c> for StatementsOn<E>
where
    E: Executor<'c, Database = Postgres>,
{
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, Q>(
        self,
        query: Q,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        Q: 'q + Execute<'q, Postgres>,
    {
        let persistent = self.persistent;
        self.inner.fetch_many(InMode { query, persistent })
    }

    fn fetch_optional<'e, 'q: 'e, Q>(
        self,
        query: Q,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        Q: 'q + Execute<'q, Postgres>,
    {
        let persistent = self.persistent;
        self.inner.fetch_optional(InMode { query, persistent })
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        if self.persistent {
            self.inner.prepare_with(sql, parameters)
        } else {
            refused()
        }
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        // sqlx describes with a named statement and caches it: a later query with this text
        // would be sent by that name, which the pooler loses.
        if self.persistent {
            self.inner.describe(sql)
        } else {
            refused()
        }
    }
}

/// `&mut wrapper` is an executor as `&mut *conn` is: one wrapper for every query of a
/// connection or transaction.
impl<'c, 'a: 'c> Executor<'c> for &'c mut StatementsOn<&'a mut PgConnection> {
    type Database = Postgres;

    fn fetch_many<'e, 'q: 'e, Q>(
        self,
        query: Q,
    ) -> BoxStream<'e, Result<Either<PgQueryResult, PgRow>, sqlx::Error>>
    where
        'c: 'e,
        Q: 'q + Execute<'q, Postgres>,
    {
        self.reborrow().fetch_many(query)
    }

    fn fetch_optional<'e, 'q: 'e, Q>(
        self,
        query: Q,
    ) -> BoxFuture<'e, Result<Option<PgRow>, sqlx::Error>>
    where
        'c: 'e,
        Q: 'q + Execute<'q, Postgres>,
    {
        self.reborrow().fetch_optional(query)
    }

    fn prepare_with<'e, 'q: 'e>(
        self,
        sql: &'q str,
        parameters: &'e [PgTypeInfo],
    ) -> BoxFuture<'e, Result<PgStatement<'q>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.reborrow().prepare_with(sql, parameters)
    }

    fn describe<'e, 'q: 'e>(
        self,
        sql: &'q str,
    ) -> BoxFuture<'e, Result<Describe<Postgres>, sqlx::Error>>
    where
        'c: 'e,
    {
        self.reborrow().describe(sql)
    }
}
