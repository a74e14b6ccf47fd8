//! Recovery points without boilerplate: [`recovery_points!`](crate::recovery_points) declares an
//! enum and implements [`RecoveryPoint`](crate::RecoveryPoint) for it.

/// Declares the recovery points of a request: an enum that starts at `Started`, ends at
/// `Finished`, and has the application's own points in between, each with the name it is stored
/// under.
///
/// The stored names are written out, not derived from the variants, so that renaming a variant
/// never strands the keys stored under its old name. The macro adds `Started` (`"started"`) and
/// `Finished` (`"finished"`); the names are checked at compile time: not empty, at most 64 bytes,
/// all different.
///
/// ```
/// idempotency::recovery_points! {
///     /// The transfer's points: one per commit that a foreign call separates from the next.
///     pub enum Point {
///         /// The money has moved; the notification is next.
///         Moved = "moved",
///     }
/// }
/// use idempotency::RecoveryPoint;
/// assert_eq!(Point::Moved.name(), "moved");
/// assert_eq!(Point::from_name("finished"), Some(Point::Finished));
/// assert_eq!(Point::from_name("shipped"), None);
/// ```
///
/// Two points under one name do not compile:
///
/// ```compile_fail
/// idempotency::recovery_points! {
///     enum Point { Moved = "moved", Sent = "moved" }
/// }
/// ```
#[macro_export]
macro_rules! recovery_points {
    (
        $(#[$meta:meta])*
        $vis:vis enum $name:ident {
            $( $(#[$vmeta:meta])* $variant:ident = $stored:literal ),* $(,)?
        }
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        $vis enum $name {
            /// Claimed; nothing of the request committed yet.
            Started,
            $( $(#[$vmeta])* $variant, )*
            /// The response is stored.
            Finished,
        }

        impl $crate::RecoveryPoint for $name {
            const STARTED: Self = Self::Started;
            const FINISHED: Self = Self::Finished;

            fn name(self) -> &'static str {
                match self {
                    Self::Started => "started",
                    $( Self::$variant => $stored, )*
                    Self::Finished => "finished",
                }
            }

            fn from_name(name: &str) -> Option<Self> {
                match name {
                    "started" => Some(Self::Started),
                    $( $stored => Some(Self::$variant), )*
                    "finished" => Some(Self::Finished),
                    _ => None,
                }
            }
        }

        const _: () = assert!(
            $crate::__private::names_are_valid(&["started", $( $stored, )* "finished"]),
            "recovery point names must be non-empty, at most 64 bytes, and all different \
             (\"started\" and \"finished\" are taken)"
        );
    };
}

/// Whether every name is non-empty, at most 64 bytes (the column's bound), and unlike every
/// other. A `const fn`, so that [`recovery_points!`](crate::recovery_points) checks at compile
/// time.
pub const fn names_are_valid(names: &[&str]) -> bool {
    let mut i = 0;
    while i < names.len() {
        let len = names[i].len();
        if len == 0 || len > 64 {
            return false;
        }
        let mut j = i + 1;
        while j < names.len() {
            if same(names[i].as_bytes(), names[j].as_bytes()) {
                return false;
            }
            j += 1;
        }
        i += 1;
    }
    true
}

const fn same(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    let mut i = 0;
    while i < a.len() {
        if a[i] != b[i] {
            return false;
        }
        i += 1;
    }
    true
}

#[cfg(test)]
mod tests {
    use super::names_are_valid;
    use crate::RecoveryPoint;

    crate::recovery_points! {
        /// A test enum.
        enum Ride {
            Created = "ride_created",
            /// With a doc comment.
            Charged = "charge_created",
        }
    }

    #[test]
    fn every_point_round_trips_through_its_stored_name() {
        for point in [Ride::Started, Ride::Created, Ride::Charged, Ride::Finished] {
            assert_eq!(Ride::from_name(point.name()), Some(point));
        }
        assert_eq!(Ride::STARTED, Ride::Started);
        assert_eq!(Ride::FINISHED, Ride::Finished);
        assert_eq!(Ride::Charged.name(), "charge_created");
    }

    #[test]
    fn unknown_names_are_refused() {
        for unknown in [
            "",
            "Charged",
            "charged",
            "ride_created ",
            "FINISHED",
            "moved",
        ] {
            assert_eq!(Ride::from_name(unknown), None, "{unknown:?}");
        }
    }

    #[test]
    fn names_are_checked_for_emptiness_length_and_repeats() {
        assert!(names_are_valid(&["started", "a", "finished"]));
        assert!(!names_are_valid(&["started", "", "finished"]));
        assert!(!names_are_valid(&["started", "finished", "finished"]));
        assert!(!names_are_valid(&["started", "ab", "ab", "finished"]));
        let long = "x".repeat(65);
        assert!(!names_are_valid(&["started", &long]));
        assert!(names_are_valid(&["started", &long[..64]]));
    }
}
