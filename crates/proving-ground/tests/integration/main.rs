//! The proving ground's integration tests, one binary (one build, one link): each module below
//! was a test binary of its own.

mod bench;
mod chaos;
mod docs;
mod migrations;
