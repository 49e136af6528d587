//! What a run found: one verdict per check, written as a table for people, JSON and JUnit XML
//! for CI.

use std::fmt::{self, Write as _};

use serde::Serialize;

/// The outcome of one check.
///
/// ```
/// use tower_idempotency_conformance::Verdict;
///
/// let verdict = Verdict::NotApplicable { reason: "no tenant_b configured".into() };
/// assert_eq!(verdict.label(), "n/a");
/// assert!(!verdict.is_fail());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "verdict", rename_all = "snake_case")]
#[non_exhaustive]
pub enum Verdict {
    /// The API did what the rule asks.
    Pass {
        /// What was seen, in one line.
        detail: String,
    },
    /// The API did what the draft requires, but not something it recommends or that clients rely
    /// on without the draft requiring it (a `409` without `Retry-After`). Not a failure: the exit
    /// status stays 0.
    Warn {
        /// What was seen, in one line.
        detail: String,
        /// Each thing missing, in one line, with why it matters.
        warnings: Vec<String>,
    },
    /// The API broke the rule.
    Fail {
        /// The first problem, in one line.
        detail: String,
        /// Every problem the check found, the first included, one line each.
        problems: Vec<String>,
        /// The run-wide cause this failure shares with others, when one was found (a setting
        /// of the config that does not match the API): also in [`Report::causes`].
        cause: Option<String>,
        /// Every request the check sent, and what came back.
        exchanges: Vec<Exchange>,
    },
    /// The check does not apply to this API as configured.
    NotApplicable {
        /// Why, and what to configure to run it.
        reason: String,
    },
}

impl Verdict {
    /// `pass`, `warn`, `FAIL` or `n/a`.
    pub fn label(&self) -> &'static str {
        match self {
            Self::Pass { .. } => "pass",
            Self::Warn { .. } => "warn",
            Self::Fail { .. } => "FAIL",
            Self::NotApplicable { .. } => "n/a",
        }
    }

    /// Whether this is a failure.
    pub fn is_fail(&self) -> bool {
        matches!(self, Self::Fail { .. })
    }

    /// The detail of a pass, a warning or a failure (its first problem), or the reason a check
    /// does not apply.
    pub fn detail(&self) -> &str {
        match self {
            Self::Pass { detail } | Self::Warn { detail, .. } | Self::Fail { detail, .. } => detail,
            Self::NotApplicable { reason } => reason,
        }
    }
}

/// A setting of the config that one API behaviour contradicts, behind several failures: named once,
/// with the checks it failed.
///
/// ```
/// use tower_idempotency_conformance::Report;
///
/// assert!(Report::default().causes.is_empty());
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Cause {
    /// What the run saw, and what to check.
    pub cause: String,
    /// The checks it failed.
    pub checks: Vec<&'static str>,
}

/// One request a check sent and what came back: what a failure shows.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Exchange {
    /// The request's part in the check (`first`, `retry`, `duplicate 3`).
    pub step: String,
    /// The method.
    pub method: String,
    /// The path.
    pub path: String,
    /// Which tenant's credentials it carried: `a` or `b`.
    pub tenant: char,
    /// The key header's value as sent, shortened when long; none when no key was sent.
    pub key: Option<String>,
    /// The answer's status; none when no answer came.
    pub status: Option<u16>,
    /// The answer's headers that the checks look at (content type, `Retry-After`, the replay
    /// and retention headers, those compared on replay), in the order received.
    pub headers: Vec<(String, String)>,
    /// The start of the answer's body (at most 300 bytes, as text).
    pub body: String,
    /// The length of the answer's body.
    pub body_bytes: usize,
    /// How long the answer took, from sending to its body's last byte; none when no answer came.
    pub elapsed_ms: Option<u64>,
    /// Why no answer came (a timeout, a refused connection).
    pub error: Option<String>,
}

impl fmt::Display for Exchange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let key = self.key.as_deref().unwrap_or("(none)");
        write!(
            f,
            "{}: {} {} as tenant {}, key {key} -> ",
            self.step, self.method, self.path, self.tenant
        )?;
        match (self.status, &self.error) {
            (_, Some(error)) => write!(f, "no answer: {error}"),
            (Some(status), None) => {
                write!(f, "{status}")?;
                for (name, value) in &self.headers {
                    write!(f, "; {name}: {value}")?;
                }
                let body = crate::api::quote(self.body.as_bytes(), self.body_bytes);
                write!(f, "; body: {body}")
            }
            (None, None) => write!(f, "no answer"),
        }
    }
}

/// One check's result.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct CheckResult {
    /// The check's stable name (`replay`, `concurrent-duplicates`, ...).
    pub name: &'static str,
    /// What it checks, in a few words.
    pub title: &'static str,
    /// The rule it checks: the draft's section, or Stripe's documented rule.
    pub citation: &'static str,
    /// The verdict, with its detail.
    #[serde(flatten)]
    pub verdict: Verdict,
}

/// Every check's result, in the order of [`CHECKS`](crate::CHECKS).
///
/// ```
/// use tower_idempotency_conformance::Report;
///
/// let report = Report::default();
/// assert_eq!(report.exit_code(), 0);
/// assert!(report.failed().next().is_none());
/// ```
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Report {
    /// The endpoint checked, `METHOD URL`.
    pub endpoint: String,
    /// How many checks passed, warned, failed and did not apply.
    pub summary: Summary,
    /// The results.
    pub checks: Vec<CheckResult>,
    /// Settings of the config that several failures share as their cause, each named once.
    pub causes: Vec<Cause>,
    /// What the run noticed about the config that failed no check (an `id_pointer` that found
    /// nothing), one line each.
    pub notes: Vec<String>,
}

/// The counts of a [`Report`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[non_exhaustive]
pub struct Summary {
    /// Checks passed.
    pub pass: usize,
    /// Checks passed with a warning.
    pub warn: usize,
    /// Checks failed.
    pub fail: usize,
    /// Checks not applicable.
    pub not_applicable: usize,
}

impl Report {
    pub(crate) fn new(
        endpoint: String,
        checks: Vec<CheckResult>,
        causes: Vec<Cause>,
        notes: Vec<String>,
    ) -> Self {
        let mut summary = Summary::default();
        for check in &checks {
            match check.verdict {
                Verdict::Pass { .. } => summary.pass += 1,
                Verdict::Warn { .. } => summary.warn += 1,
                Verdict::Fail { .. } => summary.fail += 1,
                Verdict::NotApplicable { .. } => summary.not_applicable += 1,
            }
        }
        Self {
            endpoint,
            summary,
            checks,
            causes,
            notes,
        }
    }

    /// The checks that failed.
    pub fn failed(&self) -> impl Iterator<Item = &CheckResult> {
        self.checks.iter().filter(|check| check.verdict.is_fail())
    }

    /// The result of the check named `name`.
    pub fn check(&self, name: &str) -> Option<&CheckResult> {
        self.checks.iter().find(|check| check.name == name)
    }

    /// The command line's exit status: 0 when every check passed or did not apply, 1 when one
    /// failed.
    pub fn exit_code(&self) -> u8 {
        u8::from(self.summary.fail > 0)
    }

    /// The report as a table (check, verdict, detail), then each failure's exchanges.
    ///
    /// ```
    /// use tower_idempotency_conformance::Report;
    ///
    /// assert!(Report::default().table().contains("check"));
    /// ```
    pub fn table(&self) -> String {
        let name_width = (self.checks.iter().map(|check| check.name.len()))
            .chain([5])
            .max()
            .unwrap_or(5);
        let mut out = String::new();
        let _ = writeln!(out, "{:name_width$}  verdict  detail", "check");
        let _ = writeln!(out, "{:-<name_width$}  -------  ------", "");
        for check in &self.checks {
            let _ = write!(
                out,
                "{:name_width$}  {:7}  {}",
                check.name,
                check.verdict.label(),
                check.verdict.detail()
            );
            match &check.verdict {
                Verdict::Fail {
                    problems,
                    cause: Some(cause),
                    ..
                } => {
                    let number = self.causes.iter().position(|c| c.cause == *cause);
                    let _ = write!(out, " [cause {}]", number.map_or(0, |n| n + 1));
                    more(&mut out, problems.len());
                }
                Verdict::Fail { problems, .. } => more(&mut out, problems.len()),
                Verdict::Warn { warnings, .. } => {
                    let _ = write!(out, " (warning below)");
                    more(&mut out, warnings.len());
                }
                _ => {}
            }
            out.push('\n');
        }
        let Summary {
            pass,
            warn,
            fail,
            not_applicable,
        } = self.summary;
        let _ = writeln!(
            out,
            "\n{pass} passed, {warn} warned, {fail} failed, {not_applicable} not applicable ({})",
            self.endpoint
        );
        for (n, cause) in self.causes.iter().enumerate() {
            let _ = writeln!(
                out,
                "\ncause {}, behind {}: {}",
                n + 1,
                cause.checks.join(", "),
                cause.cause
            );
        }
        for note in &self.notes {
            let _ = writeln!(out, "\nnote: {note}");
        }
        for check in &self.checks {
            match &check.verdict {
                Verdict::Warn { warnings, .. } => {
                    let _ = writeln!(out, "\n{} ({}): warning", check.name, check.citation);
                    for warning in warnings {
                        let _ = writeln!(out, "  - {warning}");
                    }
                }
                Verdict::Fail {
                    problems,
                    exchanges,
                    ..
                } => {
                    let _ = writeln!(
                        out,
                        "\n{} ({}): {}",
                        check.name, check.citation, check.title
                    );
                    // One problem is the table's line already.
                    if problems.len() > 1 {
                        for problem in problems {
                            let _ = writeln!(out, "  - {problem}");
                        }
                    }
                    for exchange in exchanges {
                        let _ = writeln!(out, "  {exchange}");
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// The report as JSON: the endpoint, the summary, and each check with its verdict, detail
    /// and, for a failure, its exchanges.
    ///
    /// ```
    /// use tower_idempotency_conformance::Report;
    ///
    /// let json: serde_json::Value = serde_json::from_str(&Report::default().json()).unwrap();
    /// assert_eq!(json["summary"]["fail"], 0);
    /// ```
    pub fn json(&self) -> String {
        serde_json::to_string_pretty(self).unwrap_or_else(|err| format!("{{\"error\": \"{err}\"}}"))
    }

    /// The report as JUnit XML: one test case per check, a failure with its exchanges, a
    /// non-applicable check skipped with its reason.
    ///
    /// ```
    /// use tower_idempotency_conformance::Report;
    ///
    /// assert!(Report::default().junit().contains("<testsuite name=\"idempotency-conformance\""));
    /// ```
    pub fn junit(&self) -> String {
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n");
        let _ = writeln!(
            out,
            "<testsuites tests=\"{}\" failures=\"{}\" skipped=\"{}\">",
            self.checks.len(),
            self.summary.fail,
            self.summary.not_applicable
        );
        let _ = writeln!(
            out,
            "  <testsuite name=\"idempotency-conformance\" tests=\"{}\" failures=\"{}\" \
             errors=\"0\" skipped=\"{}\">",
            self.checks.len(),
            self.summary.fail,
            self.summary.not_applicable
        );
        let _ = writeln!(
            out,
            "    <properties><property name=\"endpoint\" value=\"{}\"/></properties>",
            xml(&self.endpoint)
        );
        for check in &self.checks {
            let _ = write!(
                out,
                "    <testcase classname=\"idempotency-conformance\" name=\"{}\">",
                xml(check.name)
            );
            match &check.verdict {
                Verdict::Pass { detail } => {
                    let _ = write!(out, "<system-out>{}</system-out>", xml(detail));
                }
                Verdict::Warn { detail, warnings } => {
                    let mut text = format!("{detail}\n");
                    for warning in warnings {
                        let _ = writeln!(text, "warning: {warning}");
                    }
                    let _ = write!(out, "<system-out>{}</system-out>", xml(&text));
                }
                Verdict::Fail {
                    detail,
                    problems,
                    cause,
                    exchanges,
                } => {
                    let mut text = format!("{}\n{}\n", check.citation, check.title);
                    if let Some(cause) = cause {
                        let _ = writeln!(text, "cause: {cause}");
                    }
                    for problem in problems {
                        let _ = writeln!(text, "- {problem}");
                    }
                    for exchange in exchanges {
                        let _ = writeln!(text, "{exchange}");
                    }
                    let _ = write!(
                        out,
                        "<failure message=\"{}\">{}</failure>",
                        xml(detail),
                        xml(&text)
                    );
                }
                Verdict::NotApplicable { reason } => {
                    let _ = write!(out, "<skipped message=\"{}\"/>", xml(reason));
                }
            }
            out.push_str("</testcase>\n");
        }
        out.push_str("  </testsuite>\n</testsuites>\n");
        out
    }
}

/// Says that more than one problem is listed below the table.
fn more(out: &mut String, count: usize) {
    if count > 1 {
        let _ = write!(out, " (and {} more below)", count - 1);
    }
}

/// `text` escaped for XML text and attributes, without the characters XML 1.0 cannot hold.
fn xml(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            '\n' | '\t' => out.push(c),
            c if (c as u32) < 0x20 || c == '\u{FFFE}' || c == '\u{FFFF}' => out.push('\u{FFFD}'),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report() -> Report {
        let exchange = Exchange {
            step: "retry".into(),
            method: "POST".into(),
            path: "/a".into(),
            tenant: 'a',
            key: Some("\"k\"".into()),
            status: Some(201),
            headers: vec![("content-type".into(), "text/plain".into())],
            body: "<b>&\u{1}\nline two".into(),
            body_bytes: 400,
            elapsed_ms: Some(3),
            error: None,
        };
        Report::new(
            "POST http://x/a".into(),
            vec![
                CheckResult {
                    name: "one",
                    title: "t1",
                    citation: "c1",
                    verdict: Verdict::Pass {
                        detail: "fine".into(),
                    },
                },
                CheckResult {
                    name: "two",
                    title: "t2",
                    citation: "c2",
                    verdict: Verdict::Fail {
                        detail: "bodies \"differ\"".into(),
                        problems: vec!["bodies \"differ\"".into(), "and more".into()],
                        cause: Some("a wrong setting".into()),
                        exchanges: vec![exchange],
                    },
                },
                CheckResult {
                    name: "four",
                    title: "t4",
                    citation: "c4",
                    verdict: Verdict::Warn {
                        detail: "fine, mostly".into(),
                        warnings: vec!["409 without Retry-After".into()],
                    },
                },
                CheckResult {
                    name: "three",
                    title: "t3",
                    citation: "c3",
                    verdict: Verdict::NotApplicable {
                        reason: "none".into(),
                    },
                },
            ],
            vec![Cause {
                cause: "a wrong setting".into(),
                checks: vec!["two", "five"],
            }],
            vec!["a note".into()],
        )
    }

    #[test]
    fn table_lists_every_check_then_every_problem_cause_and_exchange() {
        let table = report().table();
        assert!(table.contains("one    pass     fine\n"), "{table}");
        assert!(
            table.contains("two    FAIL     bodies \"differ\" [cause 1] (and 1 more below)\n"),
            "{table}"
        );
        assert!(
            table.contains("four   warn     fine, mostly (warning below)\n"),
            "{table}"
        );
        assert!(table.contains("three  n/a      none\n"), "{table}");
        assert!(
            table.contains("1 passed, 1 warned, 1 failed, 1 not applicable"),
            "{table}"
        );
        // The cause named once, with the checks behind it.
        assert_eq!(table.matches("a wrong setting").count(), 1, "{table}");
        assert!(
            table.contains("cause 1, behind two, five: a wrong setting"),
            "{table}"
        );
        assert!(table.contains("note: a note"), "{table}");
        assert!(table.contains("  - and more\n"), "{table}");
        assert!(table.contains("  - 409 without Retry-After\n"), "{table}");
        // The body on one line, quoted, with its whole length.
        assert!(
            table.contains(
                "retry: POST /a as tenant a, key \"k\" -> 201; content-type: text/plain; \
                 body: `<b>&\\u{1}\\nline two`... (400 bytes)\n"
            ),
            "{table}"
        );
        assert_eq!(report().exit_code(), 1);
    }

    #[test]
    fn a_warning_is_not_a_failure() {
        let mut report = report();
        report.checks.remove(1);
        let report = Report::new(report.endpoint, report.checks, Vec::new(), Vec::new());
        assert_eq!(report.summary.warn, 1);
        assert_eq!(report.exit_code(), 0);
    }

    #[test]
    fn json_has_verdicts_problems_causes_and_exchanges() {
        let json: serde_json::Value = serde_json::from_str(&report().json()).unwrap();
        assert_eq!(json["summary"]["not_applicable"], 1);
        assert_eq!(json["summary"]["warn"], 1);
        assert_eq!(json["checks"][1]["verdict"], "fail");
        assert_eq!(json["checks"][1]["problems"][1], "and more");
        assert_eq!(json["checks"][1]["cause"], "a wrong setting");
        assert_eq!(json["checks"][1]["exchanges"][0]["status"], 201);
        assert_eq!(json["checks"][1]["exchanges"][0]["body_bytes"], 400);
        assert_eq!(json["checks"][2]["warnings"][0], "409 without Retry-After");
        assert_eq!(json["checks"][3]["reason"], "none");
        assert_eq!(json["causes"][0]["checks"][1], "five");
        assert_eq!(json["notes"][0], "a note");
    }

    #[test]
    fn junit_is_escaped_and_lists_every_problem() {
        let junit = report().junit();
        assert!(
            junit.contains("failures=\"1\" errors=\"0\" skipped=\"1\""),
            "{junit}"
        );
        assert!(
            junit.contains("<failure message=\"bodies &quot;differ&quot;\">"),
            "{junit}"
        );
        assert!(junit.contains("cause: a wrong setting\n"), "{junit}");
        assert!(junit.contains("- and more\n"), "{junit}");
        assert!(
            junit.contains("warning: 409 without Retry-After"),
            "{junit}"
        );
        assert!(
            junit.contains("body: `&lt;b&gt;&amp;\\u{1}\\nline two`... (400 bytes)\n"),
            "{junit}"
        );
        assert!(junit.contains("<skipped message=\"none\"/>"), "{junit}");
    }
}
