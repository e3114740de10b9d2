//! Configuration: a TOML file, overridden by `TIERSTORE_*` environment variables, overridden by API
//! arguments. Every value remembers where it came from (`tierstore config show`), and every invalid value
//! fails at start with one message that names the key, the value, where it was set and the fix.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

pub mod settings;
pub(crate) mod tiers;
pub(crate) mod values;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

pub use tiers::{default_tier_dir, TierConfig, TierKind};
pub use values::{format_size, fs_info, parse_size, ConfigError, FsInfo, Origin};

use crate::cluster::config::{self as cluster, ClusterConfig};
use crate::placement::Policy;
use crate::source::store_config::{self, is_url, StoreConfig, TableKey};
use crate::writeback::config::{self as writeback, Destination};
use settings::{default_value, keys_of, Table};
use tiers::RawTier;
use values::{bad, closest, expand_home, parse_duration, scalar, unknown_key, SIZE_FIX};

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
    /// The object store, when the source is one (`source = "s3://bucket/prefix"`, `gs://`, `az://`,
    /// `http(s)://`); `source` then holds the URL.
    pub object_store: Option<StoreConfig>,
    /// Where each top-level key's value came from.
    pub origins: BTreeMap<String, Origin>,
    /// Write-back destinations (`[[writeback]]`): writes under them are staged on the node first.
    pub writeback: Vec<Destination>,
}

/// Values given by the API or CLI; what is not given leaves the file or environment value in place.
#[derive(Clone, Debug, Default)]
pub struct Overrides {
    /// A TOML file to read instead of `$TIERSTORE_CONFIG` or `./tierstore.toml`.
    pub config_file: Option<PathBuf>,
    /// Top-level keys of the file and their values, as the file would write them, read by the same
    /// code: `("policy", "lru")`, `("tiers", [{path = "/dev/shm/t", quota = "8G"}])`, `("object_store",
    /// {endpoint = "..."})`. Given later, a key wins: a list (`tiers`) replaces the file's, a table
    /// (`object_store`) is laid key by key over it.
    pub settings: Vec<(String, toml::Value)>,
}

impl Overrides {
    /// These overrides with the top-level setting `key` given as `value` (one string or number).
    pub fn with(self, key: &str, value: impl Into<String>) -> Overrides {
        self.with_value(key, toml::Value::String(value.into()))
    }

    /// These overrides with the top-level key `key` given as `value`, as the file would write it.
    pub fn with_value(mut self, key: &str, value: toml::Value) -> Overrides {
        self.settings.push((key.to_string(), value));
        self
    }

    /// These overrides with the tiers given as `(path, quota)` pairs, fastest first; a quota of `None`
    /// is derived from the free space.
    pub fn with_tiers(self, tiers: &[(String, Option<String>)]) -> Overrides {
        let list = tiers.iter().map(|(path, quota)| {
            let mut t = toml::Table::new();
            t.insert("path".into(), toml::Value::String(path.clone()));
            if let Some(q) = quota {
                t.insert("quota".into(), toml::Value::String(q.clone()));
            }
            toml::Value::Table(t)
        });
        self.with_value("tiers", toml::Value::Array(list.collect()))
    }
}

/// Variables named `TIERSTORE_*` that are not tierstore's configuration: the test suite's knobs
/// (`TIERSTORE_TEST_*`) and where it finds its tools (`TIERSTORE_WEED`), which tests/README.md tells
/// contributors to set in their shell. They are passed over, not refused as misspellings.
fn not_ours(name: &str) -> bool {
    name.starts_with("TIERSTORE_TEST_") || name == "TIERSTORE_WEED"
}

/// The raw, unvalidated values of the TOML file.
#[derive(Default)]
struct Raw {
    /// The top-level keys whose value is one string or number (`source`, `policy`, ...), each with where
    /// it was set.
    top: BTreeMap<&'static str, (String, Origin)>,
    tiers: Option<(Vec<RawTier>, Origin)>,
    /// The source as resolved by the parent process, with the spelling it was resolved from.
    resolved: Option<(String, String)>,
    /// `[cluster]` keys, each with where it was set.
    cluster: BTreeMap<&'static str, (toml::Value, Origin)>,
    /// `[object_store]` (or `[s3]`) keys, each with where it was set and under which name.
    object_store: BTreeMap<String, TableKey>,
    /// Slurm's node list of the job, when the process runs under Slurm.
    slurm_nodes: Option<String>,
    /// Slurm's job id, which names the job in a registry by default.
    slurm_job: Option<String>,
    /// `[[writeback]]` tables, or `$TIERSTORE_WRITEBACK` in their form (see `crate::writeback::config`).
    writeback: Option<(toml::Value, Origin)>,
    /// `[stream]` keys, each with where it was set.
    stream: BTreeMap<&'static str, (toml::Value, Origin)>,
}

/// A TOML syntax error as one that names the line, what is written there and the column (the path is the
/// error's origin already).
fn syntax_error(origin: &Origin, text: &str, e: &toml::de::Error) -> ConfigError {
    let at = e.span().map_or(0, |s| s.start).min(text.len());
    let before = text.get(..at).unwrap_or("");
    let line = before.matches('\n').count() + 1;
    let start = before.rfind('\n').map_or(0, |i| i + 1);
    let column = before[start..].chars().count() + 1;
    let written = text[start..].lines().next().unwrap_or("").trim_end();
    let problem = format!("is not valid TOML at column {column}: {}", e.message().trim_end());
    bad(origin, &format!("line {line}"), format!("{written:?}"), &problem, "fix the syntax there")
}

fn read_file(path: &Path, raw: &mut Raw) -> Result<(), ConfigError> {
    let origin = Origin::File(path.to_path_buf());
    let text = std::fs::read_to_string(path).map_err(|e| {
        bad(&origin, "file", path.display(), &format!("cannot be read ({e})"), "check the path and its permissions")
    })?;
    let table: toml::Table = text.parse().map_err(|e: toml::de::Error| syntax_error(&origin, &text, &e))?;
    for (key, value) in &table {
        read_value(raw, &origin, key, value)?;
    }
    Ok(())
}

/// One top-level key of the file and its value, from `origin`: the file's own, or the same key given
/// through [`Overrides`].
fn read_value(raw: &mut Raw, origin: &Origin, key: &str, value: &toml::Value) -> Result<(), ConfigError> {
    let text_of = |v: &toml::Value| -> Result<String, ConfigError> {
        match v {
            toml::Value::String(_) | toml::Value::Integer(_) | toml::Value::Float(_) => Ok(scalar(v)),
            _ => Err(bad(origin, key, v, "must be a string or a number", "write a single value")),
        }
    };
    if let Some(s) = settings::find(Table::Top, key).filter(|s| s.is_scalar()) {
        raw.top.insert(s.key, (text_of(value)?, origin.clone()));
        return Ok(());
    }
    match key {
        "tiers" => raw.tiers = Some((tiers::from_toml(origin, key, value)?, origin.clone())),
        "cluster" => {
            let fix = "write a [cluster] table: sharing = \"partitioned\", peers = [\"gpu[001-016]\"]";
            let t = value.as_table().ok_or_else(|| bad(origin, key, value, "must be a table", fix))?;
            for (ck, cv) in t {
                let Some(s) = settings::find(Table::Cluster, ck) else {
                    return Err(unknown_key(origin, &format!("cluster.{ck}"), cv, &keys_of(Table::Cluster)));
                };
                raw.cluster.insert(s.key, (cv.clone(), origin.clone()));
            }
        }
        "object_store" | "s3" => {
            let table: &'static str = if key == "s3" { "s3" } else { "object_store" };
            let fix = format!("write an [{table}] table: timeout = \"30s\", aws_region = \"us-east-1\"");
            let t = value.as_table().ok_or_else(|| bad(origin, key, value, "must be a table", &fix))?;
            for (sk, sv) in t {
                if sv.is_table() || sv.is_array() {
                    return Err(bad(origin, &format!("{table}.{sk}"), sv, "must be a string or a number", &fix));
                }
                raw.object_store.insert(sk.clone(), (sv.clone(), origin.clone(), table));
            }
        }
        "writeback" => raw.writeback = Some((value.clone(), origin.clone())),
        "stream" => {
            let fix = "write a [stream] table: redis = \"redis://head-node:6379\", keep = 2";
            let t = value.as_table().ok_or_else(|| bad(origin, key, value, "must be a table", fix))?;
            for (sk, sv) in t {
                let Some(s) = settings::find(Table::Stream, sk) else {
                    return Err(unknown_key(origin, &format!("stream.{sk}"), sv, &keys_of(Table::Stream)));
                };
                raw.stream.insert(s.key, (sv.clone(), origin.clone()));
            }
        }
        other => return Err(unknown_key(origin, other, value, &keys_of(Table::Top))),
    }
    Ok(())
}

/// One top-level setting as set, else its default from the settings table (read as a user's value is),
/// else `None` when the table says the default is worked out at start. Where the value came from is
/// recorded for `tierstore config show`.
fn setting<T>(
    origins: &mut BTreeMap<String, Origin>,
    top: &mut BTreeMap<&'static str, (String, Origin)>,
    key: &str,
    parse: impl FnOnce(&str, &Origin) -> Result<T, ConfigError>,
) -> Result<Option<T>, ConfigError> {
    let value = match top.remove(key) {
        Some((text, origin)) => {
            origins.insert(key.to_string(), origin.clone());
            return parse(&text, &origin).map(Some);
        }
        None => default_value(Table::Top, key).map(|text| parse(text, &Origin::Default)).transpose()?,
    };
    origins.insert(key.to_string(), Origin::Default);
    Ok(value)
}

/// Set by `tierstore run` for the processes it starts: the source as configured and the same directory
/// with symlinks resolved. A process that finds its own configured source there takes the resolved
/// directory as it is, so a job checks and resolves its source once, not once per process (each check
/// costs the shared store a few metadata operations, and DataLoader workers start every epoch).
pub const RESOLVED_FROM_ENV: &str = "TIERSTORE_RESOLVED_SOURCE_OF";
/// See [`RESOLVED_FROM_ENV`].
pub const RESOLVED_ENV: &str = "TIERSTORE_RESOLVED_SOURCE";

/// `TIERSTORE_OBJECT_STORE`: `[object_store]` settings as one JSON object of strings, numbers and
/// booleans, each checked later as the file's would be.
fn object_store_from_env(text: &str) -> Result<Vec<(String, toml::Value)>, ConfigError> {
    let origin = Origin::Env("TIERSTORE_OBJECT_STORE".into());
    let fix = r#"give a JSON object of settings, e.g. TIERSTORE_OBJECT_STORE='{"endpoint": "http://127.0.0.1:9000", "retries": 3}'"#;
    let shown = "(the variable's value)"; // it may hold a secret: never echoed
    let object = match serde_json::from_str::<serde_json::Value>(text) {
        Ok(serde_json::Value::Object(o)) => o,
        Ok(_) => return Err(bad(&origin, "object_store", shown, "is not a JSON object", fix)),
        Err(e) => return Err(bad(&origin, "object_store", shown, &format!("is not JSON ({e})"), fix)),
    };
    object
        .into_iter()
        .map(|(k, v)| {
            let value = match v {
                serde_json::Value::String(s) => toml::Value::String(s),
                serde_json::Value::Bool(b) => toml::Value::Boolean(b),
                serde_json::Value::Number(n) => match n.as_i64() {
                    Some(i) => toml::Value::Integer(i),
                    None => toml::Value::Float(n.as_f64().unwrap_or(f64::NAN)),
                },
                _ => {
                    let problem = "is not a string, a number or a boolean";
                    return Err(bad(&origin, &format!("object_store.{k}"), shown, problem, fix));
                }
            };
            Ok((k, value))
        })
        .collect()
}

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
        let known = settings::env_vars();
        for (name, value) in env {
            let private = [RESOLVED_FROM_ENV, RESOLVED_ENV].contains(&name.as_str());
            if name.starts_with("TIERSTORE_") && !known.contains(&name.as_str()) && !private && !not_ours(name) {
                let fix = match closest(name, &known) {
                    Some(k) => format!("did you mean {k}? tierstore reads {}", known.join(", ")),
                    None => format!("tierstore reads {}", known.join(", ")),
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
        // Every variable that sets one string or number of the file, as the table declares it.
        for s in settings::SETTINGS.iter().filter(|s| s.is_scalar()) {
            let Some((name, v)) = s.env.and_then(|name| Some((name, env.get(name)?))) else { continue };
            let given = || (toml::Value::String(v.clone()), env_origin(name));
            match s.table {
                Table::Top => {
                    raw.top.insert(s.key, (v.clone(), env_origin(name)));
                }
                Table::Cluster => {
                    raw.cluster.insert(s.key, given());
                }
                Table::Stream => {
                    raw.stream.insert(s.key, given());
                }
                _ => {}
            }
        }
        if let (Some(from), Some(to)) = (env.get(RESOLVED_FROM_ENV), env.get(RESOLVED_ENV)) {
            raw.resolved = Some((from.clone(), to.clone()));
        }
        if let Some(v) = env.get("TIERSTORE_TIERS") {
            let o = env_origin("TIERSTORE_TIERS");
            raw.tiers = Some((tiers::from_env(v, &o)?, o));
        }
        if let Some(v) = env.get("TIERSTORE_OBJECT_STORE") {
            for (k, v) in object_store_from_env(v)? {
                raw.object_store.insert(k, (v, env_origin("TIERSTORE_OBJECT_STORE"), "object_store"));
            }
        }
        for (key, value) in &overrides.settings {
            read_value(&mut raw, &Origin::Argument, key, value)?;
        }
        if let Some(v) = env.get("TIERSTORE_WRITEBACK") {
            let o = env_origin("TIERSTORE_WRITEBACK");
            raw.writeback = Some((writeback::from_env(v, &o)?, o));
        }
        Ok(raw)
    }

    fn validate(mut raw: Raw) -> Result<Config, ConfigError> {
        let mut origins = BTreeMap::new();
        let (source_text, source_origin) = raw.top.remove("source").ok_or_else(|| {
            bad(
                &Origin::Default,
                "source",
                "(unset)",
                "no source directory is configured",
                "set source = \"/path/to/dataset\" in tierstore.toml, TIERSTORE_SOURCE, or Cache(source=...)",
            )
        })?;
        let object_store = if is_url(&source_text) {
            let c =
                StoreConfig::parse(&source_text).map_err(|e| bad(&source_origin, "source", &source_text, &e.0, ""))?;
            Some(store_config::validate(c, &raw.object_store)?)
        } else {
            if let Some((k, (v, o, table))) = raw.object_store.iter().next() {
                return Err(bad(
                    o,
                    &format!("{table}.{k}"),
                    scalar(v),
                    "is set but the source is not an object store",
                    &format!("give source = \"s3://BUCKET/PREFIX\" (or gs://, az://, http://), or remove the [{table}] table"),
                ));
            }
            None
        };
        let (source, source_alias) = match &object_store {
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

        let (raw_tiers, tiers_origin) = raw.tiers.unwrap_or_else(|| (tiers::default_raw(), Origin::Default));
        let tiers = tiers::validate(&raw_tiers, &tiers_origin, &source)?;
        origins.insert("tiers".to_string(), tiers_origin);

        let expected = "the settings table gives a default";
        let policy = setting(&mut origins, &mut raw.top, "policy", |text, origin| {
            Policy::parse(text).ok_or_else(|| {
                bad(
                    origin,
                    "policy",
                    format!("\"{text}\""),
                    "unknown policy",
                    "use \"fill\" (fill tiers in order, never evict), \"lru\", \"lfu\" or \"fifo\"",
                )
            })
        })?
        .expect(expected);

        let threads =
            setting(&mut origins, &mut raw.top, "threads", |text, origin| {
                text.trim().parse().ok().filter(|n| (1..=256).contains(n)).ok_or_else(|| {
                    bad(origin, "threads", text, "not a thread count", "use a whole number from 1 to 256")
                })
            })?
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get() * 2).unwrap_or(4).clamp(2, 16));

        let inline_max = setting(&mut origins, &mut raw.top, "inline_max", |text, origin| {
            parse_size(text).ok_or_else(|| bad(origin, "inline_max", format!("\"{text}\""), "not a size", SIZE_FIX))
        })?
        .expect(expected);

        let verify = setting(&mut origins, &mut raw.top, "verify", |text, origin| match text {
            "metadata" => Ok(Verify::Metadata),
            "checksum" => Ok(Verify::Checksum),
            _ => Err(bad(
                origin,
                "verify",
                format!("\"{text}\""),
                "unknown verification mode",
                "use \"metadata\" (size and mtime, free) or \"checksum\" (blake3 of every copy opened)",
            )),
        })?
        .expect(expected);

        let revalidate = setting(&mut origins, &mut raw.top, "revalidate", |text, origin| match text {
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
        })?
        .expect(expected);

        let cluster = cluster::validate(&raw.cluster, raw.slurm_nodes.as_deref(), raw.slurm_job.as_deref())?;
        let writeback = writeback::validate(raw.writeback.as_ref())?;
        if let Some((_, o)) = raw.cluster.get("sharing") {
            origins.insert("cluster".to_string(), o.clone());
        }
        // Each part of [cluster] may come from elsewhere than `sharing` (TIERSTORE_PEERS, TIERSTORE_NODE,
        // Slurm's variables): `config show` says where each came from.
        for key in keys_of(Table::Cluster) {
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
            object_store,
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
pub fn load_writeback(overrides: &Overrides) -> Result<Vec<Destination>, ConfigError> {
    let raw = Config::layers(overrides, &job_env())?;
    writeback::validate(raw.writeback.as_ref())
}

/// Only the `[cluster]` settings of the configuration (the file, then `TIERSTORE_*` and Slurm's), with no
/// source required: what a write-back reader needs to ask the other nodes for files staged there.
pub fn load_cluster(overrides: &Overrides) -> Result<ClusterConfig, ConfigError> {
    let raw = Config::layers(overrides, &job_env())?;
    cluster::validate(&raw.cluster, raw.slurm_nodes.as_deref(), raw.slurm_job.as_deref())
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
    use crate::cluster::config::Sharing;

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
        let o = Overrides { config_file: Some(file.clone()), ..Default::default() }.with("threads", "5");
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
        let base = Overrides::default().with("source", src.display().to_string());
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
    fn object_store_settings_come_from_the_environment_as_json_over_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("t.toml");
        let t0 = dir.path().join("t0").display().to_string();
        let toml = format!(
            "source = \"s3://bucket/p\"\n[[tiers]]\npath = \"{t0}\"\n[object_store]\nretries = 2\nrange_size = \"1M\"\n"
        );
        std::fs::write(&file, toml).unwrap();
        let o = Overrides { config_file: Some(file), ..Default::default() };
        let given = r#"{"endpoint": "http://127.0.0.1:9000", "retries": 7, "allow_http": true}"#;
        let c = Config::load_with_env(&o, &env(&[("TIERSTORE_OBJECT_STORE", given)])).unwrap();
        let store = c.object_store.unwrap();
        assert_eq!((store.retries, store.range_size), (7, 1 << 20));
        assert_eq!(store.settings["endpoint"], "http://127.0.0.1:9000");
        assert_eq!(store.settings["allow_http"], "true");

        let err = |v: &str| Config::load_with_env(&o, &env(&[("TIERSTORE_OBJECT_STORE", v)])).unwrap_err().to_string();
        let e = err("endpoint=http://x");
        assert!(e.contains("TIERSTORE_OBJECT_STORE") && e.contains("is not JSON") && e.contains("e.g."), "{e}");
        let e = err(r#"["retries", 7]"#);
        assert!(e.contains("is not a JSON object"), "{e}");
        let e = err(r#"{"secret_access_key": ["s3cr3t"]}"#);
        assert!(e.contains("object_store.secret_access_key") && !e.contains("s3cr3t"), "{e}");
        let e = err(r#"{"retries": "many"}"#);
        assert!(e.contains("object_store.retries") && e.contains("TIERSTORE_OBJECT_STORE"), "{e}");
    }

    #[test]
    fn errors_name_key_value_and_fix() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let t0 = dir.path().join("t0").display().to_string();
        let base = Overrides::default().with("source", src.display().to_string());
        let err = |o: Overrides, e: &[(&str, &str)]| Config::load_with_env(&o, &env(e)).unwrap_err().to_string();

        let e = err(base.clone().with_tiers(&[(t0.clone(), Some("80X".into()))]), &[]);
        assert!(e.contains("tiers[0].quota") && e.contains("80X") && e.contains("use a size like"), "{e}");
        let e = err(base.clone().with("policy", "lfru"), &[]);
        assert!(e.contains("policy") && e.contains("lfru") && e.contains("\"fill\""), "{e}");
        let e = err(base.clone().with("threads", "0"), &[]);
        assert!(e.contains("threads = 0"), "{e}");
        let e = err(base.clone().with("polcy", "lru"), &[]);
        assert!(e.contains("polcy") && e.contains("unknown key") && e.contains("did you mean \"policy\""), "{e}");
        let e = err(base.clone().with("tiers", "/tmp/t"), &[]);
        assert!(e.contains("tiers") && e.contains("must be a list of tables"), "{e}");
        let e = err(base.clone(), &[("TIERSTORE_POLCY", "lru")]);
        assert!(e.contains("did you mean TIERSTORE_POLICY"), "{e}");
        // The test suite's own variables, which its README tells contributors to set, are not refused.
        let tools = env(&[("TIERSTORE_WEED", "/opt/weed"), ("TIERSTORE_TEST_WRITEBACK_KILLS", "20")]);
        assert!(Config::load_with_env(&base, &tools).is_ok());
        let inside = src.join("cache").display().to_string();
        let e = err(base.clone().with_tiers(&[(inside, Some("1M".into()))]), &[]);
        assert!(e.contains("overlaps the source"), "{e}");
        let e = err(Overrides::default(), &[]);
        assert!(e.contains("no source directory"), "{e}");
        let e = err(base.clone(), &[("TIERSTORE_TIERS", "/tmp/x:12Q")]);
        assert!(e.contains("TIERSTORE_TIERS") && e.contains("not a size"), "{e}");
        let file = dir.path().join("bad.toml");
        std::fs::write(&file, "polcy = \"lru\"\n").unwrap();
        let e = err(Overrides { config_file: Some(file), ..base.clone() }, &[]);
        assert!(e.contains("unknown key") && e.contains("did you mean \"policy\""), "{e}");
    }
}
