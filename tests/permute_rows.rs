//! `Tensor::permute_rows` (a reordering of rows by a permutation whose inverse is known, the MoE
//! layer's combine weights put into the plan's order): the values from its definition
//! `y[r] = x[order[r]]` in f64; the gradient against finite differences (`gradcheck`), which a
//! backward that gathered by `order` instead of its inverse fails; the GPU against the CPU over
//! random shapes, forward and backward; bad input named in an error; and the dispatch plan's
//! `position` as the inverse of its `order`, which the layer passes as that inverse.

mod common;
#[path = "common/parity.rs"]
mod parity;

use moegrad::gradcheck::{GradcheckOptions, gradcheck};
use moegrad::moe::{Capacity, DispatchPlan, Routing};
use moegrad::{DType, Device, Error, Tensor};
use parity::{Gen, TIGHT, V, parity};
use rand::seq::SliceRandom;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A random permutation of `0..n` and its inverse.
fn permutation(rng: &mut ChaCha8Rng, n: usize) -> (Vec<i32>, Vec<i32>) {
    let mut order: Vec<i32> = (0..n as i32).collect();
    order.shuffle(rng);
    let mut inverse = vec![0; n];
    for (r, &i) in order.iter().enumerate() {
        inverse[i as usize] = r as i32;
    }
    (order, inverse)
}

fn ints(v: &[i32], dev: Device) -> Tensor {
    Tensor::from_i32(v.to_vec(), &[v.len()], dev).unwrap()
}

/// A random shape whose first axis has `rows` entries (rank 1 to 3).
fn shape_with_rows(rng: &mut ChaCha8Rng, rows: usize) -> Vec<usize> {
    let rank = rng.random_range(1..=3);
    std::iter::once(rows)
        .chain((1..rank).map(|_| rng.random_range(1..=4)))
        .collect()
}

#[test]
fn permute_rows_matches_its_definition() {
    let mut rng = ChaCha8Rng::seed_from_u64(71);
    for rows in [1, 2, 7, 40] {
        let shape = shape_with_rows(&mut rng, rows);
        let inner: usize = shape[1..].iter().product();
        let x: Vec<f64> = (0..rows * inner)
            .map(|_| rng.random_range(-1.0..1.0))
            .collect();
        let (order, inverse) = permutation(&mut rng, rows);
        let got = common::f64t(&x, &shape)
            .permute_rows(&ints(&order, Device::cpu()), &ints(&inverse, Device::cpu()))
            .unwrap();
        assert_eq!(got.shape(), &shape[..]);
        // y[r] = x[order[r]], row by row
        let want: Vec<f64> = order
            .iter()
            .flat_map(|&i| x[i as usize * inner..(i as usize + 1) * inner].to_vec())
            .collect();
        assert_eq!(got.to_vec_f64().unwrap(), want, "{shape:?} by {order:?}");
    }
}

#[test]
fn permute_rows_passes_gradcheck() {
    let mut rng = ChaCha8Rng::seed_from_u64(72);
    for rows in [2, 5, 9] {
        let shape = shape_with_rows(&mut rng, rows);
        let n: usize = shape.iter().product();
        let x: Vec<f64> = (0..n).map(|_| rng.random_range(-1.0..1.0)).collect();
        let (order, inverse) = permutation(&mut rng, rows);
        let (o, inv) = (ints(&order, Device::cpu()), ints(&inverse, Device::cpu()));
        // a weight that differs per position, so that a gradient sent to the wrong row shows
        let c: Vec<f64> = (0..n).map(|i| 1.0 + i as f64).collect();
        let c = common::f64t(&c, &shape);
        let report = gradcheck(
            |t| {
                let y = t[0].permute_rows(&o, &inv)?.mul(&c)?;
                y.mul(&y)
            },
            &[common::f64t(&x, &shape)],
            &GradcheckOptions::default(),
        )
        .unwrap_or_else(|e| panic!("permute_rows {shape:?} by {order:?}: {e}"));
        assert!(report.compared > 0);
    }
}

#[test]
fn permute_rows_gpu_matches_the_cpu() {
    let Some(dev) = common::gpu_or_skip("permute_rows_gpu_matches_the_cpu") else {
        return;
    };
    let mut rng = ChaCha8Rng::seed_from_u64(73);
    for case in 0..12 {
        let mut g = Gen::new("permute_rows", case);
        // past a workgroup of 256 rows too
        let rows = if case < 10 {
            g.dim(1, 40)
        } else {
            g.dim(257, 3000)
        };
        let shape = shape_with_rows(&mut rng, rows);
        let (order, inverse) = permutation(&mut rng, rows);
        let x = g.tensor(&shape, V::Smooth);
        let (o, inv) = (ints(&order, Device::cpu()), ints(&inverse, Device::cpu()));
        parity(
            "permute_rows",
            dev,
            TIGHT,
            |t| t[0].permute_rows(&t[1], &t[2]),
            &[x, o, inv],
        );
    }
}

#[test]
fn permute_rows_names_bad_input() {
    let x = Tensor::from_f32(vec![1.0, 2.0, 3.0], &[3], Device::cpu()).unwrap();
    let o = ints(&[2, 0, 1], Device::cpu());
    // not the inverse: an error naming the row (checked on the CPU)
    match x.permute_rows(&o, &o) {
        Err(Error::Invalid(m)) => assert!(m.contains("inverse") && m.contains("row"), "{m}"),
        other => panic!("a wrong inverse gave {other:?}"),
    }
    // out of range
    let far = ints(&[0, 1, 7], Device::cpu());
    assert!(matches!(x.permute_rows(&far, &far), Err(Error::Invalid(_))));
    // shapes: too short an index, a scalar; dtype: a float index
    match x.permute_rows(&ints(&[1, 0], Device::cpu()), &o) {
        Err(Error::Shape(m)) => assert!(m.contains("order") && m.contains("[3]"), "{m}"),
        other => panic!("a short order gave {other:?}"),
    }
    let scalar = Tensor::from_f32(vec![1.0], &[], Device::cpu()).unwrap();
    assert!(matches!(scalar.permute_rows(&o, &o), Err(Error::Shape(_))));
    let float_idx = Tensor::from_f32(vec![2.0, 0.0, 1.0], &[3], Device::cpu()).unwrap();
    assert!(matches!(
        x.permute_rows(&float_idx, &o),
        Err(Error::DType(_))
    ));
}

/// The plan's `position` inverts its `order` on every device, with drops, invalid assignments
/// and more than 1024 assignments (the sorted plan): what the MoE layer relies on when it
/// reorders its combine weights with `permute_rows(order, position)`.
#[test]
fn the_plans_position_inverts_its_order() {
    let mut devices = vec![Device::cpu()];
    devices.extend(common::gpu_or_skip("the_plans_position_inverts_its_order"));
    let mut rng = ChaCha8Rng::seed_from_u64(74);
    for dev in devices {
        for (t, n, k) in [(5, 3, 2), (700, 8, 2), (40, 4, 1)] {
            let idx: Vec<i32> = (0..t * k).map(|_| rng.random_range(0..n as i32)).collect();
            let w: Vec<f32> = (0..t * k).map(|_| rng.random_range(0.0..1.0)).collect();
            let valid: Vec<f32> = (0..t * k)
                .map(|_| (rng.random_range(0..4) > 0) as u8 as f32)
                .collect();
            let f32s = |v: Vec<f32>| Tensor::from_f32(v, &[t, k], dev).unwrap();
            let idx = Tensor::from_i32(idx, &[t, k], dev).unwrap();
            let probs = Tensor::zeros(&[t, n], DType::F32, dev).unwrap();
            let r = Routing::token_choice(&idx, &f32s(w), Some(&f32s(valid)), probs.clone(), probs)
                .unwrap();
            let capped = Capacity::Factor {
                factor: 0.7,
                min_capacity: 1,
            };
            for capacity in [Capacity::Dropless, capped] {
                let p = DispatchPlan::build(&r, capacity).unwrap();
                let order = p.order.to_vec_i32().unwrap();
                let position = p.position.to_vec_i32().unwrap();
                assert_eq!(order.len(), t * k);
                for (row, &a) in order.iter().enumerate() {
                    assert_eq!(
                        position[a as usize], row as i32,
                        "{dev}, T {t}, n {n}, k {k}, {capacity:?}: assignment {a}"
                    );
                }
            }
        }
    }
}
