//! The IDX file format of MNIST: a big-endian header (magic, then one u32 per dimension) followed
//! by unsigned bytes. Images have magic 2051 and three dimensions `[count, rows, cols]`, labels
//! magic 2049 and one dimension `[count]`. Files may be gzip-compressed (detected by their first
//! two bytes, not their name). Every problem is an error naming the file.

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

/// Reads a whole file, un-gzipping it when it starts with the gzip magic bytes.
pub fn read_maybe_gzip(path: &Path) -> Result<Vec<u8>> {
    let raw = std::fs::read(path).map_err(|e| io_err(path, e))?;
    if raw.len() >= 2 && raw[0] == 0x1f && raw[1] == 0x8b {
        let mut out = Vec::new();
        flate2::read::GzDecoder::new(&raw[..])
            .read_to_end(&mut out)
            .map_err(|e| io_err(path, format!("corrupt gzip data: {e}")))?;
        Ok(out)
    } else {
        Ok(raw)
    }
}

/// Parses the header; returns the dimensions and the payload.
fn parse(path: &Path, bytes: &[u8], magic: u32, rank: usize) -> Result<(Vec<usize>, Vec<u8>)> {
    let header = 4 + 4 * rank;
    if bytes.len() < header {
        return Err(io_err(
            path,
            format!(
                "too short for an IDX header ({} bytes, need {header})",
                bytes.len()
            ),
        ));
    }
    let word = |i: usize| {
        u32::from_be_bytes([
            bytes[4 * i],
            bytes[4 * i + 1],
            bytes[4 * i + 2],
            bytes[4 * i + 3],
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
    let payload = &bytes[header..];
    if payload.len() != expected {
        return Err(io_err(
            path,
            format!(
                "header says {dims:?} = {expected} bytes of data, the file holds {}",
                payload.len()
            ),
        ));
    }
    Ok((dims, payload.to_vec()))
}

/// Reads an IDX image file (magic 2051), gzip or raw.
pub fn read_images(path: &Path) -> Result<IdxImages> {
    let bytes = read_maybe_gzip(path)?;
    let (d, pixels) = parse(path, &bytes, 2051, 3)?;
    Ok(IdxImages {
        count: d[0],
        rows: d[1],
        cols: d[2],
        pixels,
    })
}

/// Reads an IDX label file (magic 2049), gzip or raw; every label must be at most `max_label`.
pub fn read_labels(path: &Path, max_label: u8) -> Result<Vec<u8>> {
    let bytes = read_maybe_gzip(path)?;
    let (_, labels) = parse(path, &bytes, 2049, 1)?;
    if let Some((i, &l)) = labels.iter().enumerate().find(|(_, l)| **l > max_label) {
        return Err(io_err(
            path,
            format!("label {l} at position {i} is above {max_label}"),
        ));
    }
    Ok(labels)
}
