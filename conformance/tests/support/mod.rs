//! What the tests share: the deliberately broken server.
#![allow(
    dead_code,
    reason = "every test binary that says `mod support;` compiles all of it, and each uses a part"
)]

pub mod broken_server;
