//! The runner against servers built to fool it or to wear it out: executions that read alike,
//! bodies that never end or never finish, redirects, error pages of many lines, and configs that
//! do not match the API. Each must end in a verdict that names what happened, once.

mod support;

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use support::broken_server::{Bug, Server};
use support::{config_path, failing, report};
use tower_idempotency_conformance::Verdict;

/// With no id and no replay header configured, executions are told apart by their whole bodies:
/// eight runs whose answers share their first 400 bytes and their length, differing only in the
/// id at the end, are eight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn executions_alike_but_for_their_last_bytes_are_told_apart() {
    let report = report(Bug::SamePrefix, |config| {
        config.id_pointer = None;
        config.replay_header = None;
    })
    .await;
    assert_eq!(
        failing(&report),
        BTreeSet::from(["concurrent-duplicates"]),
        "{}",
        report.table()
    );
    let detail = report
        .check("concurrent-duplicates")
        .unwrap()
        .verdict
        .detail();
    assert!(
        detail.starts_with(
            "8 concurrent duplicates executed 8 times: 8 different bodies; the bodies differ from \
             byte 4"
        ),
        "{detail}"
    );
}

/// An answer that never ends is read up to `max_body_bytes`, and the report says so.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_endless_body_is_read_up_to_the_limit_and_said() {
    let started = Instant::now();
    let report = report(Bug::EndlessBody, |config| {
        config.max_body_bytes = 64 * 1024;
        config.pause = Duration::from_millis(100);
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let detail = report.check("replay").unwrap().verdict.detail();
    assert_eq!(
        detail,
        "the first request got no answer: 201 Created, and its body is longer than \
         max_body_bytes (65536 bytes): the read stopped there"
    );
    // Every check that needs a created object fails; those that need none still pass.
    assert_eq!(
        failing(&report),
        BTreeSet::from([
            "replay",
            "concurrent-duplicates",
            "key-reuse",
            "tenant-scope",
            "server-error-not-stored",
            "validation-not-stored",
            "retention",
            "replay-after-pause",
        ]),
        "{}",
        report.table()
    );
}

/// An answer whose body trickles and never finishes is ended by `timeout_ms`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickling_body_is_ended_by_the_timeout() {
    let started = Instant::now();
    let report = report(Bug::TrickleBody, |config| {
        config.timeout = Duration::from_millis(500);
        config.pause = Duration::from_millis(100);
    })
    .await;
    assert!(
        started.elapsed() < Duration::from_secs(30),
        "{:?}",
        started.elapsed()
    );
    let Verdict::Fail {
        detail, exchanges, ..
    } = &report.check("replay").unwrap().verdict
    else {
        panic!("{}", report.table())
    };
    assert!(
        detail.starts_with(
            "the first request got no answer: 201 Created, and its body could not be read whole"
        ),
        "{detail}"
    );
    assert!(
        detail.ends_with("no complete answer within timeout_ms (500 ms)"),
        "{detail}"
    );
    assert!(exchanges[0].error.is_some(), "{exchanges:?}");
}

/// A redirect is not followed: each check that needed its request to run fails, and the
/// redirect is named once as their cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redirect_is_reported_once_not_followed() {
    let report = report(Bug::Redirect, |config| {
        config.pause = Duration::from_millis(100);
    })
    .await;
    assert_eq!(report.causes.len(), 1, "{}", report.table());
    let cause = &report.causes[0];
    assert!(
        cause.cause.starts_with(
            "requests these checks need to run were answered 307 (a redirect, which the runner \
             does not follow)"
        ),
        "{}",
        cause.cause
    );
    assert_eq!(
        cause.checks,
        [
            "replay",
            "concurrent-duplicates",
            "key-reuse",
            "tenant-scope",
            "server-error-not-stored",
            "retention",
            "replay-after-pause",
        ]
    );
    let table = report.table();
    assert_eq!(table.matches("a redirect, which").count(), 1, "{table}");
    let detail = report.check("replay").unwrap().verdict.detail();
    assert_eq!(
        detail,
        "the first request was redirected (307 to /things): the runner follows no redirect; set \
         base_url and path to where the API answers"
    );
}

/// A config whose replay header is not the one the API sends fails the checks that look for it;
/// the header is named once as the cause.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_header_the_api_never_sends_is_named_once() {
    let report = report(Bug::None, |config| {
        config.replay_header = Some("X-Replayed".into());
    })
    .await;
    assert_eq!(
        failing(&report),
        BTreeSet::from(["replay", "replay-after-pause"]),
        "{}",
        report.table()
    );
    assert_eq!(report.causes.len(), 1, "{}", report.table());
    assert_eq!(report.causes[0].checks, ["replay", "replay-after-pause"]);
    assert!(
        report.causes[0]
            .cause
            .starts_with("replay_header = \"X-Replayed\": no answer of the run carried it"),
        "{:?}",
        report.causes
    );
    let table = report.table();
    assert_eq!(
        table.matches("no answer of the run carried it").count(),
        1,
        "{table}"
    );
    assert!(table.contains("[cause 1]"), "{table}");
}

/// Requests without the credentials the API wants: one cause, behind every check that needs a
/// request to run.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn missing_credentials_are_named_once() {
    let report = report(Bug::None, |config| {
        config.tenant_a.clear();
        config.pause = Duration::from_millis(100);
    })
    .await;
    assert_eq!(report.causes.len(), 1, "{}", report.table());
    let cause = &report.causes[0];
    assert!(
        cause
            .cause
            .starts_with("requests these checks need to run were answered 401: ")
    );
    assert!(cause.checks.len() >= 6, "{cause:?}");
    for check in report.failed() {
        let Verdict::Fail { cause: named, .. } = &check.verdict else {
            unreachable!()
        };
        if cause.checks.contains(&check.name) {
            assert_eq!(named.as_ref(), Some(&cause.cause), "{}", check.name);
        }
    }
}

/// An `id_pointer` that finds nothing fails no check (bodies are compared whole) but is noted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_id_pointer_that_finds_nothing_is_noted() {
    let report = report(Bug::None, |config| config.id_pointer = Some("/nope".into())).await;
    assert_eq!(report.summary.fail, 0, "{}", report.table());
    assert_eq!(report.notes.len(), 1, "{:?}", report.notes);
    assert!(
        report.notes[0].starts_with("id_pointer = \"/nope\" found nothing in any of the "),
        "{:?}",
        report.notes
    );
}

/// Duplicates held until the first execution is done and answered with its replay: the pass
/// says they waited, not that they may have come late.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_that_wait_and_replay_are_said_to_have_waited() {
    let report = report(Bug::WaitsAndReplays, |_| {}).await;
    assert_eq!(report.summary.fail, 0, "{}", report.table());
    let detail = report
        .check("concurrent-duplicates")
        .unwrap()
        .verdict
        .detail();
    assert!(
        detail.contains("7 replays, 0 x 409; a later retry got the same; no 409: the 7 others waited for the execution"),
        "{detail}"
    );
}

/// Error pages of many lines are quoted on one line each, and cut.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn error_pages_are_quoted_on_one_line_and_cut() {
    let report = report(Bug::HtmlErrors, |_| {}).await;
    assert_eq!(
        failing(&report),
        BTreeSet::from(["server-error-not-stored", "validation-not-stored"]),
        "{}",
        report.table()
    );
    let table = report.table();
    assert!(!table.contains("\n<html>"), "{table}");
    let quoted = (table.lines())
        .filter(|line| line.contains("body: `<!DOCTYPE html>\\n<html>\\n<head>"))
        .collect::<Vec<_>>();
    assert!(!quoted.is_empty(), "{table}");
    let whole = format!("`... ({} bytes)", support::broken_server::HTML_ERROR.len());
    for line in quoted {
        assert!(line.ends_with(&whole), "{line}");
    }
}

/// A reader that stops reading (`| head`) leaves the run's verdict in the exit status, its
/// report files written, and no panic.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_closed_stdout_ends_quietly_with_the_report_files_written() {
    let server = Server::start(Bug::NoScope).await;
    let junit = std::env::temp_dir().join(format!("conformance-closed-{}.xml", std::process::id()));
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_idempotency-conformance"))
        .args([
            config_path().to_str().unwrap(),
            "--base-url",
            &server.url(),
            "--json",
        ])
        .arg("--junit")
        .arg(&junit)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("the binary runs");
    // Closed before the report is written.
    drop(child.stdout.take());
    let output = tokio::task::spawn_blocking(move || child.wait_with_output())
        .await
        .unwrap()
        .expect("the binary ends");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(output.status.code(), Some(1), "{stderr}");
    assert!(stderr.is_empty(), "{stderr}");
    let xml = std::fs::read_to_string(&junit).expect("--junit wrote the file");
    let _ = std::fs::remove_file(&junit);
    assert!(
        xml.contains("name=\"tenant-scope\"><failure message="),
        "{xml}"
    );
}

/// A server that fails (5xx) or throttles (429) is no setting's fault: no cause blames the config.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failing_server_is_not_blamed_on_the_config() {
    let report = report(Bug::AlwaysUnavailable, |config| {
        config.pause = Duration::from_millis(100);
    })
    .await;
    assert!(report.failed().count() >= 6, "{}", report.table());
    assert!(report.causes.is_empty(), "{:?}", report.causes);
}
