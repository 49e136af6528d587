//! The gRPC mode (PROTOCOL.md §16) over HTTP/2 on loopback, against the example's
//! `payments.v1.Payments` (`examples/grpc.rs`): the layer with a real tonic server and client
//! (`server`), and the client's half over tonic's `Channel` (`client`).

mod client;
// The example's service itself, as `examples/grpc.rs` serves it: the tests hold the example to
// what they check.
#[allow(dead_code)]
#[path = "../../examples/grpc/payments.rs"]
mod payments;
mod server;
mod support;
