//! The `Source` contract (`tierstore_core::source`), one suite run against every implementation: the POSIX
//! source over a directory, and the S3 source over a bucket prefix of a real SeaweedFS server.
//!
//! Each case takes a [`Store`]: the source under test, and the means to change the files behind it as
//! another writer of the store would. The cases work in directories of their own, so that one store serves
//! them all.

use std::collections::BTreeMap;
use std::fs::File;
use std::io;
use std::path::PathBuf;

use tierstore_core::counters::source as slot;
use tierstore_core::hash;
use tierstore_core::index::SourceId;
use tierstore_core::source::{CopyFault, Source, SourceFile};

/// A source under test, and write access to the store behind it.
pub trait Store {
    /// The source under test.
    fn source(&self) -> &dyn Source;
    /// Writes `bytes` as the file `rel` (relative to the source), replacing any file of that name whole, as
    /// a writer of the store does (a POSIX writer renames a finished file into place).
    fn put(&self, rel: &str, bytes: &[u8]);
    /// A path that is not under the source.
    fn outside(&self) -> PathBuf;
    /// Whether the store has directories of its own: a POSIX listing is one level, directories included,
    /// and a directory is no file; an object store lists every key under a prefix.
    fn has_directories(&self) -> bool;
    /// Where the cases may write temporary files (tier copies).
    fn scratch(&self) -> PathBuf;
    /// Characters the store's server itself does not keep in a name (it stores another in their place),
    /// left out of the names the cases write: a limit of that server, not of the source.
    fn changes_in_names(&self) -> &'static str {
        ""
    }
}

/// One clause of the contract, checked against a store.
type Case = fn(&dyn Store);

/// Every case, in order; `name` says which implementation runs them.
pub fn conforms(name: &str, store: &dyn Store) {
    let cases: [(&str, Case); 10] = [
        ("paths", paths),
        ("names_byte_for_byte", names_byte_for_byte),
        ("identity", identity),
        ("identify_opened", identify_opened),
        ("whole_and_ranged_reads", whole_and_ranged_reads),
        ("copy_with_progress", copy_with_progress),
        ("pinned_reads", pinned_reads),
        ("listing", listing),
        ("identities_of_a_directory", identities_of_a_directory),
        ("errors_keep_their_kind", errors_keep_their_kind),
    ];
    for (case, run) in cases {
        eprintln!("{name}: {case}");
        run(store);
    }
}

/// Deterministic bytes of a file: `n` bytes from `seed`.
fn bytes(seed: u8, n: usize) -> Vec<u8> {
    (0..n).map(|j| (j as u64 * 31 + u64::from(seed) * 7 + (j as u64 >> 9)) as u8).collect()
}

/// Sizes around the edges: empty, one byte, a page, and larger than the S3 store's first range (64 KiB
/// in these tests) and than a few of its ranges.
const SIZES: [usize; 5] = [0, 1, 4096, 65_537, 300_001];

/// Fills `buf` from `offset` with as many `read_at`s as it takes (a read may return fewer bytes than
/// asked); returns how many bytes there were.
fn read_fully_at(src: &dyn Source, f: &SourceFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
    let mut done = 0;
    while done < buf.len() {
        let n = src.read_at(f, &mut buf[done..], offset + done as u64)?;
        if n == 0 {
            break;
        }
        done += n;
    }
    Ok(done)
}

fn scratch_file(store: &dyn Store, name: &str) -> (File, PathBuf) {
    let path = store.scratch().join(name);
    let f = File::options().read(true).write(true).create(true).truncate(true).open(&path).unwrap();
    (f, path)
}

/// A path of the source names its file, and a path outside the source is refused.
fn paths(store: &dyn Store) {
    let src = store.source();
    store.put("paths/a.bin", b"a");
    let full = src.path_of("paths/a.bin");
    assert_eq!(src.relative(&full).unwrap(), "paths/a.bin");
    assert_eq!(src.relative_or_root(&full).unwrap(), "paths/a.bin");
    assert_eq!(src.relative_or_root(src.root()).unwrap(), "");
    assert!(src.relative(src.root()).is_err(), "the root is no file of the source");
    let outside = store.outside();
    let refused = src.relative(&outside).unwrap_err();
    assert_eq!(refused.path, outside);
    assert!(refused.to_string().contains("outside the cached source"), "{refused}");
    assert!(src.relative_or_root(&outside).is_err());
}

/// Every name a dataset may hold, as the store lists it: each printable ASCII character but `/`, the
/// characters URLs and object_store treat as special (`%`, `#`, `?`, `~`, `[`, `]`, `+`, a space), text that
/// looks percent-encoded already, and names outside ASCII. Each is listed as it was written, identified,
/// opened and read by that name, and its bytes are its own.
fn names_byte_for_byte(store: &dyn Store) {
    let src = store.source();
    let kept = |c: &char| *c != '/' && !store.changes_in_names().contains(*c);
    let printable: String = (0x20u8..0x7f).map(char::from).filter(kept).collect();
    let names = [
        printable.as_str(),
        "hash#1.bin",
        "50%.bin",
        "a%2Fb%20c.bin",
        "what?.bin",
        "~home.bin",
        "[0-9].bin",
        "one + two.bin",
        "naïve café.bin",
        "日本語.bin",
        "🙂.bin",
    ];
    for (i, name) in names.iter().enumerate() {
        store.put(&format!("names/{name}"), &bytes(40 + i as u8, 100 + i));
    }
    let listed: Vec<String> = src.list("names").unwrap().into_iter().map(|e| e.name.into_string().unwrap()).collect();
    let ids: BTreeMap<String, SourceId> = src.identities("names").unwrap().into_iter().collect();
    for (i, name) in names.iter().enumerate() {
        let rel = format!("names/{name}");
        assert!(listed.iter().any(|n| n == name), "{name:?} is not listed as itself: {listed:?}");
        let id = src.identify(&rel).unwrap_or_else(|e| panic!("identify {rel:?}: {e}"));
        assert_eq!(id.size, 100 + i as u64, "{rel:?}");
        assert_eq!(ids.get(*name), Some(&id), "{rel:?}: the listing's identity is identify's");
        let f = src.open(&rel).unwrap_or_else(|e| panic!("open {rel:?}: {e}"));
        let mut buf = vec![0u8; 100 + i];
        assert_eq!(read_fully_at(src, &f, &mut buf, 0).unwrap(), buf.len(), "{rel:?}");
        assert_eq!(buf, bytes(40 + i as u8, 100 + i), "{rel:?}: another object's bytes");
        assert_eq!(src.relative(&src.path_of(&rel)).unwrap(), rel, "{rel:?}: its path names it back");
    }
}

/// One counted request says the identity; equal identities are the same bytes, and another version of
/// the file (other bytes, of the same size or not) has another identity.
fn identity(store: &dyn Store) {
    let src = store.source();
    store.put("identity/a.bin", &bytes(1, 1000));
    let stats = src.counters().get(slot::STATS);
    let first = src.identify("identity/a.bin").unwrap();
    assert_eq!(src.counters().get(slot::STATS), stats + 1, "identify is one counted request");
    assert_eq!(first.size, 1000);
    assert_eq!(src.identify("identity/a.bin").unwrap(), first, "an unchanged file keeps its identity");
    store.put("identity/a.bin", &bytes(2, 1000));
    let same_size = src.identify("identity/a.bin").unwrap();
    assert_ne!(same_size, first, "other bytes of the same size have another identity");
    store.put("identity/a.bin", &bytes(2, 1001));
    let longer = src.identify("identity/a.bin").unwrap();
    assert_eq!(longer.size, 1001);
    assert_ne!(longer, same_size);
    assert_ne!(longer, first);
}

/// An opened file's identity is the one `identify` gives, and it is a file.
fn identify_opened(store: &dyn Store) {
    let src = store.source();
    store.put("opened/a.bin", &bytes(3, 70_000));
    let opens = src.counters().get(slot::OPENS);
    let f = src.open("opened/a.bin").unwrap();
    assert_eq!(src.counters().get(slot::OPENS), opens + 1, "open is one counted request");
    let (id, is_dir) = src.identify_opened(&f, "opened/a.bin").unwrap();
    assert!(!is_dir);
    assert_eq!(id, src.identify("opened/a.bin").unwrap());
    assert_eq!(id.size, 70_000);
}

/// `read_whole` gives the bytes and the identity they are of; `read_at` reads any range, short at the
/// end and nothing past it.
fn whole_and_ranged_reads(store: &dyn Store) {
    let src = store.source();
    for (i, &size) in SIZES.iter().enumerate() {
        let rel = format!("reads/{size}.bin");
        let want = bytes(i as u8, size);
        store.put(&rel, &want);
        let id = src.identify(&rel).unwrap();
        let read_before = src.counters().get(slot::BYTES_READ);
        let (got, sid) = src.read_whole(&rel, size as u64, None).unwrap();
        assert!(got == want, "{rel}: read_whole gave other bytes");
        assert_eq!(sid, id, "{rel}: read_whole names the version it read");
        assert_eq!(src.counters().get(slot::BYTES_READ) - read_before, size as u64, "{rel}: bytes counted");
        let pre = src.open(&rel).unwrap();
        let (again, _) = src.read_whole(&rel, size as u64, Some(pre)).unwrap();
        assert!(again == want, "{rel}: read_whole of an opened file gave other bytes");

        let f = src.open(&rel).unwrap();
        let ranges = [(0, size), (0, size.min(10)), (size / 3, size / 2), (65_000.min(size), 70_000.min(size))];
        for (start, end) in ranges {
            let mut buf = vec![0u8; end - start];
            let n = read_fully_at(src, &f, &mut buf, start as u64).unwrap();
            assert_eq!(n, end - start, "{rel}: a range within the file is read whole");
            assert!(buf == want[start..end], "{rel}: bytes {start}..{end} differ");
        }
        if size > 0 {
            let mut last = [0u8; 8];
            let n = read_fully_at(src, &f, &mut last, size as u64 - 1).unwrap();
            assert_eq!((n, last[0]), (1, want[size - 1]), "{rel}: a read over the end is short");
        }
        let mut past = [0u8; 8];
        assert_eq!(src.read_at(&f, &mut past, size as u64).unwrap(), 0, "{rel}: nothing at the end");
        assert_eq!(src.read_at(&f, &mut past, size as u64 + 100).unwrap(), 0, "{rel}: nothing past the end");
    }
}

/// `copy` writes the whole file in order, hashing what it writes, and reports its progress after each
/// step: never backwards, never past the size, ending at the size.
fn copy_with_progress(store: &dyn Store) {
    let src = store.source();
    for (i, &size) in SIZES.iter().enumerate() {
        let rel = format!("copy/{size}.bin");
        let want = bytes(100 + i as u8, size);
        store.put(&rel, &want);
        let id = src.identify(&rel).unwrap();
        for hashed in [false, true] {
            let f = src.open(&rel).unwrap();
            let (to, path) = scratch_file(store, &format!("copy-{size}-{hashed}"));
            let mut hasher = hash::Pieces::new(size as u64);
            let mut seen: Vec<u64> = Vec::new();
            let result = src.copy(&f, &to, size as u64, hashed.then_some(&mut hasher), &mut |n| seen.push(n));
            let (copied, after) = match result {
                Ok(x) => x,
                Err(CopyFault::Source(e)) => panic!("{rel}: the source failed the copy: {e}"),
                Err(CopyFault::Tier(e)) => panic!("{rel}: the copy failed writing: {e}"),
            };
            assert_eq!(copied, size as u64, "{rel}: copied every byte");
            assert!(std::fs::read(&path).unwrap() == want, "{rel}: the copy holds other bytes");
            if hashed {
                assert_eq!(hasher.finalize(), hash::hash(&want), "{rel}: the hash is of the bytes");
            }
            assert!(seen.windows(2).all(|w| w[0] <= w[1]), "{rel}: progress went backwards: {seen:?}");
            assert!(seen.iter().all(|&n| n <= size as u64), "{rel}: progress past the size: {seen:?}");
            if size > 0 {
                assert_eq!(seen.last().copied(), Some(size as u64), "{rel}: progress ends at the size");
            }
            if let Some(after) = after {
                assert_eq!(after, id, "{rel}: the copy names the version it copied");
            }
        }
    }
}

/// An opened file is one version: after the store replaces it, reads through the old handle give the old
/// bytes or fail ("changed while being read"), never the new ones; reopening the old version does the
/// same; a new open reads the new version.
fn pinned_reads(store: &dyn Store) {
    let src = store.source();
    let rel = "pinned/a.bin";
    let (v1, v2) = (bytes(7, 300_001), bytes(8, 300_001));
    store.put(rel, &v1);
    let old = src.identify(rel).unwrap();
    let f = src.open(rel).unwrap();
    store.put(rel, &v2);
    let new_id = src.identify(rel).unwrap();
    assert_ne!(new_id, old);
    let changed = |e: &io::Error| {
        assert_eq!(e.kind(), io::ErrorKind::Other, "{e}");
        assert!(e.to_string().contains("changed while being read"), "{e}");
    };
    // Past the first 64 KiB, which an object store's open has already fetched.
    let mut buf = vec![0u8; 50_000];
    match read_fully_at(src, &f, &mut buf, 200_000) {
        Ok(n) => assert!(n == buf.len() && buf == v1[200_000..250_000], "a pinned read gave other bytes"),
        Err(e) => changed(&e),
    }
    // The identity read_whole returns is the one its caller publishes under: never the new version's for
    // the old bytes (a POSIX file replaced under its reader says its old inode's identity, whose ctime the
    // unlink moved: the caller then publishes nothing).
    match src.read_whole(rel, v1.len() as u64, Some(f)) {
        Ok((got, sid)) => {
            assert!(got == v1, "read_whole of a pinned file gave other bytes");
            assert_ne!(sid, new_id, "the old bytes under the new version's identity");
        }
        Err(e) => changed(&e),
    }
    match src.reopen(rel, &old) {
        Ok(again) => {
            let mut buf = vec![0u8; 50_000];
            match read_fully_at(src, &again, &mut buf, 100_000) {
                Ok(n) => assert!(n == buf.len() && buf == v1[100_000..150_000], "a reopened version changed"),
                Err(e) => changed(&e),
            }
        }
        Err(e) => changed(&e),
    }
    let new = src.open(rel).unwrap();
    let mut buf = vec![0u8; v2.len()];
    assert_eq!(read_fully_at(src, &new, &mut buf, 0).unwrap(), v2.len());
    assert!(buf == v2, "a new open reads the new version");
    assert_eq!(src.identify_opened(&new, rel).unwrap().0, new_id);
}

/// A listing names the files under a directory: one level with its subdirectories (POSIX), or every key
/// under the prefix (an object store, one counted LIST request per thousand keys).
fn listing(store: &dyn Store) {
    let src = store.source();
    for rel in ["listing/d/a.bin", "listing/d/b.bin", "listing/d/sub/c.bin", "listing/e.bin"] {
        store.put(rel, rel.as_bytes());
    }
    let lists = src.counters().get(slot::LISTS);
    let listed: BTreeMap<String, Option<bool>> =
        src.list("listing/d").unwrap().into_iter().map(|e| (e.name.into_string().unwrap(), e.is_dir)).collect();
    let names: Vec<&str> = listed.keys().map(String::as_str).collect();
    for file in ["a.bin", "b.bin"] {
        assert_ne!(listed.get(file).copied().flatten(), Some(true), "{file} listed as a directory: {listed:?}");
    }
    if store.has_directories() {
        assert_eq!(names, ["a.bin", "b.bin", "sub"]);
        assert_ne!(listed["sub"], Some(false), "a subdirectory listed as a file");
    } else {
        assert_eq!(names, ["a.bin", "b.bin", "sub/c.bin"]);
        assert!(listed.values().all(|d| *d == Some(false)), "{listed:?}");
        assert_eq!(src.counters().get(slot::LISTS), lists + 1, "one LIST request per thousand keys");
    }
    let root: Vec<String> = src.list("listing").unwrap().into_iter().map(|e| e.name.into_string().unwrap()).collect();
    assert!(root.iter().any(|n| n == "e.bin"), "{root:?}");
    assert!(root.iter().any(|n| n == "d" || n.starts_with("d/")), "{root:?}");
}

/// The identities of the files directly in a directory, in one listing, are what `identify` says of
/// each; subdirectories and their files are not among them.
fn identities_of_a_directory(store: &dyn Store) {
    let src = store.source();
    let files = [("ids/x/a.bin", 10), ("ids/x/b.bin", 70_000), ("ids/x/empty", 0), ("ids/x/sub/c.bin", 5)];
    for (i, (rel, n)) in files.iter().enumerate() {
        store.put(rel, &bytes(i as u8, *n));
    }
    let lists = src.counters().get(slot::LISTS);
    let ids: BTreeMap<String, SourceId> = src.identities("ids/x").unwrap().into_iter().collect();
    assert_eq!(src.counters().get(slot::LISTS), lists + 1, "one counted listing");
    assert_eq!(ids.keys().map(String::as_str).collect::<Vec<_>>(), ["a.bin", "b.bin", "empty"]);
    for (name, id) in &ids {
        let rel = format!("ids/x/{name}");
        assert_eq!(*id, src.identify(&rel).unwrap(), "{rel}: the listing's identity is identify's");
    }
    store.put("ids/x/a.bin", &bytes(9, 11));
    let again: BTreeMap<String, SourceId> = src.identities("ids/x").unwrap().into_iter().collect();
    assert_ne!(again["a.bin"], ids["a.bin"], "a changed file shows a new identity");
    assert_eq!(again["b.bin"], ids["b.bin"]);
}

/// A missing file is `NotFound` to every request; a directory is no file.
fn errors_keep_their_kind(store: &dyn Store) {
    let src = store.source();
    let missing = "errors/none.bin";
    let kind = |r: io::Result<()>| r.unwrap_err().kind();
    assert_eq!(kind(src.identify(missing).map(drop)), io::ErrorKind::NotFound);
    assert_eq!(kind(src.open(missing).map(drop)), io::ErrorKind::NotFound);
    assert_eq!(kind(src.read_whole(missing, 10, None).map(drop)), io::ErrorKind::NotFound);
    store.put("errors/dir/a.bin", b"a");
    if store.has_directories() {
        let e = src.identify("errors/dir").unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EISDIR), "a directory is an IsADirectory error: {e}");
    } else {
        // A prefix is no object.
        assert_eq!(kind(src.identify("errors/dir").map(drop)), io::ErrorKind::NotFound);
    }
}
