//! [`Tensor`]: shared storage + shape + device, and (when tracked) the autograd node that made it.
//!
//! A tensor is a cheap handle (`Arc`); cloning shares the data. Data are always contiguous and
//! row-major. Ops live in `ops/`, one family a file, each with its backward rule beside it; this
//! file holds construction, inspection and `detach`.
//!
//! The dependency between this module and `autograd` goes one way: autograd depends on
//! `tensor`, never the other way. Autograd records the graph (`autograd/mod.rs`,
//! `Tensor::record`), keeps the gradient bookkeeping (`autograd/leaf.rs`: `set_requires_grad`,
//! `grad`, `backward`, ...) and decides what it stores in a tensor's two autograd fields; this
//! file sees those fields only as opaque values (`TapeNode` and `dyn Any`), so it names no
//! autograd type (`tests/layering.rs` checks it).

use crate::backend::{HostData, Storage};
use crate::{DType, Device, Error, Result};
use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

static NEXT_ID: AtomicUsize = AtomicUsize::new(1);

/// An n-dimensional array on a device, optionally recorded for reverse-mode autodiff.
#[derive(Clone)]
pub struct Tensor(pub(crate) Arc<Inner>);

pub(crate) struct Inner {
    pub(crate) id: usize,
    pub(crate) storage: Storage,
    pub(crate) shape: Vec<usize>,
    /// Leaves: set by the user. Op outputs: true when any input required grad.
    pub(crate) requires_grad: AtomicBool,
    /// The op that produced this tensor (None for leaves and untracked results): autograd's
    /// node, seen here only as a [`TapeNode`].
    pub(crate) node: Option<Arc<dyn TapeNode>>,
    /// Accumulated gradient (leaves only): what autograd deposits there (its `LeafGrad`), opaque
    /// to this module.
    pub(crate) grad: Mutex<Option<Box<dyn Any + Send>>>,
}

/// The record of the op that produced a tracked tensor, as the tensor sees it: a name, and
/// otherwise opaque. Autograd's `Node` (`autograd/mod.rs`) is the one implementation; autograd
/// reads its own fields back by downcasting (`TapeNode: Any`), which keeps this module free of
/// autograd's types.
pub(crate) trait TapeNode: Any + Send + Sync {
    /// The op's name, for `Debug` and [`Tensor::op_name`].
    fn op_name(&self) -> &'static str;
}

impl std::fmt::Debug for Tensor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Tensor(shape={:?}, dtype={}, device={}",
            self.shape(),
            self.dtype(),
            self.device()
        )?;
        if let Some(n) = &self.0.node {
            write!(f, ", op={}", n.op_name())?;
        }
        if self.requires_grad() {
            write!(f, ", requires_grad")?;
        }
        write!(f, ")")
    }
}

fn check_len(shape: &[usize], len: usize) -> Result<()> {
    let n = shape.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if n != Some(len) {
        let n = n.map_or("more than can be counted".to_string(), |n| n.to_string());
        return Err(Error::Shape(format!(
            "{len} values cannot fill a tensor of shape {shape:?} ({n} elements)"
        )));
    }
    Ok(())
}

impl Tensor {
    /// Wraps a storage as an untracked tensor (the backend already produced `shape`'s elements).
    pub(crate) fn from_storage(storage: Storage, shape: Vec<usize>) -> Tensor {
        Tensor(Arc::new(Inner {
            id: NEXT_ID.fetch_add(1, Ordering::Relaxed),
            storage,
            shape,
            requires_grad: AtomicBool::new(false),
            node: None,
            grad: Mutex::new(None),
        }))
    }

    /// Builds a tensor from host data on a device.
    pub fn from_host(data: HostData, shape: &[usize], device: Device) -> Result<Tensor> {
        check_len(shape, data.len())?;
        if device.is_gpu() && data.dtype() == DType::F64 {
            return Err(Error::DType(
                "the GPU computes in f32 (and stores f16); f64 tensors live on the CPU".into(),
            ));
        }
        Ok(Tensor::from_storage(
            Storage::from_host(data, device.is_gpu())?,
            shape.to_vec(),
        ))
    }

    /// An f32 tensor from values in row-major order.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let t = Tensor::from_f32(vec![1.0, 2.0, 3.0, 4.0], &[2, 2], Device::cpu()).unwrap();
    /// assert_eq!(t.shape(), &[2, 2]);
    /// ```
    pub fn from_f32(values: Vec<f32>, shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_host(HostData::F32(values), shape, device)
    }

    /// An f64 tensor (CPU only).
    pub fn from_f64(values: Vec<f64>, shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_host(HostData::F64(values), shape, device)
    }

    /// An i32 tensor (indices, class labels).
    pub fn from_i32(values: Vec<i32>, shape: &[usize], device: Device) -> Result<Tensor> {
        Tensor::from_host(HostData::I32(values), shape, device)
    }

    /// A tensor of `shape` filled with `value`.
    pub fn full(shape: &[usize], value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        if device.is_gpu() && dtype == DType::F64 {
            return Err(Error::DType(
                "the GPU computes in f32 (and stores f16); f64 tensors live on the CPU".into(),
            ));
        }
        let n = shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| {
                Error::Invalid(format!(
                    "a tensor of shape {shape:?} has more elements than can be counted"
                ))
            })?;
        Ok(Tensor::from_storage(
            Storage::full(n, value, dtype, device.is_gpu())?,
            shape.to_vec(),
        ))
    }

    /// Zeros of `shape`.
    pub fn zeros(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 0.0, dtype, device)
    }

    /// Ones of `shape`.
    pub fn ones(shape: &[usize], dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(shape, 1.0, dtype, device)
    }

    /// Zeros with this tensor's shape, dtype and device.
    pub fn zeros_like(&self) -> Result<Tensor> {
        Tensor::zeros(self.shape(), self.dtype(), self.device())
    }

    /// A same-shaped, same-device tensor filled with `value`.
    pub fn full_like(&self, value: f64) -> Result<Tensor> {
        Tensor::full(self.shape(), value, self.dtype(), self.device())
    }

    /// A 0-dimensional tensor holding `value` (dtype and device as given).
    pub fn scalar(value: f64, dtype: DType, device: Device) -> Result<Tensor> {
        Tensor::full(&[], value, dtype, device)
    }

    /// The shape.
    pub fn shape(&self) -> &[usize] {
        &self.0.shape
    }
    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.0.shape.len()
    }
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.0.shape.iter().product()
    }
    /// The element type.
    pub fn dtype(&self) -> DType {
        self.0.storage.dtype()
    }
    /// The device holding the data.
    pub fn device(&self) -> Device {
        if self.0.storage.is_gpu() {
            Device::Gpu
        } else {
            Device::Cpu
        }
    }
    /// Mutable access to the storage, for in-place updates of untracked state (optimizer
    /// moments). A shared handle is first replaced by one of its own to the same storage; the
    /// backend copies the storage itself only if it is still shared when written.
    pub(crate) fn storage_mut(&mut self) -> &mut Storage {
        if Arc::get_mut(&mut self.0).is_none() {
            *self = Tensor::from_storage(self.0.storage.clone(), self.0.shape.clone());
        }
        match Arc::get_mut(&mut self.0) {
            Some(inner) => &mut inner.storage,
            None => unreachable!("a freshly made tensor handle is unique"),
        }
    }

    /// The storage (for backends and ops).
    pub(crate) fn storage(&self) -> &Storage {
        &self.0.storage
    }
    /// A process-unique id (used by the autograd walk).
    pub fn id(&self) -> usize {
        self.0.id
    }

    /// Copies the values to the host (waits for the GPU).
    pub fn to_host(&self) -> Result<HostData> {
        self.0.storage.download()
    }
    /// The values as f32 (converted from any dtype).
    pub fn to_vec_f32(&self) -> Result<Vec<f32>> {
        Ok(match self.to_host()? {
            HostData::F32(v) => v,
            other => other.to_f64().into_iter().map(|x| x as f32).collect(),
        })
    }
    /// The values as f64 (converted from any dtype).
    pub fn to_vec_f64(&self) -> Result<Vec<f64>> {
        Ok(self.to_host()?.to_f64())
    }
    /// The values of an I32 tensor.
    pub fn to_vec_i32(&self) -> Result<Vec<i32>> {
        match self.to_host()? {
            HostData::I32(v) => Ok(v),
            other => Err(Error::DType(format!(
                "to_vec_i32 on a {} tensor",
                other.dtype()
            ))),
        }
    }
    /// The single value of a one-element tensor, as f64.
    pub fn item(&self) -> Result<f64> {
        if self.numel() != 1 {
            return Err(Error::Shape(format!(
                "item() needs exactly one element, the tensor has shape {:?}",
                self.shape()
            )));
        }
        Ok(self.to_vec_f64()?[0])
    }

    /// A copy on another device (no gradient flows across; the result is a new leaf).
    pub fn to_device(&self, device: Device) -> Result<Tensor> {
        if device == self.device() {
            return Ok(self.detach());
        }
        let mut host = self.to_host()?;
        if device.is_gpu()
            && let HostData::F64(v) = &host
        {
            host = HostData::F32(v.iter().map(|&x| x as f32).collect());
        }
        Tensor::from_host(host, self.shape(), device)
    }

    /// Whether gradients flow to (a leaf) or through (an op output) this tensor (set on leaves
    /// with `set_requires_grad`, see `autograd/leaf.rs`).
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// A new leaf sharing this tensor's data, cut off from the graph.
    pub fn detach(&self) -> Tensor {
        Tensor::from_storage(self.0.storage.clone(), self.0.shape.clone())
    }

    /// True for tensors not produced by a recorded op.
    pub fn is_leaf(&self) -> bool {
        self.0.node.is_none()
    }

    /// The name of the op that produced this tensor, if it was recorded.
    pub fn op_name(&self) -> Option<&'static str> {
        self.0.node.as_ref().map(|n| n.op_name())
    }
}
