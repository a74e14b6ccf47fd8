//! The HTTP face's integration tests, one binary (one build, one link): each module below was a
//! test binary of its own.

mod adversary;
mod http;
mod layer;
mod transactional;
