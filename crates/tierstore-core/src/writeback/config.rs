//! `[[writeback]]`: the destinations on the shared store whose writes are staged on the node.
//!
//! ```toml
//! [[writeback]]
//! path = "/lustre/ckpt"          # the destination on the shared store (a directory that exists)
//! stage = "/nvme/tierstore-stage" # node-local directory the writes land in first
//! quota = "200G"                 # bytes staged at most; past it, writes go straight to the store
//! durability = "buffered"        # close() returns with the bytes in the page cache, as on a local disk
//!                                # ("local": fsynced on the node; "remote": on the store)
//! timeout = "10m"                # the longest close (remote) or `tierstore sync` waits for the store
//! ```
//!
//! `$TIERSTORE_WRITEBACK` replaces the file's list: `DEST:STAGE[:QUOTA[:DURABILITY]]`, comma separated.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::config::settings::{default_value, keys_of, Table};
use crate::config::values::{bad, expand_home, fs_info, parse_duration, parse_size, scalar, At, ConfigError, Origin};

/// When `close()` (and `fsync`) of a staged file returns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Durability {
    /// Once the bytes are in the node's page cache, hashed, and their journal entry is fsynced: what
    /// `close()` on a local disk gives. A crash of the program loses nothing; a crash of the node loses
    /// what the kernel had not written back yet (it writes dirty pages within `vm.dirty_expire_centisecs`
    /// plus `vm.dirty_writeback_centisecs`, 35 s by default, and the agent fsyncs every file before it
    /// migrates it), and a file torn that way is known by its checksum and never migrated (see
    /// `migrate`). The default.
    Buffered,
    /// Once the bytes and their journal entry are fsynced on the node's stage.
    Local,
    /// Once the file is fsynced and checked on the shared store.
    Remote,
}

impl Durability {
    /// The name used in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Durability::Buffered => "buffered",
            Durability::Local => "local",
            Durability::Remote => "remote",
        }
    }
}

/// One `[[writeback]]` entry, validated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Destination {
    /// The directory on the shared store (absolute, normalized) whose writes are staged.
    pub path: PathBuf,
    /// This user's node-local stage directory, `<configured stage>/<uid>` (see [`stage_dir`]; created 0700
    /// or checked to be the user's own): the journal and the staged bytes.
    pub stage: PathBuf,
    /// Bytes staged at most (files waiting for migration); a file opened past it is written through.
    pub quota: u64,
    /// What close() promises.
    pub durability: Durability,
    /// The longest a remote close or a sync waits for the store before failing.
    pub timeout: Duration,
}

impl Destination {
    /// Whether `abs` (absolute, normalized) is this destination or under it. The destination itself is
    /// one: a listing of it shows the files staged in it, and removing it removes them (else the agent
    /// would bring it back with them).
    pub fn holds(&self, abs: &Path) -> bool {
        abs.starts_with(&self.path)
    }
}

const FIX: &str = "write [[writeback]] tables: path = \"/lustre/ckpt\", stage = \"/nvme/stage\", quota = \"100G\", \
                   durability = \"local\"";

/// Turns `$TIERSTORE_WRITEBACK` (`DEST:STAGE[:QUOTA[:DURABILITY]]`, comma separated) into the TOML list the
/// file would hold.
pub fn from_env(text: &str, origin: &Origin) -> Result<toml::Value, ConfigError> {
    let mut list = Vec::new();
    for item in text.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let parts: Vec<&str> = item.split(':').collect();
        if parts.len() < 2 || parts.len() > 4 || parts[0].is_empty() || parts[1].is_empty() {
            return Err(bad(
                origin,
                "writeback",
                item,
                "is not DEST:STAGE[:QUOTA[:DURABILITY]]",
                "write TIERSTORE_WRITEBACK=\"/lustre/ckpt:/nvme/stage:100G:local\"",
            ));
        }
        let mut t = toml::Table::new();
        t.insert("path".into(), toml::Value::String(parts[0].into()));
        t.insert("stage".into(), toml::Value::String(parts[1].into()));
        if let Some(q) = parts.get(2).filter(|q| !q.is_empty()) {
            t.insert("quota".into(), toml::Value::String((*q).into()));
        }
        if let Some(d) = parts.get(3) {
            t.insert("durability".into(), toml::Value::String((*d).into()));
        }
        list.push(toml::Value::Table(t));
    }
    Ok(toml::Value::Array(list))
}

/// This user's stage under the configured stage path `configured` (absolute): `<stage>/<uid>`, the directory
/// every part of write-back uses ([`Destination::stage`]): the journal, the staged files, the list the
/// agent reads.
pub fn stage_dir(configured: &Path) -> PathBuf {
    crate::private::user_dir(configured)
}

/// A configured path made absolute (`~` is the home directory) and normalized.
fn absolute(p: &str) -> PathBuf {
    let p = expand_home(p);
    crate::source::normalized(std::path::absolute(&p).unwrap_or(p))
}

/// Validates the `writeback` value (from the file or the environment). Stage directories are created
/// (or checked to be the user's own) here, so a stage that cannot be used fails at start.
pub fn validate(raw: Option<&(toml::Value, Origin)>) -> Result<Vec<Destination>, ConfigError> {
    let Some((value, origin)) = raw else { return Ok(Vec::new()) };
    let list =
        value.as_array().ok_or_else(|| bad(origin, "writeback", scalar(value), "must be a list of tables", FIX))?;
    let mut out: Vec<Destination> = Vec::new();
    let keys = keys_of(Table::Writeback);
    for (i, item) in list.iter().enumerate() {
        let at = At { origin, key: format!("writeback[{i}]") };
        let t = item.as_table().ok_or_else(|| bad(origin, &at.key, scalar(item), "must be a table", FIX))?;
        if let Some((key, v)) = t.iter().find(|(key, _)| !keys.contains(&key.as_str())) {
            return Err(at.bad(key, scalar(v), "unknown key", &format!("known keys: {}", keys.join(", "))));
        }
        let get = |key: &str| t.get(key).map(scalar);
        // An unset key reads as the settings table's default, through the same check as a written one.
        let or_default = |key: &str| get(key).or_else(|| default_value(Table::Writeback, key).map(str::to_string));
        let path_text =
            get("path").ok_or_else(|| at.bad("path", "(missing)", "every destination needs a path", FIX))?;
        let path = destination_dir(&at, &path_text)?;
        if let Some(other) = out.iter().find(|d| d.path.starts_with(&path) || path.starts_with(&d.path)) {
            return Err(at.bad(
                "path",
                &path_text,
                &format!("overlaps the destination {}", other.path.display()),
                "give each destination its own directory, none inside another",
            ));
        }
        let stage_text = get("stage")
            .ok_or_else(|| at.bad("stage", "(missing)", "every destination needs a node-local stage directory", FIX))?;
        let stage = stage_of(&at, &stage_text, &path)?;
        let quota = match get("quota") {
            Some(q) => parse_size(&q).filter(|n| *n > 0).ok_or_else(|| {
                at.bad("quota", format!("\"{q}\""), "is not a size", "use a size like \"100G\" or \"512MiB\"")
            })?,
            // The stage's free space when the job starts, less a tenth for everything else on the disk.
            None => fs_info(&stage).map(|f| f.free / 10 * 9).unwrap_or(0),
        };
        let durability = durability_of(&at, or_default("durability").as_deref())?;
        let timeout_text = or_default("timeout").unwrap_or_default();
        let timeout = parse_duration(&timeout_text).ok_or_else(|| {
            at.bad(
                "timeout",
                format!("\"{timeout_text}\""),
                "is not a duration",
                "use seconds or \"90s\", \"10m\", \"1h\"",
            )
        })?;
        out.push(Destination { path, stage, quota, durability, timeout });
    }
    Ok(out)
}

/// A destination's directory on the shared store, absolute: it must exist, and not be the root.
fn destination_dir(at: &At<'_>, written: &str) -> Result<PathBuf, ConfigError> {
    let path = absolute(written);
    if path == Path::new("/") {
        return Err(at.bad("path", written, "is the root directory", "name the directory checkpoints go to"));
    }
    match std::fs::metadata(&path) {
        Ok(m) if m.is_dir() => Ok(path),
        Ok(_) => Err(at.bad("path", written, "is not a directory", "give a directory on the shared store")),
        Err(e) => Err(at.bad(
            "path",
            written,
            &format!("cannot be read ({e})"),
            "create the destination directory on the shared store first (mkdir -p), or fix the path",
        )),
    }
}

/// This user's stage directory beneath the stage path given, created 0700 or checked; outside the
/// destination `path`.
fn stage_of(at: &At<'_>, written: &str, path: &Path) -> Result<PathBuf, ConfigError> {
    let stage = absolute(written);
    if stage.starts_with(path) || path.starts_with(&stage) {
        return Err(at.bad(
            "stage",
            written,
            &format!("overlaps the destination {}", path.display()),
            "put the stage on node-local storage (an NVMe or SSD directory), outside the destination",
        ));
    }
    // The stage path may be given by several users of the node (`/scratch/stage`): this user's staged
    // bytes and journal live in a directory of their own beneath it, created 0700 or checked.
    let stage = stage_dir(&stage);
    crate::private::ensure_dir(&stage).map_err(|e| {
        let fix = if e.kind() == std::io::ErrorKind::PermissionDenied {
            "give a local directory only you can write to, or one under a shared sticky directory such as \
             /tmp (tierstore keeps your staged files in a directory of your own beneath it, mode 0700)"
        } else {
            "give a writable local directory"
        };
        at.bad("stage", written, &format!("cannot be used ({e})"), fix)
    })?;
    Ok(stage)
}

fn durability_of(at: &At<'_>, written: Option<&str>) -> Result<Durability, ConfigError> {
    match written {
        Some("buffered") => Ok(Durability::Buffered),
        Some("local") => Ok(Durability::Local),
        Some("remote") => Ok(Durability::Remote),
        other => Err(at.bad(
            "durability",
            format!("\"{}\"", other.unwrap_or_default()),
            "unknown durability",
            "use \"buffered\" (close returns with the bytes in the node's page cache, as on a local \
             disk), \"local\" (once they are fsynced on the node) or \"remote\" (once they are fsynced \
             and checked on the shared store)",
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(dest: &Path, stage: &Path, extra: &str) -> toml::Value {
        let text = format!("[[writeback]]\npath = {:?}\nstage = {:?}\n{extra}", dest.display(), stage.display());
        let t: toml::Table = text.parse().unwrap();
        t["writeback"].clone()
    }

    #[test]
    fn a_valid_destination_and_its_defaults() {
        let d = tempfile::tempdir().unwrap();
        let (dest, stage) = (d.path().join("store"), d.path().join("stage"));
        std::fs::create_dir(&dest).unwrap();
        let v = table(&dest, &stage, "quota = \"1M\"\ndurability = \"remote\"\ntimeout = \"90s\"");
        let out = validate(Some(&(v, Origin::Default))).unwrap();
        assert_eq!(out[0].quota, 1 << 20);
        assert_eq!(out[0].durability, Durability::Remote);
        assert_eq!(out[0].timeout, Duration::from_secs(90));
        assert!(stage.is_dir(), "the stage is created at start");
        assert_eq!(out[0].stage, stage.join(crate::private::euid().to_string()), "this user's own directory");
        use std::os::unix::fs::MetadataExt;
        assert_eq!(std::fs::metadata(&out[0].stage).unwrap().mode() & 0o777, 0o700);
        assert!(out[0].holds(&dest.join("a/b")) && out[0].holds(&dest) && !out[0].holds(&d.path().join("storex")));
    }

    #[test]
    fn errors_name_the_key_and_the_fix() {
        let d = tempfile::tempdir().unwrap();
        let (dest, stage) = (d.path().join("store"), d.path().join("stage"));
        let e = validate(Some(&(table(&dest, &stage, ""), Origin::Default))).unwrap_err();
        assert_eq!(e.key, "writeback[0].path");
        assert!(e.fix.contains("mkdir"), "{e}");
        std::fs::create_dir(&dest).unwrap();
        let e = validate(Some(&(table(&dest, &stage, "durability = \"eventual\""), Origin::Default))).unwrap_err();
        assert_eq!(e.key, "writeback[0].durability");
        assert!(e.to_string().contains("\"remote\""), "{e}");
        let e = validate(Some(&(table(&dest, &stage, "quota = \"lots\""), Origin::Default))).unwrap_err();
        assert_eq!(e.key, "writeback[0].quota");
        let e = validate(Some(&(table(&dest, &dest.join("s"), ""), Origin::Default))).unwrap_err();
        assert!(e.problem.contains("overlaps"), "{e}");
        let e = validate(Some(&(table(&dest, &stage, "qouta = 1"), Origin::Default))).unwrap_err();
        assert_eq!(e.key, "writeback[0].qouta");
    }

    #[test]
    fn a_stage_that_is_not_this_users_own_is_refused_with_the_key_and_the_fix() {
        use std::os::unix::fs::PermissionsExt;
        let d = tempfile::tempdir().unwrap();
        let (dest, stage) = (d.path().join("store"), d.path().join("stage"));
        std::fs::create_dir(&dest).unwrap();
        let mine = stage_dir(&stage);
        std::fs::create_dir_all(&mine).unwrap();
        // Another user's directory where this user's stage goes (made by them before this user came).
        if crate::private::euid() == 0 {
            std::os::unix::fs::chown(&mine, Some(65534), Some(65534)).unwrap();
            let e = validate(Some(&(table(&dest, &stage, ""), Origin::Default))).unwrap_err();
            assert_eq!(e.key, "writeback[0].stage");
            assert!(e.problem.contains("belongs to uid 65534") && e.problem.contains(&*mine.to_string_lossy()), "{e}");
            assert!(e.fix.contains("only you can write"), "{e}");
            std::os::unix::fs::chown(&mine, Some(0), Some(0)).unwrap();
        }
        // One that others can write.
        std::fs::set_permissions(&mine, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = validate(Some(&(table(&dest, &stage, ""), Origin::Default))).unwrap_err();
        assert_eq!(e.key, "writeback[0].stage");
        assert!(e.problem.contains("writable by other users"), "{e}");
        // A symbolic link in its place.
        std::fs::remove_dir(&mine).unwrap();
        let elsewhere = d.path().join("elsewhere");
        std::fs::create_dir(&elsewhere).unwrap();
        std::os::unix::fs::symlink(&elsewhere, &mine).unwrap();
        let e = validate(Some(&(table(&dest, &stage, ""), Origin::Default))).unwrap_err();
        assert!(e.problem.contains("symbolic link"), "{e}");
    }

    #[test]
    fn the_environment_form() {
        let o = Origin::Env("TIERSTORE_WRITEBACK".into());
        let v = from_env("/a:/b:1G:remote,/c:/d", &o).unwrap();
        let list = v.as_array().unwrap();
        assert_eq!(list.len(), 2);
        assert_eq!(list[0]["durability"].as_str(), Some("remote"));
        assert!(from_env("/a", &o).is_err());
    }
}
