//! GPU backend placeholder (to be written).
