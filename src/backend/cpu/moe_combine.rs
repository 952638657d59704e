//! The MoE combine's fused CPU kernels, behind [`crate::Tensor::weighted_index_scatter`]:
//!
//! * forward, `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]`: the row scatter of `cpu/layout.rs` with
//!   each source row scaled as it is added, so the `[A, d]` product `w·rows` is never written;
//! * backward, for each source row r at once: `d_rows[r] = w[r]·dy[idx[r]]` and
//!   `d_w[r] = Σ_i dy[idx[r], i]·rows[r, i]`, one pass that reads each gradient row where it is,
//!   without the gathered `[A, d]` gradient and the two products of the composed backward.
//!
//! Both round exactly as the composed ops do (`rows.mul(w)` then `index_scatter`, and their
//! backward rules), so a model trains to the same bits either way.

use super::layout::{check_indices, scatter_rows};
use super::reduce::sum_lanes;
use super::{CpuBuffer, buffer_pool, f32b, f64b, zeroed};
use crate::{Error, Result};
use num_traits::Float;
use rayon::prelude::*;
use std::mem::MaybeUninit;

/// Rows of the backward handled by one task.
const ROWS_PER_TASK: usize = 64;

/// `y [len, d]` with `y[t] = Σ_{r : idx[r] = t} w[r]·rows[r]` for `rows [A, d]`, `w [A]` (all 1
/// without `w`: `index_scatter`'s sum).
fn forward<T: Float + Send + Sync>(
    rows: &[T],
    w: Option<&[T]>,
    idx: &[i32],
    d: usize,
    len: usize,
) -> Vec<T> {
    scatter_rows(rows, w, idx, [idx.len(), 1, 0], 1, idx.len(), d, len)
}

/// `(d_rows [A, d], d_w [A])` for the gradient `dy [len, d]` of [`forward`].
fn backward<T: Float + Send + Sync>(
    rows: &[T],
    w: &[T],
    idx: &[i32],
    dy: &[T],
    d: usize,
) -> (Vec<T>, Vec<T>) {
    let a = idx.len();
    let mut d_w = zeroed(a);
    if d == 0 {
        return (Vec::new(), d_w);
    }
    let task = |(t, (dr, dw)): (usize, (&mut [MaybeUninit<T>], &mut [T])),
                products: &mut Vec<T>| {
        for (i, (dr, dw)) in dr.chunks_mut(d).zip(dw.iter_mut()).enumerate() {
            let r = t * ROWS_PER_TASK + i;
            let g = &dy[idx[r] as usize * d..(idx[r] as usize + 1) * d];
            let x = &rows[r * d..(r + 1) * d];
            for (o, &gi) in dr.iter_mut().zip(g) {
                o.write(gi * w[r]);
            }
            // the products first, then summed in lanes: the composed rule's `sum_to_shape`
            products.clear();
            products.extend(g.iter().zip(x).map(|(&gi, &xi)| gi * xi));
            *dw = sum_lanes(products);
        }
    };
    let mut d_rows: Vec<T> = buffer_pool::take(a * d).unwrap_or_else(|_| Vec::with_capacity(a * d));
    d_rows.spare_capacity_mut()[..a * d]
        .par_chunks_mut(ROWS_PER_TASK * d)
        .zip(d_w.par_chunks_mut(ROWS_PER_TASK))
        .enumerate()
        .for_each_init(
            || Vec::with_capacity(d),
            |products, job| task(job, products),
        );
    // SAFETY: the tasks wrote every element of all `a` rows.
    unsafe { d_rows.set_len(a * d) };
    (d_rows, d_w)
}

/// Checks the operands' lengths and indices: `rows [A, d]`, `w [A]`, `idx [A]` in `0..len`.
fn check(rows: usize, w: usize, idx: &[i32], (d, len): (usize, usize), what: &str) -> Result<()> {
    let a = idx.len();
    if rows != a * d || w != a {
        return Err(Error::Shape(format!(
            "{what}: {rows} row values and {w} weights for {a} rows of width {d}"
        )));
    }
    check_indices(idx, len, what)
}

/// Checks that `slots` (`[len·k]`) lists, for each output `t`, the `k` rows with `idx = t`, each
/// row once.
fn check_slot_promise(slots: &[i32], idx: &[i32], k: usize, what: &str) -> Result<()> {
    let mut seen = vec![false; idx.len()];
    for (i, &r) in slots.iter().enumerate() {
        let t = i / k.max(1);
        let listed = usize::try_from(r).ok().filter(|&r| r < idx.len());
        match listed {
            Some(r) if !seen[r] && idx[r] as usize == t => seen[r] = true,
            _ => {
                return Err(Error::Invalid(format!(
                    "{what}: slot {i} lists row {r} for output {t}, which is not one of that \
                     output's rows or was listed before"
                )));
            }
        }
    }
    Ok(())
}

/// Checks that `order` (each row's slot) is the inverse of `slots` (each slot's row).
fn check_slot_order_promise(order: &[i32], slots: &[i32], what: &str) -> Result<()> {
    for (r, &s) in order.iter().enumerate() {
        let back = usize::try_from(s).ok().and_then(|s| slots.get(s));
        if back != Some(&(r as i32)) {
            return Err(Error::Invalid(format!(
                "{what}: the slot order gives row {r} slot {s}, whose row is not {r}"
            )));
        }
    }
    Ok(())
}

/// Weights per slot `w` as weights per row, `w[order[r]]` for row `r`.
fn weights_by_row(w: &CpuBuffer, order: &[i32]) -> CpuBuffer {
    match w {
        CpuBuffer::F32(w) => f32b(order.iter().map(|&s| w[s as usize]).collect()),
        CpuBuffer::F64(w) => f64b(order.iter().map(|&s| w[s as usize]).collect()),
        other => other.clone(),
    }
}

/// Gradients per row as gradients per slot: `out[order[r]] = d_w[r]`.
fn by_slot(d_w: CpuBuffer, order: &[i32]) -> CpuBuffer {
    fn place<T: Copy + Default>(v: &[T], order: &[i32]) -> Vec<T> {
        let mut out = vec![T::default(); v.len()];
        for (&x, &s) in v.iter().zip(order) {
            out[s as usize] = x;
        }
        out
    }
    match &d_w {
        CpuBuffer::F32(v) => f32b(place(v, order)),
        CpuBuffer::F64(v) => f64b(place(v, order)),
        _ => d_w,
    }
}

/// The fused forward on CPU buffers (f32 or f64; `rows` and `w` of one dtype), with `addend`
/// (the output's dtype and size) added to the sum afterwards where given (the bits of the add).
/// Given `slots` (each output's rows, see `RoutingOps::weighted_scatter`), it checks them and
/// computes the same sum, which needs no grouping on the CPU; given `slot_order` too (weights
/// per slot), it checks that as well and reads each row's weight at its slot.
pub(crate) fn weighted_scatter(
    (rows, addend): (&CpuBuffer, Option<&CpuBuffer>),
    w: Option<&CpuBuffer>,
    idx: &CpuBuffer,
    (d, len): (usize, usize),
    slots: Option<(&CpuBuffer, usize)>,
    slot_order: Option<&CpuBuffer>,
) -> Result<CpuBuffer> {
    let out = (rows.dtype(), len * d);
    let addend_of = addend.map(|a| (a.dtype(), a.len()));
    crate::backend::checks::check_addend("weighted_index_scatter", addend_of, out)?;
    let y = combine(rows, w, idx, (d, len), slots, slot_order)?;
    Ok(match (addend, y) {
        (None, y) => y,
        (Some(CpuBuffer::F32(a)), CpuBuffer::F32(y)) => f32b(plus(a, &y)),
        (Some(CpuBuffer::F64(a)), CpuBuffer::F64(y)) => f64b(plus(a, &y)),
        (Some(a), y) => {
            return Err(Error::DType(format!(
                "weighted_index_scatter: an addend of {} for an output of {}",
                a.dtype(),
                y.dtype()
            )));
        }
    })
}

/// `a + y`, element by element.
fn plus<T: Float>(a: &[T], y: &[T]) -> Vec<T> {
    a.iter().zip(y).map(|(&a, &y)| a + y).collect()
}

/// [`weighted_scatter`] without the addend.
fn combine(
    rows: &CpuBuffer,
    w: Option<&CpuBuffer>,
    idx: &CpuBuffer,
    (d, len): (usize, usize),
    slots: Option<(&CpuBuffer, usize)>,
    slot_order: Option<&CpuBuffer>,
) -> Result<CpuBuffer> {
    const WHAT: &str = "weighted_index_scatter";
    let idx_buffer = idx;
    let idx = idx.indices(WHAT)?;
    crate::backend::checks::check_slot_order(
        WHAT,
        slot_order.map(|o| (o.dtype(), o.len())),
        slots.is_some(),
        w.is_some(),
        idx.len(),
    )?;
    if let (Some(order), Some((s, _)), Some(wb)) = (slot_order, slots, w) {
        let order = order.indices(WHAT)?;
        check_slot_order_promise(order, s.indices(WHAT)?, WHAT)?;
        let w_rows = weights_by_row(wb, order);
        return combine(rows, Some(&w_rows), idx_buffer, (d, len), slots, None);
    }
    check(
        rows.len(),
        w.map_or(idx.len(), |w| w.len()),
        idx,
        (d, len),
        WHAT,
    )?;
    if let Some((s, k)) = slots {
        crate::backend::checks::check_slots(WHAT, s.dtype(), s.len(), (len, k), idx.len())?;
        check_slot_promise(s.indices(WHAT)?, idx, k, WHAT)?;
    }
    match (rows, w) {
        (CpuBuffer::F32(x), None) => Ok(f32b(forward(x, None, idx, d, len))),
        (CpuBuffer::F64(x), None) => Ok(f64b(forward(x, None, idx, d, len))),
        (CpuBuffer::F32(x), Some(CpuBuffer::F32(w))) => Ok(f32b(forward(x, Some(w), idx, d, len))),
        (CpuBuffer::F64(x), Some(CpuBuffer::F64(w))) => Ok(f64b(forward(x, Some(w), idx, d, len))),
        _ => Err(Error::DType(format!(
            "{WHAT} needs float rows and weights of one dtype, got {} and {}",
            rows.dtype(),
            w.map_or("none".to_string(), |w| w.dtype().to_string())
        ))),
    }
}

/// The fused backward on CPU buffers: `(d_rows, d_w)` for the output gradient `dy [len, d]`.
pub(crate) fn weighted_scatter_backward(
    rows: &CpuBuffer,
    w: &CpuBuffer,
    idx: &CpuBuffer,
    dy: &CpuBuffer,
    (d, len): (usize, usize),
    slot_order: Option<&CpuBuffer>,
) -> Result<(CpuBuffer, CpuBuffer)> {
    const WHAT: &str = "weighted_index_scatter backward";
    if let Some(order) = slot_order {
        crate::backend::checks::check_slot_order(
            WHAT,
            Some((order.dtype(), order.len())),
            true,
            true,
            idx.len(),
        )?;
        let order = order.indices(WHAT)?;
        if order
            .iter()
            .any(|&s| usize::try_from(s).map_or(true, |s| s >= order.len()))
        {
            return Err(Error::Invalid(format!(
                "{WHAT}: a slot of the slot order is outside 0..{}",
                order.len()
            )));
        }
        let w_rows = weights_by_row(w, order);
        let (d_rows, d_w) = weighted_scatter_backward(rows, &w_rows, idx, dy, (d, len), None)?;
        return Ok((d_rows, by_slot(d_w, order)));
    }
    let idx = idx.indices(WHAT)?;
    check(rows.len(), w.len(), idx, (d, len), WHAT)?;
    if dy.len() != len * d {
        return Err(Error::Shape(format!(
            "{WHAT}: a gradient of {} values for [{len}, {d}]",
            dy.len()
        )));
    }
    match (rows, w, dy) {
        (CpuBuffer::F32(x), CpuBuffer::F32(w), CpuBuffer::F32(g)) => {
            let (dx, dw) = backward(x, w, idx, g, d);
            Ok((f32b(dx), f32b(dw)))
        }
        (CpuBuffer::F64(x), CpuBuffer::F64(w), CpuBuffer::F64(g)) => {
            let (dx, dw) = backward(x, w, idx, g, d);
            Ok((f64b(dx), f64b(dw)))
        }
        _ => Err(Error::DType(format!(
            "{WHAT} needs float rows, weights and gradient of one dtype, got {}, {} and {}",
            rows.dtype(),
            w.dtype(),
            dy.dtype()
        ))),
    }
}
