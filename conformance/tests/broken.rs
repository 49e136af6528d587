//! The runner against a server with one bug at a time: the correct server passes every check, and
//! each bug fails exactly the checks whose rule it breaks. Then the command line's outputs and
//! exit statuses.

mod support;

use std::collections::BTreeSet;
use std::time::Duration;

use support::broken_server::{Bug, Server};
use support::{config, config_path, failing, report};
use tower_idempotency_conformance::{CHECKS, Config, Report, RunError, Verdict, run};

/// Runs every check against a server with `bug` and expects `failing` to fail, no other.
async fn fails_exactly(bug: Bug, expected: &[&str]) -> Report {
    let report = report(bug, |_| {}).await;
    assert_eq!(
        failing(&report),
        expected.iter().copied().collect::<BTreeSet<_>>(),
        "{}",
        report.table()
    );
    assert_eq!(report.summary.not_applicable, 0, "{}", report.table());
    if bug != Bug::NoRetryAfter {
        assert_eq!(report.summary.warn, 0, "{}", report.table());
    }
    assert_eq!(report.exit_code(), u8::from(!expected.is_empty()));
    report
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_correct_server_passes_every_check() {
    let report = fails_exactly(Bug::None, &[]).await;
    assert_eq!(report.summary.pass, CHECKS.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_lock_executes_concurrent_duplicates_more_than_once() {
    let report = fails_exactly(Bug::NoLock, &["concurrent-duplicates"]).await;
    let detail = report
        .check("concurrent-duplicates")
        .unwrap()
        .verdict
        .detail();
    assert!(
        detail.starts_with("8 concurrent duplicates executed 8 times"),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_scope_gives_tenant_b_tenant_as_response() {
    let report = fails_exactly(Bug::NoScope, &["tenant-scope"]).await;
    let Verdict::Fail {
        detail, exchanges, ..
    } = &report.check("tenant-scope").unwrap().verdict
    else {
        unreachable!()
    };
    assert!(
        detail.contains("keys are shared across tenants"),
        "{detail}"
    );
    // What was sent and seen: B's request, its key and the replay header it got.
    let b = &exchanges[1];
    assert_eq!((b.tenant, b.status), ('b', Some(201)));
    assert!(b.key.is_some());
    assert!(
        b.headers
            .iter()
            .any(|(name, _)| name == "idempotent-replayed"),
        "{b:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_timestamp_on_replay_is_not_the_first_response() {
    let report = fails_exactly(Bug::FreshTimestamp, &["replay", "replay-after-pause"]).await;
    let detail = report.check("replay").unwrap().verdict.detail();
    assert!(detail.contains("the bodies differ from byte"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_fingerprint_answers_another_body_with_the_first_response() {
    fails_exactly(Bug::NoFingerprint, &["key-reuse"]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn optional_keys_run_without_or_with_a_malformed_key() {
    let report = fails_exactly(Bug::KeysOptional, &["missing-key", "malformed-key"]).await;
    let Verdict::Fail { problems, .. } = &report.check("malformed-key").unwrap().verdict else {
        unreachable!()
    };
    assert_eq!(
        problems,
        &[
            "the empty key was not refused with 4xx: 201",
            "the 300 characters key was not refused with 4xx: 201",
            "the non-ASCII key was not refused with 4xx: 201",
        ]
    );
}

/// Where keys are optional, a malformed key may be honoured as a key or refused; one dropped in
/// silence leaves its client's retries unprotected, which the draft does not forbid: a warning,
/// each key named.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_malformed_key_ignored_where_keys_are_optional_warns() {
    let server = Server::start(Bug::KeysOptional).await;
    let mut config = config(&server);
    config.keys_required = false;
    let report = run(&config).await.expect("the server answers");
    println!("{}", report.table());
    assert_eq!(failing(&report), BTreeSet::new(), "{}", report.table());
    let Verdict::Warn { detail, warnings } = &report.check("malformed-key").unwrap().verdict else {
        panic!("{}", report.table())
    };
    assert_eq!(
        detail,
        "empty: 201, ignored, 300 characters: 201, ignored, non-ASCII: 201, ignored"
    );
    assert_eq!(warnings.len(), 3, "{warnings:?}");
    assert!(
        warnings[1].starts_with("the 300 characters key was ignored: the request ran again"),
        "{warnings:?}"
    );
    let verdict = &report.check("missing-key").unwrap().verdict;
    assert!(
        matches!(verdict, Verdict::NotApplicable { .. }),
        "{verdict:?}"
    );

    // The correct server refuses them, keys optional or not.
    let server = Server::start(Bug::None).await;
    let mut config = self::config(&server);
    config.keys_required = false;
    let report = run(&config).await.expect("the server answers");
    let verdict = &report.check("malformed-key").unwrap().verdict;
    assert_eq!(
        verdict,
        &Verdict::Pass {
            detail: "empty: 400, 300 characters: 400, non-ASCII: 400".into()
        }
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stored_errors_are_replayed() {
    fails_exactly(
        Bug::StoresErrors,
        &["server-error-not-stored", "validation-not-stored"],
    )
    .await;
}

/// The draft asks for a `409`, not for its `Retry-After`: a warning, not a failure.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_409_without_retry_after_warns() {
    let report = fails_exactly(Bug::NoRetryAfter, &[]).await;
    let Verdict::Warn { warnings, .. } = &report.check("concurrent-duplicates").unwrap().verdict
    else {
        panic!("{}", report.table())
    };
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(
        warnings[0].contains("got 409 without Retry-After: the draft does not require it"),
        "{warnings:?}"
    );
    assert_eq!((report.summary.warn, report.exit_code()), (1, 0));
}

/// Without a replay header, a stored `5xx` still shows: the corrected request under its key is
/// refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stored_5xx_shows_without_a_replay_header() {
    for (bug, failing_checks) in [
        (Bug::None, vec![]),
        (
            Bug::StoresErrors,
            vec!["server-error-not-stored", "validation-not-stored"],
        ),
    ] {
        let server = Server::start(bug).await;
        let mut config = config(&server);
        config.replay_header = None;
        let report = run(&config).await.expect("the server answers");
        println!("{bug:?}, no replay header:\n{}", report.table());
        assert_eq!(
            failing(&report),
            failing_checks.into_iter().collect(),
            "{}",
            report.table()
        );
        let detail = report
            .check("server-error-not-stored")
            .unwrap()
            .verdict
            .detail();
        let expected = match bug {
            Bug::None => "503, and the corrected request ran (201)",
            _ => {
                "the corrected request was answered 422: the 503 kept the key bound to the request \
                 that failed"
            }
        };
        assert_eq!(detail, expected);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_record_forgotten_before_the_pause_fails() {
    let report = fails_exactly(Bug::ShortMemory, &["replay-after-pause"]).await;
    let detail = report.check("replay-after-pause").unwrap().verdict.detail();
    assert!(
        detail.starts_with("the retry 1500 ms later ran again: id thing_"),
        "{detail}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retention_moment_in_the_past_fails() {
    let report = fails_exactly(Bug::StaleRetention, &["retention"]).await;
    let detail = report.check("retention").unwrap().verdict.detail();
    assert!(detail.ends_with("is in the past"), "{detail}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn checks_without_their_config_are_not_applicable_and_say_why() {
    let server = Server::start(Bug::None).await;
    let mut config = Config::new(
        server.url(),
        "/things",
        r#"{"name": "{{unique}}", "amount": 100}"#,
    );
    config
        .tenant_a
        .insert("Authorization".into(), "Bearer alice".into());
    config.keys_required = false;
    config.pause = Duration::from_millis(100);
    let report = run(&config).await.expect("the server answers");
    println!("{}", report.table());
    let reasons: Vec<_> = (report.checks.iter())
        .filter_map(|check| match &check.verdict {
            Verdict::NotApplicable { reason } => Some((check.name, reason.as_str())),
            _ => None,
        })
        .collect();
    assert_eq!(
        reasons,
        [
            (
                "missing-key",
                "keys_required = false: a request without a key runs as usual"
            ),
            ("tenant-scope", "no [tenant_b] credentials configured"),
            (
                "server-error-not-stored",
                "no [server_error] request configured to provoke a 5xx"
            ),
            ("validation-not-stored", "no [invalid] request configured"),
            ("retention", "no retention_header configured"),
        ]
    );
    assert_eq!(report.summary.pass, 5, "{}", report.table());
    assert_eq!(report.exit_code(), 0);
}

#[tokio::test]
async fn an_unreachable_api_stops_the_run() {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = closed.local_addr().unwrap();
    drop(closed);
    let config = Config::new(format!("http://{addr}"), "/things", "{{unique}}");
    let err = run(&config).await.unwrap_err();
    assert!(matches!(err, RunError::Unreachable { .. }), "{err:?}");
    assert!(err.to_string().contains("is unreachable"), "{err}");
}

/// The command line: its exit status, stdout and stderr.
async fn cli(args: &[&str]) -> (i32, String, String) {
    let output = tokio::process::Command::new(env!("CARGO_BIN_EXE_idempotency-conformance"))
        .args(args)
        .output()
        .await
        .expect("the binary runs");
    (
        output.status.code().expect("an exit status"),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_command_line_exits_0_1_or_2_and_writes_json_and_junit() {
    let (good, bad) = (
        Server::start(Bug::None).await,
        Server::start(Bug::NoScope).await,
    );
    let config = config_path();
    let config = config.to_str().unwrap();
    let junit = std::env::temp_dir().join(format!("conformance-{}.xml", std::process::id()));
    let junit_arg = junit.to_str().unwrap();

    let (code, stdout, stderr) = cli(&[config, "--base-url", &good.url(), "--json"]).await;
    assert_eq!(code, 0, "{stdout}{stderr}");
    let json: serde_json::Value = serde_json::from_str(&stdout).expect("--json prints JSON");
    assert_eq!(json["summary"]["pass"], CHECKS.len());

    let args = [config, "--base-url", &bad.url(), "--junit", junit_arg];
    let (code, stdout, stderr) = cli(&args).await;
    assert_eq!(code, 1, "{stdout}{stderr}");
    let line = stdout
        .lines()
        .find(|line| line.starts_with("tenant-scope "));
    assert!(line.is_some_and(|line| line.contains(" FAIL ")), "{stdout}");
    let xml = std::fs::read_to_string(&junit).expect("--junit writes the file");
    let _ = std::fs::remove_file(&junit);
    assert!(xml.contains("failures=\"1\""), "{xml}");
    assert!(
        xml.contains("name=\"tenant-scope\"><failure message="),
        "{xml}"
    );

    let (code, _, stderr) = cli(&["no/such.toml"]).await;
    assert_eq!(code, 2);
    assert!(
        stderr.contains("cannot read the config file no/such.toml"),
        "{stderr}"
    );

    let (code, _, stderr) = cli(&[config, "--base-url", "http://127.0.0.1:1"]).await;
    assert_eq!(code, 2);
    assert!(stderr.contains("is unreachable"), "{stderr}");

    let (code, _, stderr) = cli(&[config, "--base-url", "not a url"]).await;
    assert_eq!(code, 2);
    assert!(stderr.contains("`base_url` is not a URL"), "{stderr}");
}
