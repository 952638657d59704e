//! Element types. Floats are f32 (both devices) and f64 (CPU only, for gradient checks);
//! I32 holds indices and labels and carries no gradient.

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float (CPU and GPU)
    F32,
    /// 64-bit float (CPU only; used by gradcheck)
    F64,
    /// 32-bit signed integer (indices, class labels)
    I32,
}

impl DType {
    /// True for F32 and F64.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64)
    }
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 => 8,
        }
    }
    /// Lower-case name, as printed in errors and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
