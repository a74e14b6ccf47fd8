//! Who a key belongs to: keys of different owners never meet.

use std::fmt;

/// The longest owner accepted, 128 bytes: a user id of the seed, a Stripe account id
/// (`acct_…`), a tenant's name.
pub const MAX_OWNER_LEN: usize = 128;

/// The owner of an idempotency key: the user, account or tenant whose keys form one space.
///
/// A string of 1 to [`MAX_OWNER_LEN`] bytes, without a NUL (PostgreSQL's text cannot hold one).
/// It is compared byte for byte: `"42"` and `"042"` are two owners. Integer ids convert with
/// `From`, in their decimal form, so that an application whose users are numbered writes
/// `Owner::from(user.id)` and a foreign key from its own rows can compare `user_id::text`.
///
/// On Citus the key tables are distributed by the owner; an application's rows share a node
/// with their keys when they carry the same text in a column of their own, distributed by it and
/// colocated with `idempotency_keys` ([`crate::store`] lists what that column
/// needs).
///
/// ```
/// use idempotency::Owner;
///
/// let account = Owner::new("acct_1Nv0FGQ9RKHgCVdK")?;
/// assert_eq!(account.as_str(), "acct_1Nv0FGQ9RKHgCVdK");
/// assert_eq!(Owner::from(42_i64).as_str(), "42");
/// assert!(Owner::new("").is_err());
/// # Ok::<(), idempotency::OwnerError>(())
/// ```
#[derive(Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Owner(String);

/// Why a string cannot be an [`Owner`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum OwnerError {
    /// The empty string.
    #[error("the owner of a key is empty")]
    Empty,
    /// More than [`MAX_OWNER_LEN`] bytes.
    #[error("the owner of a key is longer than 128 bytes")]
    TooLong,
    /// A NUL character, which PostgreSQL's text cannot store.
    #[error("the owner of a key contains a NUL character")]
    Nul,
}

impl Owner {
    /// Checks a string as an owner.
    pub fn new(owner: impl Into<String>) -> Result<Self, OwnerError> {
        let owner = owner.into();
        if owner.is_empty() {
            return Err(OwnerError::Empty);
        }
        if owner.len() > MAX_OWNER_LEN {
            return Err(OwnerError::TooLong);
        }
        if owner.contains('\0') {
            return Err(OwnerError::Nul);
        }
        Ok(Self(owner))
    }

    /// An owner read back from the key table, whose check constraint already holds it to the
    /// rules.
    pub(crate) fn stored(owner: String) -> Self {
        Self(owner)
    }

    /// The owner as stored.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl From<i64> for Owner {
    /// The decimal form, as PostgreSQL's `bigint::text` writes it.
    fn from(id: i64) -> Self {
        Self(id.to_string())
    }
}

impl std::str::FromStr for Owner {
    type Err = OwnerError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl AsRef<str> for Owner {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for Owner {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Owner({:?})", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_owner_is_one_to_128_bytes_without_a_nul() {
        assert_eq!(Owner::new(""), Err(OwnerError::Empty));
        assert_eq!(Owner::new("a".repeat(128)).unwrap().as_str().len(), 128);
        assert_eq!(Owner::new("a".repeat(129)), Err(OwnerError::TooLong));
        // Bytes, not characters: 43 three-byte characters are 129 bytes.
        assert_eq!(Owner::new("€".repeat(43)), Err(OwnerError::TooLong));
        assert!(Owner::new("€".repeat(42)).is_ok());
        assert_eq!(Owner::new("a\0b"), Err(OwnerError::Nul));
        assert_eq!("user 7".parse::<Owner>().unwrap().as_str(), "user 7");
    }

    #[test]
    fn integer_ids_convert_to_their_decimal_form() {
        assert_eq!(Owner::from(-1_i64).as_str(), "-1");
        assert_eq!(Owner::from(i64::MAX).as_str(), "9223372036854775807");
    }
}
