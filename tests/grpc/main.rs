//! The gRPC mode (PROTOCOL.md §16) over HTTP/2 on loopback, against the example's
//! `payments.v1.Payments` (`examples/grpc.rs`, its code the `grpc-payments` crate): the layer with a real tonic server and client
//! (`server`), and the client's half over tonic's `Channel` (`client`).

mod client;
mod server;
mod support;
