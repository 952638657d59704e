//! The kernel constants the integration tests pick their sizes around. The backend is private,
//! so those tests cannot import them: each keeps a copy, named as here, with a comment pointing
//! to this file. This test fails when a constant changes, so the copies are updated with it
//! (otherwise a test meant to cross a block edge would silently stop crossing it).

use crate::backend::cpu::{ATTENTION_BLOCK, WEIGHT_GRAD_IMAGES};
use crate::backend::gpu::{ADAM_MULTI_SLOTS, ATTENTION_MAX_HEAD_DIM, ATTENTION_TILE};

#[test]
fn the_constants_the_integration_tests_copy_are_unchanged() {
    // tests/attention.rs and tests/forward_references.rs: sequences across CPU attention blocks
    assert_eq!(
        ATTENTION_BLOCK, 32,
        "update ATTENTION_BLOCK in tests/attention.rs and tests/forward_references.rs"
    );
    // tests/attention.rs: sequences across GPU attention tiles, head dims up to the largest
    assert_eq!(
        ATTENTION_TILE, 64,
        "update ATTENTION_TILE in tests/attention.rs"
    );
    assert_eq!(
        ATTENTION_MAX_HEAD_DIM, 128,
        "update ATTENTION_MAX_HEAD_DIM in tests/attention.rs"
    );
    // tests/conv2d.rs: a batch of more than three weight-gradient blocks
    assert_eq!(
        WEIGHT_GRAD_IMAGES, 8,
        "update WEIGHT_GRAD_IMAGES in tests/conv2d.rs"
    );
    // tests/optim_reference.rs: Adam's dispatches per step on the GPU
    assert_eq!(
        ADAM_MULTI_SLOTS, 12,
        "update ADAM_MULTI_SLOTS in tests/optim_reference.rs"
    );
}
