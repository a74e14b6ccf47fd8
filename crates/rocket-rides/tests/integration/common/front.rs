//! A front for the gateway: a loopback HTTP server between the service and fakestripe that
//! forwards every request, except the `POST /v1/charges` a test scripted, which it answers on
//! its own, as a load balancer or a proxy in front of a payment gateway does (a 504 page while
//! the charge goes on behind it, a 404 page for a route it lost, an empty body).

use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use http::StatusCode;

/// What the front does with the next `POST /v1/charges`.
#[derive(Debug, Clone)]
pub enum FrontAnswer {
    /// Forwards it, and delivers the gateway's answer.
    Forward,
    /// Forwards it, lets the gateway answer (and charge), then answers this status and body
    /// itself (an empty body has no content type; any other is `text/html`).
    ForwardThen(u16, &'static str),
    /// Answers this status and body itself; the gateway never sees the request.
    Answer(u16, &'static str),
    /// Answers this status with a JSON body of its own, without forwarding: the gateway's word,
    /// spoken by a test.
    Json(u16, &'static str),
}

#[derive(Clone)]
struct Inner {
    target: String,
    script: Arc<Mutex<VecDeque<FrontAnswer>>>,
    lists: Arc<Mutex<VecDeque<FrontAnswer>>>,
    seen: Arc<Mutex<Vec<String>>>,
    http: reqwest::Client,
}

/// A running front.
pub struct Front {
    pub base: String,
    script: Arc<Mutex<VecDeque<FrontAnswer>>>,
    lists: Arc<Mutex<VecDeque<FrontAnswer>>>,
    seen: Arc<Mutex<Vec<String>>>,
    _stop: tokio::sync::oneshot::Sender<()>,
}

impl Front {
    /// A front for the gateway at `target`.
    pub async fn start(target: String) -> Self {
        let script: Arc<Mutex<VecDeque<FrontAnswer>>> = Arc::default();
        let seen: Arc<Mutex<Vec<String>>> = Arc::default();
        let lists: Arc<Mutex<VecDeque<FrontAnswer>>> = Arc::default();
        let inner = Inner {
            target,
            script: script.clone(),
            lists: lists.clone(),
            seen: seen.clone(),
            http: reqwest::Client::new(),
        };
        let router = axum::Router::new().fallback(front).with_state(inner);
        let (base, stop) = super::spawn(router).await;
        Self {
            base,
            script,
            lists,
            seen,
            _stop: stop,
        }
    }

    /// The answers to the next charges, in order; the ones after are forwarded.
    pub fn script(&self, answers: Vec<FrontAnswer>) {
        self.script.lock().unwrap().extend(answers);
    }

    /// The answers to the next lists of one customer's charges (`GET /v1/charges?customer=…`),
    /// in order; the ones after are forwarded.
    pub fn script_lists(&self, answers: Vec<FrontAnswer>) {
        self.lists.lock().unwrap().extend(answers);
    }

    /// How many scripted answers are left.
    pub fn left(&self) -> usize {
        self.script.lock().unwrap().len()
    }

    /// Every request that came through, as `METHOD path?query`, in order.
    pub fn seen(&self) -> Vec<String> {
        self.seen.lock().unwrap().clone()
    }
}

async fn front(State(inner): State<Inner>, request: Request) -> Response {
    let (parts, body) = request.into_parts();
    let body = axum::body::to_bytes(body, 1 << 20).await.unwrap();
    inner.seen.lock().unwrap().push(format!(
        "{} {}",
        parts.method,
        parts.uri.path_and_query().map_or("", |pq| pq.as_str())
    ));
    let is_charge = parts.method == http::Method::POST && parts.uri.path() == "/v1/charges";
    let lists_a_customer = parts.method == http::Method::GET
        && parts.uri.path() == "/v1/charges"
        && parts.uri.query().is_some_and(|q| q.contains("customer="));
    let scripted = if is_charge {
        inner.script.lock().unwrap().pop_front()
    } else if lists_a_customer {
        inner.lists.lock().unwrap().pop_front()
    } else {
        None
    };
    match scripted.unwrap_or(FrontAnswer::Forward) {
        FrontAnswer::Forward => forward(&inner, &parts, body).await,
        FrontAnswer::ForwardThen(status, page) => {
            let _ = forward(&inner, &parts, body).await;
            own_answer(status, page)
        }
        FrontAnswer::Answer(status, page) => own_answer(status, page),
        FrontAnswer::Json(status, json) => (
            StatusCode::from_u16(status).unwrap(),
            [("content-type", "application/json")],
            json,
        )
            .into_response(),
    }
}

fn own_answer(status: u16, page: &'static str) -> Response {
    let status = StatusCode::from_u16(status).unwrap();
    if page.is_empty() {
        return status.into_response();
    }
    (status, [("content-type", "text/html")], page).into_response()
}

async fn forward(inner: &Inner, parts: &http::request::Parts, body: Bytes) -> Response {
    let target = parts
        .uri
        .path_and_query()
        .map_or(parts.uri.path(), |pq| pq.as_str());
    let mut request = inner
        .http
        .request(parts.method.clone(), format!("{}{target}", inner.target))
        .body(body);
    for name in ["authorization", "idempotency-key", "content-type"] {
        if let Some(value) = parts.headers.get(name) {
            request = request.header(name, value);
        }
    }
    let answer = request.send().await.unwrap();
    let mut response = Response::builder().status(answer.status().as_u16());
    for name in ["content-type", "idempotent-replayed", "request-id"] {
        if let Some(value) = answer.headers().get(name) {
            response = response.header(name, value);
        }
    }
    response
        .body(Body::from(answer.bytes().await.unwrap()))
        .unwrap()
}
