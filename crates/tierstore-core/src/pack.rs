//! Pack files of the model repository: many tensors in one file, written with one sequential stream,
//! each tensor aligned for zero-copy use, read back in parallel straight into the caller's memory and
//! checked against its blake3 hash (DStore's tensor store, with integrity added).

use std::fs::{File, OpenOptions};
use std::io::{self, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// A content hash (blake3, 32 bytes).
pub type Hash = [u8; 32];

/// Buffers at least this large are hashed with all cores.
const PARALLEL_HASH_MIN: usize = 4 << 20;
/// Reads at least this large are split between threads.
const PARALLEL_READ_MIN: usize = 16 << 20;

/// Hashes one buffer, with all cores when it is large.
pub fn hash(bytes: &[u8]) -> Hash {
    if bytes.len() >= PARALLEL_HASH_MIN {
        *blake3::Hasher::new().update_rayon(bytes).finalize().as_bytes()
    } else {
        *blake3::hash(bytes).as_bytes()
    }
}

/// Hashes many buffers; small ones in parallel with each other, large ones each with all cores.
pub fn hash_many(buffers: &[&[u8]]) -> Vec<Hash> {
    use rayon::prelude::*;
    buffers.par_iter().map(|b| hash(b)).collect()
}

/// The alignment of a tensor in a pack: page alignment for large tensors (mmap and O_DIRECT friendly),
/// cache-line alignment for small ones, so that biases and norms do not cost a page each.
pub fn alignment_for(len: usize) -> u64 {
    if len >= 64 << 10 {
        4096
    } else {
        64
    }
}

/// Writes a new pack file: appended tensors, then fsync and an atomic rename into place.
pub struct PackWriter {
    file: File,
    temp: PathBuf,
    dest: PathBuf,
    len: u64,
}

impl PackWriter {
    /// Starts the pack that will be published at `dest` (written under a temporary name beside it).
    pub fn create(dest: &Path) -> io::Result<PackWriter> {
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = dest.with_file_name(format!(".{name}.{}.tmp", crate::pid()));
        let file = OpenOptions::new().write(true).create_new(true).open(&temp)?;
        Ok(PackWriter { file, temp, dest: dest.to_path_buf(), len: 0 })
    }

    /// Appends `bytes` at the next aligned offset; returns that offset.
    pub fn append(&mut self, bytes: &[u8]) -> io::Result<u64> {
        let align = alignment_for(bytes.len());
        let pad = (align - self.len % align) % align;
        if pad > 0 {
            self.file.write_all(&[0u8; 4096][..pad as usize])?;
            self.len += pad;
        }
        let offset = self.len;
        self.file.write_all(bytes)?;
        self.len += bytes.len() as u64;
        Ok(offset)
    }

    /// Bytes written so far, padding included.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// True while nothing is written.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Makes the pack durable and visible under its name.
    pub fn commit(self) -> io::Result<()> {
        self.file.sync_all()?;
        std::fs::rename(&self.temp, &self.dest)?;
        sync_dir(self.dest.parent().unwrap_or(Path::new(".")))
    }

    /// Removes the unfinished pack.
    pub fn abort(self) {
        let _ = std::fs::remove_file(&self.temp);
    }
}

/// fsyncs a directory, so that a rename or creation in it survives a crash.
pub fn sync_dir(dir: &Path) -> io::Result<()> {
    File::open(dir)?.sync_all()
}

/// One read of a tensor into memory owned by the caller.
pub struct ReadInto<'a> {
    /// Offset of the tensor in the pack.
    pub offset: u64,
    /// Where its bytes go; exactly the tensor's length.
    pub dest: &'a mut [u8],
    /// The hash the bytes must have, if checked.
    pub expect: Option<Hash>,
}

/// Why a read failed.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// The pack could not be read.
    #[error("{}: {source}", path.display())]
    Io {
        /// The pack.
        path: PathBuf,
        /// The operating system's error.
        source: io::Error,
    },
    /// The pack ended before the tensor did.
    #[error("{}: truncated pack (tensor #{index} at offset {offset} needs {len} bytes)", path.display())]
    Truncated {
        /// The pack.
        path: PathBuf,
        /// Which request.
        index: usize,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: usize,
    },
    /// The bytes do not have the recorded hash.
    #[error("{}: tensor #{index} at offset {offset} does not match its hash", path.display())]
    Corrupt {
        /// The pack.
        path: PathBuf,
        /// Which request.
        index: usize,
        /// Its offset.
        offset: u64,
    },
}

impl ReadError {
    /// The index of the request that failed, when one did.
    pub fn index(&self) -> Option<usize> {
        match self {
            ReadError::Truncated { index, .. } | ReadError::Corrupt { index, .. } => Some(*index),
            ReadError::Io { .. } => None,
        }
    }
}

fn read_exact_at(file: &File, mut buf: &mut [u8], mut offset: u64) -> io::Result<bool> {
    while !buf.is_empty() {
        match file.read_at(buf, offset) {
            Ok(0) => return Ok(false),
            Ok(n) => {
                buf = &mut buf[n..];
                offset += n as u64;
            }
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(true)
}

/// Reads every request from the pack at `path` into its destination, in parallel (small tensors side
/// by side, large ones split into chunks), then checks the hashes. Either every destination holds the
/// right bytes, or an error names the first request that does not.
pub fn read_into(path: &Path, requests: &mut [ReadInto<'_>]) -> Result<(), ReadError> {
    use rayon::prelude::*;
    let file = File::open(path).map_err(|source| ReadError::Io { path: path.to_path_buf(), source })?;
    // Split every request into chunks so that one large tensor keeps all threads busy.
    let mut chunks: Vec<(usize, u64, &mut [u8])> = Vec::new();
    for (i, r) in requests.iter_mut().enumerate() {
        let chunk = if r.dest.len() >= PARALLEL_READ_MIN { 8 << 20 } else { r.dest.len().max(1) };
        let mut offset = r.offset;
        for piece in r.dest.chunks_mut(chunk) {
            let len = piece.len() as u64;
            chunks.push((i, offset, piece));
            offset += len;
        }
    }
    let failures: Vec<(usize, Option<io::Error>)> = chunks
        .par_iter_mut()
        .filter_map(|(i, offset, piece)| match read_exact_at(&file, piece, *offset) {
            Ok(true) => None,
            Ok(false) => Some((*i, None)),
            Err(e) => Some((*i, Some(e))),
        })
        .collect();
    if let Some((index, err)) = failures.into_iter().min_by_key(|(i, _)| *i) {
        let r = &requests[index];
        return Err(match err {
            Some(source) => ReadError::Io { path: path.to_path_buf(), source },
            None => ReadError::Truncated { path: path.to_path_buf(), index, offset: r.offset, len: r.dest.len() },
        });
    }
    let bad = requests
        .par_iter()
        .enumerate()
        .filter(|(_, r)| r.expect.is_some_and(|h| hash(r.dest) != h))
        .map(|(i, _)| i)
        .min();
    match bad {
        Some(index) => Err(ReadError::Corrupt { path: path.to_path_buf(), index, offset: requests[index].offset }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_round_trip_and_corruption() {
        let dir = tempfile::tempdir().unwrap();
        let dest = dir.path().join("a.pack");
        let small = vec![7u8; 100];
        let big: Vec<u8> = (0..(20 << 20)).map(|i| (i % 251) as u8).collect();
        let mut w = PackWriter::create(&dest).unwrap();
        let o1 = w.append(&small).unwrap();
        let o2 = w.append(&big).unwrap();
        let o3 = w.append(&[]).unwrap();
        w.commit().unwrap();
        assert_eq!((o1, o2 % 4096, o3 % 64), (0, 0, 0));
        let (mut a, mut b) = (vec![0u8; 100], vec![0u8; big.len()]);
        let mut reqs = vec![
            ReadInto { offset: o1, dest: &mut a, expect: Some(hash(&small)) },
            ReadInto { offset: o2, dest: &mut b, expect: Some(hash(&big)) },
        ];
        read_into(&dest, &mut reqs).unwrap();
        assert!(a == small && b == big);
        // Flip one byte of the big tensor: the read names it.
        let f = OpenOptions::new().write(true).open(&dest).unwrap();
        f.write_at(&[0xFF ^ big[12345]], o2 + 12345).unwrap();
        let mut reqs = vec![ReadInto { offset: o2, dest: &mut b, expect: Some(hash(&big)) }];
        assert!(matches!(read_into(&dest, &mut reqs), Err(ReadError::Corrupt { index: 0, .. })));
        let mut c = vec![0u8; 10];
        let mut reqs = vec![ReadInto { offset: o3, dest: &mut c, expect: None }];
        assert!(matches!(read_into(&dest, &mut reqs), Err(ReadError::Truncated { .. })));
    }
}
