//! `[[tiers]]`: the cache tiers, fastest first, each a directory with a quota, in RAM or on a local disk.
//!
//! ```toml
//! [[tiers]]
//! path = "/dev/shm/tierstore"   # a directory outside the source (created if missing)
//! quota = "8G"                  # bytes of copies at most (default: half of what is free at start)
//! kind = "memory"               # memory | local (default: detected from the file system)
//! ```
//!
//! `$TIERSTORE_TIERS` replaces the file's list: `PATH[:QUOTA]`, comma separated.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::path::{Path, PathBuf};

use super::settings::{self, keys_of, Table};
use super::values::{
    bad, expand_home, format_size, fs_info, home_dir, parse_size, scalar, unknown_key, At, ConfigError, FsInfo, Origin,
};

/// Whether a tier lives in RAM or on a local disk.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TierKind {
    /// A RAM-backed directory (tmpfs, such as /dev/shm).
    Memory,
    /// A directory on a local disk (NVMe, SSD).
    Local,
}

impl TierKind {
    /// The name used in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            TierKind::Memory => "memory",
            TierKind::Local => "local",
        }
    }
}

/// One cache tier as configured.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TierConfig {
    /// The directory that holds the tier.
    pub path: PathBuf,
    /// Most bytes of cached copies the tier may hold.
    pub quota: u64,
    /// RAM or disk.
    pub kind: TierKind,
}

/// One tier as written, before it is checked.
pub(crate) struct RawTier {
    pub(crate) path: String,
    pub(crate) quota: Option<String>,
    pub(crate) kind: Option<String>,
}

/// The `[[tiers]]` tables of a file, checked for their keys and a path each.
pub(crate) fn from_toml(origin: &Origin, key: &str, value: &toml::Value) -> Result<Vec<RawTier>, ConfigError> {
    let fix = "write [[tiers]] tables with path = \"/dev/shm/tierstore\" and quota = \"8G\"";
    let list = value.as_array().ok_or_else(|| bad(origin, key, value, "must be a list of tables", fix))?;
    let mut tiers = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let k = format!("tiers[{i}]");
        let t = item.as_table().ok_or_else(|| bad(origin, &k, item, "must be a table", fix))?;
        for (tk, tv) in t {
            if settings::find(Table::Tiers, tk).is_none() {
                return Err(unknown_key(origin, &format!("{k}.{tk}"), tv, &keys_of(Table::Tiers)));
            }
        }
        let path = match t.get("path") {
            Some(toml::Value::String(p)) => p,
            Some(other) => {
                let fix = "write the path as a string: path = \"/dev/shm/tierstore\"";
                return Err(bad(origin, &format!("{k}.path"), other, "is not a path (a string)", fix));
            }
            None => return Err(bad(origin, &format!("{k}.path"), "(missing)", "every tier needs a path", fix)),
        };
        tiers.push(RawTier {
            path: path.to_string(),
            quota: t.get("quota").map(scalar),
            kind: t.get("kind").map(scalar),
        });
    }
    Ok(tiers)
}

/// `$TIERSTORE_TIERS`: `PATH[:QUOTA]`, comma separated.
pub(crate) fn from_env(text: &str, origin: &Origin) -> Result<Vec<RawTier>, ConfigError> {
    let fix = "write TIERSTORE_TIERS=\"/dev/shm/tierstore:8G,/nvme/tierstore:500G\"";
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let item = item.trim();
            match item.rsplit_once(':') {
                Some((path, quota)) if !path.is_empty() && (parse_size(quota).is_some() || share(quota).is_some()) => {
                    Ok(RawTier { path: path.to_string(), quota: Some(quota.to_string()), kind: None })
                }
                Some((_, quota)) if !quota.contains('/') => {
                    Err(bad(origin, "tiers", item, &format!("quota \"{quota}\" is not a size or a share"), QUOTA_FIX))
                }
                _ if item.starts_with('/') || item.starts_with('~') || item.starts_with('.') => {
                    Ok(RawTier { path: item.to_string(), quota: None, kind: None })
                }
                _ => Err(bad(origin, "tiers", item, "is not PATH or PATH:QUOTA", fix)),
            }
        })
        .collect()
}

/// How to write a quota, for messages.
const QUOTA_FIX: &str =
    "use a size like \"800G\", \"512MiB\" or a number of bytes, or a share of the file system like \"50%\"";

/// A quota written as a bare number below this is refused: one without its unit (`:50` for `:50G` or
/// `:50%`) is bytes, too few for a tier. `"50000B"` says bytes are meant.
const BARE_QUOTA_MIN: u64 = 1 << 20;

/// The percentage a quota like `"50%"` gives: above 0, at most 100.
fn share(text: &str) -> Option<f64> {
    let n: f64 = text.trim().strip_suffix('%')?.trim().parse().ok()?;
    (n > 0.0 && n <= 100.0).then_some(n)
}

/// The directory of the default tier: `$XDG_CACHE_HOME/tierstore` or `~/.cache/tierstore`.
pub fn default_tier_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => PathBuf::from(x).join("tierstore"),
        _ => home_dir().join(".cache").join("tierstore"),
    }
}

/// The tier used when none is configured: the default directory, with a quota from its free space.
pub(crate) fn default_raw() -> Vec<RawTier> {
    vec![RawTier { path: default_tier_dir().to_string_lossy().into_owned(), quota: None, kind: None }]
}

/// The tiers of the configuration, checked: each directory created and writable, outside the source and
/// apart from the others, its kind detected or checked, its quota parsed (half of the free space when
/// none is given) and within its file system.
pub(crate) fn validate(
    raw_tiers: &[RawTier],
    tiers_origin: &Origin,
    source: &Path,
) -> Result<Vec<TierConfig>, ConfigError> {
    if raw_tiers.is_empty() {
        return Err(bad(tiers_origin, "tiers", "[]", "no cache tier", "configure at least one tier directory"));
    }
    let mut tiers: Vec<TierConfig> = Vec::new();
    for (i, rt) in raw_tiers.iter().enumerate() {
        let at = At { origin: tiers_origin, key: format!("tiers[{i}]") };
        let path = tier_dir(&at, &rt.path, source, &tiers)?;
        let info =
            fs_info(&path).map_err(|e| at.bad("path", &rt.path, &format!("statfs failed ({e})"), "check the path"))?;
        let kind = tier_kind(&at, rt.kind.as_deref(), &path, &info)?;
        let quota = tier_quota(&at, rt.quota.as_deref(), &path, &info)?;
        tiers.push(TierConfig { path, quota, kind });
    }
    Ok(tiers)
}

/// A tier's directory, absolute and resolved: this user's directory beneath it created 0700 (or
/// checked), writable, outside the source and not one of the `earlier` tiers'.
fn tier_dir(at: &At<'_>, written: &str, source: &Path, earlier: &[TierConfig]) -> Result<PathBuf, ConfigError> {
    let path = expand_home(written);
    let path = std::path::absolute(&path).unwrap_or(path);
    // The tier path may be shared by several users (`/dev/shm/tierstore`): this user's copies live in
    // a directory of their own beneath it, created 0700 or checked (see `private`).
    let mine = crate::private::user_dir(&path);
    crate::private::ensure_dir(&mine).map_err(|e| {
        // `ensure_dir` says "cannot create" when mkdir failed, and why it refused a directory otherwise.
        let (problem, fix) = if e.to_string().starts_with("cannot create") {
            ("cannot be created", "give a directory you can write to")
        } else {
            ("cannot be used", "give a directory only you can write to, or one that root shares sticky (mode 1777)")
        };
        at.bad("path", written, &format!("{problem} ({e})"), fix)
    })?;
    let path = std::fs::canonicalize(&path).unwrap_or(path);
    let probe = crate::private::user_dir(&path).join(format!(".tierstore-probe-{}", crate::process::pid()));
    if let Err(e) = std::fs::write(&probe, b"") {
        return Err(at.bad("path", written, &format!("is not writable ({e})"), "give a directory you can write to"));
    }
    let _ = std::fs::remove_file(&probe);
    if path.starts_with(source) || source.starts_with(&path) {
        return Err(at.bad(
            "path",
            written,
            &format!("overlaps the source {}", source.display()),
            "put cache tiers outside the source directory",
        ));
    }
    if let Some(prev) = earlier.iter().position(|t| t.path == path) {
        return Err(at.bad(
            "path",
            written,
            &format!("is the same directory as tiers[{prev}]"),
            "give each tier its own directory",
        ));
    }
    Ok(path)
}

/// A tier's kind as written, checked against its file system; detected when not written.
fn tier_kind(at: &At<'_>, written: Option<&str>, path: &Path, info: &FsInfo) -> Result<TierKind, ConfigError> {
    match written {
        None if info.in_memory => Ok(TierKind::Memory),
        None => Ok(TierKind::Local),
        Some("memory") if info.in_memory => Ok(TierKind::Memory),
        Some("memory") => Err(at.bad(
            "kind",
            "memory",
            &format!("{} is not on a RAM-backed file system", path.display()),
            "use a directory under /dev/shm, or kind = \"local\"",
        )),
        Some("local") => Ok(TierKind::Local),
        Some(other) => Err(at.bad(
            "kind",
            other,
            "unknown tier kind",
            "use \"memory\" or \"local\" (or leave it out to detect it)",
        )),
    }
}

/// A tier's quota in bytes: a size, or a share of its file system, within the file system's size.
fn tier_quota(at: &At<'_>, written: Option<&str>, path: &Path, info: &FsInfo) -> Result<u64, ConfigError> {
    let Some(q) = written else {
        // Half of what is free now: leaves room for everything else on the node.
        return Ok((info.free / 2).max(1));
    };
    if let Some(pct) = share(q) {
        // A share of the file system's size: one configuration fits nodes of any size.
        if info.total == 0 {
            return Err(at.bad(
                "quota",
                format!("\"{q}\""),
                &format!("cannot be a share: the size of the file system of {} is unknown", path.display()),
                "give a size such as \"8G\"",
            ));
        }
        return Ok(((info.total as f64 * pct / 100.0) as u64).max(1));
    }
    let quota = parse_size(q).ok_or_else(|| {
        let why = if q.trim().ends_with('%') { "not a share above 0% and at most 100%" } else { "not a size" };
        at.bad("quota", format!("\"{q}\""), why, QUOTA_FIX)
    })?;
    if quota == 0 {
        return Err(at.bad(
            "quota",
            format!("\"{q}\""),
            "a tier of zero bytes caches nothing",
            "give a positive size, or remove the tier",
        ));
    }
    let number = q.trim();
    if quota < BARE_QUOTA_MIN && number.bytes().all(|b| b.is_ascii_digit()) {
        // `--tier /dev/shm/t:50` is 50 bytes: a share or gigabytes were surely meant.
        let meant = if quota <= 100 { format!("\"{number}%\" or \"{number}G\"") } else { format!("\"{number}G\"") };
        return Err(at.bad(
            "quota",
            format!("\"{q}\""),
            &format!("is {number} bytes, as a number without a unit is: too small for a cache tier"),
            &format!("did you mean {meant}? write the unit (\"{number}B\" if bytes are meant)"),
        ));
    }
    if info.total > 0 && quota > info.total {
        return Err(at.bad(
            "quota",
            format!("\"{q}\""),
            &format!("exceeds the size of the file system ({})", format_size(info.total)),
            &format!("use at most {}", format_size(info.total)),
        ));
    }
    Ok(quota)
}
