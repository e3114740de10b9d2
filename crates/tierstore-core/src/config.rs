//! Configuration: a TOML file, overridden by `TIERSTORE_*` environment variables, overridden by API
//! arguments. Every value remembers where it came from (`tierstore config show`), and every invalid value
//! fails at start with one message that names the key, the value, where it was set and the fix.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

use crate::cluster::{ClusterConfig, Sharing, DEFAULT_PORT};
use crate::placement::Policy;
use crate::source::s3_config::{is_url, S3Config, S3_KEYS};

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

pub(crate) fn bad(origin: &Origin, key: &str, value: impl fmt::Display, problem: &str, fix: &str) -> ConfigError {
    ConfigError {
        origin: origin.clone(),
        key: key.to_string(),
        value: value.to_string(),
        problem: problem.to_string(),
        fix: fix.to_string(),
    }
}

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

/// How a cached copy is checked when it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Size and mtime of the copy against the index (one `fstat`, free): catches truncation and writes.
    Metadata,
    /// Also a blake3 hash of the whole copy: catches silent bit rot, at the cost of hashing every open.
    Checksum,
}

/// When a cached copy is checked against the source's current version.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Revalidate {
    /// On every open, with one `stat` (or `HEAD`) of the source: a changed file is never served stale.
    Always,
    /// Never: the dataset is read-only for the life of the cache (MONARCH's assumption). Later epochs send
    /// no operation at all to the source; writes made through tierstore still invalidate what they change.
    Never,
    /// Bounded staleness, as NFS's attribute cache or JuiceFS's `--attr-cache`: a copy confirmed against
    /// the source within this long is used without asking; an older one is confirmed together with the
    /// rest of its directory (one listing, see `cache/confirm.rs`), so that a change on the source is
    /// seen within the duration and a warm epoch costs a few requests per directory, not one per open.
    Within(std::time::Duration),
}

impl Revalidate {
    /// How the mode is written in the configuration (`"always"`, `"never"`, `"30s"`).
    pub fn name(&self) -> String {
        match self {
            Revalidate::Always => "always".into(),
            Revalidate::Never => "never".into(),
            Revalidate::Within(d) => {
                let ms = d.as_millis();
                if ms % 1000 == 0 {
                    format!("{}s", ms / 1000)
                } else {
                    format!("{ms}ms")
                }
            }
        }
    }
}

/// The effective configuration of a cache.
#[derive(Clone, Debug)]
pub struct Config {
    /// The source directory, symlinks resolved: the truth, never written by the read path.
    pub source: PathBuf,
    /// The source as it was configured (absolute), when that spelling goes through a symlink: paths under
    /// it name source files too.
    pub source_alias: Option<PathBuf>,
    /// Cache tiers, fastest first.
    pub tiers: Vec<TierConfig>,
    /// Placement and eviction policy.
    pub policy: Policy,
    /// Threads of the background copy pool.
    pub threads: usize,
    /// Files up to this size are fetched whole into memory and handed to the reader at once; larger ones
    /// are streamed into the tier while the reader follows the copy.
    pub inline_max: u64,
    /// How cached copies are checked on open.
    pub verify: Verify,
    /// Whether every open checks the source's current version (one `stat` of the source).
    pub revalidate: Revalidate,
    /// How the nodes of a job share their caches, and who they are.
    pub cluster: ClusterConfig,
    /// The object store, when the source is one (`source = "s3://bucket/prefix"`); `source` then holds
    /// the URL.
    pub s3: Option<S3Config>,
    /// Where each top-level key's value came from.
    pub origins: BTreeMap<String, Origin>,
    /// Write-back destinations (`[[writeback]]`): writes under them are staged on the node first.
    pub writeback: Vec<crate::writeback::Destination>,
}

/// Values given by the API or CLI; `None` leaves the file or environment value in place.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// A TOML file to read instead of `$TIERSTORE_CONFIG` or `./tierstore.toml`.
    pub config_file: Option<PathBuf>,
    /// The source directory.
    pub source: Option<String>,
    /// Tiers as `(path, quota)` pairs; quota `None` means "derive from free space".
    pub tiers: Option<Vec<(String, Option<String>)>>,
    /// Placement policy name.
    pub policy: Option<String>,
    /// Background thread count.
    pub threads: Option<String>,
    /// Inline fetch limit (a size).
    pub inline_max: Option<String>,
    /// Verification mode name.
    pub verify: Option<String>,
    /// Revalidation mode name.
    pub revalidate: Option<String>,
    /// `[s3]` settings (key, value), over the file's.
    pub s3: Vec<(String, String)>,
}

/// The environment variables tierstore reads; any other `TIERSTORE_*` name is a typo and an error.
pub const ENV_VARS: &[&str] = &[
    "TIERSTORE_CONFIG",
    "TIERSTORE_SOURCE",
    "TIERSTORE_TIERS",
    "TIERSTORE_POLICY",
    "TIERSTORE_THREADS",
    "TIERSTORE_INLINE_MAX",
    "TIERSTORE_VERIFY",
    "TIERSTORE_REVALIDATE",
    "TIERSTORE_LOG",
    "TIERSTORE_MODELS",
    "TIERSTORE_SHARING",
    "TIERSTORE_PEERS",
    "TIERSTORE_NODE",
    "TIERSTORE_PORT",
    "TIERSTORE_LISTEN",
    "TIERSTORE_PEER_CONNECT_MS",
    "TIERSTORE_PEER_DEADLINE_MS",
    "TIERSTORE_TOKEN_FILE",
    "TIERSTORE_REGISTRY",
    "TIERSTORE_JOB",
    // The node agent's model streams: the Redis versions are announced in, versions kept, where kept.
    "TIERSTORE_STREAM_REDIS",
    "TIERSTORE_STREAM_KEEP",
    "TIERSTORE_STREAM_DIR",
    // `tierstore run --order`: the job's order, its budget, and the read marks the launcher hands the shim.
    "TIERSTORE_ORDER",
    "TIERSTORE_ORDER_BUDGET",
    "TIERSTORE_ORDER_MARKS",
    // Write-back destinations, `DEST:STAGE[:QUOTA[:DURABILITY]]`, comma separated (over the file's list).
    "TIERSTORE_WRITEBACK",
    // Set by `tierstore run` for a job with write-back destinations and no source: the shim only stages.
    "TIERSTORE_WRITEBACK_ONLY",
];

const SIZE_FIX: &str = "use a size like \"800G\", \"512MiB\" or a number of bytes";

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

/// The raw, unvalidated values of the TOML file.
#[derive(Default)]
struct Raw {
    source: Option<(String, Origin)>,
    tiers: Option<(Vec<RawTier>, Origin)>,
    policy: Option<(String, Origin)>,
    threads: Option<(String, Origin)>,
    inline_max: Option<(String, Origin)>,
    verify: Option<(String, Origin)>,
    revalidate: Option<(String, Origin)>,
    /// The source as resolved by the parent process, with the spelling it was resolved from.
    resolved: Option<(String, String)>,
    /// `[cluster]` keys, each with where it was set.
    cluster: BTreeMap<&'static str, (toml::Value, Origin)>,
    /// `[s3]` keys, each with where it was set.
    s3: BTreeMap<&'static str, (toml::Value, Origin)>,
    /// Slurm's node list of the job, when the process runs under Slurm.
    slurm_nodes: Option<String>,
    /// Slurm's job id, which names the job in a registry by default.
    slurm_job: Option<String>,
    /// `[[writeback]]` tables, or `$TIERSTORE_WRITEBACK` in their form (see `crate::writeback::config`).
    writeback: Option<(toml::Value, Origin)>,
    /// `[stream]` keys, each with where it was set.
    stream: BTreeMap<&'static str, (toml::Value, Origin)>,
}

struct RawTier {
    path: String,
    quota: Option<String>,
    kind: Option<String>,
}

const TOP_KEYS: &[&str] = &[
    "source",
    "tiers",
    "policy",
    "threads",
    "inline_max",
    "verify",
    "revalidate",
    "cluster",
    "s3",
    "writeback",
    "stream",
];
/// The keys of the `[stream]` table: the node agent's side of model streaming.
pub const STREAM_KEYS: &[&str] = &["redis", "keep", "dir"];
const CLUSTER_KEYS: &[&str] = &["sharing", "peers", "registry", "job", "node", "port", "listen", "token_file"];
const TIER_KEYS: &[&str] = &["path", "quota", "kind"];

fn scalar(v: &toml::Value) -> String {
    match v {
        toml::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn closest<'a>(word: &str, choices: &[&'a str]) -> Option<&'a str> {
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

fn unknown_key(origin: &Origin, key: &str, value: &toml::Value, known: &[&str]) -> ConfigError {
    let fix = match closest(key.rsplit('.').next().unwrap_or(key), known) {
        Some(k) => format!("did you mean \"{k}\"? known keys: {}", known.join(", ")),
        None => format!("known keys: {}", known.join(", ")),
    };
    bad(origin, key, scalar(value), "unknown key", &fix)
}

fn read_file(path: &Path, raw: &mut Raw) -> Result<(), ConfigError> {
    let origin = Origin::File(path.to_path_buf());
    let text = std::fs::read_to_string(path).map_err(|e| {
        bad(&origin, "file", path.display(), &format!("cannot be read ({e})"), "check the path and its permissions")
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| {
        bad(&origin, "file", path.display(), &format!("is not valid TOML: {}", e.message()), "fix the syntax")
    })?;
    for (key, value) in &table {
        let text_of = |v: &toml::Value| -> Result<String, ConfigError> {
            match v {
                toml::Value::String(_) | toml::Value::Integer(_) | toml::Value::Float(_) => Ok(scalar(v)),
                _ => Err(bad(&origin, key, v, "must be a string or a number", "write a single value")),
            }
        };
        match key.as_str() {
            "source" => raw.source = Some((text_of(value)?, origin.clone())),
            "policy" => raw.policy = Some((text_of(value)?, origin.clone())),
            "threads" => raw.threads = Some((text_of(value)?, origin.clone())),
            "inline_max" => raw.inline_max = Some((text_of(value)?, origin.clone())),
            "verify" => raw.verify = Some((text_of(value)?, origin.clone())),
            "revalidate" => raw.revalidate = Some((text_of(value)?, origin.clone())),
            "tiers" => {
                let fix = "write [[tiers]] tables with path = \"/dev/shm/tierstore\" and quota = \"8G\"";
                let list = value.as_array().ok_or_else(|| bad(&origin, key, value, "must be a list of tables", fix))?;
                let mut tiers = Vec::new();
                for (i, item) in list.iter().enumerate() {
                    let k = format!("tiers[{i}]");
                    let t = item.as_table().ok_or_else(|| bad(&origin, &k, item, "must be a table", fix))?;
                    for (tk, tv) in t {
                        if !TIER_KEYS.contains(&tk.as_str()) {
                            return Err(unknown_key(&origin, &format!("{k}.{tk}"), tv, TIER_KEYS));
                        }
                    }
                    let path = t.get("path").and_then(|p| p.as_str()).ok_or_else(|| {
                        bad(&origin, &format!("{k}.path"), "(missing)", "every tier needs a path", fix)
                    })?;
                    tiers.push(RawTier {
                        path: path.to_string(),
                        quota: t.get("quota").map(scalar),
                        kind: t.get("kind").map(scalar),
                    });
                }
                raw.tiers = Some((tiers, origin.clone()));
            }
            "cluster" => {
                let fix = "write a [cluster] table: sharing = \"partitioned\", peers = [\"gpu[001-016]\"]";
                let t = value.as_table().ok_or_else(|| bad(&origin, key, value, "must be a table", fix))?;
                for (ck, cv) in t {
                    let Some(&name) = CLUSTER_KEYS.iter().find(|k| **k == ck.as_str()) else {
                        return Err(unknown_key(&origin, &format!("cluster.{ck}"), cv, CLUSTER_KEYS));
                    };
                    raw.cluster.insert(name, (cv.clone(), origin.clone()));
                }
            }
            "s3" => {
                let fix = "write an [s3] table: endpoint = \"http://127.0.0.1:8333\", region = \"us-east-1\"";
                let t = value.as_table().ok_or_else(|| bad(&origin, key, value, "must be a table", fix))?;
                for (sk, sv) in t {
                    let Some(&name) = S3_KEYS.iter().find(|k| **k == sk.as_str()) else {
                        return Err(unknown_key(&origin, &format!("s3.{sk}"), sv, S3_KEYS));
                    };
                    raw.s3.insert(name, (sv.clone(), origin.clone()));
                }
            }
            "writeback" => raw.writeback = Some((value.clone(), origin.clone())),
            "stream" => {
                let fix = "write a [stream] table: redis = \"redis://head-node:6379\", keep = 2";
                let t = value.as_table().ok_or_else(|| bad(&origin, key, value, "must be a table", fix))?;
                for (sk, sv) in t {
                    let Some(&name) = STREAM_KEYS.iter().find(|k| **k == sk.as_str()) else {
                        return Err(unknown_key(&origin, &format!("stream.{sk}"), sv, STREAM_KEYS));
                    };
                    raw.stream.insert(name, (sv.clone(), origin.clone()));
                }
            }
            other => return Err(unknown_key(&origin, other, value, TOP_KEYS)),
        }
    }
    Ok(())
}

/// Validates the `[s3]` keys into `c` (the bucket and prefix parsed from the source).
fn validate_s3(mut c: S3Config, keys: &BTreeMap<&'static str, (toml::Value, Origin)>) -> Result<S3Config, ConfigError> {
    for (&k, (v, o)) in keys {
        let text = v.as_str().map_or_else(|| scalar(v), str::to_owned);
        let key = format!("s3.{k}");
        match k {
            "timeout" | "connect_timeout" => {
                let d = parse_duration(&text).ok_or_else(|| {
                    bad(o, &key, &text, "is not a duration", "use seconds (30) or a unit: \"500ms\", \"30s\", \"2m\"")
                })?;
                if k == "timeout" {
                    c.timeout = d;
                } else {
                    c.connect_timeout = d;
                }
            }
            "retries" => {
                c.retries =
                    text.parse().ok().filter(|n| *n <= 100).ok_or_else(|| {
                        bad(o, &key, &text, "is not a retry count", "use a whole number from 0 to 100")
                    })?;
            }
            "range_size" => {
                c.range_size = parse_size(&text).filter(|n| *n >= 64 << 10).ok_or_else(|| {
                    bad(o, &key, &text, "is not a range size of at least 64 KiB", "use a size like \"8M\"")
                })?;
            }
            "ranges_in_flight" => {
                c.ranges_in_flight = text.parse().ok().filter(|n| (1..=256).contains(n)).ok_or_else(|| {
                    bad(o, &key, &text, "is not a number of ranges", "use a whole number from 1 to 256")
                })?;
            }
            "endpoint" if !(text.starts_with("http://") || text.starts_with("https://")) => {
                return Err(bad(o, &key, &text, "is not an http(s) URL", "write http://HOST:PORT or https://HOST"));
            }
            _ => {
                c.settings.insert(k.to_string(), text);
            }
        }
    }
    Ok(c)
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

/// Validates the `[cluster]` keys (see [`crate::cluster`]).
fn validate_cluster(
    keys: &BTreeMap<&'static str, (toml::Value, Origin)>,
    slurm_nodes: Option<&str>,
    slurm_job: Option<&str>,
) -> Result<ClusterConfig, ConfigError> {
    let text = |k: &str| keys.get(k).map(|(v, o)| (v.as_str().map_or_else(|| scalar(v), str::to_owned), o));
    let mut c = ClusterConfig { port: DEFAULT_PORT, listen: "127.0.0.1".into(), ..Default::default() };
    if let Some((v, o)) = text("sharing") {
        c.sharing = Sharing::parse(&v).ok_or_else(|| {
            bad(o, "cluster.sharing", &v, "is not a sharing mode", "use \"off\", \"inclusive\" or \"partitioned\"")
        })?;
    }
    if let Some((v, o)) = text("port") {
        c.port = v.parse().ok().filter(|p| *p > 0).ok_or_else(|| {
            bad(o, "cluster.port", &v, "is not a TCP port", "use a number from 1 to 65535, e.g. 7078")
        })?;
    }
    if let Some((v, o)) = text("listen") {
        if v.parse::<std::net::IpAddr>().is_err() {
            return Err(bad(
                o,
                "cluster.listen",
                &v,
                "is not an IP address",
                "use 0.0.0.0, 127.0.0.1 or this node's address",
            ));
        }
        c.listen = v;
    }
    let token_origin = text("token_file").map(|(v, o)| {
        c.token_file = Some(expand_home(&v));
        (v, o.clone())
    });
    if let Some((v, o)) = text("registry") {
        if !(v.starts_with("redis://") || v.starts_with("rediss://") || v.starts_with("redis+unix://")) {
            return Err(bad(o, "cluster.registry", &v, "is not a Redis URL", "write redis://HOST:6379"));
        }
        c.registry = Some(v);
    }
    c.job = match text("job") {
        Some((v, _)) => v,
        None => slurm_job.map_or_else(|| "tierstore".to_string(), |id| format!("slurm-{id}")),
    };
    if c.sharing == Sharing::Off {
        return Ok(c);
    }
    if let (Some(path), Some((v, o))) = (&c.token_file, &token_origin) {
        // Read now, so that a missing token is one message at start rather than a failure deep in the
        // first read that crosses nodes.
        if let Err(problem) = crate::cluster::read_token(path) {
            return Err(bad(o, "cluster.token_file", v, &problem, crate::cluster::TOKEN_FIX));
        }
    }
    if c.registry.is_some() && !keys.contains_key("peers") {
        // The members are whoever registered: the agent keeps the list, and every process asks it.
        c.node = match text("node") {
            Some((v, _)) => v,
            None => crate::cluster::hostname(),
        };
        return Ok(c);
    }
    let fix = "list the job's nodes in [cluster] peers, TIERSTORE_PEERS (e.g. \"gpu[001-016]\"), or run under Slurm";
    let (entries, origin) = match keys.get("peers") {
        Some((toml::Value::Array(list), o)) => (list.iter().map(scalar_text).collect(), o.clone()),
        Some((toml::Value::String(s), o)) => (vec![s.clone()], o.clone()),
        Some((other, o)) => return Err(bad(o, "cluster.peers", scalar(other), "must be a list of hosts", fix)),
        None => match slurm_nodes {
            Some(s) => (vec![s.to_string()], Origin::Env("SLURM_JOB_NODELIST".into())),
            None => {
                return Err(bad(
                    &Origin::Default,
                    "cluster.peers",
                    "(unset)",
                    "sharing is on but no node is listed",
                    fix,
                ))
            }
        },
    };
    c.members = crate::cluster::members_of(&entries, c.port)
        .map_err(|e| bad(&origin, "cluster.peers", entries.join(","), &e.problem, fix))?;
    let (node, node_origin) = match text("node") {
        Some((v, o)) => (v, o.clone()),
        None => (crate::cluster::hostname(), Origin::Default),
    };
    c.me = crate::cluster::find_member(&c.members, &node, c.port);
    if c.me.is_none() && node_origin != Origin::Default {
        let names: Vec<String> = c.members.iter().take(8).map(|m| m.address()).collect();
        return Err(bad(
            &node_origin,
            "cluster.node",
            &node,
            "is not one of the members",
            &format!("name this node as the member list does (host or host:port), e.g. {}", names.join(", ")),
        ));
    }
    c.node = node;
    Ok(c)
}

fn scalar_text(v: &toml::Value) -> String {
    v.as_str().map_or_else(|| scalar(v), str::to_owned)
}

fn parse_env_tiers(text: &str, origin: &Origin) -> Result<Vec<RawTier>, ConfigError> {
    let fix = "write TIERSTORE_TIERS=\"/dev/shm/tierstore:8G,/nvme/tierstore:500G\"";
    text.split(',')
        .filter(|s| !s.trim().is_empty())
        .map(|item| {
            let item = item.trim();
            match item.rsplit_once(':') {
                Some((path, quota)) if !path.is_empty() && parse_size(quota).is_some() => {
                    Ok(RawTier { path: path.to_string(), quota: Some(quota.to_string()), kind: None })
                }
                Some((_, quota)) if !quota.contains('/') => {
                    Err(bad(origin, "tiers", item, &format!("quota \"{quota}\" is not a size"), SIZE_FIX))
                }
                _ if item.starts_with('/') || item.starts_with('~') || item.starts_with('.') => {
                    Ok(RawTier { path: item.to_string(), quota: None, kind: None })
                }
                _ => Err(bad(origin, "tiers", item, "is not PATH or PATH:QUOTA", fix)),
            }
        })
        .collect()
}

fn expand_home(p: &str) -> PathBuf {
    match p.strip_prefix("~/") {
        Some(rest) => home_dir().join(rest),
        None if p == "~" => home_dir(),
        None => PathBuf::from(p),
    }
}

fn home_dir() -> PathBuf {
    std::env::var_os("HOME").map(PathBuf::from).unwrap_or_else(|| PathBuf::from("/tmp"))
}

/// The directory of the default tier: `$XDG_CACHE_HOME/tierstore` or `~/.cache/tierstore`.
pub fn default_tier_dir() -> PathBuf {
    match std::env::var_os("XDG_CACHE_HOME") {
        Some(x) if !x.is_empty() => PathBuf::from(x).join("tierstore"),
        _ => home_dir().join(".cache").join("tierstore"),
    }
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

/// One scalar setting: its default when unset, else its parsed value; either way, where it came from
/// is recorded for `tierstore config show`.
fn setting<T>(
    origins: &mut BTreeMap<String, Origin>,
    key: &str,
    raw: Option<(String, Origin)>,
    default: impl FnOnce() -> T,
    parse: impl FnOnce(&str, &Origin) -> Result<T, ConfigError>,
) -> Result<T, ConfigError> {
    let (value, origin) = match raw {
        None => (default(), Origin::Default),
        Some((text, origin)) => (parse(&text, &origin)?, origin),
    };
    origins.insert(key.to_string(), origin);
    Ok(value)
}

/// Set by `tierstore run` for the processes it starts: the source as configured and the same directory
/// with symlinks resolved. A process that finds its own configured source there takes the resolved
/// directory as it is, so a job checks and resolves its source once, not once per process (each check
/// costs the shared store a few metadata operations, and DataLoader workers start every epoch).
pub const RESOLVED_FROM_ENV: &str = "TIERSTORE_RESOLVED_SOURCE_OF";
/// See [`RESOLVED_FROM_ENV`].
pub const RESOLVED_ENV: &str = "TIERSTORE_RESOLVED_SOURCE";

fn resolved_by_parent(given: &Path, resolved: Option<&(String, String)>) -> Option<PathBuf> {
    let (from, to) = resolved?;
    (Path::new(from) == given && Path::new(to).is_absolute()).then(|| PathBuf::from(to))
}

fn check_source_dir(source: &Path, origin: &Origin, text: &str) -> Result<(), ConfigError> {
    match std::fs::metadata(source) {
        Ok(m) if m.is_dir() => Ok(()),
        Ok(_) => Err(bad(origin, "source", text, "is not a directory", "give the dataset's directory")),
        Err(e) => Err(bad(origin, "source", text, &format!("cannot be read ({e})"), "give an existing directory")),
    }
}

/// What tierstore reads of Slurm's environment: the job's nodes (the members, unless listed) and its id
/// (the job's name in a shared registry, unless `job` is set), so that two jobs on one Redis stay apart.
const SLURM_VARS: &[&str] = &["SLURM_JOB_NODELIST", "SLURM_JOB_ID"];

impl Config {
    /// The environment that lets child processes skip checking and resolving the source again (see
    /// [`RESOLVED_FROM_ENV`]).
    pub fn resolved_env(&self) -> Vec<(&'static str, PathBuf)> {
        let given = self.source_alias.clone().unwrap_or_else(|| self.source.clone());
        vec![(RESOLVED_FROM_ENV, given), (RESOLVED_ENV, self.source.clone())]
    }

    /// Builds the effective configuration from the file, the environment and `overrides`, and validates
    /// it. Tier directories are created here so that a tier that cannot exist fails at start.
    pub fn load(overrides: &Overrides) -> Result<Config, ConfigError> {
        Self::load_with_env(overrides, &job_env())
    }

    /// [`Config::load`] with an explicit environment (tests).
    pub fn load_with_env(overrides: &Overrides, env: &BTreeMap<String, String>) -> Result<Config, ConfigError> {
        Self::validate(Self::layers(overrides, env)?)
    }

    /// The file, the environment and `overrides`, read and layered but not validated.
    fn layers(overrides: &Overrides, env: &BTreeMap<String, String>) -> Result<Raw, ConfigError> {
        for (name, value) in env {
            let private = [RESOLVED_FROM_ENV, RESOLVED_ENV].contains(&name.as_str());
            if name.starts_with("TIERSTORE_") && !ENV_VARS.contains(&name.as_str()) && !private {
                let fix = match closest(name, ENV_VARS) {
                    Some(k) => format!("did you mean {k}? tierstore reads {}", ENV_VARS.join(", ")),
                    None => format!("tierstore reads {}", ENV_VARS.join(", ")),
                };
                return Err(bad(&Origin::Env(name.clone()), name, value, "unknown tierstore variable", &fix));
            }
        }
        let mut raw = Raw::default();
        let file = match (&overrides.config_file, env.get("TIERSTORE_CONFIG")) {
            (Some(p), _) => Some((p.clone(), true)),
            (None, Some(p)) => Some((PathBuf::from(p), true)),
            (None, None) => Some((PathBuf::from("tierstore.toml"), false)).filter(|(p, _)| p.exists()),
        };
        if let Some((path, explicit)) = file {
            if explicit && !path.exists() {
                let origin = if overrides.config_file.is_some() {
                    Origin::Argument
                } else {
                    Origin::Env("TIERSTORE_CONFIG".into())
                };
                return Err(bad(&origin, "config", path.display(), "no such file", "give the path of a TOML file"));
            }
            let abs = std::path::absolute(&path).unwrap_or(path);
            read_file(&abs, &mut raw)?;
        }
        let env_origin = |k: &str| Origin::Env(k.to_string());
        raw.slurm_nodes = env.get("SLURM_JOB_NODELIST").cloned();
        raw.slurm_job = env.get("SLURM_JOB_ID").cloned();
        for (name, key) in [
            ("TIERSTORE_SHARING", "sharing"),
            ("TIERSTORE_PEERS", "peers"),
            ("TIERSTORE_NODE", "node"),
            ("TIERSTORE_PORT", "port"),
            ("TIERSTORE_LISTEN", "listen"),
            ("TIERSTORE_TOKEN_FILE", "token_file"),
            ("TIERSTORE_REGISTRY", "registry"),
            ("TIERSTORE_JOB", "job"),
        ] {
            if let Some(v) = env.get(name) {
                raw.cluster.insert(key, (toml::Value::String(v.clone()), env_origin(name)));
            }
        }
        for (name, key) in
            [("TIERSTORE_STREAM_REDIS", "redis"), ("TIERSTORE_STREAM_KEEP", "keep"), ("TIERSTORE_STREAM_DIR", "dir")]
        {
            if let Some(v) = env.get(name) {
                raw.stream.insert(key, (toml::Value::String(v.clone()), env_origin(name)));
            }
        }
        if let (Some(from), Some(to)) = (env.get(RESOLVED_FROM_ENV), env.get(RESOLVED_ENV)) {
            raw.resolved = Some((from.clone(), to.clone()));
        }
        if let Some(v) = env.get("TIERSTORE_SOURCE") {
            raw.source = Some((v.clone(), env_origin("TIERSTORE_SOURCE")));
        }
        if let Some(v) = env.get("TIERSTORE_TIERS") {
            let o = env_origin("TIERSTORE_TIERS");
            raw.tiers = Some((parse_env_tiers(v, &o)?, o));
        }
        for (name, slot) in [
            ("TIERSTORE_POLICY", &mut raw.policy),
            ("TIERSTORE_THREADS", &mut raw.threads),
            ("TIERSTORE_INLINE_MAX", &mut raw.inline_max),
            ("TIERSTORE_VERIFY", &mut raw.verify),
            ("TIERSTORE_REVALIDATE", &mut raw.revalidate),
        ] {
            if let Some(v) = env.get(name) {
                *slot = Some((v.clone(), env_origin(name)));
            }
        }
        if let Some(v) = &overrides.source {
            raw.source = Some((v.clone(), Origin::Argument));
        }
        for (k, v) in &overrides.s3 {
            let value = toml::Value::String(v.clone());
            let Some(&name) = S3_KEYS.iter().find(|n| **n == k.as_str()) else {
                return Err(unknown_key(&Origin::Argument, &format!("s3.{k}"), &value, S3_KEYS));
            };
            raw.s3.insert(name, (value, Origin::Argument));
        }
        if let Some(t) = &overrides.tiers {
            let tiers = t.iter().map(|(p, q)| RawTier { path: p.clone(), quota: q.clone(), kind: None }).collect();
            raw.tiers = Some((tiers, Origin::Argument));
        }
        for (value, slot) in [
            (&overrides.policy, &mut raw.policy),
            (&overrides.threads, &mut raw.threads),
            (&overrides.inline_max, &mut raw.inline_max),
            (&overrides.verify, &mut raw.verify),
            (&overrides.revalidate, &mut raw.revalidate),
        ] {
            if let Some(v) = value {
                *slot = Some((v.clone(), Origin::Argument));
            }
        }
        if let Some(v) = env.get("TIERSTORE_WRITEBACK") {
            let o = env_origin("TIERSTORE_WRITEBACK");
            raw.writeback = Some((crate::writeback::config::from_env(v, &o)?, o));
        }
        Ok(raw)
    }

    fn validate(raw: Raw) -> Result<Config, ConfigError> {
        let mut origins = BTreeMap::new();
        let (source_text, source_origin) = raw.source.ok_or_else(|| {
            bad(
                &Origin::Default,
                "source",
                "(unset)",
                "no source directory is configured",
                "set source = \"/path/to/dataset\" in tierstore.toml, TIERSTORE_SOURCE, or Cache(source=...)",
            )
        })?;
        let s3 = if is_url(&source_text) {
            let c = S3Config::parse(&source_text).map_err(|e| bad(&source_origin, "source", &source_text, &e.0, ""))?;
            Some(validate_s3(c, &raw.s3)?)
        } else {
            if let Some((k, (v, o))) = raw.s3.iter().next() {
                return Err(bad(
                    o,
                    &format!("s3.{k}"),
                    scalar(v),
                    "is set but the source is not an object store",
                    "give source = \"s3://BUCKET/PREFIX\", or remove the [s3] table",
                ));
            }
            None
        };
        let (source, source_alias) = match &s3 {
            Some(c) => (PathBuf::from(&c.url), None),
            None => {
                let given = expand_home(&source_text);
                let given = crate::source::normalize(&std::path::absolute(&given).unwrap_or(given));
                let source = match resolved_by_parent(&given, raw.resolved.as_ref()) {
                    Some(resolved) => resolved,
                    None => {
                        check_source_dir(&given, &source_origin, &source_text)?;
                        std::fs::canonicalize(&given).unwrap_or_else(|_| given.clone())
                    }
                };
                let alias = (given != source).then_some(given);
                (source, alias)
            }
        };
        origins.insert("source".to_string(), source_origin);

        let (raw_tiers, tiers_origin) = raw.tiers.unwrap_or_else(|| {
            let path = default_tier_dir().to_string_lossy().into_owned();
            (vec![RawTier { path, quota: None, kind: None }], Origin::Default)
        });
        if raw_tiers.is_empty() {
            return Err(bad(&tiers_origin, "tiers", "[]", "no cache tier", "configure at least one tier directory"));
        }
        let mut tiers: Vec<TierConfig> = Vec::new();
        for (i, rt) in raw_tiers.iter().enumerate() {
            let key = format!("tiers[{i}]");
            let path = expand_home(&rt.path);
            let path = std::path::absolute(&path).unwrap_or(path);
            std::fs::create_dir_all(&path).map_err(|e| {
                bad(
                    &tiers_origin,
                    &format!("{key}.path"),
                    &rt.path,
                    &format!("cannot be created ({e})"),
                    "give a directory you can write to",
                )
            })?;
            let path = std::fs::canonicalize(&path).unwrap_or(path);
            let probe = path.join(format!(".tierstore-probe-{}", crate::process::pid()));
            if let Err(e) = std::fs::write(&probe, b"") {
                return Err(bad(
                    &tiers_origin,
                    &format!("{key}.path"),
                    &rt.path,
                    &format!("is not writable ({e})"),
                    "give a directory you can write to",
                ));
            }
            let _ = std::fs::remove_file(&probe);
            if path.starts_with(&source) || source.starts_with(&path) {
                return Err(bad(
                    &tiers_origin,
                    &format!("{key}.path"),
                    &rt.path,
                    &format!("overlaps the source {}", source.display()),
                    "put cache tiers outside the source directory",
                ));
            }
            if let Some(prev) = tiers.iter().position(|t| t.path == path) {
                return Err(bad(
                    &tiers_origin,
                    &format!("{key}.path"),
                    &rt.path,
                    &format!("is the same directory as tiers[{prev}]"),
                    "give each tier its own directory",
                ));
            }
            let info = fs_info(&path).map_err(|e| {
                bad(&tiers_origin, &format!("{key}.path"), &rt.path, &format!("statfs failed ({e})"), "check the path")
            })?;
            let kind = match rt.kind.as_deref() {
                None => {
                    if info.in_memory {
                        TierKind::Memory
                    } else {
                        TierKind::Local
                    }
                }
                Some("memory") if info.in_memory => TierKind::Memory,
                Some("memory") => {
                    return Err(bad(
                        &tiers_origin,
                        &format!("{key}.kind"),
                        "memory",
                        &format!("{} is not on a RAM-backed file system", path.display()),
                        "use a directory under /dev/shm, or kind = \"local\"",
                    ))
                }
                Some("local") => TierKind::Local,
                Some(other) => {
                    return Err(bad(
                        &tiers_origin,
                        &format!("{key}.kind"),
                        other,
                        "unknown tier kind",
                        "use \"memory\" or \"local\" (or leave it out to detect it)",
                    ))
                }
            };
            let quota = match &rt.quota {
                // Half of what is free now: leaves room for everything else on the node.
                None => (info.free / 2).max(1),
                Some(q) => {
                    let quota = parse_size(q).ok_or_else(|| {
                        bad(&tiers_origin, &format!("{key}.quota"), format!("\"{q}\""), "not a size", SIZE_FIX)
                    })?;
                    if quota == 0 {
                        return Err(bad(
                            &tiers_origin,
                            &format!("{key}.quota"),
                            format!("\"{q}\""),
                            "a tier of zero bytes caches nothing",
                            "give a positive size, or remove the tier",
                        ));
                    }
                    if info.total > 0 && quota > info.total {
                        return Err(bad(
                            &tiers_origin,
                            &format!("{key}.quota"),
                            format!("\"{q}\""),
                            &format!("exceeds the size of the file system ({})", format_size(info.total)),
                            &format!("use at most {}", format_size(info.total)),
                        ));
                    }
                    quota
                }
            };
            tiers.push(TierConfig { path, quota, kind });
        }
        origins.insert("tiers".to_string(), tiers_origin);

        let policy = setting(
            &mut origins,
            "policy",
            raw.policy,
            || Policy::Fill,
            |text, origin| {
                Policy::parse(text).ok_or_else(|| {
                    bad(
                        origin,
                        "policy",
                        format!("\"{text}\""),
                        "unknown policy",
                        "use \"fill\" (fill tiers in order, never evict), \"lru\", \"lfu\" or \"fifo\"",
                    )
                })
            },
        )?;

        let default_threads = || std::thread::available_parallelism().map(|n| n.get() * 2).unwrap_or(4).clamp(2, 16);
        let threads =
            setting(&mut origins, "threads", raw.threads, default_threads, |text, origin| {
                text.trim().parse().ok().filter(|n| (1..=256).contains(n)).ok_or_else(|| {
                    bad(origin, "threads", text, "not a thread count", "use a whole number from 1 to 256")
                })
            })?;

        let inline_max = setting(
            &mut origins,
            "inline_max",
            raw.inline_max,
            || 8 << 20,
            |text, origin| {
                parse_size(text).ok_or_else(|| bad(origin, "inline_max", format!("\"{text}\""), "not a size", SIZE_FIX))
            },
        )?;

        let verify = setting(
            &mut origins,
            "verify",
            raw.verify,
            || Verify::Metadata,
            |text, origin| match text {
                "metadata" => Ok(Verify::Metadata),
                "checksum" => Ok(Verify::Checksum),
                _ => Err(bad(
                    origin,
                    "verify",
                    format!("\"{text}\""),
                    "unknown verification mode",
                    "use \"metadata\" (size and mtime, free) or \"checksum\" (blake3 of every copy opened)",
                )),
            },
        )?;

        let revalidate = setting(
            &mut origins,
            "revalidate",
            raw.revalidate,
            || Revalidate::Always,
            |text, origin| match text {
                "always" => Ok(Revalidate::Always),
                "never" => Ok(Revalidate::Never),
                // A bare number would be ambiguous between seconds and a count: a duration needs its unit.
                _ if text.trim().ends_with(|c: char| c.is_ascii_alphabetic()) && parse_duration(text).is_some() => {
                    Ok(Revalidate::Within(parse_duration(text).expect("checked")))
                }
                _ => Err(bad(
                    origin,
                    "revalidate",
                    format!("\"{text}\""),
                    "unknown revalidation mode",
                    "use \"always\" (ask the source on every open: never stale), a duration such as \"60s\" \
                     (trust a copy confirmed within it; a change is seen within that long) or \"never\" (trust \
                     the cache for a read-only dataset: no source operation at all after the first epoch)",
                )),
            },
        )?;

        let cluster = validate_cluster(&raw.cluster, raw.slurm_nodes.as_deref(), raw.slurm_job.as_deref())?;
        let writeback = crate::writeback::config::validate(raw.writeback.as_ref())?;
        if let Some((_, o)) = raw.cluster.get("sharing") {
            origins.insert("cluster".to_string(), o.clone());
        }
        // Each part of [cluster] may come from elsewhere than `sharing` (TIERSTORE_PEERS, TIERSTORE_NODE,
        // Slurm's variables): `config show` says where each came from.
        for key in CLUSTER_KEYS {
            if let Some((_, o)) = raw.cluster.get(key) {
                origins.insert(format!("cluster.{key}"), o.clone());
            }
        }
        if !raw.cluster.contains_key("peers") && raw.slurm_nodes.is_some() {
            origins.insert("cluster.peers".into(), Origin::Env("SLURM_JOB_NODELIST".into()));
        }
        if !raw.cluster.contains_key("job") && raw.slurm_job.is_some() {
            origins.insert("cluster.job".into(), Origin::Env("SLURM_JOB_ID".into()));
        }
        Ok(Config {
            source,
            source_alias,
            tiers,
            policy,
            threads,
            inline_max,
            verify,
            revalidate,
            cluster,
            s3,
            origins,
            writeback,
        })
    }
}

/// The variables the configuration reads: tierstore's own and Slurm's.
fn job_env() -> BTreeMap<String, String> {
    std::env::vars().filter(|(k, _)| k.starts_with("TIERSTORE_") || SLURM_VARS.contains(&k.as_str())).collect()
}

/// Only the `[[writeback]]` destinations of the configuration (the file, then `$TIERSTORE_WRITEBACK`):
/// what writers and the agent need, with no source required.
pub fn load_writeback(overrides: &Overrides) -> Result<Vec<crate::writeback::Destination>, ConfigError> {
    let raw = Config::layers(overrides, &job_env())?;
    crate::writeback::config::validate(raw.writeback.as_ref())
}

/// Only the `[cluster]` settings of the configuration (the file, then `TIERSTORE_*` and Slurm's), with no
/// source required: what a write-back reader needs to ask the other nodes for files staged there.
pub fn load_cluster(overrides: &Overrides) -> Result<ClusterConfig, ConfigError> {
    let raw = Config::layers(overrides, &job_env())?;
    validate_cluster(&raw.cluster, raw.slurm_nodes.as_deref(), raw.slurm_job.as_deref())
}

/// The node agent's side of model streaming (`[stream]`, `TIERSTORE_STREAM_*`); each unset key leaves the
/// agent's default (versions announced in the `[cluster]` registry when there is one, 2 kept, on /dev/shm).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct StreamConfig {
    /// The Redis that versions are announced in and followed from across nodes (`redis://HOST:PORT`).
    pub redis: Option<String>,
    /// Versions kept per stream besides those a consumer still holds.
    pub keep: Option<usize>,
    /// Where the versions' tensors are kept (memory: a directory on /dev/shm).
    pub dir: Option<PathBuf>,
}

/// Only the `[stream]` settings of the configuration, with no source required (an agent that only
/// streams models serves no dataset).
pub fn load_stream(overrides: &Overrides) -> Result<StreamConfig, ConfigError> {
    let raw = Config::layers(overrides, &job_env())?;
    let mut c = StreamConfig::default();
    for (&k, (v, o)) in &raw.stream {
        let text = scalar(v);
        match k {
            "redis" => {
                if !(text.starts_with("redis://") || text.starts_with("rediss://") || text.starts_with("redis+unix://"))
                {
                    return Err(bad(o, "stream.redis", &text, "is not a Redis URL", "write redis://HOST:6379"));
                }
                c.redis = Some(text);
            }
            "keep" => {
                c.keep = Some(text.trim().parse().ok().filter(|n| *n > 0).ok_or_else(|| {
                    bad(o, "stream.keep", &text, "is not a count of versions", "use a whole number from 1 up, e.g. 2")
                })?);
            }
            _ => c.dir = Some(expand_home(&text)),
        }
    }
    Ok(c)
}

#[cfg(test)]
mod tests {
    use super::*;

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

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn layers_override_in_order_and_remember_origins() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let file = dir.path().join("t.toml");
        std::fs::write(
            &file,
            format!(
                "source = \"{}\"\npolicy = \"lru\"\nthreads = 3\n[[tiers]]\npath = \"{}\"\nquota = \"1M\"\n",
                src.display(),
                dir.path().join("t0").display()
            ),
        )
        .unwrap();
        let o = Overrides { config_file: Some(file.clone()), threads: Some("5".into()), ..Default::default() };
        let c = Config::load_with_env(&o, &env(&[("TIERSTORE_POLICY", "lfu")])).unwrap();
        assert_eq!(c.policy, Policy::Lfu);
        assert_eq!(c.threads, 5);
        assert_eq!(c.tiers[0].quota, 1 << 20);
        assert_eq!(c.origins["policy"], Origin::Env("TIERSTORE_POLICY".into()));
        assert_eq!(c.origins["threads"], Origin::Argument);
        assert_eq!(c.origins["tiers"], Origin::File(file));
    }

    #[test]
    fn cluster_members_come_from_the_file_the_environment_or_slurm() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let t0 = dir.path().join("t0").display().to_string();
        let file = dir.path().join("t.toml");
        let toml = format!(
            "source = \"{}\"\n[[tiers]]\npath = \"{t0}\"\n[cluster]\nsharing = \"partitioned\"\npeers = [\"gpu[01-02]\", \"login:7100\"]\n",
            src.display()
        );
        std::fs::write(&file, toml).unwrap();
        let o = Overrides { config_file: Some(file), ..Default::default() };
        let c = Config::load_with_env(&o, &env(&[])).unwrap();
        assert_eq!(c.cluster.sharing, Sharing::Partitioned);
        let addrs: Vec<String> = c.cluster.members.iter().map(|m| m.address()).collect();
        assert_eq!(addrs, ["gpu01:7078", "gpu02:7078", "login:7100"]);
        // The environment overrides the file; Slurm's list is the fallback when none is given.
        let c = Config::load_with_env(&o, &env(&[("TIERSTORE_PEERS", "n[1-3]")])).unwrap();
        assert_eq!(c.cluster.members.len(), 3);
        let base = Overrides { source: Some(src.display().to_string()), ..Default::default() };
        let c = Config::load_with_env(
            &base,
            &env(&[("TIERSTORE_SHARING", "inclusive"), ("SLURM_JOB_NODELIST", "node[001-004]")]),
        )
        .unwrap();
        assert_eq!((c.cluster.sharing, c.cluster.members.len()), (Sharing::Inclusive, 4));
        assert_eq!(Config::load_with_env(&base, &env(&[])).unwrap().cluster.sharing, Sharing::Off);

        let err = |e: &[(&str, &str)]| Config::load_with_env(&base, &env(e)).unwrap_err().to_string();
        let e = err(&[("TIERSTORE_SHARING", "partitoned")]);
        assert!(e.contains("cluster.sharing") && e.contains("\"partitioned\""), "{e}");
        let e = err(&[("TIERSTORE_SHARING", "partitioned")]);
        assert!(e.contains("no node is listed") && e.contains("TIERSTORE_PEERS"), "{e}");
        let e = err(&[("TIERSTORE_SHARING", "partitioned"), ("TIERSTORE_PEERS", "gpu[3-1]")]);
        assert!(e.contains("TIERSTORE_PEERS") && e.contains("runs backwards"), "{e}");
    }

    #[test]
    fn errors_name_key_value_and_fix() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let t0 = dir.path().join("t0").display().to_string();
        let base = Overrides { source: Some(src.display().to_string()), ..Default::default() };
        let err = |o: Overrides, e: &[(&str, &str)]| Config::load_with_env(&o, &env(e)).unwrap_err().to_string();

        let e = err(Overrides { tiers: Some(vec![(t0.clone(), Some("80X".into()))]), ..base.clone() }, &[]);
        assert!(e.contains("tiers[0].quota") && e.contains("80X") && e.contains("use a size like"), "{e}");
        let e = err(Overrides { policy: Some("lfru".into()), ..base.clone() }, &[]);
        assert!(e.contains("policy") && e.contains("lfru") && e.contains("\"fill\""), "{e}");
        let e = err(Overrides { threads: Some("0".into()), ..base.clone() }, &[]);
        assert!(e.contains("threads = 0"), "{e}");
        let e = err(base.clone(), &[("TIERSTORE_POLCY", "lru")]);
        assert!(e.contains("did you mean TIERSTORE_POLICY"), "{e}");
        let inside = src.join("cache").display().to_string();
        let e = err(Overrides { tiers: Some(vec![(inside, Some("1M".into()))]), ..base.clone() }, &[]);
        assert!(e.contains("overlaps the source"), "{e}");
        let e = err(Overrides { source: None, ..base.clone() }, &[]);
        assert!(e.contains("no source directory"), "{e}");
        let e = err(base.clone(), &[("TIERSTORE_TIERS", "/tmp/x:12Q")]);
        assert!(e.contains("TIERSTORE_TIERS") && e.contains("not a size"), "{e}");
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "polcy = \"lru\"\n").unwrap();
        let e = err(Overrides { config_file: Some(file), ..base.clone() }, &[]);
        assert!(e.contains("unknown key") && e.contains("did you mean \"policy\""), "{e}");
    }
}
