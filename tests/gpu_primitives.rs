//! GPU primitives against the CPU backend (work in progress).

mod common;

use moegrad::DType;
use moegrad::backend::cpu::CpuBackend;
use moegrad::backend::gpu::GpuBackend;
use moegrad::backend::{Backend, HostData};

fn gpu(test: &str) -> Option<GpuBackend> {
    common::gpu_or_skip(test)?;
    Some(GpuBackend::get().expect("Device::gpu succeeded"))
}

#[test]
fn upload_download_full() {
    let Some(g) = gpu("upload_download_full") else {
        return;
    };
    for n in [0usize, 1, 255, 256, 1000, 70_000] {
        let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.5 - 3.0).collect();
        let b = g.upload(&HostData::F32(v.clone())).unwrap();
        assert_eq!(g.download(&b).unwrap(), HostData::F32(v));
        let f = g.full(n, 2.5, DType::F32).unwrap();
        assert_eq!(
            g.download(&f).unwrap(),
            CpuBackend
                .download(&CpuBackend.full(n, 2.5, DType::F32).unwrap())
                .unwrap()
        );
        let f = g.full(n, -7.9, DType::I32).unwrap();
        assert_eq!(g.download(&f).unwrap(), HostData::I32(vec![-7; n]));
    }
}
