//! The body of an answer too large to store: the frames already read, then the rest, so that
//! the client still gets the whole answer.

use std::collections::VecDeque;
use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::{Body, Bytes};
use http_body::Frame;

/// Frames already read from an answer, then the answer's remaining body.
pub(super) struct Resumed {
    pub(super) read: VecDeque<Frame<Bytes>>,
    pub(super) rest: Body,
}

impl http_body::Body for Resumed {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(frame) = self.read.pop_front() {
            return Poll::Ready(Some(Ok(frame)));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}
