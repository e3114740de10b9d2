//! Configuration: a TOML file, overridden by `TIERSTORE_*` environment variables, overridden by API
//! arguments. Every value remembers where it came from (`tierstore config show`), and every invalid value
//! fails at start with one message that names the key, the value, where it was set and the fix.
// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

mod layers;
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
use layers::Raw;
pub use layers::{Overrides, RESOLVED_ENV, RESOLVED_FROM_ENV};
use settings::{default_value, keys_of, Table};
use values::{bad, boolean, expand_home, parse_duration, scalar, SIZE_FIX};

/// How a cached copy is checked when it is opened.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Size and mtime of the copy against the index (one `fstat`, free): catches truncation and writes.
    Metadata,
    /// Also a blake3 hash of the whole copy: catches silent bit rot, at the cost of hashing every open.
    Checksum,
}

impl Verify {
    /// How the mode is written in the configuration.
    pub fn name(self) -> &'static str {
        match self {
            Verify::Metadata => "metadata",
            Verify::Checksum => "checksum",
        }
    }
}

/// A value of the top of the configuration, as `Cache.config()` and `config show` show it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Shown {
    /// Text, as the file would write it (`"lru"`, `"60s"`, a path or URL).
    Text(String),
    /// A number (`threads`, `inline_max` in bytes).
    Count(u64),
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
    /// The value of `key`, one of the settings of one value at the top of the file (`settings::SETTINGS`,
    /// `Table::Top`, not a section): what `Cache.config()` shows beside its origin. `None` for any other
    /// key. The binding iterates the settings table and asks this for each; a test checks that every such
    /// setting has its value here.
    pub fn shown(&self, key: &str) -> Option<Shown> {
        Some(match key {
            "source" => Shown::Text(self.source.to_string_lossy().into_owned()),
            "policy" => Shown::Text(self.policy.name().to_string()),
            "threads" => Shown::Count(self.threads as u64),
            "inline_max" => Shown::Count(self.inline_max),
            "verify" => Shown::Text(self.verify.name().to_string()),
            "revalidate" => Shown::Text(self.revalidate.name()),
            _ => return None,
        })
    }

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
        Self::validate(layers::layers(overrides, env)?)
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
        let object_store = object_store_of(&source_text, &source_origin, &raw.object_store)?;
        let (source, source_alias) = match &object_store {
            Some(c) => (PathBuf::from(&c.url), None),
            None => source_dir(&source_text, &source_origin, raw.resolved.as_ref())?,
        };
        origins.insert("source".to_string(), source_origin);

        let (raw_tiers, tiers_origin) = raw.tiers.take().unwrap_or_else(|| (tiers::default_raw(), Origin::Default));
        let tiers = tiers::validate(&raw_tiers, &tiers_origin, &source)?;
        origins.insert("tiers".to_string(), tiers_origin);

        let expected = "the settings table gives a default";
        let top = &mut raw.top;
        let policy = setting(&mut origins, top, "policy", parse_policy)?.expect(expected);
        let threads = setting(&mut origins, top, "threads", parse_threads)?
            .unwrap_or_else(|| std::thread::available_parallelism().map(|n| n.get() * 2).unwrap_or(4).clamp(2, 16));
        let inline_max = setting(&mut origins, top, "inline_max", |text, origin| {
            parse_size(text).ok_or_else(|| bad(origin, "inline_max", format!("\"{text}\""), "not a size", SIZE_FIX))
        })?
        .expect(expected);
        let verify = setting(&mut origins, top, "verify", parse_verify)?.expect(expected);
        let revalidate = setting(&mut origins, top, "revalidate", parse_revalidate)?.expect(expected);

        let cluster = cluster::validate(&raw.cluster, raw.slurm_nodes.as_deref(), raw.slurm_job.as_deref())?;
        let writeback = writeback::validate(raw.writeback.as_ref())?;
        cluster_origins(&raw, &mut origins);
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

/// The object store the source names, when it is a URL, with the `[object_store]` settings over its
/// defaults; `None` for a directory, which refuses any `[object_store]` setting.
fn object_store_of(
    source_text: &str,
    source_origin: &Origin,
    settings: &BTreeMap<String, TableKey>,
) -> Result<Option<StoreConfig>, ConfigError> {
    if is_url(source_text) {
        if let Some(shown) = values::without_password(source_text) {
            return Err(bad(
                source_origin,
                "source",
                shown,
                "carries a password in the URL, which tierstore does not take",
                "give the URL without it, and the store's credentials in [object_store] or its variables \
                 (AWS_*, GOOGLE_*, AZURE_*)",
            ));
        }
        let c = StoreConfig::parse(source_text).map_err(|e| bad(source_origin, "source", source_text, &e.0, ""))?;
        return store_config::validate(c, settings).map(Some);
    }
    if let Some((k, (v, o, table))) = settings.iter().next() {
        return Err(bad(
            o,
            &format!("{table}.{k}"),
            scalar(v),
            "is set but the source is not an object store",
            &format!("give source = \"s3://BUCKET/PREFIX\" (or gs://, az://, http://), or remove the [{table}] table"),
        ));
    }
    Ok(None)
}

/// The source directory as given (`~` expanded, made absolute), resolved through its links unless the
/// parent process resolved it already; and the path as given, when it differs (the alias a program may
/// still use).
fn source_dir(
    text: &str,
    origin: &Origin,
    resolved: Option<&(String, String)>,
) -> Result<(PathBuf, Option<PathBuf>), ConfigError> {
    let given = expand_home(text);
    let given = crate::source::normalized(std::path::absolute(&given).unwrap_or(given));
    let source = match resolved_by_parent(&given, resolved) {
        Some(resolved) => resolved,
        None => {
            check_source_dir(&given, origin, text)?;
            std::fs::canonicalize(&given).unwrap_or_else(|_| given.clone())
        }
    };
    let alias = (given != source).then_some(given);
    Ok((source, alias))
}

fn parse_policy(text: &str, origin: &Origin) -> Result<Policy, ConfigError> {
    Policy::parse(text).ok_or_else(|| {
        bad(
            origin,
            "policy",
            format!("\"{text}\""),
            "unknown policy",
            "use \"fill\" (fill tiers in order, never evict), \"lru\", \"lfu\" or \"fifo\"",
        )
    })
}

fn parse_threads(text: &str, origin: &Origin) -> Result<usize, ConfigError> {
    settings::parse_count(Table::Top, "threads", text)
        .map(|n| n as usize)
        .map_err(|fix| bad(origin, "threads", text, "not a thread count", &fix))
}

fn parse_verify(text: &str, origin: &Origin) -> Result<Verify, ConfigError> {
    match text {
        "metadata" => Ok(Verify::Metadata),
        "checksum" => Ok(Verify::Checksum),
        _ => Err(bad(
            origin,
            "verify",
            format!("\"{text}\""),
            "unknown verification mode",
            "use \"metadata\" (size and mtime, free) or \"checksum\" (blake3 of every copy opened)",
        )),
    }
}

fn parse_revalidate(text: &str, origin: &Origin) -> Result<Revalidate, ConfigError> {
    match text {
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
    }
}

/// Where each part of `[cluster]` came from, for `config show`: a part may come from elsewhere than
/// `sharing` (TIERSTORE_PEERS, TIERSTORE_NODE, Slurm's variables).
fn cluster_origins(raw: &Raw, origins: &mut BTreeMap<String, Origin>) {
    if let Some((_, o)) = raw.cluster.get("sharing") {
        origins.insert("cluster".to_string(), o.clone());
    }
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
}

/// The variables the configuration reads: tierstore's own and Slurm's.
fn job_env() -> BTreeMap<String, String> {
    std::env::vars().filter(|(k, _)| k.starts_with("TIERSTORE_") || SLURM_VARS.contains(&k.as_str())).collect()
}

/// Only the `[[writeback]]` destinations of the configuration (the file, then `$TIERSTORE_WRITEBACK`):
/// what writers and the agent need, with no source required.
pub fn load_writeback(overrides: &Overrides) -> Result<Vec<Destination>, ConfigError> {
    let raw = layers::layers(overrides, &job_env())?;
    writeback::validate(raw.writeback.as_ref())
}

/// Only the `[cluster]` settings of the configuration (the file, then `TIERSTORE_*` and Slurm's), with no
/// source required: what a write-back reader needs to ask the other nodes for files staged there.
pub fn load_cluster(overrides: &Overrides) -> Result<ClusterConfig, ConfigError> {
    let raw = layers::layers(overrides, &job_env())?;
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
    /// Whether the agent allocates the memory of the next publish's changed tensors ahead.
    pub spares: Option<bool>,
}

/// Only the `[stream]` settings of the configuration, with no source required (an agent that only
/// streams models serves no dataset).
pub fn load_stream(overrides: &Overrides) -> Result<StreamConfig, ConfigError> {
    let raw = layers::layers(overrides, &job_env())?;
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
            "spares" => c.spares = Some(boolean(o, "stream.spares", &text, "write spares = false")?),
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
    fn every_value_at_the_top_of_the_file_is_shown() {
        let dir = tempfile::tempdir().unwrap();
        let src = dir.path().join("src");
        std::fs::create_dir(&src).unwrap();
        let o = Overrides::default()
            .with("source", src.display().to_string())
            .with_tiers(&[(dir.path().join("t0").display().to_string(), Some("1M".into()))]);
        let c = Config::load_with_env(&o, &env(&[])).unwrap();
        for s in settings::SETTINGS.iter().filter(|s| s.table == Table::Top && s.is_scalar()) {
            assert!(c.shown(s.key).is_some(), "Config::shown has no value for the setting {}", s.key);
        }
        assert_eq!(c.shown("threads"), Some(Shown::Count(c.threads as u64)));
        assert_eq!(c.shown("tiers"), None, "a section");
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
        // A number without its unit is bytes: too few for a tier, and surely not what was meant.
        let e = err(base.clone().with_tiers(&[(t0.clone(), Some("50".into()))]), &[]);
        assert!(e.contains("quota = \"50\"") && e.contains("did you mean \"50%\" or \"50G\"?"), "{e}");
        let e = err(base.clone(), &[("TIERSTORE_TIERS", &format!("{t0}:4096"))]);
        assert!(e.contains("$TIERSTORE_TIERS") && e.contains("\"4096B\" if bytes are meant"), "{e}");
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
