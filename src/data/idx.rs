//! The IDX file format of MNIST: a big-endian header (magic, then one u32 per dimension) followed
//! by unsigned bytes. Images have magic 2051 and three dimensions `[count, rows, cols]`, labels
//! magic 2049 and one dimension `[count]`. Files may be gzip-compressed (detected by their first
//! two bytes, not their name), in one member or several (`cat a.gz b.gz` is a valid gzip file).
//! Every problem is an error naming the file.
//!
//! Memory stays bounded by what the header declares: the header is read first, its declared
//! size checked against the memory limit ([`crate::memory::check_fits`]), and then at most that
//! many bytes plus one are read or unpacked, so a small gzip that unpacks to gigabytes is refused
//! after one byte too many. [`read_maybe_gzip`], the generic reader, takes an explicit cap.

use crate::{Error, Result};
use std::io::Read;
use std::path::Path;

/// Images read from an IDX file: `count` images of `rows × cols` bytes, row-major.
#[derive(Clone, Debug, PartialEq)]
pub struct IdxImages {
    /// number of images
    pub count: usize,
    /// rows per image
    pub rows: usize,
    /// columns per image
    pub cols: usize,
    /// `count·rows·cols` pixel values, 0 = background
    pub pixels: Vec<u8>,
}

fn io_err(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Io(format!("{}: {what}", path.display()))
}

/// Opens `path` as a byte stream: through a gzip decoder when the file starts with the gzip
/// magic bytes (every member, so `cat a.gz b.gz` reads as one file), else as it is. Returns the
/// stream and whether it is gzip.
/// A path in the bundled directory (`<bundled>/NAME`) is read from the copy built into the
/// binary ([`crate::data::bundled`]).
pub(crate) fn open(path: &Path) -> Result<(Box<dyn Read>, bool)> {
    let mut file: Box<dyn Read> = match crate::data::bundled::file(path) {
        Some(bytes) => Box::new(bytes),
        None => Box::new(std::fs::File::open(path).map_err(|e| io_err(path, e))?),
    };
    let mut magic = Vec::with_capacity(2);
    (&mut file)
        .take(2)
        .read_to_end(&mut magic)
        .map_err(|e| io_err(path, e))?;
    let gzip = magic == [0x1f, 0x8b];
    let stream = std::io::Cursor::new(magic).chain(file);
    Ok(if gzip {
        (Box::new(flate2::read::MultiGzDecoder::new(stream)), true)
    } else {
        (Box::new(stream), false)
    })
}

/// An error while reading the stream of `path`: corrupt compressed data when it is gzip.
pub(crate) fn read_err(path: &Path, gzip: bool, e: std::io::Error) -> Error {
    if gzip {
        io_err(path, format!("corrupt gzip data: {e}"))
    } else {
        io_err(path, e)
    }
}

/// Reads a whole file of at most `max_bytes` bytes (after unpacking), un-gzipping it (every
/// member) when it starts with the gzip magic bytes. At most `max_bytes + 1` bytes are ever
/// unpacked, so a small file that unpacks to gigabytes costs no more than the cap.
///
/// # Errors
/// The file cannot be read, its gzip data is corrupt, or it holds more than `max_bytes` bytes.
pub fn read_maybe_gzip(path: &Path, max_bytes: u64) -> Result<Vec<u8>> {
    let (stream, gzip) = open(path)?;
    let mut out = Vec::new();
    stream
        .take(max_bytes.saturating_add(1))
        .read_to_end(&mut out)
        .map_err(|e| read_err(path, gzip, e))?;
    if out.len() as u64 > max_bytes {
        return Err(io_err(
            path,
            format!(
                "holds more than {max_bytes} bytes{}, the most this reader accepts",
                if gzip { " once unpacked" } else { "" }
            ),
        ));
    }
    Ok(out)
}

/// Reads an IDX file whose magic number must be `magic` and whose header has `rank`
/// dimensions: the header first, then at most the payload it declares plus one byte (so a file
/// that holds or unpacks to more is refused after reading one byte too many, not all of it).
/// Returns the dimensions and the payload.
fn read_idx(path: &Path, magic: u32, rank: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let (mut stream, gzip) = open(path)?;
    let header_len = 4 + 4 * rank;
    let mut header = Vec::with_capacity(header_len);
    (&mut stream)
        .take(header_len as u64)
        .read_to_end(&mut header)
        .map_err(|e| read_err(path, gzip, e))?;
    if header.len() < header_len {
        return Err(io_err(
            path,
            format!(
                "too short for an IDX header ({} bytes, need {header_len})",
                header.len()
            ),
        ));
    }
    let word = |i: usize| {
        u32::from_be_bytes([
            header[4 * i],
            header[4 * i + 1],
            header[4 * i + 2],
            header[4 * i + 3],
        ])
    };
    let found = word(0);
    if found != magic {
        let kind = if magic == 2051 { "images" } else { "labels" };
        return Err(io_err(
            path,
            format!("bad magic number {found} (IDX {kind} files start with {magic})"),
        ));
    }
    let dims: Vec<usize> = (1..=rank).map(|i| word(i) as usize).collect();
    let expected = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| io_err(path, "dimensions overflow"))?;
    // the bytes, then (in the caller) a float per byte: 5 bytes per value
    crate::memory::check_fits(
        &format!(
            "{}: an IDX file whose header declares {dims:?} = {expected} values",
            path.display()
        ),
        (expected as u64).checked_mul(5),
    )?;
    // room for the declared payload (up to 64 MiB at first: a header may lie) and one byte more
    let mut payload = crate::memory::try_vec(expected.saturating_add(1).min(1 << 26))?;
    stream
        .take(expected as u64 + 1)
        .read_to_end(&mut payload)
        .map_err(|e| read_err(path, gzip, e))?;
    if payload.len() != expected {
        let held = if payload.len() > expected {
            "more".to_string()
        } else {
            payload.len().to_string()
        };
        return Err(io_err(
            path,
            format!(
                "header says {dims:?} = {expected} bytes of data, the file holds {held}{}",
                if gzip { " once unpacked" } else { "" }
            ),
        ));
    }
    Ok((dims, payload))
}

/// Reads an IDX image file (magic 2051), gzip or raw.
pub fn read_images(path: &Path) -> Result<IdxImages> {
    let (d, pixels) = read_idx(path, 2051, 3)?;
    Ok(IdxImages {
        count: d[0],
        rows: d[1],
        cols: d[2],
        pixels,
    })
}

/// Reads an IDX label file (magic 2049), gzip or raw; every label must be at most `max_label`.
pub fn read_labels(path: &Path, max_label: u8) -> Result<Vec<u8>> {
    let (_, labels) = read_idx(path, 2049, 1)?;
    if let Some((i, &l)) = labels.iter().enumerate().find(|(_, l)| **l > max_label) {
        return Err(io_err(
            path,
            format!("label {l} at position {i} is above {max_label}"),
        ));
    }
    Ok(labels)
}
