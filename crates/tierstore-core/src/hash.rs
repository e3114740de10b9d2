//! The one content hash of tierstore: blake3, for every byte that is checked against what it should be.
//!
//! The model repository names a tensor by it ([`crate::models::pack`]), model streaming names a
//! version's tensor files by it ([`crate::models::stream`]), the write-back journal records it for a
//! staged file and migration checks the store's copy against it ([`crate::writeback`]), a cached copy
//! records it when copies are verified or served to peers, and the agents check every file and tensor
//! that crosses nodes with it. One hash everywhere means a tensor hashed once is known by that hash in
//! every one of these places.
//!
//! blake3 is a tree: a large buffer is hashed by all cores at once ([`hash`]), and pieces hashed apart (as
//! they are read or written) merge into the hash of the whole ([`Subtree`], [`merge`], [`merge_root`],
//! [`root_of_pieces`]), so no byte is read twice to be hashed. The names hashed to keys (index keys, the
//! owners' rendezvous weights) and the agents' keyed token proof are not content hashes and stay with
//! their modules.

use std::io::{self, Read};
use std::path::Path;

use blake3::hazmat::{left_subtree_len, merge_subtrees_non_root, merge_subtrees_root, HasherExt, Mode};

/// A content hash (blake3, 32 bytes).
pub type Hash = [u8; 32];

/// The incremental hasher, for bytes that arrive in order (a copy, a transfer): `update`, then
/// `finalize`.
pub type Hasher = blake3::Hasher;

/// What a subtree of blake3's tree hashes to before it is merged into its parent.
pub type ChainingValue = blake3::hazmat::ChainingValue;

/// Buffers at least this large are hashed with all cores.
const PARALLEL_HASH_MIN: usize = 4 << 20;

/// Hashes one buffer, with all cores when it is large.
pub fn hash(bytes: &[u8]) -> Hash {
    if bytes.len() >= PARALLEL_HASH_MIN {
        *Hasher::new().update_rayon(bytes).finalize().as_bytes()
    } else {
        hash_serial(bytes)
    }
}

/// Hashes one buffer on the calling thread alone: for callers that already keep the cores busy (a
/// load's readers and hashers) or must leave them to the job (the copy pool, a reader checking a copy).
pub fn hash_serial(bytes: &[u8]) -> Hash {
    *blake3::hash(bytes).as_bytes()
}

/// Hashes many buffers; small ones in parallel with each other, large ones each with all cores.
pub fn hash_many(buffers: &[&[u8]]) -> Vec<Hash> {
    use rayon::prelude::*;
    buffers.par_iter().map(|b| hash(b)).collect()
}

/// Adds `bytes` to `hasher`, with all cores when they are many.
pub fn update(hasher: &mut Hasher, bytes: &[u8]) {
    if bytes.len() >= PARALLEL_HASH_MIN {
        hasher.update_rayon(bytes);
    } else {
        hasher.update(bytes);
    }
}

/// The lowercase hex of a hash: how a hash is written in file names and manifests.
pub fn hex(h: &Hash) -> String {
    h.iter().map(|b| format!("{b:02x}")).collect()
}

/// The size and hash of a file, read through a mapping. The caller makes sure that nothing truncates the
/// file meanwhile (a mapping read past the file's end raises SIGBUS): the write-back journal hashes staged
/// files, which only its own writers change, under its lock.
pub fn hash_file(path: &Path) -> io::Result<(u64, Hash)> {
    hash_mapped(path, hash_serial)
}

/// [`hash_file`] with threads of its own (one per core, at most 4), for a caller the program waits on: a
/// write-back close. Not the rayon pool: this runs in the program's process, which may fork (a pool's
/// threads do not follow a fork; these are joined before it returns).
pub fn hash_file_now(path: &Path) -> io::Result<(u64, Hash)> {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(4);
    hash_mapped(path, |bytes| hash_scoped(bytes, threads))
}

/// The size of the file at `path` and `hash` of its bytes, mapped (see [`hash_file`]).
fn hash_mapped(path: &Path, hash: impl FnOnce(&[u8]) -> Hash) -> io::Result<(u64, Hash)> {
    let f = std::fs::File::open(path)?;
    let size = f.metadata()?.len();
    if size == 0 {
        return Ok((0, hash(&[])));
    }
    // SAFETY: the caller keeps the file from shrinking while it is mapped (see `hash_file`).
    let map = unsafe { memmap2::Mmap::map(&f)? };
    Ok((size, hash(&map)))
}

/// Hashes `bytes` in 1 MiB pieces shared among `threads` scoped threads (the calling one included), the
/// pieces merged in blake3's own tree. Small inputs, or a thread that cannot be started, are hashed here.
pub fn hash_scoped(bytes: &[u8], threads: usize) -> Hash {
    const PIECE_LEN: usize = 1 << 20;
    if threads < 2 || bytes.len() < 4 * PIECE_LEN {
        return hash_serial(bytes);
    }
    let pieces: Vec<&[u8]> = bytes.chunks(PIECE_LEN).collect();
    let per = pieces.len().div_ceil(threads);
    let hash_group = |first: usize, group: &[&[u8]]| -> Vec<ChainingValue> {
        group.iter().enumerate().map(|(i, p)| subtree(((first + i) * PIECE_LEN) as u64, p)).collect()
    };
    let cvs: Vec<ChainingValue> = std::thread::scope(|s| {
        let mut groups = pieces.chunks(per).enumerate();
        let (_, mine) = groups.next().expect("at least four pieces");
        let others: Vec<_> = groups
            .map(|(g, group)| {
                let spawned = std::thread::Builder::new().spawn_scoped(s, move || hash_group(g * per, group));
                (g, group, spawned.ok())
            })
            .collect();
        let mut cvs = hash_group(0, mine);
        for (g, group, handle) in others {
            match handle.map(|h| h.join()) {
                Some(Ok(part)) => cvs.extend(part),
                Some(Err(panic)) => std::panic::resume_unwind(panic),
                None => cvs.extend(hash_group(g * per, group)),
            }
        }
        cvs
    });
    root_of_pieces(&cvs, bytes.len() as u64, PIECE_LEN)
}

/// The size and hash of everything `reader` yields, read 1 MiB at a time.
pub fn hash_reader(mut reader: impl Read) -> io::Result<(u64, Hash)> {
    let mut h = Hasher::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut n = 0u64;
    loop {
        let got = reader.read(&mut buf)?;
        if got == 0 {
            return Ok((n, *h.finalize().as_bytes()));
        }
        h.update(&buf[..got]);
        n += got as u64;
    }
}

/// The hasher of one subtree of a larger input (not its root): the bytes from `offset` of the whole, in
/// order. A subtree starts at a multiple of its own length, a power of two of at least 1 KiB (blake3's
/// chunk), or is the last one.
pub struct Subtree(Hasher);

impl Subtree {
    /// A subtree that starts at byte `offset` of the whole input.
    pub fn at(offset: u64) -> Subtree {
        let mut h = Hasher::new();
        h.set_input_offset(offset);
        Subtree(h)
    }

    /// Adds the next bytes of the subtree.
    pub fn update(&mut self, bytes: &[u8]) {
        self.0.update(bytes);
    }

    /// The subtree's chaining value, to merge with its sibling.
    pub fn finish(&self) -> ChainingValue {
        self.0.finalize_non_root()
    }
}

/// The chaining value of `bytes`, a subtree that starts at `offset` of the whole input.
pub fn subtree(offset: u64, bytes: &[u8]) -> ChainingValue {
    let mut s = Subtree::at(offset);
    s.update(bytes);
    s.finish()
}

/// How many of `len` bytes blake3 puts in the left subtree: the largest power-of-two number of chunks
/// that leaves at least one byte on the right. Splitting there makes both halves valid subtrees.
pub fn left_len(len: u64) -> u64 {
    left_subtree_len(len)
}

/// Merges two sibling subtrees into their parent's chaining value (a parent that is not the root).
pub fn merge(left: &ChainingValue, right: &ChainingValue) -> ChainingValue {
    merge_subtrees_non_root(left, right, Mode::Hash)
}

/// Merges the two halves of the whole input into its hash (the root is finalized differently from every
/// other node of the tree).
pub fn merge_root(left: &ChainingValue, right: &ChainingValue) -> Hash {
    *merge_subtrees_root(left, right, Mode::Hash).as_bytes()
}

/// The hash of `len` bytes from the chaining values of their pieces (every piece `piece` bytes but the
/// last; `piece` a power of two of at least 1 KiB, and `len` more than one piece), merged in the shape of
/// blake3's own tree: the result equals [`hash`] of the whole.
pub fn root_of_pieces(cvs: &[ChainingValue], len: u64, piece: usize) -> Hash {
    let piece = piece as u64;
    // blake3 splits a subtree longer than a piece at a power of two that is at least a piece, so at a
    // piece boundary: the first `left / piece` pieces go left.
    fn tree(cvs: &[ChainingValue], len: u64, piece: u64) -> ChainingValue {
        if len <= piece {
            return cvs[0];
        }
        let left = left_len(len);
        let n = (left / piece) as usize;
        merge(&tree(&cvs[..n], left, piece), &tree(&cvs[n..], len - left, piece))
    }
    let left = left_len(len);
    let n = (left / piece) as usize;
    merge_root(&tree(&cvs[..n], left, piece), &tree(&cvs[n..], len - left, piece))
}

/// How many bytes each chaining value of a copy covers ([`Pieces`]): one wire chunk
/// ([`crate::cluster::wire::CHUNK`]), so that a reader on another node checks each chunk on its own.
pub const PIECE: usize = 1 << 20;

/// What a [`Pieces`] calls with each piece's chaining value.
type OnPiece<'a> = Box<dyn FnMut(&ChainingValue) + Send + 'a>;

/// The hasher of a copy of `len` bytes made in order (from the store into a tier) that also yields the
/// chaining value of each [`PIECE`] as it completes, when the file is longer than one piece. A copy
/// records them as it grows, so a reader on another node can check (and use) each piece it is sent
/// before the copy is complete; the hash of the whole comes from the same pass ([`root_of_pieces`]), so
/// no byte is hashed twice.
pub struct Pieces<'a> {
    len: u64,
    done: u64,
    current: Hasher,
    cvs: Vec<ChainingValue>,
    on_piece: Option<OnPiece<'a>>,
}

impl<'a> Pieces<'a> {
    /// The hasher of a file of `len` bytes.
    pub fn new(len: u64) -> Pieces<'a> {
        Pieces { len, done: 0, current: Hasher::new(), cvs: Vec::new(), on_piece: None }
    }

    /// The same, calling `on_piece` with each piece's chaining value as it completes (in order).
    pub fn reporting(len: u64, on_piece: impl FnMut(&ChainingValue) + Send + 'a) -> Pieces<'a> {
        Pieces { on_piece: Some(Box::new(on_piece)), ..Pieces::new(len) }
    }

    /// Adds the next bytes.
    pub fn update(&mut self, mut bytes: &[u8]) {
        let split = self.len > PIECE as u64;
        while !bytes.is_empty() {
            let room = PIECE - (self.done % PIECE as u64) as usize;
            let n = room.min(bytes.len());
            self.current.update(&bytes[..n]);
            self.done += n as u64;
            bytes = &bytes[n..];
            if split && (n == room || self.done == self.len) {
                let cv = self.current.finalize_non_root();
                if let Some(f) = self.on_piece.as_mut() {
                    f(&cv);
                }
                self.cvs.push(cv);
                self.current = Hasher::new();
                if self.done.is_multiple_of(PIECE as u64) {
                    self.current.set_input_offset(self.done);
                }
            }
        }
    }

    /// The hash of every byte added (the whole file's, once all `len` of them were).
    pub fn finalize(&self) -> Hash {
        if self.done != self.len {
            // The file changed size during the copy, which is never published: its hash only has to
            // differ from the file's. (A piece's hasher past the first cannot be finalized at all here:
            // blake3 panics on a root of a subtree, and on an empty one.)
            let mut h = Hasher::new();
            h.update(b"tierstore: a copy of another length than the file's");
            h.update(&self.done.to_le_bytes());
            for cv in &self.cvs {
                h.update(cv);
            }
            return *h.finalize().as_bytes();
        }
        if self.len <= PIECE as u64 {
            return *self.current.finalize().as_bytes(); // one piece: the root of its own tree
        }
        root_of_pieces(&self.cvs, self.len, PIECE)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_merge_into_the_hash_of_the_whole() {
        const PIECE: usize = 64 << 10;
        let bytes: Vec<u8> = (0..(4 * PIECE + 3000)).map(|i| (i * 7 % 253) as u8).collect();
        for len in [PIECE + 1, 2 * PIECE, 3 * PIECE - 1, 3 * PIECE + 1, 4 * PIECE + 3000] {
            let whole = &bytes[..len];
            let cvs: Vec<ChainingValue> =
                whole.chunks(PIECE).enumerate().map(|(k, p)| subtree((k * PIECE) as u64, p)).collect();
            assert_eq!(root_of_pieces(&cvs, len as u64, PIECE), hash(whole), "length {len}");
        }
    }

    #[test]
    fn a_file_hashed_by_threads_of_its_own_is_blake3s_hash() {
        const MIB: usize = 1 << 20;
        let bytes: Vec<u8> = (0..(9 * MIB + 4097)).map(|i| (i * 29 % 251) as u8).collect();
        for len in [0, 1, MIB, 4 * MIB - 1, 4 * MIB, 4 * MIB + 1, 7 * MIB + 3, 9 * MIB + 4097] {
            let part = &bytes[..len];
            for threads in [1, 2, 3, 4] {
                assert_eq!(hash_scoped(part, threads), *blake3::hash(part).as_bytes(), "{len} bytes, {threads}");
            }
        }
        let d = tempfile::tempdir().unwrap();
        for len in [0, 9 * MIB + 4097] {
            let path = d.path().join(format!("f{len}"));
            std::fs::write(&path, &bytes[..len]).unwrap();
            assert_eq!(hash_file_now(&path).unwrap(), hash_file(&path).unwrap());
        }
    }

    #[test]
    fn halves_merge_into_the_root_and_readers_agree_with_buffers() {
        let bytes: Vec<u8> = (0..(PARALLEL_HASH_MIN + 12345)).map(|i| (i * 31 % 251) as u8).collect();
        let left = left_len(bytes.len() as u64) as usize;
        let root = merge_root(&subtree(0, &bytes[..left]), &subtree(left as u64, &bytes[left..]));
        assert_eq!(root, hash(&bytes));
        assert_eq!(root, *blake3::hash(&bytes).as_bytes(), "the parallel hash is blake3's");
        assert_eq!(hash_reader(&bytes[..]).unwrap(), (bytes.len() as u64, root));
        let mut h = Hasher::new();
        update(&mut h, &bytes);
        assert_eq!(*h.finalize().as_bytes(), root);
        assert_eq!(hex(&[0xab; 32]).len(), 64);
    }

    #[test]
    fn a_copys_pieces_are_what_a_reader_checks_and_merge_into_its_hash() {
        const MIB: usize = PIECE;
        for len in [10, MIB, MIB + 1, 2 * MIB, 3 * MIB + 4097] {
            let bytes: Vec<u8> = (0..len).map(|i| (i * 13 % 251) as u8).collect();
            let mut seen = Vec::new();
            let mut p = Pieces::reporting(len as u64, |cv| seen.push(*cv));
            // Fed in odd sizes, as a copy's reads come.
            for part in bytes.chunks(300_001) {
                p.update(part);
            }
            assert_eq!(p.finalize(), hash(&bytes), "length {len}");
            drop(p);
            let want: Vec<ChainingValue> = if len <= MIB {
                vec![]
            } else {
                bytes.chunks(MIB).enumerate().map(|(k, c)| subtree((k * MIB) as u64, c)).collect()
            };
            assert_eq!(seen, want, "length {len}");
        }
    }

    #[test]
    fn a_copy_that_gets_fewer_or_more_bytes_than_it_expected_hashes_to_something_else() {
        let bytes: Vec<u8> = (0..3 * PIECE + 10).map(|i| (i % 7) as u8).collect();
        let whole = hash(&bytes);
        // The file shrank after it was identified: 2.5 pieces of the 3 expected.
        let mut short = Pieces::new(bytes.len() as u64);
        short.update(&bytes[..2 * PIECE + PIECE / 2]);
        assert_ne!(short.finalize(), whole);
        // It grew: more than expected, on a piece boundary and off one.
        for extra in [PIECE - 10, PIECE + 5] {
            let mut long = Pieces::new(bytes.len() as u64);
            long.update(&bytes);
            long.update(&vec![1u8; extra]);
            assert_ne!(long.finalize(), whole);
        }
    }
}
