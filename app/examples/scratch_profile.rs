use moegrad::Device;
fn main() {
    let dev = Device::gpu().unwrap();
    let w = moegrad_cli::bench::MoeWorkload {
        tokens: 4096,
        d: 256,
        hidden: 512,
        k: 2,
    };
    let n: usize = std::env::args()
        .nth(1)
        .map(|s| s.parse().unwrap())
        .unwrap_or(2);
    let router = std::env::args().nth(2).unwrap_or("topk".into());
    let k = if router == "softmax" { n } else { 2 };
    moegrad::profile::enable();
    let _ = moegrad_cli::bench::moe_step(dev, (&router, n, k), Some(router == "softmax"), w, 1)
        .unwrap();
    let r = moegrad::profile::disable().unwrap();
    for k in r.gpu.unwrap().kernels {
        println!("{:50} {:5}", k.kernel, k.calls);
    }
}
