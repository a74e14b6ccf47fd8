//! How the store sends its statements: prepared and cached (the default), or unnamed and each
//! inside an explicit transaction, for a connection pooler in transaction mode.
//!
//! A pooler in transaction mode (PgBouncer's `pool_mode = transaction`) lends a server
//! connection to a client for one transaction, or for one statement outside a transaction, and
//! may lend the next one to another client. Two things of sqlx's extended-query protocol assume
//! that a client keeps its server connection:
//!
//! - **Named prepared statements** (sqlx's cache, `sqlx_s_1`, …) are prepared on one server
//!   connection and executed later, when the client may hold another: "prepared statement does
//!   not exist", or one of the same name that another client prepared there with other SQL.
//! - **An unnamed statement outside a transaction** is sent by sqlx in two syncs (Parse and
//!   Describe, then Bind and Execute). Between them the server connection is idle, and the pooler
//!   may hand it to another client: the Bind then finds that client's unnamed statement, and runs
//!   its SQL with this client's parameters.
//!
//! [`Statements::Unnamed`] avoids both: every statement of the store is unnamed
//! (`persistent(false)`), and the store's autocommit statements get a `BEGIN` and a `COMMIT`
//! around them, so that the server connection is the client's from the Parse to the Execute.
//! The application's own queries get the same mode from the connection they are sent on
//! ([`Store::statements_on`], `executor.rs`).

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, Postgres, Transaction};

use super::model::Store;

/// How the store sends its statements ([`Store::with_statements`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Statements {
    /// Named prepared statements, cached per connection (sqlx's default), and the statements
    /// that stand alone (the claim's read, a renewal, a release, the completer's and the
    /// reaper's) sent in autocommit. For a direct connection, or a pooler in session mode.
    #[default]
    Prepared,
    /// Unnamed statements (`persistent(false)`), each inside an explicit transaction: the
    /// statements that stand alone get a `BEGIN` and a `COMMIT` around them, two more round
    /// trips each. For a pooler in transaction mode (PgBouncer's `pool_mode = transaction`),
    /// which breaks [`Statements::Prepared`] (see [`Store::with_statements`]).
    Unnamed,
}

/// A connection for a statement that stands alone ([`Store::autocommit`]): the pool's
/// connection as it is, or, with [`Statements::Unnamed`], a transaction on it. Dropping it
/// without [`Autocommit::done`] rolls the transaction back.
#[derive(Debug)]
#[must_use = "call done() after the statement: with Statements::Unnamed, dropping it rolls back"]
pub struct Autocommit(Held);

#[derive(Debug)]
enum Held {
    Direct(PoolConnection<Postgres>),
    Wrapped(Transaction<'static, Postgres>),
}

impl Autocommit {
    /// The connection to send the statement on.
    pub fn conn(&mut self) -> &mut PgConnection {
        match &mut self.0 {
            Held::Direct(conn) => conn,
            Held::Wrapped(tx) => tx,
        }
    }

    /// Commits the transaction around the statements, if there is one.
    ///
    /// It does not look for a cancelled wait for the synchronous standby
    /// ([`crate::commit_watch`]): it is for reads, and for writes that a failover may lose
    /// harmlessly.
    pub async fn done(self) -> Result<(), sqlx::Error> {
        match self.0 {
            Held::Direct(_) => Ok(()),
            Held::Wrapped(tx) => tx.commit().await,
        }
    }

    /// Commits the transaction around the statements, if there is one, refusing the success of
    /// a commit whose wait for the synchronous standby was cancelled
    /// ([`crate::Error::CommitUnconfirmed`]). Without a transaction the statement committed by
    /// itself, and its caller watched it.
    pub(crate) async fn confirmed(self, context: String) -> Result<(), crate::Error> {
        match self.0 {
            Held::Direct(_) => Ok(()),
            Held::Wrapped(tx) => super::commit(tx, context).await,
        }
    }
}

impl Store {
    /// Makes the store send every statement of its own as `statements` says. By default
    /// [`Statements::Prepared`].
    ///
    /// **Behind a pooler in transaction mode** (PgBouncer's `pool_mode = transaction`) set
    /// [`Statements::Unnamed`]. Without it, sqlx's named prepared statements fail ("prepared
    /// statement … does not exist", "… already exists") whenever the pooler lends the client
    /// another server connection, and an unnamed statement sent outside a transaction can be
    /// bound on a server connection that another client has just prepared its own statement on:
    /// the database then runs *that client's* SQL with this one's parameters, and no error may
    /// tell. A pooler in session mode needs nothing: the default is right there, and it is the
    /// safe choice (see `docs/operations.md`, "Running behind PgBouncer").
    ///
    /// **The application's statements** are its own: those it sends through
    /// [`crate::Phase::conn`], [`crate::FinalPhase::conn`] and the others are inside the
    /// phase's transaction already, but must be unnamed too: send them through
    /// [`Store::statements_on`] that connection (one wrapper, and no query says
    /// `.persistent(…)`), and send any it would send on the pool alone through
    /// [`Store::autocommit`], wrapped the same way.
    ///
    /// **Migrations** ([`crate::migrate()`], [`crate::migrate_with`]) need a direct connection
    /// (sqlx's advisory lock is held across transactions, and its migrator prepares named
    /// statements): run them on a pool connected to the database, not through the pooler.
    pub fn with_statements(mut self, statements: Statements) -> Self {
        self.statements = statements;
        self
    }

    /// How the store sends its statements ([`Store::with_statements`]).
    pub fn statements(&self) -> Statements {
        self.statements
    }

    /// Whether the store's statements are named prepared statements: what a query sent
    /// through [`Store::statements_on`] gets as its `.persistent(…)`, so that the
    /// application's queries are unnamed when the store's are.
    pub fn persistent(&self) -> bool {
        self.statements == Statements::Prepared
    }

    /// A connection of the store's pool for statements that stand alone, in a transaction of
    /// their own when the statements are [`Statements::Unnamed`]: how the store sends its own,
    /// and how an application sends those it would send on the pool, so that they are safe
    /// behind a transaction pooler too. Send them through
    /// `store.statements_on(autocommit.conn())`, then call [`Autocommit::done`]. With the default
    /// statements this costs no round trip: the pool would acquire the connection for the
    /// statement anyway.
    pub async fn autocommit(&self) -> Result<Autocommit, sqlx::Error> {
        Ok(Autocommit(match self.statements {
            Statements::Prepared => Held::Direct(self.pool.acquire().await?),
            Statements::Unnamed => Held::Wrapped(self.pool.begin().await?),
        }))
    }
}
