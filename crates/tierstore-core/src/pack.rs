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
    /// Bytes already handed to the device by `sync_file_range`.
    flushed: u64,
}

const WRITEBACK_STEP: u64 = 64 << 20;

impl PackWriter {
    /// Starts the pack that will be published at `dest` (written under a temporary name beside it).
    pub fn create(dest: &Path) -> io::Result<PackWriter> {
        let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let temp = dest.with_file_name(format!(".{name}.{}.tmp", crate::pid()));
        let file = OpenOptions::new().write(true).create_new(true).open(&temp)?;
        Ok(PackWriter { file, temp, dest: dest.to_path_buf(), len: 0, flushed: 0 })
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
        // Every 64 MiB, start writing what is new to the device without waiting for it: the caller hashes
        // the next tensors meanwhile, and the final fsync only waits for the tail. (Per small tensor, the
        // call would cost more than it overlaps.)
        if self.len - self.flushed >= WRITEBACK_STEP {
            use std::os::fd::AsRawFd;
            // SAFETY: a hint on an open descriptor; failure only loses the overlap.
            unsafe {
                libc::sync_file_range(
                    self.file.as_raw_fd(),
                    self.flushed as i64,
                    (self.len - self.flushed) as i64,
                    libc::SYNC_FILE_RANGE_WRITE,
                )
            };
            self.flushed = self.len;
        }
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

/// Threads reading a pack at once: enough requests in flight to keep a disk's queue busy.
const READ_THREADS: usize = 8;

/// Reads every request from the pack at `path` into its destination and checks the hashes. Either every
/// destination holds the right bytes, or an error names the first request that does not.
///
/// The kernel is told exactly which ranges will be read (and not to read ahead past them, which would drag
/// neighbouring tensors of a partial load off the disk). Requests are spread over a few I/O threads; each
/// reads its tensor in chunks and hashes each chunk as it arrives, so hashing overlaps other threads'
/// reads. A very large tensor is split between all threads and hashed with all cores once read.
pub fn read_into(path: &Path, requests: &mut [ReadInto<'_>]) -> Result<(), ReadError> {
    use std::os::fd::AsRawFd;
    use std::sync::Mutex;

    let file = File::open(path).map_err(|source| ReadError::Io { path: path.to_path_buf(), source })?;
    let fd = file.as_raw_fd();
    // A partial load reads scattered tensors: readahead past each would drag its neighbours off the disk.
    // A (nearly) whole pack is read in order, where readahead keeps the disk streaming.
    let wanted: u64 = requests.iter().map(|r| r.dest.len() as u64).sum();
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let sparse = wanted * 10 < size * 9;
    // SAFETY: advice on an open descriptor; failure only loses the hint.
    unsafe {
        let advice = if sparse { libc::POSIX_FADV_RANDOM } else { libc::POSIX_FADV_SEQUENTIAL };
        libc::posix_fadvise(fd, 0, 0, advice);
        for r in requests.iter() {
            libc::posix_fadvise(fd, r.offset as i64, r.dest.len() as i64, libc::POSIX_FADV_WILLNEED);
        }
    }
    const HUGE: usize = 256 << 20;
    const CHUNK: usize = 8 << 20;
    // Work items: whole tensors (read and hashed in one task) and pieces of huge tensors.
    enum Item<'b> {
        Whole(usize, u64, &'b mut [u8], Option<Hash>),
        Piece(usize, u64, &'b mut [u8]),
    }
    let mut items: Vec<Item<'_>> = Vec::new();
    let mut huge: Vec<usize> = Vec::new();
    for (i, r) in requests.iter_mut().enumerate() {
        if r.dest.len() >= HUGE {
            huge.push(i);
            let mut offset = r.offset;
            for piece in r.dest.chunks_mut(CHUNK) {
                let len = piece.len() as u64;
                items.push(Item::Piece(i, offset, piece));
                offset += len;
            }
        } else {
            items.push(Item::Whole(i, r.offset, &mut *r.dest, r.expect));
        }
    }
    let queue = Mutex::new(items.into_iter());
    let failure: Mutex<Option<(usize, Option<io::Error>, bool)>> = Mutex::new(None);
    let record = |i: usize, err: Option<io::Error>, corrupt: bool| {
        let mut f = failure.lock().expect("failure lock");
        if f.as_ref().is_none_or(|(j, _, _)| i < *j) {
            *f = Some((i, err, corrupt));
        }
    };
    std::thread::scope(|scope| {
        for _ in 0..READ_THREADS {
            scope.spawn(|| loop {
                let Some(item) = queue.lock().expect("queue lock").next() else { break };
                match item {
                    Item::Piece(i, offset, buf) => match read_exact_at(&file, buf, offset) {
                        Ok(true) => {}
                        Ok(false) => record(i, None, false),
                        Err(e) => record(i, Some(e), false),
                    },
                    Item::Whole(i, offset, buf, expect) => {
                        let mut hasher = expect.map(|_| blake3::Hasher::new());
                        let mut pos = 0;
                        while pos < buf.len() {
                            let end = (pos + CHUNK).min(buf.len());
                            match read_exact_at(&file, &mut buf[pos..end], offset + pos as u64) {
                                Ok(true) => {}
                                Ok(false) => {
                                    record(i, None, false);
                                    break;
                                }
                                Err(e) => {
                                    record(i, Some(e), false);
                                    break;
                                }
                            }
                            if let Some(h) = hasher.as_mut() {
                                h.update(&buf[pos..end]);
                            }
                            pos = end;
                        }
                        if pos == buf.len() {
                            if let (Some(h), Some(want)) = (hasher, expect) {
                                if *h.finalize().as_bytes() != want {
                                    record(i, None, true);
                                }
                            }
                        }
                    }
                }
            });
        }
    });
    if failure.lock().expect("failure lock").is_none() {
        for i in huge {
            let r = &requests[i];
            if r.expect.is_some_and(|want| hash(r.dest) != want) {
                record(i, None, true);
                break;
            }
        }
    }
    match failure.into_inner().expect("failure lock") {
        None => Ok(()),
        Some((index, err, corrupt)) => {
            let r = &requests[index];
            Err(match (err, corrupt) {
                (Some(source), _) => ReadError::Io { path: path.to_path_buf(), source },
                (None, true) => ReadError::Corrupt { path: path.to_path_buf(), index, offset: r.offset },
                (None, false) => {
                    ReadError::Truncated { path: path.to_path_buf(), index, offset: r.offset, len: r.dest.len() }
                }
            })
        }
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
