//! Every setting of tierstore, declared once: its table and key in the TOML file, its type, its default,
//! its `TIERSTORE_*` variable, its keyword of `tierstore.Cache`, its option of the `tierstore` command and a
//! line of documentation.
//!
//! What reads a setting is derived from this table, not written beside it: the keys the file accepts in
//! each table (and the "did you mean" of an unknown one), the variables the environment maps onto keys,
//! the variables that are not typos, the defaults the parsers start from, the knobs read straight from the
//! environment ([`tuning`]), and, through `_core.SETTINGS`, what the Python side hands an agent it starts
//! and the `tierstore --policy` choices. tests/docs/test_docs_reference.py checks the configuration
//! reference and `Cache`'s signature against it. A new setting is one entry here plus the code that uses
//! its value (docs/design/contributing.md, "Add a setting").

/// Where a setting is written in the TOML file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Table {
    /// A key at the top of the file (`policy = "lru"`).
    Top,
    /// A key of each `[[tiers]]` table.
    Tiers,
    /// A key of `[cluster]`.
    Cluster,
    /// One of tierstore's own keys of `[object_store]`, which `[s3]` takes too.
    ObjectStore,
    /// A short name only an `s3://` source's `[s3]` (or `[object_store]`) table takes.
    S3,
    /// A key of each `[[writeback]]` table.
    Writeback,
    /// A key of `[stream]`.
    Stream,
    /// Not in the file: only the environment variable sets it.
    Environment,
}

impl Table {
    /// The table's name as the file writes it (`""` for the top of the file and for the environment).
    pub fn name(self) -> &'static str {
        match self {
            Table::Top | Table::Environment => "",
            Table::Tiers => "tiers",
            Table::Cluster => "cluster",
            Table::ObjectStore => "object_store",
            Table::S3 => "s3",
            Table::Writeback => "writeback",
            Table::Stream => "stream",
        }
    }
}

/// What a setting's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Type {
    /// Free text: a name, a host.
    Text,
    /// A path (`~` expanded) or, for `source`, an object store URL.
    Path,
    /// A URL (`redis://`, `http://`).
    Url,
    /// Bytes: `"64G"`, `"512MiB"`, a number.
    Size,
    /// A duration with its unit: `"30s"`, `"500ms"`.
    Duration,
    /// `true` or `false`.
    Bool,
    /// A whole number within bounds.
    Count {
        /// The least value taken.
        min: u64,
        /// The greatest value taken.
        max: u64,
    },
    /// One of a few words.
    Choice(&'static [&'static str]),
    /// A table (`[cluster]`) or a list of tables (`[[tiers]]`), whose keys are settings of their own.
    Section,
    /// A JSON object (`TIERSTORE_OBJECT_STORE`).
    Json,
}

impl Type {
    /// The type's name, as `_core.SETTINGS` gives it to Python.
    pub fn name(self) -> &'static str {
        match self {
            Type::Text => "text",
            Type::Path => "path",
            Type::Url => "url",
            Type::Size => "size",
            Type::Duration => "duration",
            Type::Bool => "bool",
            Type::Count { .. } => "count",
            Type::Choice(_) => "choice",
            Type::Section => "section",
            Type::Json => "json",
        }
    }
}

/// What a setting is when nothing sets it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DefaultIs {
    /// A value, written as the file would write it: the parser reads it as it reads a user's.
    Value(&'static str),
    /// Worked out when the cache starts (from the CPUs, the free space, Slurm's variables): how, in words.
    Derived(&'static str),
    /// Unset: the setting is off, or required.
    Unset,
}

/// One setting.
#[derive(Clone, Copy, Debug)]
pub struct Setting {
    /// Its table in the file.
    pub table: Table,
    /// Its key in that table; for a setting only the environment sets, the variable.
    pub key: &'static str,
    /// What its value is.
    pub ty: Type,
    /// What it is when nothing sets it.
    pub default: DefaultIs,
    /// The `TIERSTORE_*` variable that sets it, over the file.
    pub env: Option<&'static str>,
    /// The keyword of `tierstore.Cache(...)` that sets it, over the file and the environment.
    pub argument: Option<&'static str>,
    /// The option of the `tierstore` command that sets it.
    pub flag: Option<&'static str>,
    /// One line: what it does.
    pub doc: &'static str,
}

impl Setting {
    const fn new(table: Table, key: &'static str, ty: Type, default: DefaultIs, doc: &'static str) -> Setting {
        Setting { table, key, ty, default, env: None, argument: None, flag: None, doc }
    }

    const fn env(self, var: &'static str) -> Setting {
        Setting { env: Some(var), ..self }
    }

    const fn argument(self, name: &'static str) -> Setting {
        Setting { argument: Some(name), ..self }
    }

    const fn flag(self, flag: &'static str) -> Setting {
        Setting { flag: Some(flag), ..self }
    }

    /// The setting's name as errors and `config show` write it: `policy`, `cluster.port`.
    pub fn name(&self) -> String {
        match self.table {
            Table::Top | Table::Environment => self.key.to_string(),
            t => format!("{}.{}", t.name(), self.key),
        }
    }

    /// Whether the value is one string or number (not a table, a list or JSON).
    pub fn is_scalar(&self) -> bool {
        !matches!(self.ty, Type::Section | Type::Json)
    }
}

use DefaultIs::{Derived, Unset, Value};
use Table::*;
use Type::*;

/// The choices of `policy` (placement and eviction).
pub const POLICIES: &[&str] = &["fill", "lru", "lfu", "fifo"];

/// Every setting, by table in the order the configuration reference lists them.
pub const SETTINGS: &[Setting] = &[
    // The top of the file.
    Setting::new(Top, "source", Path, Unset, "The dataset: a directory on the shared store, or an object store URL.")
        .env("TIERSTORE_SOURCE")
        .argument("source")
        .flag("--source"),
    Setting::new(
        Top,
        "tiers",
        Section,
        Derived("one tier in ~/.cache/tierstore, half of its disk's free space"),
        "Cache tiers, fastest first.",
    )
    .env("TIERSTORE_TIERS")
    .argument("tiers")
    .flag("--tier"),
    Setting::new(Top, "policy", Choice(POLICIES), Value("fill"), "Placement and eviction policy.")
        .env("TIERSTORE_POLICY")
        .argument("policy")
        .flag("--policy"),
    Setting::new(
        Top,
        "threads",
        Count { min: 1, max: 256 },
        Derived("twice the CPUs, between 2 and 16"),
        "Threads of the background copy pool.",
    )
    .env("TIERSTORE_THREADS")
    .argument("threads"),
    Setting::new(Top, "inline_max", Size, Value("8MiB"), "Files up to this size are read whole on a miss.")
        .env("TIERSTORE_INLINE_MAX")
        .argument("inline_max"),
    Setting::new(
        Top,
        "verify",
        Choice(&["metadata", "checksum"]),
        Value("metadata"),
        "How a copy is checked when it is opened.",
    )
    .env("TIERSTORE_VERIFY")
    .argument("verify"),
    // A minute, as gcsfuse, goofys and Mountpoint for S3 keep metadata, and as NFS's `acregmax`; a dataset
    // that changes under a running job asks for "always".
    Setting::new(
        Top,
        "revalidate",
        Duration,
        Value("60s"),
        "When a copy is checked against the source: \"always\", \"never\" or a duration.",
    )
    .env("TIERSTORE_REVALIDATE")
    .argument("revalidate"),
    Setting::new(Top, "cluster", Section, Unset, "Sharing the cache across the nodes of a job."),
    Setting::new(Top, "object_store", Section, Unset, "How an object store source is reached.")
        .env("TIERSTORE_OBJECT_STORE")
        .argument("object_store"),
    Setting::new(Top, "s3", Section, Unset, "The older name of object_store, still read.").argument("s3"),
    Setting::new(Top, "writeback", Section, Unset, "Destinations whose writes are staged on the node first.")
        .env("TIERSTORE_WRITEBACK"),
    Setting::new(Top, "stream", Section, Unset, "The node agent's side of model streaming."),
    // [[tiers]]
    Setting::new(Tiers, "path", Path, Unset, "The tier's directory."),
    Setting::new(
        Tiers,
        "quota",
        Size,
        Derived("half of the disk's free space when the cache starts"),
        "Most bytes of copies the tier holds.",
    ),
    Setting::new(
        Tiers,
        "kind",
        Choice(&["memory", "local"]),
        Derived("memory on tmpfs and ramfs, else local"),
        "Whether the tier is RAM or a local disk.",
    ),
    // [cluster]
    Setting::new(
        Cluster,
        "sharing",
        Choice(&["off", "inclusive", "partitioned"]),
        Value("off"),
        "Whether and how the nodes share their caches.",
    )
    .env("TIERSTORE_SHARING"),
    Setting::new(
        Cluster,
        "peers",
        Text,
        Derived("$SLURM_JOB_NODELIST"),
        "The job's members, in Slurm hostlist syntax.",
    )
    .env("TIERSTORE_PEERS"),
    Setting::new(Cluster, "registry", Url, Unset, "A Redis the members of an elastic job register in.")
        .env("TIERSTORE_REGISTRY"),
    Setting::new(
        Cluster,
        "job",
        Text,
        Derived("slurm-$SLURM_JOB_ID under Slurm, else tierstore"),
        "The job's name in the registry.",
    )
    .env("TIERSTORE_JOB"),
    Setting::new(Cluster, "node", Text, Derived("the host name"), "Which member this node is.").env("TIERSTORE_NODE"),
    Setting::new(
        Cluster,
        "port",
        Count { min: 1, max: 65535 },
        Value("7078"),
        "The TCP port this node's agent serves peers on.",
    )
    .env("TIERSTORE_PORT"),
    Setting::new(Cluster, "listen", Text, Value("127.0.0.1"), "The address this node's agent listens on.")
        .env("TIERSTORE_LISTEN"),
    Setting::new(Cluster, "token_file", Path, Derived("~/.tierstore/token"), "The job's shared secret.")
        .env("TIERSTORE_TOKEN_FILE"),
    Setting::new(Cluster, "encrypt", Bool, Value("false"), "Encrypt every frame between nodes.")
        .env("TIERSTORE_ENCRYPT"),
    // [object_store] (and [s3]): tierstore's own keys.
    Setting::new(ObjectStore, "timeout", Duration, Value("30s"), "The deadline of one request, body included."),
    Setting::new(ObjectStore, "connect_timeout", Duration, Value("5s"), "The deadline of connecting to the endpoint."),
    Setting::new(ObjectStore, "retries", Count { min: 0, max: 100 }, Value("3"), "Retries of a failed request."),
    Setting::new(
        ObjectStore,
        "range_size",
        Size,
        Value("8M"),
        "Objects larger than this are fetched as parallel ranges of it.",
    ),
    Setting::new(
        ObjectStore,
        "ranges_in_flight",
        Count { min: 1, max: 256 },
        Value("8"),
        "Ranges of one object fetched at once.",
    ),
    // [s3]: the short names an s3:// source has always taken.
    Setting::new(
        S3,
        "endpoint",
        Url,
        Derived("$AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL, the profile, else AWS"),
        "The S3-compatible server.",
    ),
    Setting::new(
        S3,
        "region",
        Text,
        Derived("$AWS_REGION, $AWS_DEFAULT_REGION, the profile, else us-east-1"),
        "The bucket's region.",
    ),
    Setting::new(S3, "profile", Text, Derived("$AWS_PROFILE, else default"), "The profile of the AWS shared files."),
    Setting::new(S3, "access_key_id", Text, Derived("$AWS_ACCESS_KEY_ID, the profile"), "Credentials."),
    Setting::new(
        S3,
        "secret_access_key",
        Text,
        Derived("$AWS_SECRET_ACCESS_KEY, the profile"),
        "Credentials; never printed.",
    ),
    Setting::new(
        S3,
        "session_token",
        Text,
        Derived("$AWS_SESSION_TOKEN, the profile"),
        "Temporary credentials; never printed.",
    ),
    // [[writeback]]
    Setting::new(Writeback, "path", Path, Unset, "The destination on the shared store."),
    Setting::new(Writeback, "stage", Path, Unset, "The node-local directory the writes land in first."),
    Setting::new(
        Writeback,
        "quota",
        Size,
        Derived("nine tenths of the stage's free space at start"),
        "Staged bytes at most.",
    ),
    Setting::new(
        Writeback,
        "durability",
        Choice(&["buffered", "local", "remote"]),
        Value("buffered"),
        "What close() promises.",
    ),
    Setting::new(
        Writeback,
        "timeout",
        Duration,
        Value("10m"),
        "The longest a remote close or a sync waits for the store.",
    ),
    // [stream]
    Setting::new(
        Stream,
        "redis",
        Url,
        Derived("the [cluster] registry, else none"),
        "Where versions are announced and followed.",
    )
    .env("TIERSTORE_STREAM_REDIS"),
    Setting::new(Stream, "keep", Count { min: 1, max: u64::MAX }, Value("2"), "Versions kept per stream.")
        .env("TIERSTORE_STREAM_KEEP"),
    Setting::new(Stream, "dir", Path, Value("/dev/shm"), "Where the versions' tensors are kept.")
        .env("TIERSTORE_STREAM_DIR"),
    Setting::new(
        Stream,
        "spares",
        Bool,
        Value("true"),
        "Allocate the memory of the next publish's changed tensors ahead (at most the last publish's new bytes).",
    )
    .env("TIERSTORE_STREAM_SPARES"),
    // Only in the environment.
    Setting::new(Environment, "TIERSTORE_CONFIG", Path, Derived("./tierstore.toml when it exists"), "The TOML file.")
        .env("TIERSTORE_CONFIG")
        .argument("config")
        .flag("--config"),
    Setting::new(
        Environment,
        "TIERSTORE_LOG",
        Choice(&["off", "error", "warn", "info", "debug", "trace"]),
        Value("warn"),
        "What tierstore says on stderr.",
    )
    .env("TIERSTORE_LOG")
    .flag("--verbose"),
    Setting::new(Environment, "TIERSTORE_MODELS", Path, Unset, "The model repository of `tierstore models`.")
        .env("TIERSTORE_MODELS"),
    Setting::new(
        Environment,
        "TIERSTORE_PEER_CONNECT_MS",
        Count { min: 1, max: 3_600_000 },
        Value("1000"),
        "The deadline of connecting to a peer's agent, in ms.",
    )
    .env("TIERSTORE_PEER_CONNECT_MS"),
    Setting::new(
        Environment,
        "TIERSTORE_PEER_DEADLINE_MS",
        Count { min: 1, max: 3_600_000 },
        Value("5000"),
        "The deadline of every frame exchanged with a peer, in ms.",
    )
    .env("TIERSTORE_PEER_DEADLINE_MS"),
    Setting::new(
        Environment,
        "TIERSTORE_PEER_FETCH_WAIT_MS",
        Count { min: 1, max: 86_400_000 },
        Value("300000"),
        "How long a reader waits for an owner still fetching, in ms.",
    )
    .env("TIERSTORE_PEER_FETCH_WAIT_MS"),
    Setting::new(
        Environment,
        "TIERSTORE_PART_BLOCKS_MIB",
        Count { min: 1, max: 1 << 30 },
        Value("1024"),
        "The agent's memory for blocks of partial model loads, in MiB.",
    )
    .env("TIERSTORE_PART_BLOCKS_MIB"),
    // A parallel file system stripes a large file over several servers so that clients read it in parallel,
    // and one reader waits for each read in turn: docs/benchmarks/ranged.md measures 1 to 8 streams.
    Setting::new(
        Environment,
        "TIERSTORE_COPY_STREAMS",
        Count { min: 1, max: 64 },
        Value("4"),
        "Ranged readers copying a large file from a POSIX store.",
    )
    .env("TIERSTORE_COPY_STREAMS"),
    Setting::new(
        Environment,
        "TIERSTORE_ORDER",
        Path,
        Unset,
        "tierstore run --order: the job's files in reading order.",
    )
    .env("TIERSTORE_ORDER"),
    Setting::new(
        Environment,
        "TIERSTORE_ORDER_BUDGET",
        Size,
        Value("2G"),
        "tierstore run --budget: bytes fetched ahead of the reads at most.",
    )
    .env("TIERSTORE_ORDER_BUDGET"),
    Setting::new(
        Environment,
        "TIERSTORE_ORDER_MARKS",
        Path,
        Unset,
        "Set by tierstore run --order: the read-marks file.",
    )
    .env("TIERSTORE_ORDER_MARKS"),
    Setting::new(
        Environment,
        "TIERSTORE_SAMPLER_PREFETCH",
        Text,
        Value("auto"),
        "DataLoaders prefetch in their sampler's order: auto, off, or a budget.",
    )
    .env("TIERSTORE_SAMPLER_PREFETCH"),
    Setting::new(
        Environment,
        "TIERSTORE_WRITEBACK_ONLY",
        Bool,
        Unset,
        "Set by tierstore run: the shim only stages writes.",
    )
    .env("TIERSTORE_WRITEBACK_ONLY"),
];

/// The keys `table` takes in the file, in the reference's order. `[s3]` takes its short names and every
/// key of `[object_store]`.
pub fn keys_of(table: Table) -> Vec<&'static str> {
    let of = |t: Table| SETTINGS.iter().filter(move |s| s.table == t).map(|s| s.key);
    match table {
        Table::S3 => of(Table::S3).chain(of(Table::ObjectStore)).collect(),
        Table::Environment => Vec::new(),
        t => of(t).collect(),
    }
}

/// The setting `key` of `table`.
pub fn find(table: Table, key: &str) -> Option<&'static Setting> {
    SETTINGS.iter().find(|s| s.table == table && s.key == key)
}

/// The top-level settings of one value each (`source`, `policy`, `threads`, ...): a keyword of
/// `tierstore.Cache(...)` gives them by the key, through [`Overrides::settings`](super::Overrides::settings).
pub fn top_values() -> impl Iterator<Item = &'static Setting> {
    SETTINGS.iter().filter(|s| s.table == Table::Top && s.is_scalar())
}

/// The default of `key` in `table` as the file would write it, when it has one.
pub fn default_value(table: Table, key: &str) -> Option<&'static str> {
    match find(table, key)?.default {
        Value(v) => Some(v),
        _ => None,
    }
}

/// Every `TIERSTORE_*` variable that sets something.
pub fn env_vars() -> Vec<&'static str> {
    SETTINGS.iter().filter_map(|s| s.env).collect()
}

/// The value of the whole-number setting `key` of `table`, read within its declared bounds, which are
/// written nowhere else: `Err` is the fix to give ("use a whole number from 1 to 256").
pub fn parse_count(table: Table, key: &str, text: &str) -> Result<u64, String> {
    let Some(&Setting { ty: Count { min, max }, .. }) = find(table, key) else {
        panic!("{}.{key} is not a whole-number setting", table.name())
    };
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|n| (min..=max).contains(n))
        .ok_or_else(|| format!("use a whole number from {min} to {max}"))
}

/// A whole-number knob only the environment sets (`TIERSTORE_PEER_DEADLINE_MS`, `TIERSTORE_COPY_STREAMS`):
/// the variable's value within the setting's bounds, else its default. A value that is not one is said in
/// the log with the bounds, once per read, and the default is used: these tune, and a job must not stop
/// for a typo in one.
pub fn tuning(var: &str) -> u64 {
    let setting = SETTINGS.iter().find(|s| s.env == Some(var)).unwrap_or_else(|| panic!("{var} is not a setting"));
    let Value(default) = setting.default else { panic!("{var} has no default") };
    let default: u64 = default.parse().expect("a count's default is a number");
    let Ok(text) = std::env::var(var) else { return default };
    parse_count(setting.table, setting.key, &text).unwrap_or_else(|fix| {
        log::warn!("{var}={text:?} is not taken: {fix}; using {default}");
        default
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_setting_is_named_once_and_every_variable_once() {
        let mut names: Vec<String> = SETTINGS.iter().map(Setting::name).collect();
        names.sort();
        let all = names.len();
        names.dedup();
        assert_eq!(names.len(), all, "a setting is declared twice");
        let mut vars = env_vars();
        vars.sort();
        let all = vars.len();
        vars.dedup();
        assert_eq!(vars.len(), all, "a variable sets two settings");
        assert!(vars.iter().all(|v| v.starts_with("TIERSTORE_")));
    }

    #[test]
    fn each_default_value_is_one_its_type_takes() {
        for s in SETTINGS {
            let Value(v) = s.default else { continue };
            let ok = match s.ty {
                Size => crate::config::parse_size(v).is_some(),
                Duration => crate::config::values::parse_duration(v).is_some(),
                Bool => ["true", "false"].contains(&v),
                Count { min, max } => v.parse::<u64>().is_ok_and(|n| (min..=max).contains(&n)),
                Choice(words) => words.contains(&v),
                Text | Path | Url => !v.is_empty(),
                Section | Json => false,
            };
            assert!(ok, "{}: the default {v:?} is not a {}", s.name(), s.ty.name());
        }
    }

    #[test]
    fn the_constants_the_code_names_agree_with_the_table() {
        assert_eq!(default_value(Cluster, "port"), Some(crate::cluster::DEFAULT_PORT.to_string().as_str()));
        assert_eq!(keys_of(S3).len(), 11);
    }

    #[test]
    fn a_knob_outside_its_bounds_keeps_its_default() {
        // Each variable is read by this test alone (the process's other tests do not set it).
        std::env::set_var("TIERSTORE_PEER_FETCH_WAIT_MS", "250");
        assert_eq!(tuning("TIERSTORE_PEER_FETCH_WAIT_MS"), 250);
        std::env::set_var("TIERSTORE_PEER_FETCH_WAIT_MS", "0");
        assert_eq!(tuning("TIERSTORE_PEER_FETCH_WAIT_MS"), 300_000);
        std::env::set_var("TIERSTORE_PEER_FETCH_WAIT_MS", "soon");
        assert_eq!(tuning("TIERSTORE_PEER_FETCH_WAIT_MS"), 300_000);
        std::env::remove_var("TIERSTORE_PEER_FETCH_WAIT_MS");
        assert_eq!(tuning("TIERSTORE_PEER_FETCH_WAIT_MS"), 300_000);
    }
}
