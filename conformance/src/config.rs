//! The endpoint under test and how to talk to it: read from a TOML file, or built in code.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::{Method, Url};
use serde::Deserialize;

/// The placeholder of a body template that each request replaces with a fresh value.
pub const UNIQUE: &str = "{{unique}}";

/// The longest `timeout_ms`: an hour.
const MAX_TIMEOUT: Duration = Duration::from_secs(3600);

/// The longest `pause_ms`: a day, the usual retention of a key.
const MAX_PAUSE: Duration = Duration::from_secs(86_400);

/// The bounds of `max_body_bytes`: a kilobyte to a gigabyte.
const BODY_LIMITS: std::ops::RangeInclusive<usize> = 1024..=1 << 30;

/// What the runner needs to know about the API: one mutating endpoint, its credentials, and the
/// conventions its idempotency follows. Every field but `base_url`, `path` and `body` has a
/// default, stated on the field.
///
/// From a file, as the command line reads it (`README.md` describes every field):
///
/// ```
/// use tower_idempotency_conformance::Config;
///
/// let config = Config::from_toml(r#"
///     base_url = "http://127.0.0.1:3000"
///     path = "/v1/charges"
///     content_type = "application/x-www-form-urlencoded"
///     body = "amount=2500&currency=eur&source=tok_visa&metadata[run]={{unique}}"
///     id_pointer = "/id"
///     mismatch_status = 400
///
///     [tenant_a]
///     Authorization = "Bearer sk_test_alice"
/// "#)?;
/// assert_eq!(config.concurrency, 8);
/// # Ok::<(), tower_idempotency_conformance::ConfigError>(())
/// ```
///
/// Or in code, from another crate's test:
///
/// ```
/// use std::time::Duration;
/// use tower_idempotency_conformance::Config;
///
/// let mut config = Config::new("http://127.0.0.1:3000", "/orders", r#"{"item": "{{unique}}"}"#);
/// config.id_pointer = Some("/id".into());
/// config.replay_header = Some("Idempotent-Replayed".into());
/// config.pause = Duration::from_millis(500);
/// config.validate()?;
/// # Ok::<(), tower_idempotency_conformance::ConfigError>(())
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Config {
    /// Where the API is served: scheme, host, port and an optional path prefix
    /// (`https://api.example.com`). The command line's `--base-url` replaces it.
    pub base_url: String,
    /// The endpoint's method. Default: `POST`.
    pub method: String,
    /// The endpoint's path, joined to `base_url` (`/v1/charges`).
    pub path: String,
    /// The request body template: each request replaces every `{{unique}}` with a fresh value, so
    /// that two operations never collide and a reused key can be sent with another body. It must
    /// hold `{{unique}}` at least once.
    pub body: String,
    /// The body's `Content-Type`. Default: `application/json`.
    pub content_type: String,
    /// Headers sent with every request, before the tenant's. Default: none.
    pub headers: BTreeMap<String, String>,
    /// The name of the key header. Default: `Idempotency-Key`.
    pub key_header: String,
    /// How keys are written. Default: [`KeyFormat::String`], the draft's quoted form.
    pub key_format: KeyFormat,
    /// Tenant A's credential headers (`Authorization = "Bearer ..."`): every check runs as A.
    /// Default: none (an API without authentication).
    pub tenant_a: BTreeMap<String, String>,
    /// Tenant B's credential headers, for the tenant-scope check; unset, that check is not
    /// applicable. Default: none.
    pub tenant_b: Option<BTreeMap<String, String>>,
    /// A request the API refuses with a `4xx` because its input is invalid (a validation
    /// error): the check that such a failure is not stored sends it, then the valid body under the
    /// same key. Unset, that check is not applicable. Default: none.
    pub invalid: Option<Variant>,
    /// A request the API answers with a `5xx` (a dependency that is down, a test token): the check
    /// that a `5xx` is not replayed sends it twice under one key. Unset, that check is not
    /// applicable. Default: none.
    pub server_error: Option<Variant>,
    /// A JSON pointer (RFC 6901) to the created object's id in a `2xx` body (`/id`): how the
    /// runner tells "ran twice" from "replayed". Unset, whole bodies are compared. Default: none.
    pub id_pointer: Option<String>,
    /// The header the API puts on replays only (`Idempotent-Replayed`): when set, a replay must
    /// carry it and a first response must not. Default: none.
    pub replay_header: Option<String>,
    /// The header stating when the key's record expires (`Idempotency-Key-Expires`), if the API
    /// sends one: it is checked for form, for being in the future and for being replayed
    /// unchanged. Default: none (the check is not applicable).
    pub retention_header: Option<String>,
    /// The response headers a replay must repeat exactly. Default: `content-type`.
    pub compare_headers: Vec<String>,
    /// The status a key reused with another body gets. Default: `422` (the draft's);
    /// Stripe-style APIs answer `400`.
    pub mismatch_status: u16,
    /// Whether the endpoint refuses requests without a valid key; when false, the missing- and
    /// malformed-key checks are not applicable. Default: true.
    pub keys_required: bool,
    /// How many duplicates the concurrency check sends at once. Default: 8 (2 to 1,000).
    pub concurrency: usize,
    /// How long the last check waits before it replays. Default: 2 s, at most a day. In the
    /// file: `pause_ms`.
    pub pause: Duration,
    /// How long one request may take, from connecting to the body's last byte (a body that
    /// trickles is cut there). Default: 10 s, at most an hour. In the file: `timeout_ms`.
    pub timeout: Duration,
    /// The most bytes of one answer's body the runner reads: a longer answer is an error, said in
    /// the report. Default: 1 MiB (1,048,576), from 1 KiB to 1 GiB.
    pub max_body_bytes: usize,
}

/// A variant of the endpoint's request: another body, and headers added to (or replacing) the
/// usual ones. In the file, the `[invalid]` and `[server_error]` tables.
///
/// ```
/// use tower_idempotency_conformance::{Config, Variant};
///
/// let mut config = Config::new("http://127.0.0.1:3000", "/orders", r#"{"item": "{{unique}}"}"#);
/// config.invalid = Some(Variant::body(r#"{"item": ""}"#));
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct Variant {
    /// The body template (`{{unique}}` is replaced, and may be absent).
    pub body: String,
    /// Headers that this request adds to or replaces in the usual ones. Default: none.
    #[serde(default)]
    pub headers: BTreeMap<String, String>,
}

impl Variant {
    /// A variant with `body` and no headers of its own.
    ///
    /// ```
    /// use tower_idempotency_conformance::Variant;
    ///
    /// assert!(Variant::body("amount=0").headers.is_empty());
    /// ```
    pub fn body(body: impl Into<String>) -> Self {
        Self {
            body: body.into(),
            headers: BTreeMap::new(),
        }
    }
}

/// How the runner writes its idempotency keys.
///
/// ```
/// use tower_idempotency_conformance::KeyFormat;
///
/// assert_eq!(KeyFormat::String.write("k1"), "\"k1\"");
/// assert_eq!(KeyFormat::Bare.write("k1"), "k1");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "lowercase")]
#[non_exhaustive]
pub enum KeyFormat {
    /// The draft's form (§2.1): a structured-field string, `"8e03978e-..."`. `string` in the file.
    #[default]
    String,
    /// Stripe's form: the key as it is, `8e03978e-...`. `bare` in the file.
    Bare,
}

impl KeyFormat {
    /// `key` as this format writes it in the header (no escaping: the runner's keys need none).
    pub fn write(self, key: &str) -> String {
        match self {
            Self::String => format!("\"{key}\""),
            Self::Bare => key.to_owned(),
        }
    }
}

/// A config that cannot be used: unreadable, not TOML, or a field out of range. The message names
/// the field and what is wrong.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read the config file {}: {source}", path.display())]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
    /// The file is not valid TOML, or has a field of the wrong type, an unknown field, or misses
    /// a required one.
    #[error("the config is not valid: {0}")]
    Parse(#[from] toml::de::Error),
    /// A field has a value the runner cannot use.
    #[error("`{field}` {reason}")]
    Invalid {
        /// The field, as the file names it.
        field: &'static str,
        /// What is wrong with it.
        reason: String,
    },
}

impl ConfigError {
    fn invalid(field: &'static str, reason: impl Into<String>) -> Self {
        Self::Invalid {
            field,
            reason: reason.into(),
        }
    }
}

/// The file's shape: [`Config`] with its durations in milliseconds.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct File {
    base_url: String,
    #[serde(default = "default_method")]
    method: String,
    path: String,
    body: String,
    #[serde(default = "default_content_type")]
    content_type: String,
    #[serde(default)]
    headers: BTreeMap<String, String>,
    #[serde(default = "default_key_header")]
    key_header: String,
    #[serde(default)]
    key_format: KeyFormat,
    #[serde(default)]
    tenant_a: BTreeMap<String, String>,
    tenant_b: Option<BTreeMap<String, String>>,
    invalid: Option<Variant>,
    server_error: Option<Variant>,
    id_pointer: Option<String>,
    replay_header: Option<String>,
    retention_header: Option<String>,
    #[serde(default = "default_compare_headers")]
    compare_headers: Vec<String>,
    #[serde(default = "default_mismatch_status")]
    mismatch_status: u16,
    #[serde(default = "default_keys_required")]
    keys_required: bool,
    #[serde(default = "default_concurrency")]
    concurrency: usize,
    #[serde(default = "default_pause_ms")]
    pause_ms: u64,
    #[serde(default = "default_timeout_ms")]
    timeout_ms: u64,
    #[serde(default = "default_max_body_bytes")]
    max_body_bytes: usize,
}

fn default_method() -> String {
    "POST".into()
}
fn default_content_type() -> String {
    "application/json".into()
}
fn default_key_header() -> String {
    "Idempotency-Key".into()
}
fn default_compare_headers() -> Vec<String> {
    vec!["content-type".into()]
}
fn default_mismatch_status() -> u16 {
    422
}
fn default_keys_required() -> bool {
    true
}
fn default_concurrency() -> usize {
    8
}
fn default_pause_ms() -> u64 {
    2000
}
fn default_timeout_ms() -> u64 {
    10_000
}
fn default_max_body_bytes() -> usize {
    1 << 20
}

impl Config {
    /// A config for `method` `POST` on `base_url` + `path` with the body template `body`, every
    /// other field at its default.
    ///
    /// ```
    /// use tower_idempotency_conformance::Config;
    ///
    /// let config = Config::new("http://127.0.0.1:3000", "/orders", r#"{"item": "{{unique}}"}"#);
    /// assert_eq!(config.mismatch_status, 422);
    /// assert!(config.validate().is_ok());
    /// ```
    pub fn new(
        base_url: impl Into<String>,
        path: impl Into<String>,
        body: impl Into<String>,
    ) -> Self {
        Self {
            base_url: base_url.into(),
            method: default_method(),
            path: path.into(),
            body: body.into(),
            content_type: default_content_type(),
            headers: BTreeMap::new(),
            key_header: default_key_header(),
            key_format: KeyFormat::default(),
            tenant_a: BTreeMap::new(),
            tenant_b: None,
            invalid: None,
            server_error: None,
            id_pointer: None,
            replay_header: None,
            retention_header: None,
            compare_headers: default_compare_headers(),
            mismatch_status: default_mismatch_status(),
            keys_required: default_keys_required(),
            concurrency: default_concurrency(),
            pause: Duration::from_millis(default_pause_ms()),
            timeout: Duration::from_millis(default_timeout_ms()),
            max_body_bytes: default_max_body_bytes(),
        }
    }

    /// The config in `text`, a TOML document, checked with [`Config::validate`].
    ///
    /// ```
    /// use tower_idempotency_conformance::Config;
    ///
    /// let err = Config::from_toml("base_url = 'http://x'\npath = '/a'\nbody = 'no placeholder'")
    ///     .unwrap_err();
    /// assert!(err.to_string().contains("{{unique}}"));
    /// ```
    pub fn from_toml(text: &str) -> Result<Self, ConfigError> {
        let file: File = toml::from_str(text)?;
        let config = Self {
            base_url: file.base_url,
            method: file.method,
            path: file.path,
            body: file.body,
            content_type: file.content_type,
            headers: file.headers,
            key_header: file.key_header,
            key_format: file.key_format,
            tenant_a: file.tenant_a,
            tenant_b: file.tenant_b,
            invalid: file.invalid,
            server_error: file.server_error,
            id_pointer: file.id_pointer,
            replay_header: file.replay_header,
            retention_header: file.retention_header,
            compare_headers: file.compare_headers,
            mismatch_status: file.mismatch_status,
            keys_required: file.keys_required,
            concurrency: file.concurrency,
            pause: Duration::from_millis(file.pause_ms),
            timeout: Duration::from_millis(file.timeout_ms),
            max_body_bytes: file.max_body_bytes,
        };
        config.validate()?;
        Ok(config)
    }

    /// The config in the TOML file at `path`.
    ///
    /// ```
    /// use tower_idempotency_conformance::{Config, ConfigError};
    ///
    /// let err = Config::load("no/such/file.toml").unwrap_err();
    /// assert!(matches!(err, ConfigError::Read { .. }));
    /// ```
    pub fn load(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_owned(),
            source,
        })?;
        Self::from_toml(&text)
    }

    /// Checks every field: the URL, the method, the header names and values, the templates, the
    /// pointer, the statuses and the bounds. [`run`](crate::run) checks it too.
    ///
    /// ```
    /// use tower_idempotency_conformance::Config;
    ///
    /// let mut config = Config::new("http://127.0.0.1:3000", "/orders", "{{unique}}");
    /// config.concurrency = 1;
    /// assert!(config.validate().unwrap_err().to_string().contains("concurrency"));
    /// ```
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.prepare().map(drop)
    }

    /// The config in the form requests are built from.
    pub(crate) fn prepare(&self) -> Result<Prepared, ConfigError> {
        let base = Url::parse(&self.base_url)
            .map_err(|err| ConfigError::invalid("base_url", format!("is not a URL: {err}")))?;
        if !matches!(base.scheme(), "http" | "https") || base.cannot_be_a_base() {
            return Err(ConfigError::invalid(
                "base_url",
                "must be an http:// or https:// URL",
            ));
        }
        if !self.path.starts_with('/') {
            return Err(ConfigError::invalid("path", "must start with `/`"));
        }
        let url = Url::parse(&format!(
            "{}{}",
            self.base_url.trim_end_matches('/'),
            self.path
        ))
        .map_err(|err| ConfigError::invalid("path", format!("does not make a URL: {err}")))?;
        let method = Method::from_bytes(self.method.as_bytes()).map_err(|_| {
            ConfigError::invalid("method", format!("{:?} is not a method", self.method))
        })?;
        if !self.body.contains(UNIQUE) {
            return Err(ConfigError::invalid(
                "body",
                format!(
                    "must contain {UNIQUE} (each request gets a fresh value there, so that the \
                     runner can send the same key with another body)"
                ),
            ));
        }
        let mut common = headers("headers", &self.headers)?;
        let content_type = HeaderValue::from_str(&self.content_type)
            .map_err(|_| ConfigError::invalid("content_type", "is not a valid header value"))?;
        common.insert(reqwest::header::CONTENT_TYPE, content_type);
        let key_header = header_name("key_header", &self.key_header)?;
        let tenant_a = headers("tenant_a", &self.tenant_a)?;
        let tenant_b = (self.tenant_b.as_ref())
            .map(|tenant| headers("tenant_b", tenant))
            .transpose()?;
        if tenant_b.as_ref().is_some_and(|b| *b == tenant_a) {
            return Err(ConfigError::invalid(
                "tenant_b",
                "has tenant_a's headers: give it another tenant's credentials",
            ));
        }
        let invalid = (self.invalid.as_ref())
            .map(|variant| variant_headers("invalid", variant))
            .transpose()?;
        let server_error = (self.server_error.as_ref())
            .map(|variant| variant_headers("server_error", variant))
            .transpose()?;
        if let Some(pointer) = &self.id_pointer
            && !pointer.starts_with('/')
        {
            return Err(ConfigError::invalid(
                "id_pointer",
                "must be a JSON pointer, starting with `/` (`/id`)",
            ));
        }
        let replay_header = (self.replay_header.as_deref())
            .map(|name| header_name("replay_header", name))
            .transpose()?;
        let retention_header = (self.retention_header.as_deref())
            .map(|name| header_name("retention_header", name))
            .transpose()?;
        let compare_headers = (self.compare_headers.iter())
            .map(|name| header_name("compare_headers", name))
            .collect::<Result<_, _>>()?;
        if !(400..500).contains(&self.mismatch_status) {
            return Err(ConfigError::invalid(
                "mismatch_status",
                format!("must be a 4xx status, not {}", self.mismatch_status),
            ));
        }
        if !(2..=1000).contains(&self.concurrency) {
            return Err(ConfigError::invalid(
                "concurrency",
                format!("must be from 2 to 1000, not {}", self.concurrency),
            ));
        }
        if self.timeout.is_zero() || self.timeout > MAX_TIMEOUT {
            return Err(ConfigError::invalid(
                "timeout_ms",
                format!("must be from 1 to {}", MAX_TIMEOUT.as_millis()),
            ));
        }
        if !BODY_LIMITS.contains(&self.max_body_bytes) {
            return Err(ConfigError::invalid(
                "max_body_bytes",
                format!(
                    "must be from {} to {}, not {}",
                    BODY_LIMITS.start(),
                    BODY_LIMITS.end(),
                    self.max_body_bytes
                ),
            ));
        }
        if self.pause > MAX_PAUSE {
            return Err(ConfigError::invalid(
                "pause_ms",
                format!("must be at most {} (a day)", MAX_PAUSE.as_millis()),
            ));
        }
        Ok(Prepared {
            url,
            method,
            common,
            key_header,
            tenant_a,
            tenant_b,
            invalid,
            server_error,
            replay_header,
            retention_header,
            compare_headers,
        })
    }
}

/// The parts of a [`Config`] that requests are built from, checked.
#[derive(Debug, Clone)]
pub(crate) struct Prepared {
    pub url: Url,
    pub method: Method,
    /// The config's headers and the content type.
    pub common: HeaderMap,
    pub key_header: HeaderName,
    pub tenant_a: HeaderMap,
    pub tenant_b: Option<HeaderMap>,
    pub invalid: Option<HeaderMap>,
    pub server_error: Option<HeaderMap>,
    pub replay_header: Option<HeaderName>,
    pub retention_header: Option<HeaderName>,
    pub compare_headers: Vec<HeaderName>,
}

fn header_name(field: &'static str, name: &str) -> Result<HeaderName, ConfigError> {
    HeaderName::from_bytes(name.as_bytes())
        .map_err(|_| ConfigError::invalid(field, format!("{name:?} is not a header name")))
}

fn headers(field: &'static str, map: &BTreeMap<String, String>) -> Result<HeaderMap, ConfigError> {
    let mut headers = HeaderMap::new();
    for (name, value) in map {
        let value = HeaderValue::from_str(value).map_err(|_| {
            ConfigError::invalid(
                field,
                format!("the value of {name:?} is not a header value"),
            )
        })?;
        headers.insert(header_name(field, name)?, value);
    }
    Ok(headers)
}

fn variant_headers(field: &'static str, variant: &Variant) -> Result<HeaderMap, ConfigError> {
    headers(field, &variant.headers)
}

#[cfg(test)]
mod tests {
    use super::*;

    const MINIMAL: &str = "base_url = 'http://127.0.0.1:1'\npath = '/a'\nbody = '{{unique}}'\n";

    fn error(text: &str) -> String {
        Config::from_toml(text).unwrap_err().to_string()
    }

    #[test]
    fn defaults() {
        let config = Config::from_toml(MINIMAL).unwrap();
        assert_eq!(
            config,
            Config::new("http://127.0.0.1:1", "/a", "{{unique}}")
        );
        assert_eq!(config.pause, Duration::from_secs(2));
        assert_eq!(config.compare_headers, ["content-type"]);
    }

    /// Every field of the file, each set away from its default.
    const EVERY_FIELD: &str = "base_url = 'http://127.0.0.1:1'\npath = '/a'\nbody = '{{unique}}'\n\
        method = 'PATCH'\ncontent_type = 'text/plain'\nkey_header = 'X-Key'\n\
        key_format = 'bare'\nid_pointer = '/data/id'\nreplay_header = 'Idempotent-Replayed'\n\
        retention_header = 'Idempotency-Key-Expires'\ncompare_headers = []\n\
        mismatch_status = 400\nkeys_required = false\nconcurrency = 3\npause_ms = 10\n\
        timeout_ms = 20\nmax_body_bytes = 2048\n[headers]\nX-Api = '1'\n[tenant_a]\nAuthorization = 'a'\n\
        [tenant_b]\nAuthorization = 'b'\n[invalid]\nbody = 'x'\n\
        [server_error]\nbody = 'y'\nheaders = { X-Fail = '1' }\n";

    #[test]
    fn every_field() {
        let config = Config::from_toml(EVERY_FIELD).unwrap();
        assert_eq!(config.key_format, KeyFormat::Bare);
        assert_eq!(config.timeout, Duration::from_millis(20));
        assert_eq!(config.max_body_bytes, 2048);
        assert_eq!(config.server_error.unwrap().headers["X-Fail"], "1");
        assert_eq!(config.tenant_b.unwrap()["Authorization"], "b");
    }

    #[test]
    fn the_readme_describes_every_field() {
        let readme = include_str!("../README.md");
        let fields: toml::Table = EVERY_FIELD.parse().unwrap();
        assert_eq!(fields.len(), 22);
        for field in fields.keys() {
            assert!(readme.contains(&format!("| `{field}` |")), "{field}");
        }
    }

    #[test]
    fn clear_errors() {
        assert!(
            error("base_url = ").contains("not valid"),
            "{}",
            error("base_url = ")
        );
        assert!(error(&format!("{MINIMAL}surprise = 1")).contains("surprise"));
        assert!(error("path = '/a'\nbody = '{{unique}}'").contains("base_url"));
        assert!(error(&MINIMAL.replace("http://127.0.0.1:1", "nope")).starts_with("`base_url`"));
        assert!(error(&MINIMAL.replace("http://127.0.0.1:1", "ftp://x")).contains("http://"));
        assert!(error(&MINIMAL.replace("'/a'", "'a'")).starts_with("`path`"));
        assert!(error(&format!("{MINIMAL}method = 'P O'")).starts_with("`method`"));
        assert!(error(&format!("{MINIMAL}mismatch_status = 200")).contains("4xx"));
        assert!(error(&format!("{MINIMAL}concurrency = 1")).contains("2 to 1000"));
        assert!(error(&format!("{MINIMAL}id_pointer = 'id'")).contains("JSON pointer"));
        assert!(error(&format!("{MINIMAL}replay_header = 'a b'")).starts_with("`replay_header`"));
        assert!(error(&format!("{MINIMAL}[tenant_a]\n'a b' = 'x'")).starts_with("`tenant_a`"));
        assert!(error(&format!("{MINIMAL}[tenant_a]\nA = \"x\\n\"")).contains("header value"));
        assert!(
            error(&format!(
                "{MINIMAL}[tenant_a]\nA = 'x'\n[tenant_b]\nA = 'x'"
            ))
            .contains("another tenant")
        );
        assert!(error(&format!("{MINIMAL}key_format = 'fancy'")).contains("key_format"));
        assert!(error(&format!("{MINIMAL}timeout_ms = 0")).starts_with("`timeout_ms`"));
        let forever = u64::MAX;
        assert!(error(&format!("{MINIMAL}timeout_ms = {forever}")).contains("from 1 to 3600000"));
        assert!(error(&format!("{MINIMAL}pause_ms = {forever}")).contains("at most 86400000"));
        assert!(error(&format!("{MINIMAL}concurrency = -1")).contains("concurrency"));
        assert!(
            error(&format!("{MINIMAL}max_body_bytes = 10")).contains("from 1024 to 1073741824")
        );
    }
}
