//! One migration step: the oldest pending file of a stage goes to the shared store.
//!
//! The bytes are copied to a hidden temporary name beside the destination (`.NAME.tierstore-part`), hashed
//! on the way, fsynced, read back and checked (size and blake3 against the journal), then renamed into
//! place and the directory fsynced, all while the journal's write lock makes sure the program did not
//! change the file meanwhile; only then do the entry and the staged copy go. A crash at any point leaves
//! either the entry (the step is redone: the temporary name is rewritten, a rename already done is
//! redone with the same bytes) or nothing to do.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};

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
}

/// The temporary name a file is uploaded under before it is renamed into place: hidden, and the same
/// for every attempt, so that a retry overwrites what a killed one left.
pub fn part_path(dest: &Path) -> PathBuf {
    let name = dest.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    dest.with_file_name(format!(".{name}.tierstore-part"))
}

const BUF: usize = 1 << 20;

fn copy_hashed(from: &Path, to: &Path) -> io::Result<(u64, Hash)> {
    let mut src = std::fs::File::open(from)?;
    let mut dst = std::fs::OpenOptions::new().write(true).create(true).truncate(true).open(to)?;
    let mut h = Hasher::new();
    let mut buf = vec![0u8; BUF];
    let mut n = 0u64;
    loop {
        let got = src.read(&mut buf)?;
        if got == 0 {
            break;
        }
        h.update(&buf[..got]);
        dst.write_all(&buf[..got])?;
        n += got as u64;
    }
    dst.sync_all()?;
    Ok((n, *h.finalize().as_bytes()))
}

fn fsync_dir(dir: &Path) -> io::Result<()> {
    std::fs::File::open(dir)?.sync_all()
}

fn context<'a>(what: &str, path: &'a Path) -> impl FnOnce(io::Error) -> String + 'a {
    let what = what.to_string();
    move |e| format!("{what} {}: {e}", path.display())
}

/// Uploads `e` under its temporary name and checks it; `Ok(None)` when the entry was superseded.
fn upload(j: &Journal, e: &Entry) -> Result<Option<PathBuf>, String> {
    let staged = j.staged_path(&e.staged);
    if !staged.exists() {
        // Renamed or rewritten since it was read from the journal (its staged copy went with it)?
        return match j.lookup(&e.dest) {
            Ok(Some(now)) if now.seq == e.seq => Err(format!(
                "the staged copy {} of {} is missing: the stage was altered",
                staged.display(),
                e.dest.display()
            )),
            _ => Ok(None),
        };
    }
    let dir = e.dest.parent().ok_or_else(|| format!("{} has no directory", e.dest.display()))?;
    std::fs::create_dir_all(dir).map_err(context("cannot create the directory", dir))?;
    let part = part_path(&e.dest);
    let copied = copy_hashed(&staged, &part);
    let (size, hash) = match copied {
        Ok(v) => v,
        Err(err) if err.kind() == io::ErrorKind::NotFound && !staged.exists() => {
            let _ = std::fs::remove_file(&part);
            return Ok(None);
        }
        Err(err) => return Err(format!("cannot upload {} to {}: {err}", e.dest.display(), part.display())),
    };
    if (size, hash) != (e.size, e.hash) {
        let _ = std::fs::remove_file(&part);
        if !matches!(j.lookup(&e.dest), Ok(Some(now)) if now.seq == e.seq) {
            return Ok(None);
        }
        return Err(format!(
            "the staged copy of {} ({size} bytes) does not match its journal entry ({} bytes): it was changed \
             after it was closed; it stays in the stage at {}",
            e.dest.display(),
            e.size,
            staged.display()
        ));
    }
    let back = std::fs::File::open(&part).and_then(hash_reader).map_err(context("cannot read back", &part))?;
    if back != (e.size, e.hash) {
        let _ = std::fs::remove_file(&part);
        return Err(format!(
            "the store's copy {} read back {} bytes with another checksum than the {} written: the store \
             damaged it; retrying",
            part.display(),
            back.0,
            e.size
        ));
    }
    Ok(Some(part))
}

/// Migrates the oldest pending file of `j` (see the module's description).
pub fn step(j: &Journal) -> Result<Step, JournalError> {
    let Some(e) = j.first()? else { return Ok(Step::Idle) };
    let part = match upload(j, &e) {
        Ok(Some(p)) => p,
        Ok(None) => return Ok(Step::Superseded),
        Err(msg) => {
            j.note_error(e.seq, &msg)?;
            return Ok(Step::Failed(e, msg));
        }
    };
    let dir = e.dest.parent().map(Path::to_path_buf).unwrap_or_default();
    let finished = j.finish(&e, || {
        std::fs::rename(&part, &e.dest)?;
        fsync_dir(&dir)
    })?;
    match finished {
        Ok(Finish::Done) => Ok(Step::Migrated(e)),
        Ok(Finish::Superseded) => {
            let _ = std::fs::remove_file(&part);
            Ok(Step::Superseded)
        }
        Err(err) => {
            let msg = format!("cannot rename {} into place as {}: {err}", part.display(), e.dest.display());
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
        let Step::Migrated(first) = step(&j).unwrap() else { panic!("expected a migration") };
        assert_eq!(first.dest, store.join("a/data"));
        assert!(!store.join("a/meta").exists(), "the later file waits for the earlier one");
        assert!(matches!(step(&j).unwrap(), Step::Migrated(_)));
        assert!(matches!(step(&j).unwrap(), Step::Idle));
        assert_eq!(std::fs::read(store.join("a/meta")).unwrap(), b"meta");
        assert!(!part_path(&store.join("a/data")).exists());
        assert_eq!(std::fs::read_dir(j.data_dir()).unwrap().count(), 0);
    }

    #[test]
    fn a_staged_copy_changed_after_close_is_never_published() {
        let d = tempfile::tempdir().unwrap();
        let (stage, store) = (d.path().join("stage"), d.path().join("store"));
        let j = Journal::open(&stage).unwrap();
        let s = new_staged_name();
        std::fs::write(j.staged_path(&s), b"right").unwrap();
        let (size, hash) = hash_file(&j.staged_path(&s)).unwrap();
        j.commit(&store.join("f"), &s, size, hash).unwrap();
        std::fs::write(j.staged_path(&s), b"wrong!").unwrap();
        let Step::Failed(_, msg) = step(&j).unwrap() else { panic!("expected a failure") };
        assert!(msg.contains("does not match"), "{msg}");
        assert!(!store.join("f").exists());
        assert_eq!(j.pending(&store).unwrap().errors.len(), 1);
    }
}
