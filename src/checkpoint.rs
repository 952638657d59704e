//! Checkpoints in the safetensors format: parameters under their module names
//! (`layers.0.weight`, ...), optimizer state under `adam.m.<name>` / `adam.v.<name>` /
//! `sgd.momentum.<name>`, and string metadata (step, epoch, the run's config as JSON). PyTorch
//! reads them with `safetensors.torch.load_file(path)`.
//!
//! Writing is atomic: the bytes go to a temporary file in the same directory, are flushed to disk,
//! and the file is renamed over the target, so a crash never leaves a half-written checkpoint
//! and the previous one survives until the new one is complete. A process killed mid-write
//! leaves its temporary (`.<name>.tmp-<PID>`) behind; [`remove_stale_temporaries`] deletes
//! those whose process is gone. [`Checkpoint::first_non_finite`] finds a NaN or infinity
//! before it is saved or resumed from.

use crate::backend::HostData;
use crate::{Device, Error, Result, Tensor};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};

/// What a checkpoint holds.
#[derive(Clone, Debug, Default)]
pub struct Checkpoint {
    /// named tensors (parameters and optimizer state)
    pub tensors: BTreeMap<String, Tensor>,
    /// string metadata
    pub metadata: BTreeMap<String, String>,
}

fn io(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

fn to_bytes(host: &HostData) -> (Dtype, Vec<u8>) {
    match host {
        HostData::F32(v) => (Dtype::F32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::F64(v) => (Dtype::F64, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
        HostData::I32(v) => (Dtype::I32, v.iter().flat_map(|x| x.to_le_bytes()).collect()),
    }
}

fn from_bytes(dtype: Dtype, bytes: &[u8], name: &str, path: &Path) -> Result<HostData> {
    Ok(match dtype {
        Dtype::F32 => HostData::F32(
            bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        Dtype::F64 => HostData::F64(
            bytes
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes([c[0], c[1], c[2], c[3], c[4], c[5], c[6], c[7]]))
                .collect(),
        ),
        Dtype::I32 => HostData::I32(
            bytes
                .chunks_exact(4)
                .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
        ),
        other => {
            return Err(io(
                path,
                format!("tensor {name} has dtype {other:?}; moegrad reads F32, F64 and I32"),
            ));
        }
    })
}

/// What separates a temporary's target name from the writer's PID: `.<name>.tmp-<PID>`.
const TMP_MARK: &str = ".tmp-";

/// Whether process `pid` is running on this machine. Where that cannot be told (no `/proc`,
/// not Unix), the answer is true, so nothing that might be in use is taken or deleted.
pub fn process_is_running(pid: u32) -> bool {
    if pid == std::process::id() {
        return true;
    }
    if Path::new("/proc/self").exists() {
        return Path::new(&format!("/proc/{pid}")).exists();
    }
    #[cfg(unix)]
    {
        // `kill -0` sends nothing; it succeeds when the process exists
        std::process::Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(std::process::Stdio::null())
            .status()
            .map(|s| s.success())
            .unwrap_or(true)
    }
    #[cfg(not(unix))]
    {
        true
    }
}

/// Deletes the temporaries [`write_atomic`] left in `dir` for the files named in `targets`
/// when its process was killed mid-write (`.<target>.tmp-<PID>` of a PID that is no longer
/// running), and returns their paths. Those of running processes (a write in progress) and
/// every other file are kept.
pub fn remove_stale_temporaries(dir: &Path, targets: &[&str]) -> Result<Vec<std::path::PathBuf>> {
    let mut removed = Vec::new();
    let entries = match std::fs::read_dir(dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(removed),
        Err(e) => return Err(io(dir, e)),
    };
    for entry in entries {
        let entry = entry.map_err(|e| io(dir, e))?;
        let name = entry.file_name().to_string_lossy().into_owned();
        let pid = name
            .strip_prefix('.')
            .and_then(|rest| rest.rsplit_once(TMP_MARK))
            .filter(|(target, _)| targets.contains(target))
            .and_then(|(_, pid)| pid.parse::<u32>().ok());
        let is_file = entry.file_type().map(|t| t.is_file()).unwrap_or(false);
        if let Some(pid) = pid
            && is_file
            && !process_is_running(pid)
        {
            let path = entry.path();
            std::fs::remove_file(&path).map_err(|e| io(&path, e))?;
            removed.push(path);
        }
    }
    Ok(removed)
}

/// A tensor holding NaN or ±∞ (see [`Checkpoint::first_non_finite`]).
#[derive(Clone, Debug, PartialEq)]
pub struct NonFinite {
    /// the tensor's name
    pub name: String,
    /// how many of its values are not finite
    pub count: usize,
    /// how many values it has
    pub total: usize,
    /// the first value that is not finite
    pub first: f64,
}

impl std::fmt::Display for NonFinite {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} holds {} (and {} other non-finite values of {})",
            self.name,
            self.first,
            self.count - 1,
            self.total
        )
    }
}

/// A file written atomically: whatever is written to [`AtomicFile::tmp`] (a temporary in the
/// target's directory, `.<name>.tmp-<PID>`) replaces the target only at
/// [`AtomicFile::commit`], which flushes it to disk and renames it over the target. Dropped
/// without a commit (an error while writing), the temporary is deleted and the target is
/// untouched; a process killed meanwhile leaves the temporary for
/// [`remove_stale_temporaries`]. Checkpoints and plots are written this way.
#[derive(Debug)]
pub struct AtomicFile {
    target: PathBuf,
    tmp: PathBuf,
    committed: bool,
}

impl AtomicFile {
    /// Prepares an atomic write of `path` (creating its directory if needed). A symbolic link
    /// is followed (the file it points to is replaced, not the link); a path that exists but is
    /// not a regular file (a directory, `/dev/full`, a FIFO) is refused, since the rename would
    /// replace it rather than write to it.
    ///
    /// # Errors
    /// The directory cannot be created, `path` names no file, or it is not a regular file.
    pub fn new(path: &Path) -> Result<AtomicFile> {
        let resolved = std::fs::canonicalize(path).ok();
        let path = resolved.as_deref().unwrap_or(path);
        if path.exists() && !path.is_file() {
            return Err(io(
                path,
                "not a regular file: it is written by replacing the file, which would replace this one",
            ));
        }
        let dir = path
            .parent()
            .filter(|p| !p.as_os_str().is_empty())
            .unwrap_or(Path::new("."));
        std::fs::create_dir_all(dir).map_err(|e| io(dir, e))?;
        let name = path
            .file_name()
            .ok_or_else(|| io(path, "not a file name"))?
            .to_string_lossy();
        Ok(AtomicFile {
            target: path.to_path_buf(),
            tmp: dir.join(format!(".{name}{TMP_MARK}{}", std::process::id())),
            committed: false,
        })
    }

    /// The temporary to write.
    pub fn tmp(&self) -> &Path {
        &self.tmp
    }

    /// Flushes the temporary to disk and renames it over the target.
    ///
    /// # Errors
    /// The temporary is missing or cannot be flushed, or the rename fails (the target is then
    /// unchanged and the temporary deleted).
    pub fn commit(mut self) -> Result<()> {
        let f = std::fs::File::open(&self.tmp).map_err(|e| io(&self.tmp, e))?;
        f.sync_all().map_err(|e| io(&self.tmp, e))?;
        std::fs::rename(&self.tmp, &self.target).map_err(|e| io(&self.target, e))?;
        self.committed = true;
        Ok(())
    }
}

impl Drop for AtomicFile {
    fn drop(&mut self) {
        if !self.committed {
            let _ = std::fs::remove_file(&self.tmp);
        }
    }
}

/// Writes `path` atomically (see [`AtomicFile`]).
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let file = AtomicFile::new(path)?;
    let tmp = file.tmp();
    let mut f = std::fs::File::create(tmp).map_err(|e| io(tmp, e))?;
    f.write_all(bytes).map_err(|e| io(tmp, e))?;
    drop(f);
    file.commit()
}

/// The largest safetensors header read by [`Checkpoint::read_metadata`] (the JSON that lists
/// the tensors and the metadata; a real one is a few kilobytes).
const MAX_HEADER_BYTES: u64 = 100 << 20;

impl Checkpoint {
    /// Reads only the string metadata of the checkpoint at `path` (the safetensors header),
    /// without its tensors: what a run checks before it builds anything from them.
    ///
    /// # Errors
    /// The file cannot be read, is not a regular file, or its header is not a safetensors header.
    pub fn read_metadata(path: &Path) -> Result<BTreeMap<String, String>> {
        use std::io::Read;
        let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
        if !meta.is_file() {
            return Err(io(path, "not a regular file, so not a checkpoint"));
        }
        let mut f = std::fs::File::open(path).map_err(|e| io(path, e))?;
        let mut len = [0u8; 8];
        f.read_exact(&mut len)
            .map_err(|e| io(path, format!("not a valid safetensors file: {e}")))?;
        let len = u64::from_le_bytes(len);
        if len > MAX_HEADER_BYTES.min(meta.len()) {
            return Err(io(
                path,
                format!("not a valid safetensors file (a header of {len} bytes)"),
            ));
        }
        let mut header = vec![0u8; len as usize];
        f.read_exact(&mut header)
            .map_err(|e| io(path, format!("not a valid safetensors file: {e}")))?;
        let json: serde_json::Value = serde_json::from_slice(&header)
            .map_err(|e| io(path, format!("not a valid safetensors file: {e}")))?;
        Ok(json
            .get("__metadata__")
            .and_then(|m| m.as_object())
            .map(|m| {
                m.iter()
                    .filter_map(|(k, v)| Some((k.clone(), v.as_str()?.to_string())))
                    .collect()
            })
            .unwrap_or_default())
    }

    /// The first tensor, in name order, holding a NaN or an infinity (read back to the host;
    /// integer tensors are always finite), or None when every value is finite.
    pub fn first_non_finite(&self) -> Result<Option<NonFinite>> {
        for (name, t) in &self.tensors {
            let values = match t.to_host()? {
                HostData::F32(v) => v.into_iter().map(f64::from).collect(),
                HostData::F64(v) => v,
                HostData::I32(_) => continue,
            };
            let mut bad = values.iter().filter(|v| !v.is_finite());
            if let Some(&first) = bad.next() {
                return Ok(Some(NonFinite {
                    name: name.clone(),
                    count: 1 + bad.count(),
                    total: values.len(),
                    first,
                }));
            }
        }
        Ok(None)
    }

    /// Sets every parameter of `model` from the tensor of the same name (as f32), then loads
    /// the `state.` tensors as its step-to-step state (routers' correction bias, noise counters).
    /// `path` names the file in the errors.
    ///
    /// # Errors
    /// A parameter missing or of another shape than the model's (named); a state tensor the
    /// model does not hold.
    pub fn load_into(&self, model: &dyn crate::nn::Parameters, path: &Path) -> Result<()> {
        for (name, p) in model.named_params() {
            let t = self
                .tensors
                .get(&name)
                .ok_or_else(|| io(path, format!("parameter {name} is missing")))?;
            if t.shape() != p.get().shape() {
                return Err(io(
                    path,
                    format!(
                        "{name} has shape {:?}, but the model its metadata describes needs {:?}",
                        t.shape(),
                        p.get().shape()
                    ),
                ));
            }
            p.set(t.to_dtype(crate::DType::F32)?)?;
        }
        for (name, t) in &self.tensors {
            if let Some(state) = name.strip_prefix(crate::train::resume::STATE_PREFIX) {
                model.load_state(state, t).map_err(|e| io(path, e))?;
            }
        }
        Ok(())
    }

    /// Saves to `path` atomically.
    pub fn save(&self, path: &Path) -> Result<()> {
        let mut owned = Vec::with_capacity(self.tensors.len());
        for (name, t) in &self.tensors {
            let (dtype, bytes) = to_bytes(&t.to_host()?);
            owned.push((name.clone(), dtype, t.shape().to_vec(), bytes));
        }
        let views = owned
            .iter()
            .map(|(n, d, s, b)| TensorView::new(*d, s.clone(), b).map(|v| (n.clone(), v)))
            .collect::<std::result::Result<Vec<_>, _>>()
            .map_err(|e| io(path, e))?;
        let meta: HashMap<String, String> = self.metadata.clone().into_iter().collect();
        let bytes = safetensors::serialize(views, Some(meta)).map_err(|e| io(path, e))?;
        write_atomic(path, &bytes)
    }

    /// Loads from `path`, placing tensors on `device` (f64 stays on the CPU).
    pub fn load(path: &Path, device: Device) -> Result<Checkpoint> {
        // a device or a FIFO (`/dev/zero`) would be read without end: only regular files, and
        // only those whose bytes and tensors fit in memory
        let meta = std::fs::metadata(path).map_err(|e| io(path, e))?;
        if !meta.is_file() {
            return Err(io(path, "not a regular file, so not a checkpoint"));
        }
        crate::memory::check_fits(
            &format!("{}: a checkpoint of {} bytes", path.display(), meta.len()),
            meta.len().checked_mul(2),
        )?;
        let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
        let st = SafeTensors::deserialize(&bytes)
            .map_err(|e| io(path, format!("not a valid safetensors file: {e}")))?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| io(path, e))?;
        let metadata = header
            .metadata()
            .clone()
            .unwrap_or_default()
            .into_iter()
            .collect();
        let mut tensors = BTreeMap::new();
        for (name, view) in st.tensors() {
            let host = from_bytes(view.dtype(), view.data(), &name, path)?;
            let dev = if matches!(host, HostData::F64(_)) {
                Device::Cpu
            } else {
                device
            };
            tensors.insert(name, Tensor::from_host(host, view.shape(), dev)?);
        }
        Ok(Checkpoint { tensors, metadata })
    }
}
