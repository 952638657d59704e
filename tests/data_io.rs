//! The data layer: the IDX reader on hand-built files (raw and gzip, good and bad: magic, sizes,
//! truncation, labels out of range, missing files), the bundled MNIST subset, MultiMNIST's
//! construction and determinism, and the loader's seeded shuffling.

use moegrad::Device;
use moegrad::data::idx::{read_images, read_labels};
use moegrad::data::{Dataset, Mnist, multimnist};
use std::io::Write;
use std::path::{Path, PathBuf};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("moegrad-test-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn idx_bytes(magic: u32, dims: &[u32], payload: &[u8]) -> Vec<u8> {
    let mut v = magic.to_be_bytes().to_vec();
    for d in dims {
        v.extend(d.to_be_bytes());
    }
    v.extend(payload);
    v
}

fn write(path: &Path, bytes: &[u8], gzip: bool) {
    let mut f = std::fs::File::create(path).unwrap();
    if gzip {
        let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
        enc.write_all(bytes).unwrap();
        f.write_all(&enc.finish().unwrap()).unwrap();
    } else {
        f.write_all(bytes).unwrap();
    }
}

#[test]
fn reads_hand_built_idx_files_raw_and_gzip() {
    let dir = tmpdir("idx-good");
    let pixels: Vec<u8> = (0..2 * 3 * 4).map(|i| i as u8 * 10).collect();
    for gz in [false, true] {
        let ip = dir.join(format!("img{gz}"));
        let lp = dir.join(format!("lab{gz}"));
        write(&ip, &idx_bytes(2051, &[2, 3, 4], &pixels), gz);
        write(&lp, &idx_bytes(2049, &[2], &[7, 3]), gz);
        let im = read_images(&ip).unwrap();
        assert_eq!((im.count, im.rows, im.cols), (2, 3, 4));
        assert_eq!(im.pixels, pixels);
        assert_eq!(read_labels(&lp, 9).unwrap(), vec![7, 3]);
    }
}

#[test]
fn rejects_bad_idx_files_naming_the_file_and_problem() {
    let dir = tmpdir("idx-bad");
    let cases: Vec<(&str, Vec<u8>, bool, &str)> = vec![
        (
            "wrong-magic",
            idx_bytes(2049, &[1, 2, 2], &[0; 4]),
            false,
            "bad magic number 2049",
        ),
        (
            "short-payload",
            idx_bytes(2051, &[2, 2, 2], &[0; 5]),
            false,
            "the file holds 5",
        ),
        (
            "long-payload",
            idx_bytes(2051, &[1, 2, 2], &[0; 9]),
            true,
            "the file holds 9",
        ),
        (
            "truncated-header",
            vec![0, 0, 8, 3, 0, 0],
            false,
            "too short",
        ),
    ];
    for (name, bytes, gz, expect) in cases {
        let p = dir.join(name);
        write(&p, &bytes, gz);
        let e = read_images(&p).unwrap_err().to_string();
        assert!(e.contains(name) && e.contains(expect), "{name}: {e}");
    }
    let p = dir.join("labels-out-of-range");
    write(&p, &idx_bytes(2049, &[3], &[1, 12, 2]), false);
    let e = read_labels(&p, 9).unwrap_err().to_string();
    assert!(e.contains("label 12 at position 1"), "{e}");
    let p = dir.join("corrupt.gz");
    std::fs::write(&p, [0x1f, 0x8b, 1, 2, 3, 4, 5]).unwrap();
    assert!(
        read_images(&p)
            .unwrap_err()
            .to_string()
            .contains("corrupt gzip")
    );
    let e = read_images(&dir.join("missing")).unwrap_err().to_string();
    assert!(e.contains("missing"), "{e}");
    let e = Mnist::load(&dir.join("nowhere")).unwrap_err().to_string();
    assert!(e.contains("nowhere") && e.contains("train-images"), "{e}");
}

#[test]
fn bundled_mnist_has_the_documented_counts() {
    let m = Mnist::load(Path::new(env!("CARGO_MANIFEST_DIR")).join("data").as_path()).unwrap();
    assert_eq!(
        (m.train.count, m.test.count, m.train.rows, m.train.cols),
        (8000, 2000, 28, 28)
    );
    let mut counts = [0usize; 10];
    for &l in &m.train.labels {
        counts[l as usize] += 1;
    }
    assert_eq!(counts, [810, 913, 786, 805, 799, 685, 807, 862, 745, 788]);
    assert!(m.train.images.iter().all(|&p| (0.0..=1.0).contains(&p)));
}

#[test]
fn multimnist_places_two_digits_and_is_deterministic() {
    let m = Mnist::load(Path::new(env!("CARGO_MANIFEST_DIR")).join("data").as_path()).unwrap();
    let small = moegrad::data::ImageSet::from_bytes(
        &m.train.images[..50 * 784]
            .iter()
            .map(|&p| (p * 255.0).round() as u8)
            .collect::<Vec<_>>(),
        &m.train.labels[..50]
            .iter()
            .map(|&l| l as u8)
            .collect::<Vec<_>>(),
        50,
        28,
        28,
    )
    .unwrap();
    let a = multimnist::compose(&small, 5).unwrap();
    let b = multimnist::compose(&small, 5).unwrap();
    let c = multimnist::compose(&small, 6).unwrap();
    assert_eq!(a.images, b.images);
    assert_eq!(a.labels, b.labels);
    assert_ne!(a.labels[1], c.labels[1]);
    assert_eq!(a.images.len(), 50 * 36 * 36);
    assert_eq!(a.labels[0], small.labels);
    // The top-left digit sits at offset 0, so the bottom-right 8×8 corner holds only the other
    // digit; the top-left 8×8 corner only the first.
    for i in 0..50 {
        let canvas = &a.images[i * 1296..(i + 1) * 1296];
        let digit = &small.images[i * 784..(i + 1) * 784];
        for r in 0..8 {
            for col in 0..8 {
                assert_eq!(canvas[r * 36 + col], digit[r * 28 + col]);
            }
        }
        // Each pixel is the max of the two placed digits.
        assert!(canvas.iter().all(|&p| (0.0..=1.0).contains(&p)));
    }
    let wrong = moegrad::data::ImageSet::from_bytes(&[0; 9], &[1], 1, 3, 3).unwrap();
    assert!(multimnist::compose(&wrong, 0).is_err());
}

#[test]
fn loader_shuffles_by_seed_and_epoch_and_batches_on_the_device() {
    let d = Dataset::new(
        (0..20).map(|i| i as f32).collect(),
        vec![2],
        vec![(0..10).collect()],
    )
    .unwrap();
    assert_eq!(d.len(), 10);
    assert_eq!(d.batches_per_epoch(3), 4);
    let o1 = d.order(1, 0, true);
    assert_eq!(o1, d.order(1, 0, true));
    assert_ne!(o1, d.order(1, 1, true));
    assert_ne!(o1, d.order(2, 0, true));
    let mut sorted = o1.clone();
    sorted.sort();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    let b = d.batch(&[3, 1], Device::cpu()).unwrap();
    assert_eq!(b.x.shape(), &[2, 2]);
    assert_eq!(b.x.to_vec_f32().unwrap(), vec![6.0, 7.0, 2.0, 3.0]);
    assert_eq!(b.y[0].to_vec_i32().unwrap(), vec![3, 1]);
    assert!(d.batch(&[], Device::cpu()).is_err());
    assert!(Dataset::new(vec![0.0; 5], vec![2], vec![]).is_err());
    assert!(Dataset::new(vec![0.0; 4], vec![2], vec![vec![1]]).is_err());
}
