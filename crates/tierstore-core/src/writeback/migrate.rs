//! One migration step: the oldest pending file of a stage goes to the shared store.
//!
//! The bytes are copied to a hidden temporary name beside the destination (`.NAME.tierstore-part`), hashed
//! on the way, fsynced, read back and checked (size and blake3 against the journal), then renamed into
//! place and the directory fsynced, all while the journal's write lock makes sure the program did not
//! change the file meanwhile; only then do the entry and the staged copy go. A crash at any point leaves
//! either the entry (the step is redone: the temporary name is rewritten, a rename already done is
//! redone with the same bytes) or nothing to do.
//!
//! Only entries whose destination lies beneath one of the stage's configured destination roots are
//! migrated ([`beneath`]): a journal is trusted no further than the configuration that named its stage,
//! so an entry pointing elsewhere (`~/.bashrc`, `/lustre/ckpt/../other`) is never written. Such an entry
//! is left in the journal, untouched, for the agent to report ([`refused`]); the entries after it go on.
//!
//! Beneath its root, the destination's directory is reached one component at a time, none followed if it
//! is a symbolic link (`dest_dir`), and every later step names files through that directory's
//! descriptor: a link another user plants inside a destination they can write to never sends a
//! checkpoint outside it.

use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Component, Path, PathBuf};

use super::journal::{Entry, Finish, Journal, JournalError};
use crate::hash::{hash_reader, Hash, Hasher};

/// What a step did.
#[derive(Debug)]
pub enum Step {
    /// Nothing was pending.
    Idle,
    /// This entry is now on the store, checked.
    Migrated(Entry),
    /// The program changed the file while it was copied; its newer entry is migrated in its turn.
    Superseded,
    /// The store failed (the entry stays, with the error recorded): retry later.
    Failed(Entry, String),
    /// The staged copy of an entry closed with `durability = "buffered"` was torn by a crash of the node
    /// before the kernel wrote it back: it is dropped, never published; the store keeps what it held.
    Torn(Entry, String),
}

/// The temporary name a file is uploaded under before it is renamed into place: hidden, and the same
/// for every attempt, so that a retry overwrites what a killed one left.
pub fn part_path(dest: &Path) -> PathBuf {
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!(".{name}.tierstore-part"))
}

/// Whether `dest` may be written for a stage whose configured destinations are `roots`: it is absolute,
/// has no `..` (nor `.`) component, and lies strictly beneath one of the roots, compared as lexically
/// normalized paths. A root that is `/` or not absolute allows nothing.
pub fn beneath(dest: &Path, roots: &[PathBuf]) -> bool {
    let plain =
        |p: &Path| p.is_absolute() && p.components().all(|c| matches!(c, Component::RootDir | Component::Normal(_)));
    plain(dest)
        && roots.iter().any(|r| {
            let r = crate::source::normalize(r);
            r.is_absolute() && r != Path::new("/") && dest != r && dest.starts_with(&r)
        })
}

/// The pending entries of `j` that [`step`] refuses to migrate for `roots` (their destination is not
/// beneath any of them): left in the journal, for the agent to report.
pub fn refused(j: &Journal, roots: &[PathBuf]) -> Result<Vec<Entry>, JournalError> {
    Ok(j.entries()?.into_iter().filter(|e| !beneath(&e.dest, roots)).collect())
}

const BUF: usize = 1 << 20;

/// How often a copy asks whether its file is still wanted: a removed checkpoint stops being copied within
/// this, and its temporary copy goes (see [`copy_hashed`]).
const WANTED_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Copies `from` to the fresh file `to`, hashing on the way; `None` when `wanted` said no (asked every
/// [`WANTED_EVERY`]): the program removed or replaced the file meanwhile, and `rm -r` of its directory
/// waits for the copy to go rather than for a multi-gigabyte copy to end.
fn copy_hashed(from: &Path, to: &Path, wanted: impl Fn() -> bool) -> io::Result<Option<(u64, Hash)>> {
    let mut src = std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(from)?;
    // A fresh file under the temporary name, never through a link planted there (a destination directory
    // other users can write): what a killed attempt left is removed first.
    match std::fs::remove_file(to) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => return Err(e),
        _ => {}
    }
    let mut dst = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(to)?;
    let mut h = Hasher::new();
    let mut buf = vec![0u8; BUF];
    let mut n = 0u64;
    let mut asked = std::time::Instant::now();
    loop {
        if asked.elapsed() >= WANTED_EVERY {
            if !wanted() {
                return Ok(None);
            }
            asked = std::time::Instant::now();
        }
        let got = src.read(&mut buf)?;
        if got == 0 {
            break;
        }
        h.update(&buf[..got]);
        dst.write_all(&buf[..got])?;
        n += got as u64;
    }
    dst.sync_all()?;
    Ok(Some((n, *h.finalize().as_bytes())))
}

/// The directory `dest` goes in, opened from the destination root (among `roots`) that holds it, one
/// component at a time: each made if missing, none followed if it is a symbolic link. Paths under
/// [`through`] of it name that very directory, whatever is renamed on the way afterwards.
fn dest_dir(dest: &Path, roots: &[PathBuf]) -> io::Result<File> {
    use std::os::fd::FromRawFd;
    use std::os::unix::ffi::OsStrExt;
    let outside =
        || io::Error::new(io::ErrorKind::PermissionDenied, format!("{} is outside its destinations", dest.display()));
    let root = roots.iter().map(|r| crate::source::normalize(r)).find(|r| dest.starts_with(r)).ok_or_else(outside)?;
    let rel = dest.parent().and_then(|p| p.strip_prefix(&root).ok()).ok_or_else(outside)?;
    // The root is the configuration's own path: made if missing and followed as the user wrote it.
    std::fs::create_dir_all(&root)?;
    let mut dir = crate::source::open_dir(&root)?;
    for c in rel.components() {
        let Component::Normal(name) = c else { return Err(outside()) };
        let name = std::ffi::CString::new(name.as_bytes()).map_err(|_| outside())?;
        // SAFETY: mkdirat and openat with a valid directory descriptor and a NUL-terminated name.
        unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o777) };
        let flags = libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
        // SAFETY: as above; the new descriptor is owned below.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            return Err(match e.raw_os_error() {
                Some(libc::ELOOP) | Some(libc::ENOTDIR) => io::Error::new(
                    io::ErrorKind::PermissionDenied,
                    format!(
                        "{} is a symbolic link (or not a directory) inside the destination {}: a checkpoint is never \
                         written through one; remove it",
                        root.join(rel).display(),
                        root.display()
                    ),
                ),
                _ => e,
            });
        }
        // SAFETY: `fd` was just opened.
        dir = unsafe { File::from_raw_fd(fd) };
    }
    Ok(dir)
}

/// `name` in the directory `dir`, as a path that resolves through its descriptor (`/proc/self/fd/N/name`).
fn through(dir: &File, name: &std::ffi::OsStr) -> PathBuf {
    PathBuf::from(format!("/proc/self/fd/{}", dir.as_raw_fd())).join(name)
}

fn context<'a>(what: &str, path: &'a Path) -> impl FnOnce(io::Error) -> String + 'a {
    let what = what.to_string();
    move |e| format!("{what} {}: {e}", path.display())
}

/// Where an entry's bytes go: its directory on the store (see [`dest_dir`]), the temporary name and the
/// final one, both named through that directory.
struct Upload {
    dir: File,
    part: PathBuf,
    dest: PathBuf,
}

/// What became of an upload that did not fail.
enum Uploaded {
    /// Under its temporary name on the store, checked.
    Ready(Upload),
    /// The program changed the file meanwhile.
    Superseded,
    /// Its staged copy was torn by a crash of the node (see [`torn_by_a_crash`]): why, for the log.
    Torn(String),
}

/// Whether `e`, whose staged copy does not match its hash, was closed with its bytes in the page cache in
/// an earlier boot of the node: then a crash tore it (a program changing the file after its close is
/// another matter, told to the user as such).
fn torn_by_a_crash(e: &Entry) -> bool {
    e.unflushed_in.is_some_and(|boot| Some(boot) != crate::process::boot_id())
}

/// Whether `e` is still the journal's entry for its file: not removed, renamed or rewritten since.
fn current(j: &Journal, e: &Entry) -> bool {
    matches!(j.lookup(&e.dest), Ok(Some(now)) if now.seq == e.seq)
}

/// Uploads `e` under its temporary name and checks it.
fn upload(j: &Journal, e: &Entry, roots: &[PathBuf]) -> Result<Uploaded, String> {
    let staged = j.staged_path(&e.staged);
    if !staged.exists() {
        // Renamed or rewritten since it was read from the journal (its staged copy went with it)?
        return if current(j, e) {
            Err(format!(
                "the staged copy {} of {} is missing: the stage was altered",
                staged.display(),
                e.dest.display()
            ))
        } else {
            Ok(Uploaded::Superseded)
        };
    }
    if e.unflushed_in.is_some() {
        // Closed with its bytes in the page cache: on the node's disk before anything leaves it, so that a
        // crash during the migration finds the staged copy whole.
        std::fs::File::open(&staged).and_then(|f| f.sync_all()).map_err(context("cannot fsync", &staged))?;
    }
    let dir = dest_dir(&e.dest, roots).map_err(context("cannot open the directory of", &e.dest))?;
    let name = e.dest.file_name().ok_or_else(|| format!("{} has no file name", e.dest.display()))?;
    let part = through(&dir, part_path(&e.dest).file_name().expect("a part has a name"));
    let copied = copy_hashed(&staged, &part, || current(j, e));
    let (size, hash) = match copied {
        Ok(Some(v)) => v,
        Ok(None) => {
            let _ = std::fs::remove_file(&part);
            return Ok(Uploaded::Superseded);
        }
        Err(err) if err.kind() == io::ErrorKind::NotFound && !staged.exists() => {
            let _ = std::fs::remove_file(&part);
            return Ok(Uploaded::Superseded);
        }
        Err(err) => {
            let shown = part_path(&e.dest);
            return Err(format!("cannot upload {} to {}: {err}", e.dest.display(), shown.display()));
        }
    };
    if (size, hash) != (e.size, e.hash) {
        let _ = std::fs::remove_file(&part);
        if !current(j, e) {
            return Ok(Uploaded::Superseded);
        }
        if torn_by_a_crash(e) {
            return Ok(Uploaded::Torn(format!(
                "{} was lost: its staged copy {} ({size} of {} bytes) was torn by a crash of the node before \
                 the kernel wrote it to disk (durability \"buffered\"); the store keeps what it held before",
                e.dest.display(),
                staged.display(),
                e.size
            )));
        }
        return Err(format!(
            "the staged copy of {} ({size} bytes) does not match its journal entry ({} bytes): it was changed \
             after it was closed; it stays in the stage at {}",
            e.dest.display(),
            e.size,
            staged.display()
        ));
    }
    let shown = part_path(&e.dest);
    let back = std::fs::File::open(&part).and_then(hash_reader).map_err(context("cannot read back", &shown))?;
    if back != (e.size, e.hash) {
        let _ = std::fs::remove_file(&part);
        return Err(format!(
            "the store's copy {} read back {} bytes with another checksum than the {} written: the store \
             damaged it; retrying",
            shown.display(),
            back.0,
            e.size
        ));
    }
    Ok(Uploaded::Ready(Upload { dest: through(&dir, name), dir, part }))
}

/// Migrates the oldest pending file of `j` whose destination lies beneath one of `roots`, the stage's
/// configured destinations (see the module's description); entries that do not are skipped, left as
/// they are.
pub fn step(j: &Journal, roots: &[PathBuf]) -> Result<Step, JournalError> {
    let Some(e) = j.first_where(|e| beneath(&e.dest, roots))? else { return Ok(Step::Idle) };
    let up = match upload(j, &e, roots) {
        Ok(Uploaded::Ready(up)) => up,
        Ok(Uploaded::Superseded) => return Ok(Step::Superseded),
        Ok(Uploaded::Torn(msg)) => {
            // Never published; the entry and its copy go, so that the files closed after it migrate.
            return Ok(match j.finish(&e, || Ok(()))? {
                Ok(Finish::Done) => Step::Torn(e, msg),
                _ => Step::Superseded,
            });
        }
        // The program removed or replaced the file while it was copied (`rm -r` of a step's directory
        // takes the temporary copy with it): nothing failed, and the stage goes on without a back-off.
        Err(_) if !current(j, &e) => return Ok(Step::Superseded),
        Err(msg) => {
            j.note_error(e.seq, &msg)?;
            return Ok(Step::Failed(e, msg));
        }
    };
    let finished = j.finish(&e, || {
        std::fs::rename(&up.part, &up.dest)?;
        up.dir.sync_all()
    })?;
    match finished {
        Ok(Finish::Done) => Ok(Step::Migrated(e)),
        Ok(Finish::Superseded) => {
            let _ = std::fs::remove_file(&up.part);
            Ok(Step::Superseded)
        }
        Err(err) => {
            let msg = format!("cannot rename {} into place: {err}", e.dest.display());
            j.note_error(e.seq, &msg)?;
            Ok(Step::Failed(e, msg))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_file;
    use crate::writeback::journal::new_staged_name;

    #[test]
    fn files_reach_the_store_in_order_checked_and_leave_the_stage() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store) = (d.path().join("stage"), d.path().join("store"));
        let j = Journal::open(&stage).unwrap();
        for (name, bytes) in [("a/data", &b"data bytes"[..]), ("a/meta", b"meta")] {
            let s = new_staged_name();
            std::fs::write(j.staged_path(&s), bytes).unwrap();
            let (size, hash) = hash_file(&j.staged_path(&s)).unwrap();
            j.commit(&store.join(name), &s, size, hash).unwrap();
        }
        let Step::Migrated(first) = step(&j, std::slice::from_ref(&store)).unwrap() else {
            panic!("expected a migration")
        };
        assert_eq!(first.dest, store.join("a/data"));
        assert!(!store.join("a/meta").exists(), "the later file waits for the earlier one");
        assert!(matches!(step(&j, std::slice::from_ref(&store)).unwrap(), Step::Migrated(_)));
        assert!(matches!(step(&j, std::slice::from_ref(&store)).unwrap(), Step::Idle));
        assert_eq!(std::fs::read(store.join("a/meta")).unwrap(), b"meta");
        assert!(!part_path(&store.join("a/data")).exists());
        assert_eq!(std::fs::read_dir(j.data_dir()).unwrap().count(), 0);
    }

    fn commit(j: &Journal, dest: &Path, bytes: &[u8]) {
        let s = new_staged_name();
        std::fs::write(j.staged_path(&s), bytes).unwrap();
        let (size, hash) = hash_file(&j.staged_path(&s)).unwrap();
        j.commit(dest, &s, size, hash).unwrap();
    }

    #[test]
    fn an_entry_outside_the_stages_destinations_is_never_written_and_stays() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store, home) = (d.path().join("stage"), d.path().join("store"), d.path().join("home"));
        std::fs::create_dir_all(&home).unwrap();
        let victim = home.join(".bashrc");
        std::fs::write(&victim, b"the user's own").unwrap();
        let j = Journal::open(&stage).unwrap();
        // Closed first, but aimed outside the destination: directly, through `..`, at a sibling whose name
        // starts like the destination's, and at the destination itself.
        commit(&j, &victim, b"planted");
        commit(&j, &store.join("../home/.bashrc"), b"planted");
        commit(&j, &d.path().join("store-other/x"), b"planted");
        commit(&j, &store, b"planted");
        commit(&j, &store.join("ckpt/model.bin"), b"weights");
        let roots = [store.clone()];
        assert_eq!(refused(&j, &roots).unwrap().len(), 4);
        let Step::Migrated(e) = step(&j, &roots).unwrap() else { panic!("expected a migration") };
        assert_eq!(e.dest, store.join("ckpt/model.bin"), "the entries after a refused one go on");
        assert!(matches!(step(&j, &roots).unwrap(), Step::Idle), "nothing else is migrated");
        assert_eq!(std::fs::read(&victim).unwrap(), b"the user's own", "the target is untouched");
        assert!(!part_path(&victim).exists() && !d.path().join("store-other").exists());
        assert_eq!(std::fs::read(store.join("ckpt/model.bin")).unwrap(), b"weights");
        // The refused entries and their staged bytes stay, for the user to see.
        let left = j.entries().unwrap();
        assert_eq!(left.len(), 4);
        assert!(left.iter().all(|e| j.staged_path(&e.staged).exists()));
        // No destination at all, or `/`, allows nothing.
        assert!(matches!(step(&j, &[]).unwrap(), Step::Idle));
        assert!(matches!(step(&j, &[PathBuf::from("/")]).unwrap(), Step::Idle));
    }

    #[test]
    fn beneath_compares_normalized_absolute_paths() {
        let roots = [PathBuf::from("/lustre/ckpt/")];
        assert!(beneath(Path::new("/lustre/ckpt/a/b"), &roots));
        assert!(beneath(Path::new("/lustre//ckpt/./a"), &roots));
        assert!(!beneath(Path::new("/lustre/ckpt"), &roots));
        assert!(!beneath(Path::new("/lustre/ckpt/../x"), &roots));
        assert!(!beneath(Path::new("/lustre/ckpt/a/../../x"), &roots));
        assert!(!beneath(Path::new("/lustre/ckptx/a"), &roots));
        assert!(!beneath(Path::new("lustre/ckpt/a"), &roots));
        assert!(beneath(Path::new("/lustre/ckpt/a"), &[PathBuf::from("/lustre/x/../ckpt")]));
    }

    #[test]
    fn a_link_at_the_temporary_name_is_replaced_not_followed() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store) = (d.path().join("stage"), d.path().join("store"));
        std::fs::create_dir_all(&store).unwrap();
        let victim = d.path().join("victim");
        std::fs::write(&victim, b"keep").unwrap();
        std::os::unix::fs::symlink(&victim, part_path(&store.join("f"))).unwrap();
        let j = Journal::open(&stage).unwrap();
        commit(&j, &store.join("f"), b"bytes");
        assert!(matches!(step(&j, std::slice::from_ref(&store)).unwrap(), Step::Migrated(_)));
        assert_eq!(std::fs::read(&victim).unwrap(), b"keep");
        assert_eq!(std::fs::read(store.join("f")).unwrap(), b"bytes");
    }

    #[test]
    fn a_link_inside_the_destination_never_sends_a_checkpoint_outside_it() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store, elsewhere) = (d.path().join("stage"), d.path().join("store"), d.path().join("elsewhere"));
        std::fs::create_dir_all(&store).unwrap();
        std::fs::create_dir_all(&elsewhere).unwrap();
        // Another user who can write to the destination plants a directory link out of it.
        std::os::unix::fs::symlink(&elsewhere, store.join("run")).unwrap();
        let j = Journal::open(&stage).unwrap();
        commit(&j, &store.join("run/step_1/model.pt"), b"weights");
        let Step::Failed(_, msg) = step(&j, std::slice::from_ref(&store)).unwrap() else {
            panic!("expected a refusal")
        };
        assert!(msg.contains("symbolic link"), "{msg}");
        assert_eq!(std::fs::read_dir(&elsewhere).unwrap().count(), 0, "nothing was made or written outside");
        assert_eq!(j.entries().unwrap().len(), 1, "the entry stays, for the user to see");
        // With the link gone, the same entry migrates into a real directory.
        std::fs::remove_file(store.join("run")).unwrap();
        assert!(matches!(step(&j, std::slice::from_ref(&store)).unwrap(), Step::Migrated(_)));
        assert_eq!(std::fs::read(store.join("run/step_1/model.pt")).unwrap(), b"weights");
    }

    #[test]
    fn a_buffered_copy_torn_by_a_crash_of_the_node_is_dropped_and_the_next_file_migrates() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store) = (d.path().join("stage"), d.path().join("store"));
        std::fs::create_dir_all(&store).unwrap();
        std::fs::write(store.join("model.pt"), b"the step before").unwrap();
        let j = Journal::open(&stage).unwrap();
        // Closed in an earlier boot with its bytes in the page cache; the crash kept only half of them.
        let s = new_staged_name();
        std::fs::write(j.staged_path(&s), b"half of the new").unwrap();
        let (size, hash) = hash_file(&j.staged_path(&s)).unwrap();
        let earlier_boot = crate::process::boot_id().map(|b| b.map(|x| !x));
        j.record(&store.join("model.pt"), &s, size, hash, earlier_boot).unwrap();
        std::fs::write(j.staged_path(&s), b"half of").unwrap();
        commit(&j, &store.join("meta.json"), b"{}");
        let Step::Torn(e, msg) = step(&j, std::slice::from_ref(&store)).unwrap() else {
            panic!("expected the torn copy to be dropped")
        };
        assert_eq!(e.dest, store.join("model.pt"));
        assert!(msg.contains("torn by a crash of the node"), "{msg}");
        assert_eq!(std::fs::read(store.join("model.pt")).unwrap(), b"the step before", "never published");
        assert!(!j.staged_path(&s).exists());
        assert!(matches!(step(&j, std::slice::from_ref(&store)).unwrap(), Step::Migrated(_)));
        assert_eq!(std::fs::read(store.join("meta.json")).unwrap(), b"{}");
    }

    #[test]
    fn a_staged_copy_changed_after_close_is_never_published() {
        // Fsynced at close, or buffered and changed within this boot (not torn by a crash): refused, kept.
        for buffered in [false, true] {
            let d = tempfile::tempdir().unwrap();
            let (stage, store) = (d.path().join("stage"), d.path().join("store"));
            let j = Journal::open(&stage).unwrap();
            let s = new_staged_name();
            std::fs::write(j.staged_path(&s), b"right").unwrap();
            let (size, hash) = hash_file(&j.staged_path(&s)).unwrap();
            if buffered {
                j.close_buffered(&store.join("f"), &s, size, Some(hash)).unwrap();
            } else {
                j.commit(&store.join("f"), &s, size, hash).unwrap();
            }
            std::fs::write(j.staged_path(&s), b"wrong!").unwrap();
            let Step::Failed(_, msg) = step(&j, std::slice::from_ref(&store)).unwrap() else {
                panic!("expected a failure (buffered: {buffered})")
            };
            assert!(msg.contains("does not match") && msg.contains("changed after it was closed"), "{msg}");
            assert!(!store.join("f").exists());
            assert_eq!(j.entries().unwrap().len(), 1);
            assert_eq!(j.pending(&store).unwrap().errors.len(), 1);
        }
    }
}
