//! What the exports write (`moegrad export --format hf` in `lm/hf_export.rs`, `--format torch`
//! in `train/torch_export.rs`): a new directory, written under a temporary name beside its
//! target and renamed into place once every file is in it (a failure leaves nothing behind),
//! and safetensors files with PyTorch's `format: pt` metadata.

use crate::checkpoint::write_atomic;
use crate::{Error, Result};
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tensor to write: its shape and f32 values.
pub(crate) type Values = (Vec<usize>, Vec<f32>);

/// A tensor to write with its safetensors dtype and little-endian bytes.
pub(crate) struct RawTensor {
    /// the name
    pub name: String,
    /// the element type
    pub dtype: Dtype,
    /// the shape
    pub shape: Vec<usize>,
    /// the values, little-endian
    pub bytes: Vec<u8>,
}

/// The safetensors bytes of F32 `tensors`, with PyTorch's `format: pt` metadata.
pub(crate) fn safetensors_bytes(tensors: &BTreeMap<String, Values>) -> Result<Vec<u8>> {
    raw_safetensors_bytes(
        tensors
            .iter()
            .map(|(n, (shape, v))| RawTensor {
                name: n.clone(),
                dtype: Dtype::F32,
                shape: shape.clone(),
                bytes: v.iter().flat_map(|x| x.to_le_bytes()).collect(),
            })
            .collect(),
    )
}

/// The safetensors bytes of `tensors` of any dtype, with PyTorch's `format: pt` metadata.
pub(crate) fn raw_safetensors_bytes(tensors: Vec<RawTensor>) -> Result<Vec<u8>> {
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|t| {
            safetensors::tensor::TensorView::new(t.dtype, t.shape.clone(), &t.bytes)
                .map(|view| (t.name.clone(), view))
                .map_err(|e| Error::Invalid(format!("tensor {}: {e}", t.name)))
        })
        .collect::<Result<_>>()?;
    let meta = std::collections::HashMap::from([("format".to_string(), "pt".to_string())]);
    safetensors::serialize(views, Some(meta)).map_err(|e| Error::Invalid(e.to_string()))
}

/// Writes `files` into a new directory `out`: under a temporary name beside it first, renamed
/// into place once every file is written (an existing empty `out` is replaced).
pub(crate) fn write_dir(out: &Path, files: &[(&str, Vec<u8>)]) -> Result<()> {
    let io = |p: &Path, e: std::io::Error| Error::Io(format!("{}: {e}", p.display()));
    if out.exists() {
        let empty = std::fs::read_dir(out)
            .map_err(|e| io(out, e))?
            .next()
            .is_none();
        if !out.is_dir() || !empty {
            return Err(Error::Invalid(format!(
                "--out {} exists and is not an empty directory: choose a new directory (an export never mixes its files with others)",
                out.display()
            )));
        }
    }
    let name = out
        .file_name()
        .ok_or_else(|| Error::Invalid(format!("--out {}: not a directory name", out.display())))?;
    let parent = match out.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    if !parent.is_dir() {
        return Err(Error::Io(format!(
            "--out {}: the directory {} does not exist",
            out.display(),
            parent.display()
        )));
    }
    let tmp = parent.join(format!(
        ".{}.tmp-{}",
        name.to_string_lossy(),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = (|| {
        std::fs::create_dir(&tmp).map_err(|e| io(&tmp, e))?;
        for (file, bytes) in files {
            write_atomic(&tmp.join(file), bytes)?;
        }
        if out.exists() {
            std::fs::remove_dir(out).map_err(|e| io(out, e))?;
        }
        std::fs::rename(&tmp, out).map_err(|e| io(out, e))
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}
