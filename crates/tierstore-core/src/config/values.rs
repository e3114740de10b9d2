//! The values of the configuration, shared by every section (`[[tiers]]`, `[cluster]`, `[s3]`,
//! `[[writeback]]`, `[stream]`): where a value came from, the one error every invalid value becomes (the
//! key, the value, where it was set and the fix), and the parsing of sizes, durations and paths.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::fmt;
use std::path::{Path, PathBuf};

/// Where a configuration value came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    /// tierstore's built-in default.
    Default,
    /// A TOML file.
    File(PathBuf),
    /// An environment variable.
    Env(String),
    /// An argument of the Python API or the CLI.
    Argument,
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Default => write!(f, "default"),
            Origin::File(p) => write!(f, "{}", p.display()),
            Origin::Env(name) => write!(f, "${name}"),
            Origin::Argument => write!(f, "argument"),
        }
    }
}

/// A configuration value that is wrong, with what to do about it.
#[derive(Debug, thiserror::Error)]
#[error("{origin}: {key} = {value}: {problem}; {fix}")]
pub struct ConfigError {
    /// Where the bad value was set.
    pub origin: Origin,
    /// The key, as written in the TOML file (`tiers[1].quota`).
    pub key: String,
    /// The value as given.
    pub value: String,
    /// What is wrong with it.
    pub problem: String,
    /// What to do instead.
    pub fix: String,
}

/// A boolean key's value (`true`, `false`, and the words the environment spells them with), or the error
/// naming `key` and the `fix`.
pub(crate) fn boolean(origin: &Origin, key: &str, text: &str, fix: &str) -> Result<bool, ConfigError> {
    match text.trim().to_ascii_lowercase().as_str() {
        "true" | "1" | "yes" | "on" => Ok(true),
        "false" | "0" | "no" | "off" => Ok(false),
        _ => Err(bad(origin, key, text, "is not true or false", fix)),
    }
}

/// The one way every section builds its errors: where, which key, which value, what is wrong, the fix.
pub(crate) fn bad(origin: &Origin, key: &str, value: impl fmt::Display, problem: &str, fix: &str) -> ConfigError {
    ConfigError {
        origin: origin.clone(),
        key: key.to_string(),
        value: value.to_string(),
        problem: problem.to_string(),
        fix: fix.to_string(),
    }
}

/// `text` with the password of a URL's userinfo (`scheme://user:password@host/...`) written `***`, or
/// `None` when it carries none: a secret is never printed, not even by the error that refuses it.
pub(crate) fn without_password(text: &str) -> Option<String> {
    let (scheme, rest) = text.split_once("://")?;
    let at = rest.find('@')?;
    let (user, _) = rest[..at].split_once(':')?;
    if user.contains('/') {
        return None; // an `@` in the path (`s3://bucket/a:b@c`), not a userinfo
    }
    // Hidden up to the last `@`: a password may hold an `@` or a `/` of its own, and hiding a part of the
    // path too costs less than showing a part of the password.
    let last = rest.rfind('@').unwrap_or(at);
    Some(format!("{scheme}://{user}:***@{}", &rest[last + 1..]))
}

/// Which entry of a list of tables a value belongs to (`tiers[1]`, `writeback[0]`), and where the list
/// was set, for the messages of its keys.
pub(crate) struct At<'a> {
    pub(crate) origin: &'a Origin,
    /// The entry: `tiers[1]`.
    pub(crate) key: String,
}

impl At<'_> {
    /// The error of this entry's `field`.
    pub(crate) fn bad(&self, field: &str, value: impl fmt::Display, problem: &str, fix: &str) -> ConfigError {
        bad(self.origin, &format!("{}.{field}", self.key), value, problem, fix)
    }
}

/// How to write a size, for the errors of every key that takes one.
pub(crate) const SIZE_FIX: &str = "use a size like \"800G\", \"512MiB\" or a number of bytes";

/// Parses a size: a number of bytes, or a number with a unit. `K`, `M`, `G`, `T` and `KiB`… are powers
/// of 1024; `KB`, `MB`, `GB`, `TB` are powers of 1000.
pub fn parse_size(text: &str) -> Option<u64> {
    let t = text.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    if num.is_empty() {
        return None;
    }
    let n: f64 = num.parse().ok()?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        _ => return None,
    };
    let bytes = n * mult;
    if !bytes.is_finite() || bytes > u64::MAX as f64 || (unit.is_empty() && num.contains('.')) {
        return None;
    }
    Some(bytes.round() as u64)
}

/// Formats a byte count for people: `1.5 GiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut i = 0;
    while v >= 1024.0 && i < UNITS.len() - 1 {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[i])
    }
}

/// A duration: seconds as a number, or with a unit (`ms`, `s`, `m`, `h`).
pub(crate) fn parse_duration(text: &str) -> Option<std::time::Duration> {
    let t = text.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 0.001)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else if let Some(n) = t.strip_suffix('m') {
        (n, 60.0)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else {
        (t, 1.0)
    };
    let secs: f64 = num.trim().parse().ok()?;
    (secs.is_finite() && secs > 0.0).then(|| std::time::Duration::from_secs_f64(secs * scale))
}

/// A TOML value as the user wrote it: a string without its quotes, anything else as TOML writes it.
pub(crate) fn scalar(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// The known name that `word` most likely misspells, for a "did you mean".
pub(crate) fn closest<'a>(word: &str, choices: &[&'a str]) -> Option<&'a str> {
    choices.iter().copied().find(|c| {
        let (a, b) = (word.to_ascii_lowercase(), c.to_ascii_lowercase());
        a.contains(&b) || b.contains(&a) || edit_distance(&a, &b) <= 2
    })
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1];
        for (j, cb) in b.iter().enumerate() {
            let cost = usize::from(ca != *cb);
            cur.push((prev[j] + cost).min(prev[j + 1] + 1).min(cur[j] + 1));
        }
        prev = cur;
    }
    prev[b.len()]
}

/// The error for a key that no section knows, with the closest known one.
pub(crate) fn unknown_key(origin: &Origin, key: &str, value: &toml::Value, known: &[&str]) -> ConfigError {
    let fix = match closest(key.rsplit('.').next().unwrap_or(key), known) {
        Some(k) => format!("did you mean \"{k}\"? known keys: {}", known.join(", ")),
        None => format!("known keys: {}", known.join(", ")),
    };
    bad(origin, key, scalar(value), "unknown key", &fix)
}

/// `~` and `~/…` under the home directory.
pub(crate) fn expand_home(p: &str) -> PathBuf {
    match p.strip_prefix("~/") {
        Some(rest) => home_dir().join(rest),
        None if p == "~" => home_dir(),
        None => PathBuf::from(p),
    }
}

/// `$HOME`, or /tmp when it is unset.
pub(crate) fn home_dir() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// Size facts about the file system holding `path` (or its nearest existing ancestor).
pub struct FsInfo {
    /// Total bytes of the file system.
    pub total: u64,
    /// Bytes available to unprivileged users.
    pub free: u64,
    /// True for tmpfs/ramfs.
    pub in_memory: bool,
}

/// Reads [`FsInfo`] for `path`, walking up to the first ancestor that exists.
// statfs field types differ between libc targets (u64 here, u32 or i32 elsewhere): the casts are for them.
#[allow(clippy::unnecessary_cast)]
pub fn fs_info(path: &Path) -> std::io::Result<FsInfo> {
    let mut p = path;
    while !p.exists() {
        p = p.parent().unwrap_or(Path::new("/"));
    }
    let c = std::ffi::CString::new(std::os::unix::ffi::OsStrExt::as_bytes(p.as_os_str()))
        .map_err(|_| std::io::Error::from(std::io::ErrorKind::InvalidInput))?;
    let mut s = std::mem::MaybeUninit::<libc::statfs>::zeroed();
    // SAFETY: statfs writes into `s` on success.
    if unsafe { libc::statfs(c.as_ptr(), s.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let s = unsafe { s.assume_init() };
    const TMPFS_MAGIC: i64 = 0x0102_1994;
    const RAMFS_MAGIC: i64 = 0x8584_58f6;
    let bsize = s.f_bsize as u64;
    Ok(FsInfo {
        total: s.f_blocks as u64 * bsize,
        free: s.f_bavail as u64 * bsize,
        in_memory: matches!(s.f_type as i64, TMPFS_MAGIC | RAMFS_MAGIC),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_password_in_a_url_is_never_shown() {
        let shown = |t: &str| without_password(t);
        assert_eq!(shown("https://ann:hunter2@host:8080/data").as_deref(), Some("https://ann:***@host:8080/data"));
        // A password with an `@` or a `/` of its own is hidden whole.
        assert_eq!(shown("s3://ann:p@ss/w@bucket/x").as_deref(), Some("s3://ann:***@bucket/x"));
        // A user without a password, an `@` in the path, and a plain URL are not userinfo with a secret.
        assert_eq!(shown("https://ann@host/x"), None);
        assert_eq!(shown("s3://bucket/model:v@2"), None);
        assert_eq!(shown("az://container@account.dfs.core.windows.net/x"), None);
        assert_eq!(shown("/data/set"), None);
    }

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB"), Some(512 << 20));
        assert_eq!(parse_size("64G"), Some(64 << 30));
        assert_eq!(parse_size("1.5k"), Some(1536));
        assert_eq!(parse_size("2GB"), Some(2_000_000_000));
        assert_eq!(parse_size("4096"), Some(4096));
        assert_eq!(parse_size("80X"), None);
        assert_eq!(parse_size(""), None);
        assert_eq!(parse_size("G"), None);
        assert_eq!(parse_size("1.5"), None);
        assert_eq!(format_size(1536 << 20), "1.5 GiB");
    }
}
