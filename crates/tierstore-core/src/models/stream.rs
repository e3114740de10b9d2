//! The bytes of model streaming, on the side of the processes that publish and consume versions (the
//! agent keeps the versions; see `tierstore_agent::stream`).
//!
//! A version's tensors live in the agent's shared memory as one file per distinct tensor content, named
//! by its blake3 (the repository's hash, [`crate::hash::hash`]). A publisher compares each tensor with the
//! same tensor of the version before (a memcmp, several times faster than hashing), hashes only those that
//! differ and writes only those: a version where 3% of the bytes changed writes 3% of them. A consumer
//! reads only the tensors whose hash differs from what its buffer holds, straight into the buffer.
//!
//! A large changed tensor is hashed and written in one pass (`hash_and_write`): each piece is written to
//! shared memory while it is still in the core's cache from hashing it, instead of being read twice.
//!
//! Comparing is still reading the whole model. A publisher told which tensors may have changed
//! (`publish(changed=…)`, say a LoRA's adapters over a frozen base) compares only the first bytes of the
//! others ([`Check::Head`]): a guard against a wrong hint, not a proof.
//!
//! Fresh shared memory costs more than the bytes written into it: the kernel allocates and zeroes each
//! page as a write first touches it, which took more time than the copy itself (100 MB: 51 ms into new
//! files, 24 ms into files allocated before). So the agent keeps [`Spares`], files it allocated after
//! the last publish for the sizes that publish wrote, and a publish writes into them when their size fits.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use rayon::prelude::*;

use crate::hash::{self, ChainingValue, Hash, Subtree};

/// Large buffers are compared, copied and read in pieces of this size, spread over the cores.
const PIECE: usize = 8 << 20;

/// What one thread hashes and writes by itself in [`hash_and_write`]: larger inputs are split in two along
/// blake3's tree, the halves done in parallel.
const SUBTREE: usize = 4 << 20;

/// The piece hashed then written at once: small enough to stay in a core's own cache between the two.
const CACHED: usize = 128 << 10;

/// How much of a tensor [`place`] reads first when comparing it with the version before.
const HEAD: usize = 64 << 10;

/// The lowercase hex of a hash: the name of a tensor's file.
pub use crate::hash::hex;

/// What [`place`] did with one tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Placed {
    /// The tensor's blake3.
    pub hash: Hash,
    /// Whether its bytes were written (false: they equal the base's, whose file is reused).
    pub written: bool,
}

/// How much of a tensor is compared with its version before to tell whether it changed.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Check {
    /// Every byte: it may have changed anywhere.
    #[default]
    Whole,
    /// The first `HEAD` bytes: the publisher was told it did not change. A head that differs shows the
    /// hint wrong, and the tensor is then taken as changed; a change past the head goes unseen.
    Head,
}

/// The check of tensor `i`: `checks` is empty (every tensor compared whole) or has one per tensor.
fn check_of(checks: &[Check], i: usize) -> Check {
    checks.get(i).copied().unwrap_or_default()
}

fn one_check_per_tensor(checks: &[Check], n: usize) -> io::Result<()> {
    if checks.is_empty() || checks.len() == n {
        Ok(())
    } else {
        Err(io::Error::new(io::ErrorKind::InvalidInput, "one check per tensor (or none)"))
    }
}

/// Tensors smaller than this are written into new files: allocating ahead would save them little.
pub const SPARE_MIN: u64 = 256 << 10;

/// The name of spare number `n`, of `len` bytes.
pub fn spare_name(len: u64, n: u64) -> String {
    format!("{len}-{n}")
}

/// The size a spare's name gives, when `name` is one.
pub fn spare_len(name: &str) -> Option<u64> {
    let (len, n) = name.split_once('-')?;
    n.parse::<u64>().ok()?;
    len.parse().ok()
}

/// The spare files in the agent's directory for them, as a publish found them when it began: each taken
/// at most once, by renaming it into the publish's own directory. The agent makes them (see
/// `tierstore_agent::stream::spares`) and may remove one at any time: a spare gone is a new file instead.
pub struct Spares {
    dir: PathBuf,
    by_len: Mutex<HashMap<u64, Vec<String>>>,
}

impl Spares {
    /// The spares in `dir` (none when it cannot be read).
    pub fn list(dir: &Path) -> Spares {
        let mut by_len: HashMap<u64, Vec<String>> = HashMap::new();
        for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if let Some(len) = spare_len(&name) {
                by_len.entry(len).or_default().push(name);
            }
        }
        Spares { dir: dir.to_path_buf(), by_len: Mutex::new(by_len) }
    }

    /// A spare of exactly `len` bytes renamed to `to` and open for writing, if one is left (the caller
    /// asks only for `SPARE_MIN` bytes or more: the agent makes none smaller).
    fn take(&self, len: usize, to: &Path) -> Option<File> {
        loop {
            let name = self.by_len.lock().unwrap_or_else(|p| p.into_inner()).get_mut(&(len as u64))?.pop()?;
            if std::fs::rename(self.dir.join(&name), to).is_err() {
                continue; // the agent removed it meanwhile
            }
            let opened = std::fs::OpenOptions::new().write(true).custom_flags(libc::O_NOFOLLOW).open(to);
            match opened {
                Ok(f) if f.metadata().is_ok_and(|m| m.is_file() && m.len() == len as u64) => return Some(f),
                // Not what its name says: never written into.
                _ => {
                    let _ = std::fs::remove_file(to);
                }
            }
        }
    }
}

/// Places tensors for a new version: `bases[i]` is the file and hash of tensor `i` in the version before
/// (if it had one of the same size); a tensor equal to it (by `checks[i]`) keeps that hash, any other is
/// hashed and written to `dir/<hex hash>` (created new, or a spare of the agent's from `spares` renamed;
/// a file already there with that name holds the same bytes).
pub fn place(
    tensors: &[&[u8]],
    bases: &[Option<(PathBuf, Hash)>],
    checks: &[Check],
    dir: &Path,
    spares: Option<&Path>,
) -> io::Result<Vec<Placed>> {
    if tensors.len() != bases.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "one base (or none) per tensor"));
    }
    one_check_per_tensor(checks, tensors.len())?;
    let spares = spares.map(Spares::list);
    tensors
        .par_iter()
        .zip(bases.par_iter())
        .enumerate()
        .map(|(i, (bytes, base))| {
            if let Some((path, h)) = base {
                if same_bytes(path, bytes, check_of(checks, i))? {
                    return Ok(Placed { hash: *h, written: false });
                }
            }
            let hash = hash_and_write(bytes, dir, i, spares.as_ref())?;
            Ok(Placed { hash, written: true })
        })
        .collect()
}

/// [`place`] on at most `threads` threads of a pool of its own. An asynchronous publish places while the
/// trainer goes on computing: on all cores it would take the trainer's, and slow every step it overlaps.
pub fn place_on(
    threads: usize,
    tensors: &[&[u8]],
    bases: &[Option<(PathBuf, Hash)>],
    checks: &[Check],
    dir: &Path,
    spares: Option<&Path>,
) -> io::Result<Vec<Placed>> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads.max(1))
        .thread_name(|i| format!("tierstore-place-{i}"))
        .build()
        .map_err(io::Error::other)?;
    pool.install(|| place(tensors, bases, checks, dir, spares))
}

/// Whether the file at `path` holds exactly `bytes` (a missing file holds nothing), or with
/// [`Check::Head`], the same length and first bytes.
fn same_bytes(path: &Path, bytes: &[u8], check: Check) -> io::Result<bool> {
    let f = match File::open(path) {
        Ok(f) => f,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(false),
        Err(e) => return Err(e),
    };
    if f.metadata()?.len() != bytes.len() as u64 {
        return Ok(false);
    }
    if bytes.is_empty() {
        return Ok(true);
    }
    // A tensor a training step changed differs at its first bytes: one small read says so, where mapping
    // the whole file would cost a page-table entry per page of it.
    let head_len = bytes.len().min(HEAD);
    let mut head = vec![0u8; head_len];
    f.read_exact_at(&mut head, 0)?;
    if head[..] != bytes[..head_len] {
        return Ok(false);
    }
    if head_len == bytes.len() || check == Check::Head {
        return Ok(true);
    }
    // SAFETY: the agent never changes a placed file (it is only ever unlinked, which keeps the mapping's
    // pages); populate maps every page at once instead of faulting them in one by one.
    let map = unsafe { memmap2::MmapOptions::new().offset(HEAD as u64).populate().map(&f)? };
    Ok(map.par_chunks(PIECE).zip(bytes[HEAD..].par_chunks(PIECE)).all(|(a, b)| a == b))
}

/// Writes `bytes` to `dir/<hex blake3>` (created new, or one of `spares`; a file already there with that
/// name holds the same bytes) and returns the hash, reading the bytes once: each piece is hashed, then
/// written while it is still in cache. A tensor's file takes its name only once written whole (`n` makes
/// the name it is written under unique in `dir`), so a name in `dir` never holds part of its bytes; a
/// small tensor in a new file is the exception, created under its name and written at once.
fn hash_and_write(bytes: &[u8], dir: &Path, n: usize, spares: Option<&Spares>) -> io::Result<Hash> {
    // The name a file is written under before it takes its own; built only for a file written that way
    // (a small tensor without a spare, the common case of a model with many, needs none).
    let part = || dir.join(format!(".part-{n}"));
    let spare = spares.filter(|_| bytes.len() as u64 >= SPARE_MIN).and_then(|s| {
        let part = part();
        s.take(bytes.len(), &part).map(|f| (f, part))
    });
    if bytes.len() <= SUBTREE {
        // Small enough to stay in cache between hashing and writing, and a model may have tens of
        // thousands of them: no rename unless a spare is written.
        let hash = hash::hash(bytes);
        let to = dir.join(hex(&hash));
        let Some((f, part)) = spare else {
            return match File::create_new(&to) {
                Ok(f) => f.write_all_at(bytes, 0).map(|()| hash).map_err(|e| at(&to, e)),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => Ok(hash),
                Err(e) => Err(at(&to, e)),
            };
        };
        let written = f.write_all_at(bytes, 0).map_err(|e| at(&part, e));
        return name_written(written, &part, &to).map(|()| hash);
    }
    let (f, part) = match spare {
        Some(taken) => taken,
        None => {
            let part = part();
            (File::create_new(&part).map_err(|e| at(&part, e))?, part)
        }
    };
    // The root of blake3's tree is finalized differently from every other node.
    let hash = match halves(&f, bytes, 0) {
        Ok((l, r)) => hash::merge_root(&l, &r),
        Err(e) => {
            let _ = std::fs::remove_file(&part);
            return Err(at(&part, e));
        }
    };
    name_written(Ok(()), &part, &dir.join(hex(&hash)))?;
    Ok(hash)
}

/// Gives the file written at `part` its name `to` (kept as it is when `to` exists: it holds the same
/// bytes) once `written` says it was written whole, and removes `part` in every case.
fn name_written(written: io::Result<()>, part: &Path, to: &Path) -> io::Result<()> {
    let named = written.and_then(|()| match std::fs::hard_link(part, to) {
        Err(e) if e.kind() != io::ErrorKind::AlreadyExists => Err(at(to, e)),
        _ => Ok(()),
    });
    let removed = std::fs::remove_file(part).map_err(|e| at(part, e));
    named.and(removed)
}

/// The chaining value of the non-root subtree `bytes`, which starts at `offset` of its tensor, written at
/// that offset of `f`.
fn subtree(f: &File, bytes: &[u8], offset: u64) -> io::Result<ChainingValue> {
    if bytes.len() <= SUBTREE {
        let mut h = Subtree::at(offset);
        write_hashing(f, bytes, offset, &mut h)?;
        return Ok(h.finish());
    }
    let (l, r) = halves(f, bytes, offset)?;
    Ok(hash::merge(&l, &r))
}

/// The chaining values of the two halves of `bytes` (starting at `offset`), done in parallel. Split as
/// blake3 splits (the left part a power-of-two number of chunks), so each half is a valid subtree.
fn halves(f: &File, bytes: &[u8], offset: u64) -> io::Result<(ChainingValue, ChainingValue)> {
    let left = hash::left_len(bytes.len() as u64) as usize;
    let (l, r) =
        rayon::join(|| subtree(f, &bytes[..left], offset), || subtree(f, &bytes[left..], offset + left as u64));
    Ok((l?, r?))
}

/// An I/O error that names the file it happened on.
fn at(path: &Path, e: io::Error) -> io::Error {
    io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

fn write_hashing(f: &File, bytes: &[u8], offset: u64, h: &mut Subtree) -> io::Result<()> {
    for (i, piece) in bytes.chunks(CACHED).enumerate() {
        h.update(piece);
        f.write_all_at(piece, offset + (i * CACHED) as u64)?;
    }
    Ok(())
}

/// Reads each file of `paths` whole into the destination of the same index, in parallel; a file whose size
/// is not its destination's is an error naming it (nothing partial is ever taken for a tensor).
pub fn read_into(paths: &[PathBuf], dests: &mut [&mut [u8]]) -> io::Result<()> {
    if paths.len() != dests.len() {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "one destination per file"));
    }
    let files = paths
        .iter()
        .zip(dests.iter())
        .map(|(p, d)| {
            let f = File::open(p).map_err(|e| at(p, e))?;
            let len = f.metadata()?.len();
            if len != d.len() as u64 {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("{} holds {len} bytes, the tensor {}", p.display(), d.len()),
                ));
            }
            Ok(f)
        })
        .collect::<io::Result<Vec<_>>>()?;
    let jobs: Vec<(&File, u64, &mut [u8])> = files
        .iter()
        .zip(dests.iter_mut())
        .flat_map(|(f, d)| d.chunks_mut(PIECE).enumerate().map(move |(i, c)| (f, (i * PIECE) as u64, c)))
        .collect();
    jobs.into_par_iter().try_for_each(|(f, offset, dest)| f.read_exact_at(dest, offset))
}

/// Copies each source into the destination of the same index, in parallel (a publisher's snapshot into its
/// staging buffer); returns, per pair, whether any byte differed before the copy. A pair whose check is
/// [`Check::Head`] and whose first bytes are equal is taken as equal and not copied.
pub fn copy_changed(sources: &[&[u8]], dests: &mut [&mut [u8]], checks: &[Check]) -> io::Result<Vec<bool>> {
    if sources.len() != dests.len() || sources.iter().zip(dests.iter()).any(|(s, d)| s.len() != d.len()) {
        return Err(io::Error::new(io::ErrorKind::InvalidInput, "one destination of the same size per source"));
    }
    one_check_per_tensor(checks, sources.len())?;
    let jobs: Vec<(usize, &[u8], &mut [u8])> = sources
        .iter()
        .zip(dests.iter_mut())
        .enumerate()
        .filter(|(i, (s, d))| {
            let head = s.len().min(HEAD);
            check_of(checks, *i) == Check::Whole || s[..head] != d[..head]
        })
        .flat_map(|(i, (s, d))| s.chunks(PIECE).zip(d.chunks_mut(PIECE)).map(move |(s, d)| (i, s, d)))
        .collect();
    let changed: Vec<usize> = jobs
        .into_par_iter()
        .filter_map(|(i, s, d)| {
            if s == d {
                None
            } else {
                d.copy_from_slice(s);
                Some(i)
            }
        })
        .collect();
    let mut out = vec![false; sources.len()];
    for i in changed {
        out[i] = true;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashing_while_writing_gives_blake3_and_the_bytes() {
        let dir = tempfile::tempdir().unwrap();
        let sizes = [
            0,
            1,
            1023,
            1024,
            1025,
            CACHED + 1,
            SUBTREE - 1,
            SUBTREE,
            SUBTREE + 1,
            2 * SUBTREE,
            3 * SUBTREE + 17,
            9 * SUBTREE + 4096,
        ];
        for (n, len) in sizes.into_iter().enumerate() {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 31 + i / 4099) as u8).collect();
            let h = hash_and_write(&bytes, dir.path(), n, None).unwrap();
            assert_eq!(h, hash::hash(&bytes), "hash of {len} bytes");
            assert_eq!(std::fs::read(dir.path().join(hex(&h))).unwrap(), bytes, "file of {len} bytes");
            // The same bytes again (another tensor of the version): the file there is kept.
            assert_eq!(hash_and_write(&bytes, dir.path(), n, None).unwrap(), h);
        }
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert!(names.iter().all(|n| !n.starts_with(".part")), "{names:?}");
        assert_eq!(names.len(), sizes.len());
    }

    #[test]
    fn a_spare_of_the_size_is_written_into_and_one_that_is_not_is_left_out() {
        let dir = tempfile::tempdir().unwrap();
        let spares = tempfile::tempdir().unwrap();
        let spare = |len: u64, n: u64, real: u64| {
            let f = File::create_new(spares.path().join(spare_name(len, n))).unwrap();
            f.set_len(real).unwrap();
        };
        let small = vec![3u8; SPARE_MIN as usize];
        let large = (0..SUBTREE + 3 * 1024).map(|i| (i % 251) as u8).collect::<Vec<u8>>();
        let large2: Vec<u8> = large.iter().map(|b| b ^ 1).collect();
        let tiny = vec![4u8; 100];
        spare(small.len() as u64, 1, small.len() as u64);
        spare(large.len() as u64, 2, large.len() as u64);
        // Its name says the size of `large`, its file does not: whichever tensor of that size comes to it
        // leaves it out (and writes into the other spare, or a new file).
        spare(large.len() as u64, 3, 10);
        spare(100, 4, 100); // below SPARE_MIN: never used
        let tensors = [&small[..], &large, &large2, &tiny];
        let placed = place(&tensors, &[None, None, None, None], &[], dir.path(), Some(spares.path())).unwrap();
        for (bytes, p) in tensors.iter().zip(&placed) {
            assert_eq!(p.hash, hash::hash(bytes));
            assert_eq!(&std::fs::read(dir.path().join(hex(&p.hash))).unwrap(), *bytes);
        }
        let mut left: Vec<String> =
            std::fs::read_dir(spares.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        left.sort();
        // Two spares taken, the wrong one taken out of the pool and removed, the one below SPARE_MIN kept.
        assert_eq!(left, [spare_name(100, 4)]);
        let names: Vec<String> =
            std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name().into_string().unwrap()).collect();
        assert_eq!(names.len(), 4, "{names:?}");
        assert_eq!(spare_len(&spare_name(7, 9)), Some(7));
        assert_eq!(spare_len(".new-3"), None);
    }

    #[test]
    fn only_changed_tensors_are_written_and_read_back_whole() {
        let dir = tempfile::tempdir().unwrap();
        let a = vec![1u8; 3 * PIECE + 5];
        let b = vec![2u8; 100];
        let first = place(&[&a, &b], &[None, None], &[], dir.path(), None).unwrap();
        assert!(first.iter().all(|p| p.written));
        assert_eq!(first[0].hash, hash::hash(&a));
        let base = |i: usize| Some((dir.path().join(hex(&first[i].hash)), first[i].hash));
        let mut b2 = b.clone();
        b2[7] = 9;
        let second = place(&[&a, &b2], &[base(0), base(1)], &[], dir.path(), None).unwrap();
        assert_eq!(second[0], Placed { hash: first[0].hash, written: false });
        assert!(second[1].written && second[1].hash == hash::hash(&b2));
        // A change past the first bytes read, and one in them, are both seen.
        for at in [HEAD + PIECE + 1, 3] {
            let mut a2 = a.clone();
            a2[at] = 7;
            let p = place(&[&a2], &[base(0)], &[], dir.path(), None).unwrap();
            assert!(p[0].written && p[0].hash == hash::hash(&a2), "a change at byte {at} was missed");
        }
        let mut ra = vec![0u8; a.len()];
        let mut rb = vec![0u8; b2.len()];
        let paths = [dir.path().join(hex(&second[0].hash)), dir.path().join(hex(&second[1].hash))];
        read_into(&paths, &mut [&mut ra[..], &mut rb[..]]).unwrap();
        assert_eq!((ra, rb), (a, b2));
        let mut short = [0u8; 10];
        let e = read_into(&paths[1..], &mut [&mut short[..]]).unwrap_err();
        assert!(e.to_string().contains("holds 100 bytes"), "{e}");
        // An empty tensor (a 0-element buffer) has an empty file, read as nothing.
        let empty = place(&[&[]], &[None], &[], dir.path(), None).unwrap();
        read_into(&[dir.path().join(hex(&empty[0].hash))], &mut [&mut [][..]]).unwrap();
    }

    #[test]
    fn copy_changed_reports_what_differed() {
        let src = [vec![1u8; PIECE + 3], vec![4u8; 8]];
        let mut d0 = vec![1u8; PIECE + 3];
        d0[PIECE + 1] = 0;
        let mut d1 = [4u8; 8];
        let changed = copy_changed(&[&src[0], &src[1]], &mut [&mut d0[..], &mut d1[..]], &[]).unwrap();
        assert_eq!(changed, vec![true, false]);
        assert_eq!(d0, src[0]);
    }

    #[test]
    fn a_tensor_said_unchanged_is_compared_at_its_head_only() {
        let dir = tempfile::tempdir().unwrap();
        let a = vec![1u8; HEAD + PIECE];
        let first = place(&[&a], &[None], &[], dir.path(), None).unwrap();
        let base = Some((dir.path().join(hex(&first[0].hash)), first[0].hash));
        let mut tail = a.clone();
        tail[HEAD + 1] = 2;
        let mut head = a.clone();
        head[1] = 2;
        // The hint is trusted past the head: a change there keeps the base's hash (the documented cost of
        // a wrong hint)...
        let p = place(&[&tail], std::slice::from_ref(&base), &[Check::Head], dir.path(), None).unwrap();
        assert_eq!(p[0], Placed { hash: first[0].hash, written: false });
        // ...and a change in the head is seen, hint or not.
        let p = place(&[&head], &[base], &[Check::Head], dir.path(), None).unwrap();
        assert!(p[0].written && p[0].hash == hash::hash(&head));
        let mut staged = a.clone();
        let changed = copy_changed(&[&tail], &mut [&mut staged[..]], &[Check::Head]).unwrap();
        assert_eq!((changed, staged == a), (vec![false], true), "a tail change past a head check is not copied");
        let changed = copy_changed(&[&head], &mut [&mut staged[..]], &[Check::Head]).unwrap();
        assert_eq!((changed, staged == head), (vec![true], true));
        assert!(place(&[&a], &[None], &[Check::Head, Check::Head], dir.path(), None).is_err());
    }
}
