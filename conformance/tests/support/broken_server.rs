//! A small API with Idempotency-Key support written by hand, as a team would, with bugs that can
//! be switched on one at a time: what the runner must catch.
//!
//! `POST /things` with a JSON body `{"name": ..., "amount": n}` and `Authorization: Bearer
//! <tenant>` creates a thing (`201`, `{"id": "thing_N", ...}`), taking 100 ms. `amount <= 0` is a
//! validation error (`400`); `"explode": true` a dependency that is down (`503`). Keys are scoped
//! per tenant, fingerprinted by body, claimed before the work (`409` + `Retry-After` while it
//! runs), replayed with `Idempotent-Replayed: true`, and kept a day, stated in
//! `Idempotency-Key-Expires`.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// One bug, or none.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Bug {
    /// The correct server.
    None,
    /// Looks the key up, runs, then stores: no claim, so concurrent duplicates all run.
    NoLock,
    /// One key space for every tenant.
    NoScope,
    /// Replays regenerate the body's `served_at` timestamp.
    FreshTimestamp,
    /// Replays the stored response whatever the body.
    NoFingerprint,
    /// Runs requests without a key, or with a malformed one.
    KeysOptional,
    /// Stores `5xx` and validation errors like any other answer.
    StoresErrors,
    /// Answers `409` without `Retry-After`.
    NoRetryAfter,
    /// Forgets records after 1 s instead of a day.
    ShortMemory,
    /// States a retention moment an hour in the past.
    StaleRetention,
    /// No claim, as `NoLock`, and bodies alike in their first 400 bytes and their length: only the
    /// id at their end tells two executions apart.
    SamePrefix,
    /// A duplicate of a request in flight waits for it and gets its replay: never `409`.
    WaitsAndReplays,
    /// Every `2xx` body is endless.
    EndlessBody,
    /// Every `2xx` body trickles, a byte every 50 ms, and never ends.
    TrickleBody,
    /// Every `POST` is redirected to itself.
    Redirect,
    /// Stores errors, as `StoresErrors`, and answers them with a multi-line HTML page.
    HtmlErrors,
    /// Answers every request `503`: a server that is down, whatever the request.
    AlwaysUnavailable,
}

/// How long a request's work takes: long enough that concurrent duplicates overlap.
const WORK: Duration = Duration::from_millis(100);

#[derive(Debug, Clone)]
enum Record {
    Running {
        fingerprint: Bytes,
    },
    Done {
        fingerprint: Bytes,
        answer: Stored,
        at: Instant,
    },
}

#[derive(Debug, Clone)]
struct Stored {
    status: StatusCode,
    body: Vec<u8>,
    expires: Option<String>,
}

struct App {
    bug: Bug,
    records: Mutex<HashMap<(String, String), Record>>,
    next_id: AtomicU64,
}

/// A running server.
pub(crate) struct Server {
    pub addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Server {
    /// The server with `bug`, on a free port.
    pub(crate) async fn start(bug: Bug) -> Server {
        let app = Arc::new(App {
            bug,
            records: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(1),
        });
        let router = Router::new().route("/things", post(create)).with_state(app);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("a free port");
        let addr = listener.local_addr().expect("an address");
        let task = tokio::spawn(async move {
            axum::serve(listener, router)
                .await
                .expect("the server runs");
        });
        Server { addr, task }
    }

    pub(crate) fn url(&self) -> String {
        format!("http://{}", self.addr)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.task.abort();
    }
}

fn problem(status: StatusCode, detail: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/problem+json")],
        json!({ "detail": detail }).to_string(),
    )
        .into_response()
}

/// A key as the draft (`"k"`) or Stripe (`k`) writes it, if valid.
fn parse_key(value: &HeaderValue) -> Option<String> {
    let bytes = value.as_bytes();
    let inner = match bytes {
        [b'"', inner @ .., b'"'] => inner,
        bare => bare,
    };
    let valid = (1..=255).contains(&inner.len()) && inner.iter().all(|b| (0x21..=0x7e).contains(b));
    valid.then(|| String::from_utf8_lossy(inner).into_owned())
}

async fn create(State(app): State<Arc<App>>, headers: HeaderMap, body: Bytes) -> Response {
    if app.bug == Bug::AlwaysUnavailable {
        return problem(StatusCode::SERVICE_UNAVAILABLE, "down for maintenance");
    }
    if app.bug == Bug::Redirect {
        return (
            StatusCode::TEMPORARY_REDIRECT,
            [(header::LOCATION, "/things")],
        )
            .into_response();
    }
    let Some(tenant) = (headers.get(header::AUTHORIZATION))
        .and_then(|value| value.to_str().ok())
        .and_then(|value| value.strip_prefix("Bearer "))
        .map(str::to_owned)
    else {
        return problem(StatusCode::UNAUTHORIZED, "no credentials");
    };
    let key = match headers.get("idempotency-key").map(parse_key) {
        Some(Some(key)) => key,
        Some(None) if app.bug == Bug::KeysOptional => {
            return app.run(&body).await.0.into_response(&app, false);
        }
        None if app.bug == Bug::KeysOptional => {
            return app.run(&body).await.0.into_response(&app, false);
        }
        Some(None) => return problem(StatusCode::BAD_REQUEST, "invalid Idempotency-Key"),
        None => return problem(StatusCode::BAD_REQUEST, "Idempotency-Key is required"),
    };
    let scope = if app.bug == Bug::NoScope {
        String::new()
    } else {
        tenant
    };
    let id = (scope, key);
    let memory = if app.bug == Bug::ShortMemory {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(86_400)
    };
    let wait = {
        let mut records = app.records.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(Record::Done { at, .. }) = records.get(&id)
            && at.elapsed() > memory
        {
            records.remove(&id);
        }
        match records.get(&id) {
            Some(Record::Done {
                fingerprint,
                answer,
                ..
            }) => {
                if *fingerprint == body || app.bug == Bug::NoFingerprint {
                    return answer.clone().into_response(&app, true);
                }
                return problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "the key was used with another body",
                );
            }
            Some(Record::Running { fingerprint })
                if *fingerprint == body && app.bug == Bug::WaitsAndReplays =>
            {
                true
            }
            Some(Record::Running { fingerprint }) if *fingerprint == body => {
                let mut answer = problem(StatusCode::CONFLICT, "the key's request is running");
                if app.bug != Bug::NoRetryAfter {
                    answer
                        .headers_mut()
                        .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
                }
                return answer;
            }
            Some(Record::Running { .. }) => {
                return problem(
                    StatusCode::UNPROCESSABLE_ENTITY,
                    "the key was used with another body",
                );
            }
            None if matches!(app.bug, Bug::NoLock | Bug::SamePrefix) => false,
            None => {
                records.insert(
                    id.clone(),
                    Record::Running {
                        fingerprint: body.clone(),
                    },
                );
                false
            }
        }
    };
    if wait {
        return app.wait_for(&id).await;
    }
    let (answer, store) = app.run(&body).await;
    let mut records = app.records.lock().unwrap_or_else(PoisonError::into_inner);
    if store || matches!(app.bug, Bug::StoresErrors | Bug::HtmlErrors) {
        records.insert(
            id,
            Record::Done {
                fingerprint: body,
                answer: answer.clone(),
                at: Instant::now(),
            },
        );
    } else {
        records.remove(&id);
    }
    answer.into_response(&app, false)
}

/// An error page as some frameworks answer one: many lines, and long.
pub(crate) const HTML_ERROR: &str = "<!DOCTYPE html>\n<html>\n<head><title>Internal error</title></head>\n\
    <body>\n<h1>Something went wrong</h1>\n<pre>Traceback (most recent call last):\n  \
    File \"app.py\", line 42, in create\n    charge = gateway.charge(amount)\n  \
    File \"gateway.py\", line 7, in charge\n    raise Unavailable()\n</pre>\n</body>\n</html>\n";

fn now_nanos() -> String {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
        .as_nanos()
        .to_string()
}

impl App {
    /// The replay of the request running under `id`, once it is done.
    async fn wait_for(&self, id: &(String, String)) -> Response {
        loop {
            tokio::time::sleep(Duration::from_millis(10)).await;
            let records = self.records.lock().unwrap_or_else(PoisonError::into_inner);
            match records.get(id) {
                Some(Record::Done { answer, .. }) => {
                    return answer.clone().into_response(self, true);
                }
                Some(Record::Running { .. }) => {}
                None => return problem(StatusCode::CONFLICT, "the first request failed"),
            }
        }
    }

    /// Does the work; the answer, and whether it is to be stored.
    async fn run(&self, body: &[u8]) -> (Stored, bool) {
        tokio::time::sleep(WORK).await;
        let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
        let error = |status, detail: &str| Stored {
            status,
            body: json!({ "detail": detail }).to_string().into_bytes(),
            expires: None,
        };
        let Some(amount) = request["amount"].as_i64().filter(|amount| *amount > 0) else {
            return (
                error(StatusCode::BAD_REQUEST, "amount must be a positive integer"),
                false,
            );
        };
        if request["explode"] == true {
            return (
                error(StatusCode::SERVICE_UNAVAILABLE, "a dependency is down"),
                false,
            );
        }
        let id = self.next_id.fetch_add(1, Ordering::SeqCst);
        let expires = if self.bug == Bug::StaleRetention {
            SystemTime::now() - Duration::from_secs(3600)
        } else {
            SystemTime::now() + Duration::from_secs(86_400)
        };
        let thing = if self.bug == Bug::SamePrefix {
            format!(
                r#"{{"padding":"{}","name":{},"amount":{amount},"id":"thing_{id:08}"}}"#,
                "x".repeat(400),
                request["name"]
            )
        } else {
            json!({
                "id": format!("thing_{id}"),
                "name": request["name"],
                "amount": amount,
                "served_at": now_nanos(),
            })
            .to_string()
        };
        let stored = Stored {
            status: StatusCode::CREATED,
            body: thing.into_bytes(),
            expires: Some(httpdate::fmt_http_date(expires)),
        };
        (stored, true)
    }
}

impl Stored {
    fn into_response(self, app: &App, replay: bool) -> Response {
        let mut body = self.body;
        if replay
            && app.bug == Bug::FreshTimestamp
            && let Ok(mut thing) = serde_json::from_slice::<Value>(&body)
        {
            thing["served_at"] = Value::String(now_nanos());
            body = thing.to_string().into_bytes();
        }
        let (content_type, body) = match app.bug {
            _ if self.status.is_success() => ("application/json", Body::from(body)),
            Bug::HtmlErrors => ("text/html", Body::from(HTML_ERROR)),
            _ => ("application/problem+json", Body::from(body)),
        };
        let body = match app.bug {
            Bug::EndlessBody if self.status.is_success() => {
                let chunk = Bytes::from(vec![b'x'; 8192]);
                Body::from_stream(futures_util::stream::repeat_with(move || {
                    Ok::<_, std::convert::Infallible>(chunk.clone())
                }))
            }
            Bug::TrickleBody if self.status.is_success() => {
                Body::from_stream(futures_util::stream::unfold((), |()| async {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    Some((
                        Ok::<_, std::convert::Infallible>(Bytes::from_static(b"x")),
                        (),
                    ))
                }))
            }
            _ => body,
        };
        let mut response =
            (self.status, [(header::CONTENT_TYPE, content_type)], body).into_response();
        if let Some(expires) = self.expires.and_then(|e| HeaderValue::from_str(&e).ok()) {
            response
                .headers_mut()
                .insert("idempotency-key-expires", expires);
        }
        if replay {
            response
                .headers_mut()
                .insert("idempotent-replayed", HeaderValue::from_static("true"));
        }
        response
    }
}
