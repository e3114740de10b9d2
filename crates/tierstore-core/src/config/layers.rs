//! The layers of the configuration, each read over the one before: the TOML file, the environment
//! (`TIERSTORE_*` and Slurm's variables) and the API's arguments ([`Overrides`]), which are the file's
//! own keys read by the file's own reader. What comes out is [`Raw`]: each key's value as written and
//! where it came from, checked only for its shape; `Config::validate` checks the values.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use super::settings::{self, keys_of, Table};
use super::tiers::{self, RawTier};
use super::values::{bad, closest, scalar, unknown_key, ConfigError, Origin};
use crate::source::store_config::TableKey;
use crate::writeback::config as writeback;

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

/// Set by `tierstore run` for the processes it starts: the source as configured and the same directory
/// with symlinks resolved. A process that finds its own configured source there takes the resolved
/// directory as it is, so a job checks and resolves its source once, not once per process (each check
/// costs the shared store a few metadata operations, and DataLoader workers start every epoch).
pub const RESOLVED_FROM_ENV: &str = "TIERSTORE_RESOLVED_SOURCE_OF";
/// See [`RESOLVED_FROM_ENV`].
pub const RESOLVED_ENV: &str = "TIERSTORE_RESOLVED_SOURCE";

/// The file, then the environment, then the API's arguments (`overrides`), each over the one
/// before, read and layered but not validated: what each key was set to, and where.
pub(super) fn layers(overrides: &Overrides, env: &BTreeMap<String, String>) -> Result<Raw, ConfigError> {
    check_variables(env)?;
    let mut raw = Raw::default();
    if let Some(path) = config_file(overrides, env)? {
        read_file(&path, &mut raw)?;
    }
    read_env(&mut raw, env)?;
    for (key, value) in &overrides.settings {
        read_value(&mut raw, &Origin::Argument, key, value)?;
    }
    Ok(raw)
}

/// Variables named `TIERSTORE_*` that are not tierstore's configuration: the test suite's knobs
/// (`TIERSTORE_TEST_*`) and where it finds its tools (`TIERSTORE_WEED`), which tests/README.md tells
/// contributors to set in their shell. They are passed over, not refused as misspellings.
fn not_ours(name: &str) -> bool {
    name.starts_with("TIERSTORE_TEST_") || name == "TIERSTORE_WEED"
}

/// A key's value as written, and where it was set.
pub(super) type Set = (toml::Value, Origin);

/// The raw, unvalidated values of the TOML file.
#[derive(Default)]
pub(super) struct Raw {
    /// The top-level keys whose value is one string or number (`source`, `policy`, ...), each with where
    /// it was set.
    pub(super) top: BTreeMap<&'static str, (String, Origin)>,
    pub(super) tiers: Option<(Vec<RawTier>, Origin)>,
    /// The source as resolved by the parent process, with the spelling it was resolved from.
    pub(super) resolved: Option<(String, String)>,
    /// `[cluster]` keys, each with where it was set.
    pub(super) cluster: BTreeMap<&'static str, Set>,
    /// `[object_store]` (or `[s3]`) keys, each with where it was set and under which name.
    pub(super) object_store: BTreeMap<String, TableKey>,
    /// Slurm's node list of the job, when the process runs under Slurm.
    pub(super) slurm_nodes: Option<String>,
    /// Slurm's job id, which names the job in a registry by default.
    pub(super) slurm_job: Option<String>,
    /// `[[writeback]]` tables, or `$TIERSTORE_WRITEBACK` in their form (see `crate::writeback::config`).
    pub(super) writeback: Option<(toml::Value, Origin)>,
    /// `[stream]` keys, each with where it was set.
    pub(super) stream: BTreeMap<&'static str, Set>,
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
            raw.cluster.extend(section(origin, key, value, Table::Cluster, fix)?);
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
            raw.stream.extend(section(origin, key, value, Table::Stream, fix)?);
        }
        other => return Err(unknown_key(origin, other, value, &keys_of(Table::Top))),
    }
    Ok(())
}

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

/// The keys of a table the settings table declares key by key (`[cluster]`, `[stream]`: `key` is its
/// name), each with its value and `origin`; an unknown key fails with the keys it takes.
fn section(
    origin: &Origin,
    key: &str,
    value: &toml::Value,
    table: Table,
    fix: &str,
) -> Result<Vec<(&'static str, Set)>, ConfigError> {
    let t = value.as_table().ok_or_else(|| bad(origin, key, value, "must be a table", fix))?;
    t.iter()
        .map(|(k, v)| match settings::find(table, k) {
            Some(s) => Ok((s.key, (v.clone(), origin.clone()))),
            None => Err(unknown_key(origin, &format!("{key}.{k}"), v, &keys_of(table))),
        })
        .collect()
}

/// Refuses a `TIERSTORE_*` variable tierstore does not read (a misspelling would otherwise be ignored),
/// suggesting the closest it does.
fn check_variables(env: &BTreeMap<String, String>) -> Result<(), ConfigError> {
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
    Ok(())
}

/// The TOML file to read, absolute: the one given (as an argument, else `$TIERSTORE_CONFIG`), which
/// must exist, else `./tierstore.toml` when there is one.
fn config_file(overrides: &Overrides, env: &BTreeMap<String, String>) -> Result<Option<PathBuf>, ConfigError> {
    let file = match (&overrides.config_file, env.get("TIERSTORE_CONFIG")) {
        (Some(p), _) => Some((p.clone(), true)),
        (None, Some(p)) => Some((PathBuf::from(p), true)),
        (None, None) => Some((PathBuf::from("tierstore.toml"), false)).filter(|(p, _)| p.exists()),
    };
    let Some((path, explicit)) = file else { return Ok(None) };
    if explicit && !path.exists() {
        let origin =
            if overrides.config_file.is_some() { Origin::Argument } else { Origin::Env("TIERSTORE_CONFIG".into()) };
        return Err(bad(&origin, "config", path.display(), "no such file", "give the path of a TOML file"));
    }
    Ok(Some(std::path::absolute(&path).unwrap_or(path)))
}

/// The environment's layer: every variable the settings table maps onto a key of one value, the
/// variables of a whole section (`TIERSTORE_TIERS`, `TIERSTORE_OBJECT_STORE`, `TIERSTORE_WRITEBACK`),
/// Slurm's, and the source a parent process resolved.
fn read_env(raw: &mut Raw, env: &BTreeMap<String, String>) -> Result<(), ConfigError> {
    let env_origin = |k: &str| Origin::Env(k.to_string());
    raw.slurm_nodes = env.get("SLURM_JOB_NODELIST").cloned();
    raw.slurm_job = env.get("SLURM_JOB_ID").cloned();
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
    if let Some(v) = env.get("TIERSTORE_WRITEBACK") {
        let o = env_origin("TIERSTORE_WRITEBACK");
        raw.writeback = Some((writeback::from_env(v, &o)?, o));
    }
    Ok(())
}
