//! What the gRPC tests share: the example's payments service, held at a gate.

use std::sync::Arc;

use tokio::sync::Notify;
use tonic::Status;

use grpc_payments::{
    Charge, ChargeStream, CreateChargeRequest, Ledger, ListChargesRequest, Payments,
};

/// Payments whose `CreateCharge` waits for `gate` once it started.
#[derive(Clone, Default)]
pub(crate) struct Gated {
    pub ledger: Ledger,
    pub started: Arc<Notify>,
    pub gate: Arc<Notify>,
}

impl Payments for Gated {
    async fn create_charge(
        &self,
        request: tonic::Request<CreateChargeRequest>,
    ) -> Result<tonic::Response<Charge>, Status> {
        self.started.notify_one();
        self.gate.notified().await;
        self.ledger.create_charge(request).await
    }

    async fn list_charges(
        &self,
        request: tonic::Request<ListChargesRequest>,
    ) -> Result<tonic::Response<ChargeStream>, Status> {
        self.ledger.list_charges(request).await
    }
}
