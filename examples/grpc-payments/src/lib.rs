//! `payments.v1.Payments` (`payments.proto` beside this crate) by hand: the messages as prost
//! derives them, the server and client as tonic's code generation writes them, and an in-memory
//! ledger. No `protoc`, no build script.
//!
//! The API of `examples/grpc.rs`, which its tests (`tests/grpc/`) call and its bench
//! (`benches/grpc.rs`) measures: one crate, as a service's generated code is shared in a real
//! project.

use std::convert::Infallible;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};

use tokio_stream::Stream;
use tonic::body::Body;
use tonic::client::GrpcService;
use tonic::server::{Grpc, NamedService};
use tonic::{Request, Response, Status, Streaming};
use tonic_prost::ProstCodec;

type BoxError = Box<dyn std::error::Error + Send + Sync>;
type BoxFuture<T> = Pin<Box<dyn Future<Output = T> + Send>>;

pub const CREATE_CHARGE: &str = "/payments.v1.Payments/CreateCharge";
pub const LIST_CHARGES: &str = "/payments.v1.Payments/ListCharges";

#[derive(Clone, PartialEq, prost::Message)]
pub struct CreateChargeRequest {
    #[prost(int64, tag = "1")]
    pub amount: i64,
    #[prost(string, tag = "2")]
    pub currency: String,
    #[prost(string, tag = "3")]
    pub description: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct Charge {
    #[prost(string, tag = "1")]
    pub id: String,
    #[prost(int64, tag = "2")]
    pub amount: i64,
    #[prost(string, tag = "3")]
    pub currency: String,
    #[prost(string, tag = "4")]
    pub status: String,
}

#[derive(Clone, PartialEq, prost::Message)]
pub struct ListChargesRequest {}

pub type ChargeStream = Pin<Box<dyn Stream<Item = Result<Charge, Status>> + Send>>;

/// The service's methods, as tonic's generated trait has them.
pub trait Payments: Send + Sync + 'static {
    fn create_charge(
        &self,
        request: Request<CreateChargeRequest>,
    ) -> impl Future<Output = Result<Response<Charge>, Status>> + Send;

    fn list_charges(
        &self,
        request: Request<ListChargesRequest>,
    ) -> impl Future<Output = Result<Response<ChargeStream>, Status>> + Send;
}

/// The charges made, in memory: what the example charges and the tests count.
#[derive(Clone, Default, Debug)]
pub struct Ledger(Arc<Mutex<Vec<Charge>>>);

impl Ledger {
    pub fn charges(&self) -> Vec<Charge> {
        self.0.lock().unwrap().clone()
    }
}

impl Payments for Ledger {
    async fn create_charge(
        &self,
        request: Request<CreateChargeRequest>,
    ) -> Result<Response<Charge>, Status> {
        let CreateChargeRequest {
            amount, currency, ..
        } = request.into_inner();
        if amount <= 0 || currency.len() != 3 {
            return Err(Status::invalid_argument(
                "amount must be positive, currency 3 letters",
            ));
        }
        let mut charges = self.0.lock().unwrap();
        let charge = Charge {
            id: format!("ch_{}", charges.len() + 1),
            amount,
            currency,
            status: "succeeded".into(),
        };
        charges.push(charge.clone());
        let mut response = Response::new(charge);
        response
            .metadata_mut()
            .insert("x-ledger-entries", charges.len().into());
        Ok(response)
    }

    async fn list_charges(
        &self,
        _: Request<ListChargesRequest>,
    ) -> Result<Response<ChargeStream>, Status> {
        let charges = self.charges().into_iter().map(Ok);
        Ok(Response::new(Box::pin(tokio_stream::iter(charges))))
    }
}

/// The server, as tonic's code generation writes it.
#[derive(Debug)]
pub struct PaymentsServer<T>(Arc<T>);

impl<T> PaymentsServer<T> {
    pub fn new(payments: T) -> Self {
        Self(Arc::new(payments))
    }
}

impl<T> Clone for PaymentsServer<T> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

impl<T> NamedService for PaymentsServer<T> {
    const NAME: &'static str = "payments.v1.Payments";
}

impl<T, B> tower::Service<http::Request<B>> for PaymentsServer<T>
where
    T: Payments,
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<BoxError> + Send + 'static,
{
    type Response = http::Response<Body>;
    type Error = Infallible;
    type Future = BoxFuture<Result<Self::Response, Infallible>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let payments = self.0.clone();
        match request.uri().path() {
            CREATE_CHARGE => Box::pin(async move {
                let method = tower::service_fn(move |r| {
                    let payments = payments.clone();
                    async move { payments.create_charge(r).await }
                });
                Ok(Grpc::new(ProstCodec::default())
                    .unary(method, request)
                    .await)
            }),
            LIST_CHARGES => Box::pin(async move {
                let method = tower::service_fn(move |r| {
                    let payments = payments.clone();
                    async move { payments.list_charges(r).await }
                });
                let mut grpc = Grpc::new(ProstCodec::default());
                Ok(grpc.server_streaming(method, request).await)
            }),
            _ => Box::pin(async { Ok(Status::unimplemented("no such method").into_http()) }),
        }
    }
}

/// The client, as tonic's code generation writes it, over any transport (a `Channel`, or one
/// behind `tower_idempotency_client::GrpcRetryLayer`).
#[derive(Clone, Debug)]
pub struct PaymentsClient<T>(tonic::client::Grpc<T>);

impl<T> PaymentsClient<T>
where
    T: GrpcService<Body>,
    T::Error: Into<BoxError>,
    T::ResponseBody: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    <T::ResponseBody as http_body::Body>::Error: Into<BoxError> + Send,
{
    pub fn new(transport: T) -> Self {
        Self(tonic::client::Grpc::new(transport))
    }

    pub async fn create_charge(
        &mut self,
        request: impl tonic::IntoRequest<CreateChargeRequest>,
    ) -> Result<Response<Charge>, Status> {
        self.ready().await?;
        let path = http::uri::PathAndQuery::from_static(CREATE_CHARGE);
        self.0
            .unary(request.into_request(), path, ProstCodec::default())
            .await
    }

    pub async fn list_charges(
        &mut self,
        request: ListChargesRequest,
    ) -> Result<Response<Streaming<Charge>>, Status> {
        self.ready().await?;
        let path = http::uri::PathAndQuery::from_static(LIST_CHARGES);
        self.0
            .server_streaming(Request::new(request), path, ProstCodec::default())
            .await
    }

    async fn ready(&mut self) -> Result<(), Status> {
        self.0
            .ready()
            .await
            .map_err(|err| Status::unavailable(format!("not ready: {}", err.into())))
    }
}
