//! The handlers of `/v1/charges`.
//!
//! Every handler that calls the provider runs behind the idempotency layer and passes the
//! provider a key derived from the request's [`IdempotencyKey`] and the account: a retry that
//! reaches the handler again (its record lost) reaches the provider with the same key. It commits
//! the `-ing` state that holds the charge before the call, and writes the answer and its event
//! with the request after it (in PostgreSQL, with the idempotency record).
//!
//! Right before the provider call, the irreversible step, a handler asks
//! [`HeldClaim::still_held`]: a run taken over stops there (`409` `idempotency_key_superseded`,
//! nothing done). That narrows the window, it does not close it: a run that stalls after the
//! check calls the provider with the same derived key as the newer run, so the provider makes the
//! call once and answers both alike, and the charge's constraint keeps one charge per operation.
//! Once the provider may have acted, no answer says that nothing happened.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use axum::Json;
use axum::body::Bytes;
use axum::extract::{Extension, Path, State};
use axum::http::{Extensions, HeaderMap, StatusCode};
use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize};
use tower_idempotency::{HeldClaim, IdempotencyKey};

use super::AppState;
use super::auth::Account;
use super::error::{ApiError, quote};
use super::events::PaymentEvent;
use super::ledger::{Charge, ChargeJson, NewCharge, Opened};
use super::now_ms;
use super::params::{self, Form};
use super::provider::{Outcome, ProviderError, Source};
use super::reconciler::metadata;
use super::state_machine::{Event, Status};

/// The amounts a charge may have, in minor units (cents): 1 to 99,999,999, as card payment APIs
/// allow. The bound keeps every sum the example makes (a balance, a refund total) far from
/// overflowing.
pub const AMOUNTS: RangeInclusive<i64> = 1..=99_999_999;

/// The longest `description`, in characters. A charge echoes its description, so the bound
/// keeps every charge's JSON small (at most 6 bytes a character once escaped, about 6 KB), and
/// far within the response limit the idempotency layer stores: see [`super::RESPONSE_LIMIT`].
pub const DESCRIPTION_CHARS: usize = 1000;

/// The body of `POST /v1/charges`, as JSON or as a form (`params.rs`); either way an unknown
/// parameter is refused, so that a misspelt one is never taken as left out.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateCharge {
    amount: Option<i64>,
    currency: Option<String>,
    source: Option<String>,
    capture: Option<bool>,
    description: Option<String>,
    metadata: Option<BTreeMap<String, String>>,
}

impl CreateCharge {
    fn from_form(mut form: Form) -> Result<Self, ApiError> {
        let input = Self {
            amount: form.integer("amount")?,
            currency: form.text("currency"),
            source: form.text("source"),
            capture: form.boolean("capture")?,
            description: form.text("description"),
            metadata: form.metadata(),
        };
        form.finish()?;
        Ok(input)
    }
}

/// The body of `POST /v1/charges/{id}/refunds`; empty means "refund the rest" (and `{"amont":
/// 100}` is refused, not a refund of the rest).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRefund {
    amount: Option<i64>,
}

impl CreateRefund {
    fn from_form(mut form: Form) -> Result<Self, ApiError> {
        let input = Self {
            amount: form.integer("amount")?,
        };
        form.finish()?;
        Ok(input)
    }
}

/// A page of charges, as the API shows it.
#[derive(Debug, Serialize)]
pub struct ListJson {
    object: &'static str,
    data: Vec<ChargeJson>,
}

/// A refund, as the API shows it.
#[derive(Debug, Serialize)]
pub struct RefundJson {
    id: String,
    object: &'static str,
    amount: i64,
    charge: String,
    status: &'static str,
}

/// The provider's idempotency key for this request: the same on every retry, unrelated between
/// accounts.
fn provider_key(key: &IdempotencyKey, account: &Account) -> String {
    key.derive(account.id())
}

/// Right before an irreversible provider call: `409` `idempotency_key_superseded` when the
/// request's claim was taken over by a later run of it, `503` when the store cannot tell.
async fn still_held(claim: Option<&HeldClaim>) -> Result<(), ApiError> {
    let Some(claim) = claim else {
        return Ok(());
    };
    match claim.still_held().await {
        Ok(true) => Ok(()),
        Ok(false) => {
            tracing::info!(
                fence = claim.fence().get(),
                "a later run took this request over; stopping before the provider call"
            );
            Err(ApiError::superseded())
        }
        Err(err) => {
            tracing::warn!(error = %super::report(&err), "cannot tell whether the claim is still held");
            Err(ApiError::storage_unavailable())
        }
    }
}

/// `POST /v1/charges`: 201 with the charge; 402 when the card is declined (a failed charge is
/// recorded); 503 when the provider is unavailable (nothing recorded: retry); 504 when its answer
/// was lost (the charge stays `authorizing`: the retry, or the reconciler, learns the outcome);
/// 400 `idempotency_error` when the key names another request.
pub async fn create(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    key: IdempotencyKey,
    extensions: Extensions,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<ChargeJson>), ApiError> {
    // The claim the request runs under (none when the layer let it through without one).
    let claim = extensions.get::<HeldClaim>().cloned();
    let request = parse_create(&headers, &body)?;
    let provider_key = provider_key(&key, &account);
    let opened = state.ledger.open(&account, &provider_key, &request).await?;
    let mut charge = match opened {
        Opened::Authorizing(charge) => charge,
        // An earlier attempt with this key settled its charge (its idempotency record was lost),
        // or crashed and the reconciler settled it.
        Opened::Settled(charge) if charge.status == Status::Failed => {
            return Err(ApiError::card_declined(&charge.id));
        }
        Opened::Settled(charge) => return Ok((StatusCode::CREATED, Json(charge.to_json()))),
    };
    // A run taken over leaves the `authorizing` charge as it is: it is the operation's one
    // charge, which the newer run resumes (or the reconciler settles).
    still_held(claim.as_ref()).await?;
    let call = (request.source, request.amount, request.capture);
    let metadata = metadata(&account, &provider_key);
    let created = state.provider.create_payment(&provider_key, call, metadata);
    let payment = match created.await {
        Ok(payment) => payment,
        // The charge stays `authorizing`, the operation's one charge: the provider may have made
        // the payment, and the retry with the same key resumes it, or the reconciler settles it
        // from the provider's side.
        Err(err @ ProviderError::Unknown) => return Err(err.into()),
        // The provider refused before doing anything: the charge was never made (unless the
        // reconciler took it over meanwhile, and sends it again).
        Err(err) if state.ledger.abandon(&charge).await => return Err(err.into()),
        Err(_) => return Err(ProviderError::Unknown.into()),
    };
    charge.payment = payment.id;
    match payment.outcome {
        Outcome::Declined => charge.apply(Event::Declined)?,
        Outcome::Authorized => charge.apply(Event::Approved)?,
        // One provider call authorized and captured; the charge still walks every step.
        Outcome::Captured => {
            charge.apply(Event::Approved)?;
            charge.apply(Event::Capture)?;
            charge.apply(Event::Captured)?;
        }
        Outcome::Canceled => {
            charge.apply(Event::Approved)?;
            charge.apply(Event::Cancel)?;
            charge.apply(Event::Canceled)?;
        }
    }
    // A repeated run gets the same reply from the provider and finds the same charge: the same
    // event, id and content.
    let (declined, captured) = (
        payment.outcome == Outcome::Declined,
        payment.outcome == Outcome::Captured,
    );
    let event = |c: &Charge| (!declined).then(|| PaymentEvent::succeeded(c, captured));
    let recorded = state.ledger.record(&extensions, charge, &event).await;
    let charge = recorded.map_err(not_recorded)?;
    tracing::info!(charge = %charge.id, status = charge.status.as_str(), "charge created");
    if declined {
        return Err(ApiError::card_declined(&charge.id));
    }
    Ok((StatusCode::CREATED, Json(charge.to_json())))
}

/// The body of `POST /v1/charges`, checked: 400 names the parameter at fault.
fn parse_create(headers: &HeaderMap, body: &[u8]) -> Result<NewCharge, ApiError> {
    let input = if params::is_form(headers) {
        CreateCharge::from_form(Form::parse(body))?
    } else {
        parse_json(body)?
    };
    let amount = input.amount.ok_or(ApiError::missing_param("amount"))?;
    if !AMOUNTS.contains(&amount) {
        return Err(ApiError::invalid_param(
            "amount",
            format!(
                "`amount` must be an integer from {} to {}, in minor units (cents)",
                AMOUNTS.start(),
                AMOUNTS.end()
            ),
        ));
    }
    let currency = input.currency.ok_or(ApiError::missing_param("currency"))?;
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        return Err(ApiError::invalid_param(
            "currency",
            "`currency` must be a three-letter ISO code, such as `eur`",
        ));
    }
    let token = input.source.ok_or(ApiError::missing_param("source"))?;
    let source = Source::parse(&token).ok_or_else(|| {
        ApiError::invalid_param(
            "source",
            "unknown `source`; the test tokens are `tok_visa`, `tok_chargeDeclined` and `tok_pspUnavailable`",
        )
    })?;
    let capture = input.capture.unwrap_or(true);
    if let Some(description) = &input.description
        && description.chars().count() > DESCRIPTION_CHARS
    {
        return Err(ApiError::invalid_param(
            "description",
            format!("`description` must be at most {DESCRIPTION_CHARS} characters"),
        ));
    }
    let metadata = input.metadata.unwrap_or_default();
    params::check_metadata(&metadata)?;
    Ok(NewCharge {
        amount,
        currency: currency.to_ascii_lowercase(),
        source,
        capture,
        description: input.description,
        metadata,
    })
}

/// `GET /v1/charges`: the account's charges, newest first.
pub async fn list(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
) -> Result<Json<ListJson>, ApiError> {
    let data = state
        .ledger
        .list(&account)
        .await?
        .iter()
        .map(Charge::to_json)
        .collect();
    Ok(Json(ListJson {
        object: "list",
        data,
    }))
}

/// `GET /v1/charges/{id}`: 404 for an unknown charge, and for another account's.
pub async fn get(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Json<ChargeJson>, ApiError> {
    Ok(Json(state.ledger.get(&account, &id).await?.to_json()))
}

/// `POST /v1/charges/{id}/capture`: takes the money of an authorized charge.
pub async fn capture(
    state: State<AppState>,
    account: Extension<Account>,
    key: IdempotencyKey,
    extensions: Extensions,
    id: Path<String>,
) -> Result<Json<ChargeJson>, ApiError> {
    move_along(state, account, key, extensions, id, Event::Capture).await
}

/// `POST /v1/charges/{id}/cancel`: releases an authorized charge.
pub async fn cancel(
    state: State<AppState>,
    account: Extension<Account>,
    key: IdempotencyKey,
    extensions: Extensions,
    id: Path<String>,
) -> Result<Json<ChargeJson>, ApiError> {
    move_along(state, account, key, extensions, id, Event::Cancel).await
}

/// A capture or a cancellation: `capturing` or `canceling` holds the charge during the provider
/// call (a concurrent one gets `invalid_state`; this request's own earlier run, taken over, left
/// it there and it goes on from it), then `captured` (with its event) or `canceled`.
async fn move_along(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    key: IdempotencyKey,
    extensions: Extensions,
    Path(id): Path<String>,
    begin: Event,
) -> Result<Json<ChargeJson>, ApiError> {
    let claim = extensions.get::<HeldClaim>().cloned();
    let call_key = provider_key(&key, &account);
    let charge = (state.ledger)
        .update(&account, &id, &mut |c| begin_call(c, begin, &call_key))
        .await?;
    if call_made(&charge, begin, &call_key) {
        // Made already, and settled (by an earlier run, or the reconciler): the answer.
        return Ok(Json(charge.to_json()));
    }
    still_held(claim.as_ref()).await?;
    let provider = &state.provider;
    let (called, end) = match begin {
        Event::Capture => (
            provider.capture(&call_key, &charge.payment).await,
            Event::Captured,
        ),
        _ => (
            provider.cancel(&call_key, &charge.payment).await,
            Event::Canceled,
        ),
    };
    if let Err(err) = called {
        return Err(roll_back(&state, &account, &id, begin, &call_key, err).await);
    }
    let end_call = &mut |c: &mut Charge| end_call(c, begin, end, &call_key);
    let event = |c: &Charge| (end == Event::Captured).then(|| PaymentEvent::captured(c));
    let charge = (state.ledger)
        .settle(&extensions, &account, &id, end_call, &event)
        .await
        .map_err(not_recorded)?;
    Ok(Json(charge.to_json()))
}

/// Moves `charge` along `event` into the `-ing` state of a provider call with `call_key`. A
/// charge whose last call had this key is left as it is: an earlier run of this request (taken
/// over) began the call, or made it; either way the provider answers the call again (or refuses a
/// key that was another request's), and [`end_call`] settles it once.
fn begin_call(charge: &mut Charge, event: Event, call_key: &str) -> Result<(), ApiError> {
    if charge.call_key == call_key {
        return resumable(charge, event);
    }
    if call_made(charge, event, call_key) {
        // Made, and later calls moved the charge on: answered as it is.
        return Ok(());
    }
    charge.apply(event)?;
    charge.call_key = call_key.to_owned();
    charge.call_started = now_ms();
    charge.call_amount = 0;
    Ok(())
}

/// Moves `charge` along `end` out of the `-ing` state of the `begin` call with `call_key`,
/// unless another run of the same request did already.
fn end_call(charge: &mut Charge, begin: Event, end: Event, call_key: &str) -> Result<(), ApiError> {
    if !waits_on(charge, begin, call_key) {
        return Ok(());
    }
    if end == Event::Captured {
        charge.capture_key = call_key.to_owned();
    }
    charge.apply(end)
}

/// Whether `charge` still waits on the provider call of `operation` (`Capture`, `Refund` or
/// `Cancel`) with `call_key`. Once it does not, the call was settled already (by another run of
/// the request, or the reconciler), and the charge may have moved on to another call since: a
/// late run of this one must change nothing (with the charges in memory, its write would
/// otherwise count a refund twice).
fn waits_on(charge: &Charge, operation: Event, call_key: &str) -> bool {
    charge.call_key == call_key && charge.status == calling(operation)
}

/// Whether this request's `operation` call, under `call_key`, was made and settled (by an
/// earlier run, or the reconciler), whatever calls moved the charge on since.
fn call_made(charge: &Charge, operation: Event, call_key: &str) -> bool {
    match operation {
        Event::Refund => charge.refund_under(call_key).is_some(),
        Event::Capture if charge.capture_key == call_key => true,
        Event::Capture => charge.call_key == call_key && charge.status == Status::Captured,
        _ => charge.call_key == call_key && charge.status == Status::Canceled,
    }
}

/// The `-ing` state a call of `operation` holds its charge in.
fn calling(operation: Event) -> Status {
    match operation {
        Event::Capture => Status::Capturing,
        Event::Cancel => Status::Canceling,
        _ => Status::Refunding,
    }
}

/// A request whose key made the charge's last call, for `operation`: resumed, unless that call is
/// another operation's still in flight (the client's key sent again for another operation, once
/// the layer let it go after a `5xx`), which this request must neither resume nor undo.
fn resumable(charge: &Charge, operation: Event) -> Result<(), ApiError> {
    if charge.is_busy() && charge.status != calling(operation) {
        return Err(ApiError::idempotency_key_reused());
    }
    if charge.reconciling {
        // The reconciler sends this call again: its outcome is unknown until it settles it, and
        // a retry changes nothing meanwhile (a write would only put the reconciler's turn off).
        return Err(ProviderError::Unknown.into());
    }
    Ok(())
}

/// `POST /v1/charges/{id}/refunds`: refunds `amount` (default: the rest) of a captured charge.
pub async fn refund(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    key: IdempotencyKey,
    extensions: Extensions,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<RefundJson>), ApiError> {
    // The claim the request runs under (none when the layer let it through without one).
    let claim = extensions.get::<HeldClaim>().cloned();
    let input = if params::is_form(&headers) {
        CreateRefund::from_form(Form::parse(&body))?
    } else if body.is_empty() {
        CreateRefund::default()
    } else {
        parse_json(&body)?
    };
    let call_key = provider_key(&key, &account);
    let mut amount = 0;
    let mut made = None;
    let begin = &mut |c: &mut Charge| {
        // The key names one refund: another amount under it is another request.
        let other_amount = |earlier: i64| input.amount.is_some_and(|asked| asked != earlier);
        if let Some(refund) = c.refund_under(&call_key) {
            // This request's refund was made and settled (by an earlier run, or the reconciler),
            // and other calls may have moved the charge on since: its answer, nothing more.
            if other_amount(refund.amount) {
                return Err(ApiError::idempotency_key_reused());
            }
            (amount, made) = (refund.amount, Some(refund.id.clone()));
            return Ok(());
        }
        if c.call_key == call_key {
            // An earlier run of this request began (or made) this refund: the provider answers
            // it again, or refuses the key if it was another request's.
            if c.status == Status::Refunding && other_amount(c.call_amount) {
                return Err(ApiError::idempotency_key_reused());
            }
            amount = c.call_amount;
            return resumable(c, Event::Refund);
        }
        amount = input.amount.unwrap_or(c.refundable());
        c.apply(Event::Refund)?;
        c.call_key = call_key.clone();
        c.call_started = now_ms();
        c.call_amount = amount;
        if amount <= 0 {
            return Err(ApiError::invalid_param(
                "amount",
                "`amount` must be a positive integer",
            ));
        }
        if amount > c.refundable() {
            return Err(ApiError::amount_too_large(amount, c.refundable()));
        }
        Ok(())
    };
    let charge = state.ledger.update(&account, &id, begin).await?;
    if let Some(refund_id) = made {
        return Ok(refunded(refund_id, amount, charge.id));
    }
    still_held(claim.as_ref()).await?;
    let refund_id = match state
        .provider
        .refund(&call_key, &charge.payment, amount)
        .await
    {
        Ok(refund_id) => refund_id,
        Err(err) => {
            let operation = Event::Refund;
            return Err(roll_back(&state, &account, &id, operation, &call_key, err).await);
        }
    };
    let settle = &mut |c: &mut Charge| {
        if !waits_on(c, Event::Refund, &call_key) {
            return Ok(());
        }
        c.record_refund(&call_key, &refund_id, amount)
    };
    let event = |c: &Charge| Some(PaymentEvent::refunded(c, &refund_id, amount));
    let charge = (state.ledger)
        .settle(&extensions, &account, &id, settle, &event)
        .await
        .map_err(not_recorded)?;
    Ok(refunded(refund_id, amount, charge.id))
}

/// The answer to a refund of `amount` made as `id`, of the charge `charge`.
fn refunded(id: String, amount: i64, charge: String) -> (StatusCode, Json<RefundJson>) {
    let refund = RefundJson {
        id,
        object: "refund",
        amount,
        charge,
        status: "succeeded",
    };
    (StatusCode::CREATED, Json(refund))
}

/// The provider did nothing (it was unavailable, knew the key from another request, or refused a
/// refund beyond the payment): back to the state before the call, and the error. A 503 is not
/// stored by the idempotency layer, so a retry with the same key runs again. A call refused as
/// superseded leaves the charge as it is (the later run of the same request holds it), and so
/// does a call whose outcome is unknown (the retry, or the reconciler, learns it).
/// A refusal means nothing happened at the provider: only that is ever answered as such.
async fn roll_back(
    state: &AppState,
    account: &Account,
    id: &str,
    operation: Event,
    call_key: &str,
    err: ProviderError,
) -> ApiError {
    if err == ProviderError::Unknown {
        return err.into();
    }
    // Whether the refusal still tells what happened: the charge rolled back, or the key's last
    // call another operation's (nothing of this request's was ever in flight).
    let mut told = false;
    let rolled_back = state
        .ledger
        .update(account, id, &mut |c| {
            if c.reconciling {
                // The reconciler sends this call again under its key: it may be made, and the
                // reconciler settles it, or rolls it back on its own refusal.
                return Ok(());
            }
            if !waits_on(c, operation, call_key) {
                // Not in this request's call: the reconciler settled it (making the call under
                // its key) or rolled it back, and the charge may be in another request's call by
                // now, which is not this one's to undo.
                told = c.call_key == call_key && !call_made(c, operation, call_key);
                return Ok(());
            }
            c.apply(Event::ProviderDidNothing)?;
            // The call did nothing: the same request may begin it again.
            c.call_key.clear();
            c.call_amount = 0;
            told = true;
            Ok(())
        })
        .await;
    if let Err(err) = &rolled_back {
        tracing::error!(charge = id, ?err, "could not roll the charge back");
    }
    if rolled_back.is_err() || !told {
        // The charge was left in, or settled from, this call: "nothing was done" may no longer
        // be true, and the retry with the same key learns what was.
        return ProviderError::Unknown.into();
    }
    ApiError::from(err)
}

/// The provider acted, and its answer could not be written (the database failed, or a newer run
/// of the request holds the charge): never "nothing was done", but the outcome to learn by
/// retrying with the same key, which finds the charge the provider's answer settles.
fn not_recorded(err: ApiError) -> ApiError {
    tracing::warn!(
        ?err,
        "the provider acted, and its answer could not be recorded"
    );
    ProviderError::Unknown.into()
}

/// A JSON body, or 400: `invalid_json` when it is not JSON, `parameter_invalid` when a field has
/// the wrong type. serde's message quotes the bad value: cut to a few hundred bytes.
fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|err| match err.classify() {
        // serde's own words for a field the type does not have (`deny_unknown_fields`).
        serde_json::error::Category::Data if err.to_string().starts_with("unknown field") => {
            ApiError::invalid_request("parameter_unknown", quote(&err.to_string()))
        }
        serde_json::error::Category::Data => {
            ApiError::invalid_request("parameter_invalid", quote(&err.to_string()))
        }
        _ => ApiError::invalid_request(
            "invalid_json",
            format!("the body is not valid JSON: {}", quote(&err.to_string())),
        ),
    })
}
