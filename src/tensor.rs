//! [`Tensor`]: shared storage + shape + device, and (when tracked) the autograd node that made it.
//!
//! A tensor is a cheap handle (`Arc`); cloning shares the data. Data are always contiguous and
//! row-major. Ops live in `ops/`, one family a file, each with its backward rule beside it; this
//! file holds construction, inspection and the autograd bookkeeping (`requires_grad`, `grad`,
//! `backward`, `detach`).

use crate::autograd::{self, GroupedWeightGrad, LeafGrad, Node};
use crate::backend::{HostData, Storage};
use crate::{DType, Device, Error, Result};
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
    /// The op that produced this tensor (None for leaves and untracked results).
    pub(crate) node: Option<Arc<Node>>,
    /// Accumulated gradient (leaves only).
    pub(crate) grad: Mutex<Option<LeafGrad>>,
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
            write!(f, ", op={}", n.op)?;
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
                "the GPU backend is f32-only; f64 tensors live on the CPU".into(),
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
                "the GPU backend is f32-only; f64 tensors live on the CPU".into(),
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

    // ---- autograd bookkeeping -------------------------------------------------------------

    /// Whether gradients flow to (a leaf) or through (an op output) this tensor.
    pub fn requires_grad(&self) -> bool {
        self.0.requires_grad.load(Ordering::Relaxed)
    }

    /// Marks a leaf as a parameter whose gradient `backward` should accumulate; returns `self`
    /// for chaining. Errors on an op output (its flag follows from its inputs) or on an I32 tensor.
    pub fn set_requires_grad(&self, on: bool) -> Result<&Tensor> {
        if self.0.node.is_some() {
            return Err(Error::Autograd(
                "requires_grad can only be set on a leaf tensor; call detach() first".into(),
            ));
        }
        if on && !self.dtype().is_float() {
            return Err(Error::Autograd(format!(
                "only float tensors can require grad, this one is {}",
                self.dtype()
            )));
        }
        self.0.requires_grad.store(on, Ordering::Relaxed);
        Ok(self)
    }

    /// Builder form of [`Tensor::set_requires_grad`]`(true)`.
    ///
    /// # Example
    /// ```
    /// use moegrad::{Device, Tensor};
    /// let w = Tensor::from_f32(vec![3.0], &[1], Device::cpu()).unwrap().with_grad().unwrap();
    /// let loss = w.mul(&w).unwrap().sum_all().unwrap();
    /// loss.backward().unwrap();
    /// assert_eq!(w.grad().unwrap().to_vec_f32().unwrap(), vec![6.0]);
    /// ```
    pub fn with_grad(self) -> Result<Tensor> {
        self.set_requires_grad(true)?;
        Ok(self)
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
        self.0.node.as_ref().map(|n| n.op)
    }

    /// The gradient accumulated by `backward` (leaves that require grad). An expert bank's
    /// gradient may have been kept as the recipe that computes it (see
    /// `autograd/deferred.rs`); it is computed here on first read (None if that fails; use
    /// [`Tensor::try_grad`] to see the error).
    pub fn grad(&self) -> Option<Tensor> {
        self.try_grad().ok().flatten()
    }

    /// [`Tensor::grad`], with the error of computing a deferred gradient.
    pub fn try_grad(&self) -> Result<Option<Tensor>> {
        let mut slot = self
            .0
            .grad
            .lock()
            .map_err(|_| Error::Autograd("gradient lock poisoned".into()))?;
        match slot.as_ref() {
            None => Ok(None),
            Some(LeafGrad::Dense(g)) => Ok(Some(g.clone())),
            Some(deferred) => {
                let g = deferred.to_dense()?;
                *slot = Some(LeafGrad::Dense(g.clone()));
                Ok(Some(g))
            }
        }
    }

    /// Whether the accumulated gradient is an expert bank's deferred gradient, not yet computed
    /// (see `autograd/deferred.rs`; reading it with [`Tensor::grad`] computes it).
    pub fn grad_is_deferred(&self) -> bool {
        self.0
            .grad
            .lock()
            .is_ok_and(|g| matches!(*g, Some(LeafGrad::Lazy(_))))
    }

    /// Forgets the accumulated gradient.
    pub fn zero_grad(&self) {
        if let Ok(mut g) = self.0.grad.lock() {
            *g = None;
        }
    }

    pub(crate) fn accumulate_grad(&self, g: Tensor) -> Result<()> {
        self.accumulate(LeafGrad::Dense(g))
    }

    /// Deposits an expert bank's weight gradient as its recipe (computed when used).
    pub(crate) fn accumulate_deferred(&self, g: GroupedWeightGrad) -> Result<()> {
        self.accumulate(LeafGrad::Lazy(Box::new(g)))
    }

    fn accumulate(&self, g: LeafGrad) -> Result<()> {
        let mut slot = self
            .0
            .grad
            .lock()
            .map_err(|_| Error::Autograd("gradient lock poisoned".into()))?;
        *slot = Some(match slot.take() {
            Some(old) => old.add(g)?,
            None => g,
        });
        Ok(())
    }

    /// Takes the accumulated gradient out (an optimizer's step), leaving none.
    pub(crate) fn take_grad(&self) -> Result<Option<LeafGrad>> {
        let mut slot = self
            .0
            .grad
            .lock()
            .map_err(|_| Error::Autograd("gradient lock poisoned".into()))?;
        Ok(slot.take())
    }

    /// Back-propagates from this scalar (one-element) tensor with upstream gradient 1.
    pub fn backward(&self) -> Result<()> {
        if self.numel() != 1 {
            return Err(Error::Autograd(format!(
                "backward() needs a scalar, this tensor has shape {:?}; use backward_with(grad)",
                self.shape()
            )));
        }
        let one = self.full_like(1.0)?;
        autograd::backward(self, one)
    }

    /// Back-propagates with an explicit upstream gradient of this tensor's shape.
    pub fn backward_with(&self, grad: &Tensor) -> Result<()> {
        if grad.shape() != self.shape()
            || grad.dtype() != self.dtype()
            || grad.device() != self.device()
        {
            return Err(Error::Autograd(format!(
                "upstream gradient {:?} {} on {} does not match the tensor {:?} {} on {}",
                grad.shape(),
                grad.dtype(),
                grad.device(),
                self.shape(),
                self.dtype(),
                self.device()
            )));
        }
        autograd::backward(self, grad.detach())
    }
}
