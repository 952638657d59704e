//! Element types. Floats are f32 (both devices), f64 (CPU only, for gradient checks) and f16
//! (GPU only, on adapters with `shader-f16`: the storage format of half-precision activations,
//! computed in f32); I32 holds indices and labels and carries no gradient.

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub enum DType {
    /// 32-bit float (CPU and GPU)
    F32,
    /// 64-bit float (CPU only; used by gradcheck)
    F64,
    /// 32-bit signed integer (indices, class labels)
    I32,
    /// 16-bit IEEE half-precision float (GPU only, where the adapter has wgpu's
    /// `SHADER_F16`): made by `Tensor::to_dtype(DType::F16)` from f32, read back as f32. The
    /// kernels that take it compute in f32 and only store in f16; an op without such a kernel
    /// refuses it with an error naming the op.
    F16,
}

impl DType {
    /// True for F32, F64 and F16.
    pub fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F64 | DType::F16)
    }
    /// Bytes per element.
    pub fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 => 4,
            DType::F64 => 8,
            DType::F16 => 2,
        }
    }
    /// Lower-case name, as printed in errors and on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F64 => "f64",
            DType::I32 => "i32",
            DType::F16 => "f16",
        }
    }
}

impl std::fmt::Display for DType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
