//! The root examples, driven in process through what they build: `examples/axum.rs`
//! (`axum_app`) and `examples/render.rs` (`render_app`). Each example's own source is the thing
//! under test, so it is compiled here as it is, not copied.

mod axum_app;
#[allow(dead_code)]
#[path = "../../examples/axum.rs"]
mod axum_example;
mod render_app;
#[allow(dead_code)]
#[path = "../../examples/render.rs"]
mod render_example;
