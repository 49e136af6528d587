//! The checks: each sends a few requests with fresh keys and judges the answers against one rule.

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

use reqwest::StatusCode;
use reqwest::header::RETRY_AFTER;
use tokio::sync::Barrier;
use tokio::time::Instant;

use crate::api::{
    Answer, Api, Call, Finding, Hint, Identity, Kind, Probe, Problem, Tenant, body_difference,
    retention_moment, server_now, valid_retry_after,
};

/// One check: its name, what it checks and the rule it cites.
///
/// ```
/// use tower_idempotency_conformance::CHECKS;
///
/// assert!(CHECKS.iter().any(|check| check.name == "concurrent-duplicates"));
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct Check {
    /// The stable name, as the report, `--json` and JUnit name it.
    pub name: &'static str,
    /// What it checks, in a few words.
    pub title: &'static str,
    /// The rule: the section of draft-ietf-httpapi-idempotency-key-header-07, or Stripe's rule.
    pub citation: &'static str,
}

/// Every check, in the order a run reports them.
pub const CHECKS: [Check; 10] = [
    REPLAY,
    CONCURRENT,
    KEY_REUSE,
    MISSING_KEY,
    MALFORMED_KEY,
    TENANT_SCOPE,
    SERVER_ERROR,
    VALIDATION,
    RETENTION,
    PAUSE,
];

pub(crate) const REPLAY: Check = Check {
    name: "replay",
    title: "a retry gets the first response: status, headers, body byte for byte, replay marker",
    citation: "draft-07 §2.6 (duplicate request, retry); Stripe: same key, same result",
};
pub(crate) const CONCURRENT: Check = Check {
    name: "concurrent-duplicates",
    title: "concurrent duplicates execute once; the others get the replay or 409 with Retry-After",
    citation: "draft-07 §2.6 (concurrent request), §2.7 (409); RFC 9110 §10.2.3 (Retry-After)",
};
pub(crate) const KEY_REUSE: Check = Check {
    name: "key-reuse",
    title: "the same key with another body is refused, never answered with the first response",
    citation: "draft-07 §2.2, §2.7 (422); Stripe: 400 idempotency_error",
};
pub(crate) const MISSING_KEY: Check = Check {
    name: "missing-key",
    title: "a request without a key is refused (4xx; the draft names 400) where keys are required",
    citation: "draft-07 §2.7 (400)",
};
pub(crate) const MALFORMED_KEY: Check = Check {
    name: "malformed-key",
    title: "an empty, 300-character or non-ASCII key is refused (4xx), never silently ignored",
    citation: "draft-07 §2.1 (sf-string), §5 (validate the key before any lookup)",
};
pub(crate) const TENANT_SCOPE: Check = Check {
    name: "tenant-scope",
    title: "tenant B's request with tenant A's key runs as B's own",
    citation: "draft-07 §5 (a composite key with client-specific attributes; data leaks)",
};
pub(crate) const SERVER_ERROR: Check = Check {
    name: "server-error-not-stored",
    title: "a 5xx answer is not stored: the retry is no replay, the corrected request runs",
    citation: "draft-07 §2.7 (5xx: the client retries per the server's documentation)",
};
pub(crate) const VALIDATION: Check = Check {
    name: "validation-not-stored",
    title: "a request that failed validation is not stored: the corrected retry runs",
    citation: "Stripe: no idempotent result is saved when the parameters failed validation",
};
pub(crate) const RETENTION: Check = Check {
    name: "retention",
    title: "the retention header is an HTTP-date or @epoch in the future, repeated on replay",
    citation: "draft-07 §2.3 (expiry policy); RFC 9110 §5.6.7, RFC 9651 §3.3.7",
};
pub(crate) const PAUSE: Check = Check {
    name: "replay-after-pause",
    title: "a retry after a pause still gets the replay",
    citation: "draft-07 §2.3 (keys valid until their published expiry), §2.6",
};

/// What a passing check saw, and what it found missing that the draft does not require.
#[derive(Debug, Default)]
pub(crate) struct Seen {
    pub detail: String,
    pub warnings: Vec<String>,
}

/// What a check function returns: what a pass saw, or why it did not pass.
pub(crate) type Outcome = Result<Seen, Finding>;

fn pass(detail: impl Into<String>) -> Outcome {
    Ok(Seen {
        detail: detail.into(),
        warnings: Vec::new(),
    })
}

fn fail<T>(detail: impl Into<String>) -> Result<T, Finding> {
    Err(Finding::Fail(vec![Problem::new(detail)]))
}

fn not_applicable<T>(reason: impl Into<String>) -> Result<T, Finding> {
    Err(Finding::NotApplicable(reason.into()))
}

/// What a replay must repeat of `first`: status, compared headers, body bytes, and the replay
/// header when configured. Its description, for a pass.
fn same_response(
    api: &Api,
    first: &Answer,
    replay: &Answer,
    what: &str,
) -> Result<String, Finding> {
    if replay.status != first.status {
        return fail(format!(
            "{what} was answered {}, the first request {}",
            replay.status.as_u16(),
            first.status.as_u16()
        ));
    }
    for name in &api.prepared.compare_headers {
        let before: Vec<_> = first.headers.get_all(name).iter().collect();
        let after: Vec<_> = replay.headers.get_all(name).iter().collect();
        if before != after {
            return fail(format!(
                "{what} has {name}: {after:?}, the first response {name}: {before:?}"
            ));
        }
    }
    if let (Some(before), Some(after)) = (api.id(first), api.id(replay))
        && before != after
    {
        return fail(format!(
            "{what} ran again: id {after}, the first response's {before} (the record was not kept)"
        ));
    }
    if let Some(difference) = body_difference(&first.body, &replay.body) {
        return fail(format!("{what} is not the first response: {difference}"));
    }
    if api.replayed(replay) == Some(false) {
        return Err(Finding::Fail(vec![Problem::hinted(
            Hint::ReplayHeaderAbsent,
            format!(
                "{what} repeats the first response but lacks the replay header {}",
                api.config.replay_header.as_deref().unwrap_or_default()
            ),
        )]));
    }
    let marker = (api.config.replay_header.as_deref())
        .map(|name| format!(", {name}"))
        .unwrap_or_default();
    let headers: Vec<_> = api
        .prepared
        .compare_headers
        .iter()
        .map(|h| h.as_str())
        .collect();
    Ok(format!(
        "{}, {} bytes equal, same {}{marker}",
        first.status.as_u16(),
        first.body.len(),
        if headers.is_empty() {
            "status".to_owned()
        } else {
            headers.join(", ")
        }
    ))
}

/// Whether `again` is the replay of `first`'s execution: the same status and the same id (the
/// same whole body when no id pointer is configured). A weaker test than [`same_response`], for
/// the checks whose rule is another: they leave byte-for-byte replays to `replay`.
fn same_execution(api: &Api, first: &Answer, again: &Answer, what: &str) -> Result<(), Finding> {
    let (before, after) = (api.identity(first), api.identity(again));
    if again.status != first.status || before != after {
        let how = (before.difference(&after))
            .map(|difference| format!(": {difference}"))
            .unwrap_or_default();
        return fail(format!(
            "{what} was answered {} with {after}, not the first response's replay ({}, \
             {before}){how}",
            again.status.as_u16(),
            first.status.as_u16()
        ));
    }
    Ok(())
}

/// A retry gets the first response.
pub(crate) async fn replay(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    let call = api.call(Kind::Valid, Tenant::A, Some(api.fresh_key()));
    let first = p.send_ok("first", &call).await?;
    let retry = p.send("retry", &call).await?;
    same_response(&api, &first, &retry, "the retry").and_then(pass)
}

/// The first half of the pause check: the first request.
pub(crate) async fn pause_start(p: &mut Probe) -> Result<(Call, Answer), Finding> {
    let api = p.api.clone();
    let call = api.call(Kind::Valid, Tenant::A, Some(api.fresh_key()));
    let first = p.send_ok("first", &call).await?;
    Ok((call, first))
}

/// The second half: the retry, once the pause is over.
pub(crate) async fn pause_end(
    p: &mut Probe,
    started: Result<(Call, Answer), Finding>,
    until: Instant,
) -> Outcome {
    let (call, first) = started?;
    tokio::time::sleep_until(until).await;
    let pause = p.api.config.pause;
    let retry = p.send("retry after the pause", &call).await?;
    let step = format!("the retry {} ms later", pause.as_millis());
    let same = same_response(&p.api, &first, &retry, &step)?;
    pass(format!("after {} ms: {same}", pause.as_millis()))
}

/// N concurrent duplicates execute once.
pub(crate) async fn concurrent(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    let n = api.config.concurrency;
    let call = Arc::new(api.call(Kind::Valid, Tenant::A, Some(api.fresh_key())));
    let barrier = Arc::new(Barrier::new(n));
    let tasks: Vec<_> = (0..n)
        .map(|i| {
            let (api, call, barrier) = (api.clone(), call.clone(), barrier.clone());
            tokio::spawn(async move {
                barrier.wait().await;
                api.send(&format!("duplicate {}", i + 1), &call).await
            })
        })
        .collect();
    let mut answers = Vec::new();
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    for task in tasks {
        let (exchange, answer) = match task.await {
            Ok(sent) => sent,
            Err(err) => return fail(format!("a duplicate's task failed: {err}")),
        };
        let step = exchange.step.clone();
        p.seen.push(exchange);
        match answer {
            Ok(answer) => answers.push((step, answer)),
            Err(err) => problems.push(Problem::new(format!("{step} got no answer: {err}"))),
        }
    }
    let mut ran = BTreeSet::new();
    let (mut firsts, mut conflicts) = (0, 0);
    let mut successes: Vec<&Answer> = Vec::new();
    for (step, answer) in &answers {
        if answer.status.is_success() {
            ran.insert(api.identity(answer));
            if api.replayed(answer) == Some(false) {
                firsts += 1;
            }
            successes.push(answer);
        } else if answer.status == StatusCode::CONFLICT {
            conflicts += 1;
            match answer.headers.get(RETRY_AFTER) {
                None => {
                    let warning = format!(
                        "{step} got 409 without Retry-After: the draft does not require it, but a \
                         client then cannot tell when to retry"
                    );
                    if warnings.is_empty() {
                        warnings.push(warning);
                    }
                }
                Some(value) if !valid_retry_after(value) => problems.push(Problem::new(format!(
                    "{step} got 409 with an invalid Retry-After {value:?} (delta-seconds or an \
                     HTTP-date)"
                ))),
                Some(_) => {}
            }
        } else {
            let status = answer.status.as_u16();
            problems.push(Problem::hinted(
                Hint::Refused(status),
                format!(
                    "{step} was answered {status}: neither the first response's replay nor 409"
                ),
            ));
        }
    }
    if ran.len() > 1 {
        problems.insert(0, Problem::new(executed_more_than_once(n, &ran)));
    }
    if firsts > 1 {
        problems.push(Problem::hinted(
            Hint::ReplayHeaderAbsent,
            format!(
                "{firsts} answers lack the replay header {}: each claims to be the first execution",
                api.config.replay_header.as_deref().unwrap_or_default()
            ),
        ));
    }
    if !problems.is_empty() {
        return Err(Finding::Fail(problems));
    }
    // A retry once the dust settles gets the one execution's answer.
    let settled = settle(p, &call).await?;
    let identity = api.identity(&settled);
    if let Some(ran) = ran.first()
        && *ran != identity
    {
        return fail(format!(
            "the burst's execution has {ran}, a later retry {identity}: the key ran twice"
        ));
    }
    let retry_after = answers
        .iter()
        .find_map(|(_, answer)| answer.headers.get(RETRY_AFTER))
        .map(|value| {
            format!(
                " (Retry-After: {})",
                String::from_utf8_lossy(value.as_bytes())
            )
        })
        .unwrap_or_default();
    let replays = successes.len().saturating_sub(1);
    let overlap = if conflicts > 0 || replays == 0 {
        String::new()
    } else {
        overlap(&api, &successes)
    };
    Ok(Seen {
        detail: format!(
            "{n} at once: 1 execution ({identity}), {replays} replays, {conflicts} x 409\
             {retry_after}; a later retry got the same{overlap}"
        ),
        warnings,
    })
}

/// The first problem of a burst that ran more than once: how many executions, told apart by
/// their ids, or by where their bodies differ when no id is configured.
fn executed_more_than_once(n: usize, ran: &BTreeSet<Identity>) -> String {
    let ids: Option<Vec<&str>> = (ran.iter())
        .map(|identity| match identity {
            Identity::Id(id) => Some(id.as_str()),
            _ => None,
        })
        .collect();
    let told = match ids {
        Some(ids) => ids.join(", "),
        None => {
            let mut bodies = ran.iter();
            let difference = match (bodies.next(), bodies.next()) {
                (Some(a), Some(b)) => a.difference(b).unwrap_or_default(),
                _ => String::new(),
            };
            format!("{} different bodies; {difference}", ran.len())
        }
    };
    format!(
        "{n} concurrent duplicates executed {} times: {told}",
        ran.len()
    )
}

/// The shortest execution whose overlap with its duplicates the runner's clock tells: below it,
/// sending the burst takes about as long as the execution.
const TELLING: Duration = Duration::from_millis(20);

/// What a burst answered without a `409` says of the overlap: whether the duplicates were in
/// flight while the execution ran (the API held them and replayed), or may have arrived after it.
fn overlap(api: &Api, successes: &[&Answer]) -> String {
    // The execution: the one 2xx without the replay header, else the first to finish.
    let execution = (successes.iter())
        .find(|answer| api.replayed(answer) == Some(false))
        .or_else(|| successes.iter().min_by_key(|answer| answer.done));
    let Some(execution) = execution else {
        return String::new();
    };
    let took = execution.done - execution.sent;
    if took < TELLING {
        return format!(
            "; no 409: the execution took {} ms, too short to tell whether the others waited for \
             it or came after it",
            took.as_millis()
        );
    }
    let halfway = execution.sent + took / 2;
    let others = successes
        .iter()
        .filter(|answer| !std::ptr::eq(**answer, *execution));
    let (mut waited, mut late) = (0, 0);
    for answer in others {
        // In flight across the execution's midpoint: it overlapped the execution, and waited.
        if answer.sent <= halfway && answer.done >= halfway {
            waited += 1;
        } else {
            late += 1;
        }
    }
    if late == 0 {
        format!(
            "; no 409: the {waited} others waited for the execution ({} ms) and got its replay",
            (execution.done - execution.sent).as_millis()
        )
    } else {
        format!(
            "; no 409, and {late} of the others came after the execution ({} ms) was half \
             done: the overlap was not fully tested",
            (execution.done - execution.sent).as_millis()
        )
    }
}

/// Sends `call` until it is no longer `409`, honouring `Retry-After` (at most 1 s a wait),
/// within the request timeout; the final answer, which must be `2xx`.
async fn settle(p: &mut Probe, call: &Call) -> Result<Answer, Finding> {
    let deadline = Instant::now() + p.api.config.timeout;
    loop {
        let answer = p.send("retry after the burst", call).await?;
        if answer.status != StatusCode::CONFLICT {
            if !answer.status.is_success() {
                return fail(format!(
                    "a retry after the burst was answered {}, not the execution's replay",
                    answer.status.as_u16()
                ));
            }
            return Ok(answer);
        }
        let wait = (answer.headers.get(RETRY_AFTER))
            .and_then(|value| value.to_str().ok()?.trim().parse::<u64>().ok())
            .map_or(Duration::from_millis(100), Duration::from_secs)
            .clamp(Duration::from_millis(50), Duration::from_secs(1));
        if Instant::now() + wait > deadline {
            return fail("the key was still in flight (409) after the request timeout");
        }
        tokio::time::sleep(wait).await;
    }
}

/// The same key with another body is refused.
pub(crate) async fn key_reuse(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    let key = api.fresh_key();
    let call = api.call(Kind::Valid, Tenant::A, Some(key.clone()));
    let other = api.call(Kind::Valid, Tenant::A, Some(key));
    let first = p.send_ok("first", &call).await?;
    let reused = p.send("same key, another body", &other).await?;
    let expected = api.config.mismatch_status;
    if body_difference(&first.body, &reused.body).is_none() && reused.status.is_success() {
        return fail(format!(
            "another body under the key got the first request's response ({}): the body is not \
             compared",
            reused.status.as_u16()
        ));
    }
    if let (Some(id), Some(leaked)) = (api.id(&first), api.id(&reused))
        && id == leaked
    {
        return fail(format!(
            "another body under the key was answered with the first request's id {id}"
        ));
    }
    if api.replayed(&reused) == Some(true) {
        return fail("another body under the key was answered as a replay");
    }
    if reused.status.as_u16() != expected {
        return fail(format!(
            "another body under the key was answered {}, not {expected} (mismatch_status)",
            reused.status.as_u16()
        ));
    }
    let again = p.send("the first body again", &call).await?;
    same_execution(
        &api,
        &first,
        &again,
        "the first body sent again after the refusal",
    )?;
    pass(format!("{expected}; the first request still replays"))
}

/// A request without a key is refused where keys are required.
pub(crate) async fn missing_key(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    if !api.config.keys_required {
        return not_applicable("keys_required = false: a request without a key runs as usual");
    }
    let call = api.call(Kind::Valid, Tenant::A, None);
    let answer = p.send("without a key", &call).await?;
    let status = answer.status.as_u16();
    if !answer.status.is_client_error() {
        return fail(format!(
            "a request without a key was answered {status}, not 4xx"
        ));
    }
    if status == 400 {
        return pass("400");
    }
    Ok(Seen {
        detail: status.to_string(),
        warnings: vec![format!(
            "a request without a key was answered {status}: the draft names 400 (a SHOULD)"
        )],
    })
}

/// Malformed keys are refused where keys are required. Where they are optional, a bad key
/// honoured as a key passes, and one ignored (its retry runs again while its client believes it
/// protected) is a warning: the draft asks clients for valid keys, but requires no server to
/// refuse an invalid one.
pub(crate) async fn malformed_key(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    let long: String = std::iter::repeat_with(crate::api::unique)
        .flat_map(|u| u.chars().collect::<Vec<_>>())
        .take(300)
        .collect();
    let cases = [
        ("empty", Vec::new()),
        ("300 characters", api.write_key(&long)),
        (
            "non-ASCII",
            api.write_key(&format!("clé-{}", crate::api::unique())),
        ),
    ];
    let mut seen = Vec::new();
    let mut problems = Vec::new();
    let mut warnings = Vec::new();
    for (what, key) in cases {
        let call = api.call(Kind::Valid, Tenant::A, Some(key));
        let answer = p.send(&format!("{what} key"), &call).await?;
        let status = answer.status.as_u16();
        if answer.status.is_client_error() {
            seen.push(format!("{what}: {status}"));
            continue;
        }
        if api.config.keys_required {
            problems.push(Problem::new(format!(
                "the {what} key was not refused with 4xx: {status}"
            )));
            continue;
        }
        // Keys are optional: a bad key may be honoured as a key; one dropped in silence warns.
        if !answer.status.is_success() {
            seen.push(format!("{what}: {status}"));
            continue;
        }
        let again = p.send(&format!("{what} key, again"), &call).await?;
        if same_execution(&api, &answer, &again, "").is_ok() {
            seen.push(format!("{what}: {status}, honoured as a key"));
        } else {
            seen.push(format!("{what}: {status}, ignored"));
            warnings.push(format!(
                "the {what} key was ignored: the request ran again under it ({status}, then {}: \
                 {} and {}), so its client's retries are not protected and nothing told it; \
                 refuse it with 400",
                again.status.as_u16(),
                api.identity(&answer),
                api.identity(&again)
            ));
        }
    }
    if !problems.is_empty() {
        return Err(Finding::Fail(problems));
    }
    Ok(Seen {
        detail: seen.join(", "),
        warnings,
    })
}

/// Tenant B's request under tenant A's key runs as B's own.
pub(crate) async fn tenant_scope(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    if api.prepared.tenant_b.is_none() {
        return not_applicable("no [tenant_b] credentials configured");
    }
    let call_a = api.call(Kind::Valid, Tenant::A, Some(api.fresh_key()));
    let call_b = Call {
        tenant: Tenant::B,
        ..call_a.clone()
    };
    let first = p.send_ok("tenant A", &call_a).await?;
    let other = p.send("tenant B, same key and body", &call_b).await?;
    if api.replayed(&other) == Some(true) || body_difference(&first.body, &other.body).is_none() {
        return fail("tenant B got tenant A's response: keys are shared across tenants");
    }
    if let (Some(a), Some(b)) = (api.id(&first), api.id(&other))
        && a == b
    {
        return fail(format!(
            "tenant B was answered with tenant A's id {a}: keys are shared across tenants"
        ));
    }
    if !other.status.is_success() {
        return fail(format!(
            "tenant B's request was answered {}: it did not run as B's own (tenant A's use of the \
             key shows through)",
            other.status.as_u16()
        ));
    }
    let again = p.send("tenant A again", &call_a).await?;
    same_execution(&api, &first, &again, "tenant A's retry")?;
    pass(format!(
        "B ran as its own ({}, {}); A's retry still replays A's",
        other.status.as_u16(),
        api.identity(&other)
    ))
}

/// A `5xx` is not stored: its retry is no replay (where the API marks replays), and the
/// corrected request under the same key runs, which any API shows.
pub(crate) async fn server_error(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    if api.config.server_error.is_none() {
        return not_applicable("no [server_error] request configured to provoke a 5xx");
    }
    let key = api.fresh_key();
    let call = api.call(Kind::ServerError, Tenant::A, Some(key.clone()));
    let first = p.send("first", &call).await?;
    if !first.status.is_server_error() {
        let status = first.status.as_u16();
        return Err(Finding::Fail(vec![Problem::hinted(
            Hint::Refused(status),
            format!("the [server_error] request was answered {status}, not 5xx"),
        )]));
    }
    let mut told = String::new();
    if let Some(marker) = api.config.replay_header.clone() {
        let retry = p.send("retry", &call).await?;
        if api.replayed(&retry) == Some(true) {
            return fail(format!(
                "the retry got the stored {} ({marker}): a 5xx was stored, so the retry can never \
                 succeed",
                retry.status.as_u16()
            ));
        }
        told = format!(
            ", the retry ran again ({}, no {marker})",
            retry.status.as_u16()
        );
    }
    let fixed = api.call(Kind::Valid, Tenant::A, Some(key));
    let answer = p.send("corrected, same key", &fixed).await?;
    let status = answer.status.as_u16();
    if answer.status == first.status && body_difference(&first.body, &answer.body).is_none() {
        return fail(format!(
            "the corrected request got the stored {status}: a 5xx was stored, so no retry under \
             the key can succeed"
        ));
    }
    if !answer.status.is_success() {
        return fail(format!(
            "the corrected request was answered {status}: the {} kept the key bound to the \
             request that failed",
            first.status.as_u16()
        ));
    }
    pass(format!(
        "{}{told}, and the corrected request ran ({status})",
        first.status.as_u16()
    ))
}

/// A validation failure is not stored: the corrected request under the same key runs.
pub(crate) async fn validation(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    if api.config.invalid.is_none() {
        return not_applicable("no [invalid] request configured");
    }
    let key = api.fresh_key();
    let invalid = api.call(Kind::Invalid, Tenant::A, Some(key.clone()));
    let failed = p.send("invalid", &invalid).await?;
    if !failed.status.is_client_error() {
        return fail(format!(
            "the [invalid] request was answered {}, not 4xx",
            failed.status.as_u16()
        ));
    }
    let fixed = api.call(Kind::Valid, Tenant::A, Some(key));
    let answer = p.send("corrected, same key", &fixed).await?;
    if api.replayed(&answer) == Some(true) || body_difference(&failed.body, &answer.body).is_none()
    {
        return fail(format!(
            "the corrected request got the stored validation error ({})",
            answer.status.as_u16()
        ));
    }
    if !answer.status.is_success() {
        return fail(format!(
            "the corrected request was answered {}: the validation failure was stored under the key",
            answer.status.as_u16()
        ));
    }
    pass(format!(
        "{}, then the corrected request ran ({})",
        failed.status.as_u16(),
        answer.status.as_u16()
    ))
}

/// The retention header is well formed, in the future and replayed.
pub(crate) async fn retention(p: &mut Probe) -> Outcome {
    let api = p.api.clone();
    let Some(name) = api.prepared.retention_header.clone() else {
        return not_applicable("no retention_header configured");
    };
    let call = api.call(Kind::Valid, Tenant::A, Some(api.fresh_key()));
    let first = p.send_ok("first", &call).await?;
    let Some(value) = first.headers.get(&name).cloned() else {
        return fail(format!("the first response has no {name} header"));
    };
    let moment = match retention_moment(&value) {
        Ok(moment) => moment,
        Err(err) => return fail(format!("{name}: {err}")),
    };
    let now = server_now(&first);
    let Ok(ahead) = moment.duration_since(now) else {
        return fail(format!("{name}: {value:?} is in the past"));
    };
    if ahead.is_zero() {
        return fail(format!("{name}: {value:?} is now, not in the future"));
    }
    let retry = p.send("retry", &call).await?;
    let replayed: Vec<_> = retry.headers.get_all(&name).iter().collect();
    if replayed != [&value] {
        return fail(format!(
            "{name}: the first response has {value:?}, the replay {replayed:?}"
        ));
    }
    pass(format!(
        "{name}: {} ({} s ahead), the same on replay",
        String::from_utf8_lossy(value.as_bytes()),
        ahead.as_secs()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Config;

    fn api() -> Arc<Api> {
        let config = Config::new("http://127.0.0.1:1", "/a", "{{unique}}");
        let prepared = config.prepare().expect("a valid config");
        Api::new(config, prepared, reqwest::Client::new())
    }

    /// An answer sent `sent` ms and done `done` ms after the burst left.
    fn answer(start: Instant, sent: u64, done: u64) -> Answer {
        Answer {
            status: StatusCode::CREATED,
            headers: Default::default(),
            body: b"{}".to_vec(),
            sent: start + Duration::from_millis(sent),
            done: start + Duration::from_millis(done),
        }
    }

    #[test]
    fn the_overlap_is_said_only_where_the_clock_can_tell_it() {
        let (api, start) = (api(), Instant::now());
        // A 100 ms execution, the others in flight across its midpoint: they waited.
        let slow = [
            answer(start, 0, 100),
            answer(start, 1, 105),
            answer(start, 2, 104),
        ];
        let slow: Vec<_> = slow.iter().collect();
        assert!(overlap(&api, &slow).contains("the 2 others waited"));
        // One sent after the midpoint may have come after it.
        let late = [answer(start, 0, 100), answer(start, 70, 110)];
        let late: Vec<_> = late.iter().collect();
        assert!(overlap(&api, &late).contains("1 of the others came after"));
        // A 1 ms execution tells neither.
        let fast = [answer(start, 0, 1), answer(start, 0, 2)];
        let fast: Vec<_> = fast.iter().collect();
        assert!(
            overlap(&api, &fast).contains("too short to tell"),
            "{}",
            overlap(&api, &fast)
        );
    }
}
