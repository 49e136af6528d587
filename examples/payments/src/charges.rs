//! The handlers of `/v1/charges`. One that calls the provider commits the charge's `-ing` state
//! first, passes a key derived from the request's [`IdempotencyKey`] and the account (so a retry
//! that reaches it again, its record lost, reaches the provider with the same key), and commits the
//! answer and its event with the request (in PostgreSQL, with its record). [`HeldClaim::still_held`]
//! stops a run taken over right before the call, the irreversible step; one that stalls past it
//! calls with the newer run's key, which the provider answers once, and the charge's constraint
//! keeps one charge per operation. Once the provider may have acted, no answer says nothing happened.

use std::collections::BTreeMap;
use std::ops::RangeInclusive;

use axum::extract::{Extension, Path, State};
use axum::http::{Extensions, HeaderMap, StatusCode};
use axum::{Json, body::Bytes};
use serde::{Deserialize, Serialize, de::DeserializeOwned};
use serde_json::error::Category;
use tower_idempotency::{HeldClaim, IdempotencyKey};

use super::error::{ApiError, quote};
use super::ledger::{Charge, ChargeJson, NewCharge, Opened};
use super::params::{self, Form};
use super::provider::{Outcome, ProviderError, Source};
use super::state_machine::{Event, Status};
use super::{AppState, auth::Account, events::PaymentEvent, now_ms, reconciler::metadata};

/// A charge's amounts in minor units (cents), as card payment APIs allow; the bound keeps every
/// sum the example makes (a balance, a refund total) far from overflowing.
pub(crate) const AMOUNTS: RangeInclusive<i64> = 1..=99_999_999;

/// The longest `description`, in characters: a charge echoes it, at most 6 bytes a character once
/// escaped (about 6 KB), far within the response the layer stores ([`super::RESPONSE_LIMIT`]).
pub(crate) const DESCRIPTION_CHARS: usize = 1000;

/// A provider-calling handler's account, key, and extensions (its claim; its PostgreSQL work).
type Caller = (
    State<AppState>,
    Extension<Account>,
    IdempotencyKey,
    Extensions,
);

/// The body of `POST /v1/charges`.
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

/// The body of `POST /v1/charges/{id}/refunds`; empty means "refund the rest".
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct CreateRefund {
    amount: Option<i64>,
}

/// A page of charges, as the API shows it.
#[derive(Debug, Serialize)]
pub(crate) struct ListJson {
    object: &'static str,
    data: Vec<ChargeJson>,
}

/// A refund, as the API shows it.
#[derive(Debug, Serialize)]
pub(crate) struct RefundJson {
    id: String,
    object: &'static str,
    amount: i64,
    charge: String,
    status: &'static str,
}

/// The provider's key for this request: the same on every retry, unrelated between accounts.
fn provider_key(key: &IdempotencyKey, account: &Account) -> String {
    key.derive(account.id())
}

/// Right before an irreversible provider call: `409` `idempotency_key_superseded` when a later run
/// took the request's claim over, `503` when the store cannot tell; no claim (let through) goes on.
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

/// `POST /v1/charges`: 201 with the charge; 402 if the card is declined (a failed charge recorded);
/// 503 if the provider is down (nothing recorded: retry); 504 if its answer was lost (the charge
/// stays `authorizing` for the retry, or the reconciler, to settle); 400 `idempotency_error` if the
/// key names another request.
pub(crate) async fn create(
    (State(state), Extension(account), key, extensions): Caller,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<ChargeJson>), ApiError> {
    let request = parse_create(&headers, &body)?;
    let provider_key = provider_key(&key, &account);
    let (mut charge, resumed) = match state.ledger.open(&account, &provider_key, &request).await? {
        Opened::Authorizing(charge) => (charge, false),
        Opened::Resumed(charge) => (charge, true),
        // An earlier attempt with this key settled it (its record lost), or the reconciler did.
        Opened::Settled(charge) if charge.status == Status::Failed => {
            return Err(ApiError::card_declined(&charge.id));
        }
        Opened::Settled(charge) => return Ok((StatusCode::CREATED, Json(charge.to_json()))),
    };
    // A run taken over leaves the `authorizing` charge to the newer run (or the reconciler).
    still_held(extensions.get()).await?;
    let call = (request.source, request.amount, request.capture);
    let metadata = metadata(&account, &provider_key);
    let created = state.provider.create_payment(&provider_key, call, metadata);
    let payment = match created.await {
        Ok(payment) => payment,
        // The provider may have made the payment: the charge stays `authorizing`, for the retry
        // with the same key to resume, or the reconciler to settle from the provider's side.
        Err(err @ ProviderError::Unknown) => return Err(err.into()),
        // Down for a resumed call: the earlier attempt's call may still land (the reconciler
        // settles it).
        Err(ProviderError::Unavailable) if resumed => return Err(ProviderError::Unknown.into()),
        // Refused: the charge was never made (unless the reconciler took it over, and resends).
        Err(err) if state.ledger.abandon(&charge).await => return Err(err.into()),
        Err(_) => return Err(ProviderError::Unknown.into()),
    };
    charge.payment = payment.id;
    let declined = payment.outcome == Outcome::Declined;
    let captured = payment.outcome == Outcome::Captured;
    // Authorized and captured in one call, the charge still walks every step.
    let steps: &[Event] = match payment.outcome {
        Outcome::Declined => &[Event::Declined],
        Outcome::Authorized => &[Event::Approved],
        Outcome::Captured => &[Event::Approved, Event::Capture, Event::Captured],
        Outcome::Canceled => &[Event::Approved, Event::Cancel, Event::Canceled],
    };
    steps.iter().try_for_each(|step| charge.apply(*step))?;
    // A repeated run gets the same answer and finds the same charge: the same event, id, content.
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
    let input: CreateCharge = parse_body(headers, body, |form| {
        Ok(CreateCharge {
            amount: form.integer("amount")?,
            currency: form.text("currency"),
            source: form.text("source"),
            capture: form.boolean("capture")?,
            description: form.text("description"),
            metadata: form.metadata(),
        })
    })?;
    let amount = input.amount.ok_or(ApiError::missing_param("amount"))?;
    if !AMOUNTS.contains(&amount) {
        let (low, high) = AMOUNTS.into_inner();
        let message =
            format!("`amount` must be an integer from {low} to {high}, in minor units (cents)");
        return Err(ApiError::invalid_param("amount", message));
    }
    let currency = input.currency.ok_or(ApiError::missing_param("currency"))?;
    if currency.len() != 3 || !currency.bytes().all(|b| b.is_ascii_alphabetic()) {
        let message = "`currency` must be a three-letter ISO code, such as `eur`";
        return Err(ApiError::invalid_param("currency", message));
    }
    let token = input.source.ok_or(ApiError::missing_param("source"))?;
    let message = "unknown `source`; the test tokens are `tok_visa`, `tok_chargeDeclined` and `tok_pspUnavailable`";
    let source = Source::parse(&token).ok_or_else(|| ApiError::invalid_param("source", message))?;
    let description_chars = input.description.as_deref().unwrap_or("").chars().count();
    if description_chars > DESCRIPTION_CHARS {
        let message = format!("`description` must be at most {DESCRIPTION_CHARS} characters");
        return Err(ApiError::invalid_param("description", message));
    }
    let metadata = input.metadata.unwrap_or_default();
    params::check_metadata(&metadata)?;
    Ok(NewCharge {
        amount,
        currency: currency.to_ascii_lowercase(),
        source,
        capture: input.capture.unwrap_or(true),
        description: input.description,
        metadata,
    })
}

/// `GET /v1/charges`: the account's charges, newest first.
pub(crate) async fn list(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
) -> Result<Json<ListJson>, ApiError> {
    let charges = state.ledger.list(&account).await?;
    let data = charges.iter().map(Charge::to_json).collect();
    Ok(Json(ListJson {
        object: "list",
        data,
    }))
}

/// `GET /v1/charges/{id}`: 404 for an unknown charge, and for another account's.
pub(crate) async fn get(
    State(state): State<AppState>,
    Extension(account): Extension<Account>,
    Path(id): Path<String>,
) -> Result<Json<ChargeJson>, ApiError> {
    Ok(Json(state.ledger.get(&account, &id).await?.to_json()))
}

/// `POST /v1/charges/{id}/capture`: takes the money of an authorized charge.
pub(crate) async fn capture(
    caller: Caller,
    id: Path<String>,
) -> Result<Json<ChargeJson>, ApiError> {
    move_along(caller, id, Event::Capture).await
}

/// `POST /v1/charges/{id}/cancel`: releases an authorized charge.
pub(crate) async fn cancel(caller: Caller, id: Path<String>) -> Result<Json<ChargeJson>, ApiError> {
    move_along(caller, id, Event::Cancel).await
}

/// A capture or a cancellation: `capturing` or `canceling` holds the charge during the provider
/// call (a concurrent one gets `invalid_state`; this request's own earlier run, taken over, left
/// it there and it goes on from it), then `captured` (with its event) or `canceled`.
async fn move_along(
    (State(state), Extension(account), key, extensions): Caller,
    Path(id): Path<String>,
    begin: Event,
) -> Result<Json<ChargeJson>, ApiError> {
    let call_key = provider_key(&key, &account);
    let mut resumed = false;
    let start = &mut |c: &mut Charge| begin_call(c, begin, &call_key).map(|r| resumed = r);
    let charge = state.ledger.update(&account, &id, start).await?;
    if call_made(&charge, begin, &call_key) {
        // Made already, and settled (by an earlier run, or the reconciler): the answer.
        return Ok(Json(charge.to_json()));
    }
    still_held(extensions.get()).await?;
    let (provider, payment) = (&state.provider, &charge.payment);
    let (called, end) = match begin {
        Event::Capture => (provider.capture(&call_key, payment).await, Event::Captured),
        _ => (provider.cancel(&call_key, payment).await, Event::Canceled),
    };
    let call = (begin, call_key.as_str(), resumed);
    roll_back_if_refused(called, &state, &account, &id, call).await?;
    let end_call = &mut |c: &mut Charge| {
        // Unless another run of the same request settled the call already.
        if !waits_on(c, begin, &call_key) {
            return Ok(());
        }
        if end == Event::Captured {
            c.capture_key.clone_from(&call_key);
        }
        c.apply(end)
    };
    // The event of this request's capture, once settled (by this run or the reconciler).
    let event = |c: &Charge| (c.capture_key == call_key).then(|| PaymentEvent::captured(c));
    let charge = (state.ledger)
        .settle(&extensions, &account, &id, end_call, &event)
        .await
        .map_err(not_recorded)?;
    Ok(Json(charge.to_json()))
}

/// Moves `charge` along `event` into the `-ing` state of a call with `call_key`; `true` when an
/// earlier run of this request began it (the provider answers it again). A call made is answered
/// as it is; a key whose call was another operation's is refused.
fn begin_call(charge: &mut Charge, event: Event, call_key: &str) -> Result<bool, ApiError> {
    if call_made(charge, event, call_key) {
        return Ok(false);
    }
    if charge.call_key == call_key {
        return resumable(charge, event).map(|()| true);
    }
    charge.apply(event)?;
    charge.call_key = call_key.to_owned();
    charge.call_started = now_ms();
    charge.call_amount = 0;
    Ok(false)
}

/// Whether `charge` still waits on this request's `operation` call. Once settled (by another run,
/// or the reconciler; the charge may be in another call since), a late run must change nothing (in
/// memory, its write would count a refund twice).
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

/// A request whose key made the charge's last call, not settled as `operation`'s: resumed while
/// the charge waits on it, else refused. The call was another operation's (the client's key sent
/// again for another operation, once the layer let it go), which this request must neither
/// resume nor undo, nor take as its own.
fn resumable(charge: &Charge, operation: Event) -> Result<(), ApiError> {
    if charge.status != calling(operation) {
        return Err(ApiError::idempotency_key_reused());
    }
    if charge.reconciling {
        // The reconciler resends this call: unknown until it settles it (a write would delay it).
        return Err(ProviderError::Unknown.into());
    }
    Ok(())
}

/// `POST /v1/charges/{id}/refunds`: refunds `amount` (default: the rest) of a captured charge.
pub(crate) async fn refund(
    (State(state), Extension(account), key, extensions): Caller,
    Path(id): Path<String>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<(StatusCode, Json<RefundJson>), ApiError> {
    let from_form = |form: &mut Form| form.integer("amount").map(|amount| CreateRefund { amount });
    let input = match body.is_empty() {
        true => CreateRefund::default(),
        false => parse_body(&headers, &body, from_form)?,
    };
    let call_key = provider_key(&key, &account);
    let (mut amount, mut made, mut resumed) = (0, None, false);
    let begin = &mut |c: &mut Charge| {
        // The key names one refund: another amount under it is another request.
        let other_amount = |earlier: i64| input.amount.is_some_and(|asked| asked != earlier);
        if let Some(refund) = c.refund_under(&call_key) {
            // Settled (by an earlier run, or the reconciler); the charge may have moved on since.
            if other_amount(refund.amount) {
                return Err(ApiError::idempotency_key_reused());
            }
            (amount, made) = (refund.amount, Some(refund.id.clone()));
            return Ok(());
        }
        if c.call_key == call_key {
            // Begun by an earlier run: the provider answers it again.
            if other_amount(c.call_amount) {
                return Err(ApiError::idempotency_key_reused());
            }
            (amount, resumed) = (c.call_amount, true);
            return resumable(c, Event::Refund);
        }
        amount = input.amount.unwrap_or(c.refundable());
        c.apply(Event::Refund)?;
        c.call_key = call_key.clone();
        c.call_started = now_ms();
        c.call_amount = amount;
        if amount <= 0 {
            let message = "`amount` must be a positive integer";
            return Err(ApiError::invalid_param("amount", message));
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
    still_held(extensions.get()).await?;
    let payment = &charge.payment;
    let called = state.provider.refund(&call_key, payment, amount).await;
    let call = (Event::Refund, call_key.as_str(), resumed);
    let refund_id = roll_back_if_refused(called, &state, &account, &id, call).await?;
    let settle = &mut |c: &mut Charge| match waits_on(c, Event::Refund, &call_key) {
        true => c.record_refund(&call_key, &refund_id, amount),
        false => Ok(()),
    };
    // The event of this request's refund, once settled (by this run or the reconciler).
    let event = |c: &Charge| {
        let settled = c.refund_under(&call_key).is_some_and(|r| r.id == refund_id);
        settled.then(|| PaymentEvent::refunded(c, &refund_id, amount))
    };
    let charge = (state.ledger)
        .settle(&extensions, &account, &id, settle, &event)
        .await
        .map_err(not_recorded)?;
    Ok(refunded(refund_id, amount, charge.id))
}

/// The answer to a refund of `amount` made as `id`, of the charge `charge`.
fn refunded(id: String, amount: i64, charge: String) -> (StatusCode, Json<RefundJson>) {
    let (object, status) = ("refund", "succeeded");
    let refund = RefundJson {
        id,
        object,
        amount,
        charge,
        status,
    };
    (StatusCode::CREATED, Json(refund))
}

/// The provider's answer, or its refusal (unavailable, the key another request's, a refund beyond
/// the payment) once the charge is back where it was before the call: only a refusal says nothing
/// happened (a 503 is not stored: a retry runs again). An unknown outcome, a charge the reconciler
/// or a later run holds, or a resumed call the provider was down for (the earlier run's call may
/// still land) is left as it is: the retry, or the reconciler, learns it.
async fn roll_back_if_refused<T>(
    called: Result<T, ProviderError>,
    state: &AppState,
    account: &Account,
    id: &str,
    (operation, call_key, resumed): (Event, &str, bool),
) -> Result<T, ApiError> {
    let refusal = match called {
        Ok(answer) => return Ok(answer),
        Err(ProviderError::Unavailable) if resumed => return Err(ProviderError::Unknown.into()),
        Err(err @ ProviderError::Unknown) => return Err(err.into()),
        Err(refusal) => refusal,
    };
    // Whether the refusal still tells what happened: the charge rolled back, or the key's last
    // call another operation's (nothing of this request's was ever in flight).
    let mut told = false;
    let roll_back = &mut |c: &mut Charge| {
        if c.reconciling {
            // The reconciler sends the call again under its key: it settles it, or rolls it back.
            return Ok(());
        }
        if !waits_on(c, operation, call_key) {
            // Settled (made) or rolled back by the reconciler; maybe in another request's call now.
            told = c.call_key == call_key && !call_made(c, operation, call_key);
            return Ok(());
        }
        c.apply(Event::ProviderDidNothing)?;
        // The call did nothing: the same request may begin it again.
        c.call_key.clear();
        c.call_amount = 0;
        told = true;
        Ok(())
    };
    if let Err(err) = state.ledger.update(account, id, roll_back).await {
        tracing::error!(charge = id, ?err, "could not roll the charge back");
    } else if told {
        return Err(refusal.into());
    }
    // Left in, or settled from, this call: "nothing was done" may no longer be true.
    Err(ProviderError::Unknown.into())
}

/// The provider acted, and its answer could not be written (the database failed, or a newer run
/// holds the charge): `504`, never "nothing was done"; the retry with the same key learns it.
fn not_recorded(err: ApiError) -> ApiError {
    tracing::warn!(
        ?err,
        "the provider acted, and its answer could not be recorded"
    );
    ProviderError::Unknown.into()
}

/// A body as JSON, or as a form (`params.rs`) read by `from_form` when its `Content-Type` says so.
/// Either way an unknown parameter is refused, so that a misspelt one is never taken as left out.
fn parse_body<T: DeserializeOwned>(
    headers: &HeaderMap,
    body: &[u8],
    from_form: impl FnOnce(&mut Form) -> Result<T, ApiError>,
) -> Result<T, ApiError> {
    if !params::is_form(headers) {
        return parse_json(body);
    }
    let mut form = Form::parse(body);
    let input = from_form(&mut form)?;
    form.finish()?;
    Ok(input)
}

/// A JSON body, or 400 `invalid_json`, `parameter_invalid` (a field's type) or `parameter_unknown`,
/// in serde's words, cut to a few hundred bytes (they quote the bad value).
fn parse_json<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    serde_json::from_slice(body).map_err(|err| {
        let text = quote(&err.to_string());
        let not_json = format!("the body is not valid JSON: {text}");
        let (code, text) = match err.classify() {
            Category::Data if text.starts_with("unknown field") => ("parameter_unknown", text),
            Category::Data => ("parameter_invalid", text),
            _ => ("invalid_json", not_json),
        };
        ApiError::invalid_request(code, text)
    })
}
