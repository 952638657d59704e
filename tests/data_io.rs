//! The data layer: the IDX reader on hand-built files (raw and gzip, good and bad: magic, sizes,
//! truncation, labels out of range, missing files, gzip files of several members, a gzip bomb,
//! a header declaring more than memory, training and test images of different sizes), the
//! capped generic gzip reader, the bundled MNIST subset, MultiMNIST's construction and
//! determinism, and the loader's seeded shuffling.

use moegrad::Device;
use moegrad::data::{Dataset, Mnist, multimnist};
use moegrad::data::{read_images, read_labels, read_maybe_gzip};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};

/// Counts heap bytes, so the gzip-bomb test can measure what reading a file cost.
#[global_allocator]
static ALLOC: moegrad::memory::CountingAllocator = moegrad::memory::CountingAllocator;

/// Held by the tests that allocate tens of megabytes (loading MNIST) and by the one that measures
/// the peak heap, so the measurement sees only its own allocations.
static HEAP_MEASURED: Mutex<()> = Mutex::new(());

fn heap_lock() -> MutexGuard<'static, ()> {
    HEAP_MEASURED.lock().unwrap_or_else(|e| e.into_inner())
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::default());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

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
        f.write_all(&self::gzip(bytes)).unwrap();
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
            "= 4 bytes of data, the file holds more once unpacked",
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
fn gzip_files_of_several_members_read_as_one() {
    // `cat a.gz b.gz`: a valid gzip file whose members unpack to the concatenation
    let dir = tmpdir("idx-members");
    let pixels: Vec<u8> = (0..3 * 2 * 2).map(|i| i as u8).collect();
    let whole = idx_bytes(2051, &[3, 2, 2], &pixels);
    let (a, b) = whole.split_at(10); // the split falls inside the header
    let p = dir.join("images-two-members.gz");
    std::fs::write(&p, [gzip(a), gzip(b)].concat()).unwrap();
    let im = read_images(&p).unwrap();
    assert_eq!((im.count, im.rows, im.cols), (3, 2, 2));
    assert_eq!(im.pixels, pixels);
    let labels = idx_bytes(2049, &[3], &[4, 5, 6]);
    let p = dir.join("labels-three-members.gz");
    let members: Vec<Vec<u8>> = labels.chunks(4).map(gzip).collect();
    std::fs::write(&p, members.concat()).unwrap();
    assert_eq!(read_labels(&p, 9).unwrap(), vec![4, 5, 6]);
    assert_eq!(read_maybe_gzip(&p, 100).unwrap(), labels);
}

#[test]
fn a_gzip_bomb_is_refused_after_its_declared_size_without_unpacking_it() {
    // header [1, 2, 2] (4 bytes of pixels), then 1 GiB of zeros in 256 identical members of
    // 4 MiB each (about 1 MB on disk)
    let dir = tmpdir("idx-bomb");
    let p = dir.join("bomb-images.gz");
    let zeros = gzip(&vec![0u8; 4 << 20]);
    let mut file = gzip(&idx_bytes(2051, &[1, 2, 2], &[0; 4]));
    for _ in 0..256 {
        file.extend_from_slice(&zeros);
    }
    std::fs::write(&p, &file).unwrap();
    let _only_me = heap_lock();
    let before = moegrad::memory::live_bytes();
    moegrad::memory::reset_peak();
    let e = read_images(&p).unwrap_err().to_string();
    let peak = moegrad::memory::peak_bytes().saturating_sub(before);
    assert!(
        e.contains("bomb-images.gz") && e.contains("holds more once unpacked"),
        "{e}"
    );
    // reading it whole would take the full GiB; the capped reader keeps a few buffers
    assert!(
        peak < 16 << 20,
        "reading the bomb took {peak} bytes of heap at its peak"
    );
}

#[test]
fn a_header_declaring_more_than_memory_is_refused_before_reading() {
    let dir = tmpdir("idx-huge");
    let p = dir.join("huge-images");
    write(
        &p,
        &idx_bytes(2051, &[65_535, 65_535, 65_535], &[0; 16]),
        false,
    );
    let e = read_images(&p).unwrap_err().to_string();
    assert!(
        e.contains("huge-images") && e.contains("[65535, 65535, 65535]") && e.contains("more than"),
        "{e}"
    );
}

#[test]
fn the_generic_gzip_reader_is_capped_and_reads_the_bundled_text() {
    let text = Path::new(env!("CARGO_MANIFEST_DIR")).join("data/shakespeare-10-plays.txt.gz");
    let bytes = read_maybe_gzip(&text, 2 << 20).unwrap();
    assert_eq!(bytes.len(), 1_271_402, "data/README.md gives its length");
    let e = read_maybe_gzip(&text, 1000).unwrap_err().to_string();
    assert!(
        e.contains("shakespeare-10-plays.txt.gz")
            && e.contains("more than 1000 bytes once unpacked"),
        "{e}"
    );
    let dir = tmpdir("gz-cap");
    let p = dir.join("raw.txt");
    std::fs::write(&p, b"0123456789").unwrap();
    assert_eq!(read_maybe_gzip(&p, 10).unwrap(), b"0123456789");
    assert!(read_maybe_gzip(&p, 9).is_err());
}

#[test]
fn training_and_test_images_of_different_sizes_are_refused_when_loaded() {
    let dir = tmpdir("mnist-sizes");
    write(
        &dir.join("train-images-idx3-ubyte"),
        &idx_bytes(2051, &[2, 28, 28], &[0; 2 * 28 * 28]),
        false,
    );
    write(
        &dir.join("train-labels-idx1-ubyte"),
        &idx_bytes(2049, &[2], &[1, 2]),
        false,
    );
    write(
        &dir.join("t10k-images-idx3-ubyte.gz"),
        &idx_bytes(2051, &[1, 20, 20], &[0; 400]),
        true,
    );
    write(
        &dir.join("t10k-labels-idx1-ubyte"),
        &idx_bytes(2049, &[1], &[3]),
        false,
    );
    let e = Mnist::load(&dir).unwrap_err().to_string();
    for part in [
        "train-images-idx3-ubyte",
        "28×28",
        "t10k-images-idx3-ubyte.gz",
        "20×20",
    ] {
        assert!(e.contains(part), "{part} missing from: {e}");
    }
    // the same sizes load
    write(
        &dir.join("t10k-images-idx3-ubyte.gz"),
        &idx_bytes(2051, &[1, 28, 28], &[0; 784]),
        true,
    );
    assert_eq!(Mnist::load(&dir).unwrap().test.rows, 28);
}

#[test]
fn bundled_mnist_has_the_documented_counts() {
    let _heavy = heap_lock();
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
    let _heavy = heap_lock();
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
