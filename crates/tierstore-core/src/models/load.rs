//! Reading tensors out of a pack file ([`super::pack`] is the format and its writer): into the caller's
//! memory ([`read_into`]), as a verified copy-on-write mapping ([`map_verified`]), or only to check them
//! ([`verify`]). Every byte is checked against its tensor's hash as it arrives, on every core, while the
//! disk delivers the next ones.

use std::fs::File;
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

use crate::hash::{hash_serial, root_of_pieces, subtree, ChainingValue, Hash, Hasher};

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

    /// The same error for a call that was given a subset of the requests: `indices[i]` is the index of
    /// the subset's request `i` among all of them.
    fn renumbered(self, indices: &[usize]) -> ReadError {
        match self {
            ReadError::Truncated { path, index, offset, len } => {
                ReadError::Truncated { path, index: indices[index], offset, len }
            }
            ReadError::Corrupt { path, index, offset } => ReadError::Corrupt { path, index: indices[index], offset },
            io @ ReadError::Io { .. } => io,
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

/// A whole-pack mapped load streams tensors this large in order through the kernel's readahead.
const STREAMED_MIN: usize = 8 * PIECE;

/// Threads reading scattered tensors at once: enough requests in flight to keep a disk's queue busy.
const READ_THREADS: usize = 8;

/// The unit of reading and hashing: a power of two, so that a piece of a tensor is a whole subtree of
/// its blake3 tree.
pub(super) const PIECE: usize = 8 << 20;

/// Reads every request from the pack at `path` into its destination and checks the hashes. Either every
/// destination holds the right bytes, or an error names the first request that does not.
///
/// Tensors are cut into pieces of 8 MiB, and each piece is hashed as soon as it is read, while the disk
/// delivers the next ones. A tensor of several pieces is verified by merging its pieces' blake3 chaining
/// values into the root (blake3 is a tree), so a large tensor is hashed by all cores at once and no
/// hashing is left for after the reads.
pub fn read_into(path: &Path, requests: &mut [ReadInto<'_>]) -> Result<(), ReadError> {
    use std::os::fd::AsRawFd;

    let file = File::open(path).map_err(|source| ReadError::Io { path: path.to_path_buf(), source })?;
    // A partial load reads scattered tensors: readahead past each would drag its neighbours off the disk.
    // A (nearly) whole pack is read in order, where sequential readahead keeps the disk streaming. (Telling
    // the kernel every wanted range up front with WILLNEED was measured too, and was slower for both:
    // the advice call itself queues all the reads before the threads start.)
    let size = file.metadata().map(|m| m.len()).unwrap_or(0);
    let sparse = is_sparse(requests.iter().map(|r| r.dest.len()), size);
    // SAFETY: advice on an open descriptor; failure only loses the hint.
    unsafe {
        let advice = if sparse { libc::POSIX_FADV_RANDOM } else { libc::POSIX_FADV_SEQUENTIAL };
        libc::posix_fadvise(file.as_raw_fd(), 0, 0, advice);
    }
    if sparse {
        if let Some((map, blocks)) = by_blocks(&file, requests.iter().map(|r| (r.offset, r.dest.len()))) {
            return fetch_and_verify(path, requests, true, true, |offset, buf| {
                // Brought in (or found in) the page cache by blocks, then copied out of the mapping.
                // Copying with a read instead would set off the kernel's readahead from the blocks'
                // folios, which are marked for it: 2.1x the bytes fetched for synthetic-100.
                if !blocks.bring_in(offset, buf.len())? {
                    return Ok(false);
                }
                let at = offset as usize;
                buf.copy_from_slice(&map[at..at + buf.len()]);
                Ok(true)
            });
        }
    }
    fetch_and_verify(path, requests, sparse, true, |offset, buf| read_exact_at(&file, buf, offset))
}

/// Reads every request into its destination from a pack that `fetch(offset, buf)` reads (false when the
/// pack ends first) and checks the hashes, as [`read_into`] does: in request order, each piece hashed as
/// soon as it is there, while the next is read. For a pack that is still arriving (opened through the
/// cache while its copy grows, from the store or from the node that owns it), `fetch` waits for each
/// piece, and the load checks and places the pack's first tensors while its last are on their way.
/// `path` names the pack in errors.
pub fn read_into_from(
    path: &Path,
    requests: &mut [ReadInto<'_>],
    fetch: impl Fn(u64, &mut [u8]) -> io::Result<bool> + Sync,
) -> Result<(), ReadError> {
    fetch_and_verify(path, requests, false, true, fetch)
}

/// [`read_into_from`] for a pack whose bytes are vouched for as a whole while they arrive: the cache
/// hashes the copy it makes as it writes it (from the store) or checks it against the owner's chaining
/// values (from the node that owns it), and the pack's own hash is in the manifest. The requests are read
/// without hashing each tensor; `vouched()`, called once they are all read, says whether the whole pack
/// had the writer's bytes. Only when it did not (the copy failed and the rest came from the store, it
/// was not hashed, or its hash is another) are the tensors hashed, after the reads, with all cores: the
/// load then returns what `read_into_from` would, the right bytes or the error naming the first
/// tensor that does not match.
pub fn read_into_vouched(
    path: &Path,
    requests: &mut [ReadInto<'_>],
    fetch: impl Fn(u64, &mut [u8]) -> io::Result<bool> + Sync,
    vouched: impl FnOnce() -> bool,
) -> Result<(), ReadError> {
    let expected: Vec<Option<Hash>> = requests.iter_mut().map(|r| r.expect.take()).collect();
    let read = fetch_and_verify(path, requests, false, true, fetch);
    for (r, want) in requests.iter_mut().zip(&expected) {
        r.expect = *want;
    }
    read?;
    if vouched() {
        return Ok(());
    }
    let mut got: Vec<(u64, &mut [u8])> = requests.iter_mut().map(|r| (r.offset, &mut *r.dest)).collect();
    check_parts(path, &mut got, &expected)
}

/// Where the parts of a pack come from: the agent of the node that owns it, through the node's cache
/// (the cache implements it, `cache/parts.rs`). A trait here, so that reading a pack never reaches up to
/// the cache.
pub trait PartsSource {
    /// Asks the owner of `path` for `ranges`, `(offset, length)` each: `Ok(None)` when none can serve them
    /// (the caller reads the store).
    fn open_parts(&self, path: &Path, ranges: &[(u64, u64)]) -> Result<Option<Box<dyn ReceivedParts>>, crate::Error>;
}

/// Checks the parts received, each `(offset, bytes)`, against their tensors' hashes.
pub type CheckParts<'a> = dyn FnMut(&mut [(u64, &mut [u8])]) -> Result<(), ReadError> + 'a;

/// Parts on their way from the owner of a pack.
pub trait ReceivedParts {
    /// The size of the pack the parts come from.
    fn size(&self) -> u64;
    /// Receives the parts into `dests` (one buffer per range asked, in order) and has `check` check them.
    /// `Ok(true)`: every byte is there and checked; `Ok(false)`: the owner failed (read the store); `Err`:
    /// `check`'s error, and the owner has been told that its bytes are wrong.
    fn receive(self: Box<Self>, dests: &mut [(u64, &mut [u8])], check: &mut CheckParts<'_>) -> Result<bool, ReadError>;
}

/// Reads `requests` of the pack at `path` (a file under the cache's source) as parts from the agent of the
/// node that owns the pack (see [`PartsSource`]): only the tensors' bytes cross, and when several nodes
/// load the same tensors the store is read for them once. Every byte is checked against its tensor's
/// hash, and the owner is told of a mismatch. `Ok(false)`: no owner could serve them (the cache shares
/// nothing across nodes, or the owner failed, counted): read the store's pack instead.
pub fn read_parts(cache: &dyn PartsSource, path: &Path, requests: &mut [ReadInto<'_>]) -> Result<bool, ReadError> {
    let ranges: Vec<(u64, u64)> = requests.iter().map(|r| (r.offset, r.dest.len() as u64)).collect();
    let expected: Vec<Option<Hash>> = requests.iter().map(|r| r.expect).collect();
    let Some(parts) = open_parts(cache, path, &ranges)? else { return Ok(false) };
    let mut dests: Vec<(u64, &mut [u8])> = requests.iter_mut().map(|r| (r.offset, &mut *r.dest)).collect();
    parts.receive(&mut dests, &mut |got| check_parts(path, got, &expected))
}

/// The `spans` of the pack at `path`, as [`read_parts`] has them, in private memory the size of the
/// pack (a mapping whose pages outside the spans are never touched, so they cost nothing): what a mapped
/// partial load maps. `Ok(None)` where `read_parts` returns `Ok(false)`.
pub fn map_parts(cache: &dyn PartsSource, path: &Path, spans: &[Span]) -> Result<Option<memmap2::MmapMut>, ReadError> {
    // Each distinct tensor once (a version may name the same stored tensor twice).
    let mut distinct: Vec<Span> = spans.iter().filter(|s| s.len > 0).copied().collect();
    distinct.sort_unstable_by_key(|s| (s.offset, s.len));
    distinct.dedup_by_key(|s| (s.offset, s.len));
    let ranges: Vec<(u64, u64)> = distinct.iter().map(|s| (s.offset, s.len as u64)).collect();
    let Some(parts) = open_parts(cache, path, &ranges)? else { return Ok(None) };
    let io_err = |source| ReadError::Io { path: path.to_path_buf(), source };
    let mut map = memmap2::MmapMut::map_anon(parts.size().max(1) as usize).map_err(io_err)?;
    let mut dests: Vec<(u64, &mut [u8])> = Vec::with_capacity(distinct.len());
    let mut rest: &mut [u8] = &mut map[..];
    let mut at = 0u64;
    for s in &distinct {
        // Sorted, and the owner refuses any past the pack's end. Distinct tensors of a pack never overlap;
        // should two, the error sends the load to the store's pack.
        let skip = s.offset.checked_sub(at).ok_or_else(|| io_err(io::Error::other("overlapping tensors")))?;
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(skip as usize);
        let (dest, tail) = tail.split_at_mut(s.len);
        dests.push((s.offset, dest));
        rest = tail;
        at = s.offset + s.len as u64;
    }
    let expected: Vec<Option<Hash>> = distinct.iter().map(|s| s.expect).collect();
    let received = parts.receive(&mut dests, &mut |got| check_parts(path, got, &expected)).map_err(|e| {
        // Named by the caller's span, not the distinct one.
        let index = |d: usize| spans.iter().position(|s| (s.offset, s.len) == (distinct[d].offset, distinct[d].len));
        let indices: Vec<usize> = (0..distinct.len()).map(|d| index(d).unwrap_or(d)).collect();
        e.renumbered(&indices)
    })?;
    Ok(received.then_some(map))
}

/// Asks the owner of `path` for `ranges`: `None` when the cache cannot (the caller reads the store).
fn open_parts(
    cache: &dyn PartsSource,
    path: &Path,
    ranges: &[(u64, u64)],
) -> Result<Option<Box<dyn ReceivedParts>>, ReadError> {
    cache.open_parts(path, ranges).map_err(|e| ReadError::Io { path: path.to_path_buf(), source: io::Error::other(e) })
}

/// Checks every part received against its tensor's hash, all cores at once; names the first that fails.
fn check_parts(path: &Path, got: &mut [(u64, &mut [u8])], expected: &[Option<Hash>]) -> Result<(), ReadError> {
    let slices: Vec<&[u8]> = got.iter().map(|(_, d)| &**d).collect();
    let hashes = crate::hash::hash_many(&slices);
    for (index, ((offset, _), (want, have))) in got.iter().zip(expected.iter().zip(&hashes)).enumerate() {
        if want.is_some_and(|w| w != *have) {
            return Err(ReadError::Corrupt { path: path.to_path_buf(), index, offset: *offset });
        }
    }
    Ok(())
}

/// A mapping of the pack and its `BlockFetch`, when a copying partial load of `ranges` is better read
/// by blocks, as a mapped load is: when the blocks read whole hold little else (`MAX_WARM_OVERREAD`).
/// Otherwise exact reads are better: they copy as the disk delivers each page.
///
/// The copies come out of the mapping right after `bring_in` has mapped their pages (and reported a
/// truncated pack as such), so only a pack truncated in between by another program could fault with
/// SIGBUS; tierstore never truncates a pack.
fn by_blocks(file: &File, ranges: impl Iterator<Item = (u64, usize)>) -> Option<(memmap2::Mmap, BlockFetch)> {
    // SAFETY: packs are written once under a temporary name and never changed after their rename.
    let map = unsafe { memmap2::Mmap::map(file) }.ok()?;
    let mut ranges: Vec<(u64, usize)> = ranges.filter(|&(o, n)| n > 0 && o + n as u64 <= map.len() as u64).collect();
    ranges.sort_unstable();
    ranges.dedup();
    let blocks = BlockFetch::new(file, map.as_ptr(), map.len(), true, ranges.iter().copied());
    // synthetic-1000's 258 scattered tensors of 1 MB would fetch 1.9x their bytes by blocks: the mapped
    // load, which reads them so and copies nothing, took 0.19-0.21 s cold, against 0.13-0.18 s for this
    // copying load reading them exactly. BERT-large's 25% fetches 1.03x by blocks.
    let chosen: f64 = ranges.iter().map(|&(_, n)| n as f64).sum();
    (blocks.blocks && blocks.fetched() <= MAX_WARM_OVERREAD * chosen).then_some((map, blocks))
}

/// True when the requests cover less than 90% of a pack of `size` bytes: a partial load.
fn is_sparse(lens: impl Iterator<Item = usize>, size: u64) -> bool {
    let wanted: u64 = lens.map(|n| n as u64).sum();
    wanted * 10 < size * 9
}

/// A tensor of a pack to check in place: where it is, how long, and the hash it must have.
#[derive(Clone, Copy, Debug)]
pub struct Span {
    /// Offset of the tensor in the pack.
    pub offset: u64,
    /// Its length in bytes.
    pub len: usize,
    /// The hash its bytes must have, if checked.
    pub expect: Option<Hash>,
}

/// Maps the pack at `path` copy-on-write, brings the bytes of every span into memory and checks their
/// hashes: a zero-copy load. The spans' bytes are then the pack's pages in the page cache, shared with
/// every other process that maps them; writing to the mapping copies the page written and never changes
/// the pack.
///
/// Either every span is in memory with the right bytes, or an error names one that is not. The
/// pipeline is `read_into`'s, with `MADV_POPULATE_READ` in place of the reads: no byte is copied.
///
/// A pack is never changed once written, but a mapping cannot protect itself from another program that
/// truncates the file afterwards (a later access faults with SIGBUS), which is why `read_into` exists for
/// destinations of the caller's own.
pub fn map_verified(path: &Path, spans: &[Span]) -> Result<memmap2::MmapMut, ReadError> {
    let io_err = |source| ReadError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    for (index, s) in spans.iter().enumerate() {
        if s.offset.saturating_add(s.len as u64) > size {
            return Err(ReadError::Truncated { path: path.to_path_buf(), index, offset: s.offset, len: s.len });
        }
    }
    // SAFETY: packs are written once under a temporary name and never changed after their rename.
    let mut map = unsafe { memmap2::MmapOptions::new().len(size as usize).map_copy(&file) }.map_err(io_err)?;
    let sparse = is_sparse(spans.iter().map(|s| s.len), size);
    // Each distinct tensor once (a version may name the same stored tensor twice), in pack order, so that
    // the mapping splits into disjoint slices.
    let mut order: Vec<usize> = (0..spans.len()).filter(|&i| spans[i].len > 0).collect();
    order.sort_by_key(|&i| (spans[i].offset, i));
    order.dedup_by_key(|&mut i| (spans[i].offset, spans[i].len));
    let ordered = order.iter().map(|&i| (spans[i].offset, spans[i].len));
    let blocks = BlockFetch::new(&file, map.as_ptr(), map.len(), sparse, ordered);
    // A whole pack streams in order, large tensors first (`STREAMED_MIN`); a partial load fetches every
    // tensor from many threads. Each request keeps its index in `spans`.
    let mut large: Vec<(usize, ReadInto<'_>)> = Vec::new();
    let mut small: Vec<(usize, ReadInto<'_>)> = Vec::new();
    let mut rest: &mut [u8] = &mut map[..];
    let mut at = 0u64;
    for &i in &order {
        let s = spans[i];
        if s.offset < at {
            // Overlapping tensors: no save writes them, so the manifest does not describe this pack.
            return Err(ReadError::Corrupt { path: path.to_path_buf(), index: i, offset: s.offset });
        }
        let tail = std::mem::take(&mut rest).split_at_mut((s.offset - at) as usize).1;
        let (dest, after) = tail.split_at_mut(s.len);
        rest = after;
        at = s.offset + s.len as u64;
        let group = if s.len >= STREAMED_MIN && !sparse { &mut large } else { &mut small };
        group.push((i, ReadInto { offset: s.offset, dest, expect: s.expect }));
    }
    // The mapping is the destination: bringing a piece in is all there is to do.
    let populate = |offset: u64, buf: &mut [u8]| blocks.bring_in(offset, buf.len());
    // A whole pack: large tensors stream best through one thread bringing pieces in order, each fault's
    // readahead running ahead of it. A partial load's scattered tensors need many requests in flight.
    for group in [large, small] {
        let (indices, mut requests): (Vec<usize>, Vec<ReadInto<'_>>) = group.into_iter().unzip();
        fetch_and_verify(path, &mut requests, sparse, false, populate).map_err(|e| e.renumbered(&indices))?;
    }
    Ok(map)
}

/// Checks every span of the pack at `path` against its hash, as a check of a whole repository needs:
/// every damaged span is named, not only the first, and memory stays at a piece per thread whatever the
/// size of the pack (a load's destinations hold every tensor at once; a check keeps no byte).
///
/// Returns one result per span, in order: `Truncated` for a span past the end of the pack, `Corrupt` for
/// bytes that do not have the span's hash, `Io` for bytes that cannot be read (a bad sector). A span
/// without a hash is only checked for being in the pack. `Err` only when the pack cannot be opened.
pub fn verify(path: &Path, spans: &[Span]) -> Result<Vec<Result<(), ReadError>>, ReadError> {
    use rayon::prelude::*;
    use std::os::fd::AsRawFd;

    let io_err = |source| ReadError::Io { path: path.to_path_buf(), source };
    let file = File::open(path).map_err(io_err)?;
    let size = file.metadata().map_err(io_err)?.len();
    // SAFETY: advice on an open descriptor; failure only loses the hint.
    unsafe { libc::posix_fadvise(file.as_raw_fd(), 0, 0, libc::POSIX_FADV_SEQUENTIAL) };
    let check = |(index, s): (usize, &Span)| -> Result<(), ReadError> {
        let truncated = || ReadError::Truncated { path: path.to_path_buf(), index, offset: s.offset, len: s.len };
        if s.offset.saturating_add(s.len as u64) > size {
            return Err(truncated());
        }
        let Some(expect) = s.expect else { return Ok(()) };
        let mut hasher = Hasher::new();
        let mut buf = vec![0u8; s.len.min(PIECE)];
        let mut done = 0;
        while done < s.len {
            let piece = &mut buf[..(s.len - done).min(PIECE)];
            if !read_exact_at(&file, piece, s.offset + done as u64).map_err(io_err)? {
                return Err(truncated()); // the pack shrank while it was checked
            }
            crate::hash::update(&mut hasher, piece);
            done += piece.len();
        }
        if *hasher.finalize().as_bytes() != expect {
            return Err(ReadError::Corrupt { path: path.to_path_buf(), index, offset: s.offset });
        }
        Ok(())
    };
    Ok(spans.par_iter().enumerate().map(check).collect())
}

/// A copying partial load is read by blocks when that fetches at most this many times its bytes (see
/// `by_blocks`).
const MAX_WARM_OVERREAD: f64 = 1.25;

/// The size of the blocks a fault reads in a mapping marked for huge pages (a PMD on x86-64 and arm64).
const HUGE_BLOCK: u64 = 2 << 20;

/// Brings a load's bytes into the page cache, and into a mapping of the pack, at the kernel's cheapest.
///
/// A fault in a mapping marked for huge pages reads the 2 MiB-aligned block around it into one large
/// folio: fewer, larger requests, about 3 GB/s here against about 1 GB/s for the single pages that exact
/// requests (`POSIX_FADV_WILLNEED`) get. A partial load also marks the mapping random, which stops a
/// fault from reading further ahead than its block, and asks for the chosen bytes of a block exactly
/// when less than a third of the block is chosen: single pages cost about 3x more per byte than a whole
/// block, so a third is where the two cost the same, and no block read whole is more than 3x its chosen
/// bytes. BERT-large's 25% partial mapped load, 5 cold runs: median 0.15 s, against 0.32 s with every
/// tensor asked for exactly and 0.19 s with only wholly chosen blocks read whole. Without huge pages
/// (a kernel built without them), a partial load asks for every chosen byte exactly, since the plain
/// fault path would read a window of several MiB around each tensor.
struct BlockFetch {
    /// The pack's descriptor, for the exact requests.
    fd: std::os::fd::RawFd,
    /// The address of the mapping's first byte (an address, so that the fetch can be shared by threads).
    base: usize,
    /// The mapping's length: the pack's size when it was mapped.
    len: usize,
    /// A partial load.
    sparse: bool,
    /// Faults read whole 2 MiB blocks (the mapping is marked for huge pages).
    blocks: bool,
    /// How many chosen bytes each block of a partial load holds.
    chosen: std::collections::HashMap<u64, u64>,
}

impl BlockFetch {
    /// Marks the mapping at `base` (`len` bytes, of the pack open as `file`) for the load of `spans`:
    /// (offset, length), distinct, non-empty, in pack order.
    fn new(
        file: &File,
        base: *const u8,
        len: usize,
        sparse: bool,
        spans: impl Iterator<Item = (u64, usize)>,
    ) -> BlockFetch {
        use std::os::fd::AsRawFd;

        let advise = |advice| {
            // SAFETY: advice on the caller's live mapping; it changes no contents.
            unsafe { libc::madvise(base as *mut libc::c_void, len, advice) == 0 }
        };
        let blocks = advise(libc::MADV_HUGEPAGE);
        // Random alone would make every fault read a single page, so it goes only with huge pages.
        if sparse && blocks {
            advise(libc::MADV_RANDOM);
        }
        let mut chosen = std::collections::HashMap::new();
        if sparse && blocks {
            for (offset, len) in spans {
                let end = offset + len as u64;
                for b in offset / HUGE_BLOCK..=(end - 1) / HUGE_BLOCK {
                    *chosen.entry(b).or_default() += end.min((b + 1) * HUGE_BLOCK) - offset.max(b * HUGE_BLOCK);
                }
            }
        }
        BlockFetch { fd: file.as_raw_fd(), base: base as usize, len, sparse, blocks, chosen }
    }

    /// True when a block holding `chosen` bytes of a partial load is read whole: faults read blocks, and at
    /// least a third of this one is chosen (see the type's documentation).
    fn reads_whole(&self, chosen: u64) -> bool {
        self.blocks && 3 * chosen >= HUGE_BLOCK
    }

    /// How many bytes a partial load fetches from the disk: whole blocks where they are read whole, the
    /// chosen bytes elsewhere.
    fn fetched(&self) -> f64 {
        self.chosen.values().map(|&c| if self.reads_whole(c) { HUGE_BLOCK } else { c } as f64).sum()
    }

    /// Brings `len` bytes at `offset` in the pack into the page cache and the mapping; false when the
    /// pack turns out shorter.
    fn bring_in(&self, offset: u64, len: usize) -> io::Result<bool> {
        let end = offset + len as u64;
        if end > self.len as u64 || len == 0 {
            return Ok(end <= self.len as u64);
        }
        if self.sparse {
            for b in offset / HUGE_BLOCK..=(end - 1) / HUGE_BLOCK {
                if !self.reads_whole(self.chosen.get(&b).copied().unwrap_or(0)) {
                    // The pages asked for are in the page cache, being read, when the advice returns, so
                    // the faults below wait for them instead of reading the block.
                    let (from, to) = (offset.max(b * HUGE_BLOCK), end.min((b + 1) * HUGE_BLOCK));
                    // SAFETY: advice on an open descriptor; failure only loses the exactness.
                    unsafe { libc::posix_fadvise(self.fd, from as i64, (to - from) as i64, libc::POSIX_FADV_WILLNEED) };
                }
            }
        }
        // From the page holding the first byte (the mapping starts on a page, so that page is inside it).
        let start = (self.base + offset as usize) & !4095;
        let span = self.base + end as usize - start;
        // SAFETY: the range lies inside the live mapping; populating maps pages and changes no contents.
        if unsafe { libc::madvise(start as *mut libc::c_void, span, libc::MADV_POPULATE_READ) } == 0 {
            return Ok(true);
        }
        let err = io::Error::last_os_error();
        match err.raw_os_error() {
            // A kernel before 5.14: the hashing (or the read) faults the pages in instead.
            Some(libc::EINVAL) => Ok(true),
            // The file is shorter than when it was checked: touching the piece would raise SIGBUS.
            Some(libc::EFAULT) => Ok(false),
            _ => Err(err),
        }
    }
}

/// The pipeline under `read_into` and `map_verified`: `fetch` brings a piece of a request into its
/// destination (false when the pack ends first), and every piece is hashed as soon as it is there.
/// `populate_destinations` maps fresh destination memory ahead of the fetches.
// One function of about 145 lines on purpose: its closures (`read`, `verify`, `hash_next`) and scoped
// threads all borrow the callers' destination buffers and one failure slot; split into functions,
// each would need those borrows handed to it, and the lifetimes would say more than the code.
fn fetch_and_verify(
    path: &Path,
    requests: &mut [ReadInto<'_>],
    sparse: bool,
    populate_destinations: bool,
    fetch: impl Fn(u64, &mut [u8]) -> io::Result<bool> + Sync,
) -> Result<(), ReadError> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    // One slot per piece of every multi-piece tensor that is verified.
    let mut cvs: Vec<Vec<ChainingValue>> = requests
        .iter()
        .map(|r| {
            if r.expect.is_some() && r.dest.len() > PIECE {
                vec![[0; 32]; r.dest.len().div_ceil(PIECE)]
            } else {
                Vec::new()
            }
        })
        .collect();
    /// What to do with a piece once read.
    enum Check<'c> {
        /// Nothing (the caller gave no hash).
        None,
        /// The piece is the whole tensor: compare its hash.
        Whole(Hash),
        /// Store the piece's chaining value; it starts at this offset within its tensor.
        Subtree(u64, &'c mut ChainingValue),
    }
    let mut items: Vec<(usize, u64, &mut [u8], Check<'_>)> = Vec::new();
    for ((i, r), slots) in requests.iter_mut().enumerate().zip(cvs.iter_mut()) {
        if r.dest.len() <= PIECE {
            let check = r.expect.map_or(Check::None, Check::Whole);
            items.push((i, r.offset, &mut *r.dest, check));
            continue;
        }
        let mut slots = slots.iter_mut();
        let mut within = 0u64;
        for piece in r.dest.chunks_mut(PIECE) {
            let len = piece.len() as u64;
            let check = slots.next().map_or(Check::None, |slot| Check::Subtree(within, slot));
            items.push((i, r.offset + within, piece, check));
            within += len;
        }
    }
    let failure: Mutex<Option<(usize, Option<io::Error>, bool)>> = Mutex::new(None);
    let record = |i: usize, err: Option<io::Error>, corrupt: bool| {
        let mut f = failure.lock().expect("failure lock");
        if f.as_ref().is_none_or(|(j, _, _)| i < *j) {
            *f = Some((i, err, corrupt));
        }
    };
    // Reads one piece; false (and the failure recorded) if it could not.
    let read = |i: usize, offset: u64, buf: &mut [u8]| match fetch(offset, buf) {
        Ok(true) => true,
        Ok(false) => {
            record(i, None, false);
            false
        }
        Err(e) => {
            record(i, Some(e), false);
            false
        }
    };
    let verify = |i: usize, buf: &[u8], check: Check<'_>| match check {
        Check::None => {}
        Check::Whole(want) => {
            if hash_serial(buf) != want {
                record(i, None, true);
            }
        }
        Check::Subtree(within, slot) => *slot = subtree(within, buf),
    };
    // The page-aligned parts of the destinations' pieces, in file order (addresses only: the readers own
    // the buffers).
    let fresh: Vec<(usize, usize)> = items
        .iter()
        .filter(|_| populate_destinations)
        .filter_map(|(_, _, buf, _)| {
            let addr = buf.as_ptr() as usize;
            let (start, end) = (addr.next_multiple_of(4096), (addr + buf.len()) & !4095);
            (end > start).then(|| (start, end - start))
        })
        .collect();
    let (sender, receiver) = std::sync::mpsc::channel::<(usize, &mut [u8], Check<'_>)>();
    let receiver = Mutex::new(receiver);
    let queue = Mutex::new(items.into_iter());
    // Pieces read and not yet hashed.
    let backlog = AtomicUsize::new(0);
    // Hashes the next piece read, waiting for one if `block`; false when there is none.
    let hash_next = |block: bool| {
        // Without blocking, a busy lock means a hasher is waiting in `recv`: leave the piece to it
        // (waiting for that lock could wait for the very piece this thread is about to send).
        let next = if block {
            receiver.lock().expect("receiver lock").recv().ok()
        } else {
            receiver.try_lock().ok().and_then(|r| r.try_recv().ok())
        };
        let Some((i, buf, check)) = next else { return false };
        backlog.fetch_sub(1, Ordering::Relaxed);
        verify(i, buf, check);
        true
    };
    std::thread::scope(|scope| {
        // Fresh destinations fault in page by page inside the readers' copies, which costs about as much
        // CPU as the copying itself. A helper populates them ahead, in file order, on another core
        // (MADV_POPULATE_WRITE maps pages without touching their contents, so it cannot race a reader),
        // and leaves the readers only the copy. A 1 GiB load, 8 cold runs each: median 0.42 s against
        // 0.71 s without it (one plain sequential read: 0.60 s).
        scope.spawn(|| {
            for &(start, len) in &fresh {
                // SAFETY: advice on ranges inside live destination buffers; it maps pages and changes no
                // contents; failure (an older kernel, a read-only mapping) only loses the head start.
                unsafe { libc::madvise(start as *mut libc::c_void, len, libc::MADV_POPULATE_WRITE) };
            }
        });
        if sparse {
            // Scattered reads: many threads, each reading and hashing its pieces, keep the disk's queue full.
            for _ in 0..READ_THREADS {
                scope.spawn(|| loop {
                    let Some((i, offset, buf, check)) = queue.lock().expect("queue lock").next() else { break };
                    if read(i, offset, buf) {
                        verify(i, buf, check);
                    }
                });
            }
        } else {
            // The whole pack in order: one thread reads it as one sequential stream (what the kernel's
            // readahead serves best), and the other cores hash each piece right behind it. When the bytes
            // come faster than they can be hashed (from the page cache), the reader hashes too.
            let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
            let hashers = cores.saturating_sub(1).max(1);
            for _ in 0..hashers {
                scope.spawn(|| while hash_next(true) {});
            }
            for (i, offset, buf, check) in queue.lock().expect("queue lock").by_ref() {
                if !read(i, offset, buf) {
                    continue;
                }
                backlog.fetch_add(1, Ordering::Relaxed);
                if sender.send((i, buf, check)).is_err() {
                    break;
                }
                if backlog.load(Ordering::Relaxed) > 2 * hashers {
                    hash_next(false);
                }
            }
            drop(sender);
            while hash_next(true) {}
        }
    });
    drop((queue, receiver)); // they borrow the destinations, which the checks below read
    if failure.lock().expect("failure lock").is_none() {
        for (i, (r, slots)) in requests.iter().zip(&cvs).enumerate() {
            if let Some(want) = r.expect.filter(|_| !slots.is_empty()) {
                if root_of_pieces(slots, r.dest.len() as u64, PIECE) != want {
                    record(i, None, true);
                    break;
                }
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
    fn chosen_bytes_are_counted_per_block() {
        const MIB: u64 = 1 << 20;
        let file = tempfile::tempfile().unwrap();
        file.set_len(16 * MIB).unwrap();
        // SAFETY: a private temporary file, only advised.
        let map = unsafe { memmap2::Mmap::map(&file) }.unwrap();
        // A tensor inside block 0, one across blocks 1 to 3, one alone in block 5.
        let spans = [(MIB, (MIB / 2) as usize), (3 * MIB, (4 * MIB) as usize), (11 * MIB, 4096)];
        let fetch = BlockFetch::new(&file, map.as_ptr(), map.len(), true, spans.into_iter());
        let mut blocks: Vec<(u64, u64)> = fetch.chosen.iter().map(|(&b, &n)| (b, n)).collect();
        blocks.sort();
        if fetch.blocks {
            assert_eq!(blocks, [(0, MIB / 2), (1, MIB), (2, 2 * MIB), (3, MIB), (5, 4096)]);
        }
        for (offset, len) in spans {
            assert!(fetch.bring_in(offset, len).unwrap());
        }
    }
}
