//! Throw-away servers for the workspace's tests, each its own process on a free port of
//! `127.0.0.1`, never the machine's shared ones: [`RedisServer`], [`RedisCluster`] (six nodes)
//! and [`PostgresServer`]. They can be stopped, killed, paused and restarted, so that tests can
//! exercise what a store does when its server fails. A missing binary is a panic that says what
//! to install: tests never skip. And [`logs`]: a capture of what a test binary logs.

#![deny(unsafe_op_in_unsafe_fn)]

mod at_exit;
pub mod logs;
pub mod postgres_server;
pub mod redis_cluster;
pub mod redis_server;

pub use postgres_server::PostgresServer;
pub use redis_cluster::RedisCluster;
pub use redis_server::{RedisServer, RespValue};
