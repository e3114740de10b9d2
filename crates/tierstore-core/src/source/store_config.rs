//! Which object store a source names and how it is reached: the store's kind, bucket (or container, or
//! host) and prefix from `source = "s3://bucket/prefix"` (also `gs://`, `az://`, `abfs://`, `http(s)://`),
//! and the `[object_store]` table of the configuration (`[s3]` is its older name, still read). Credentials
//! come each store's standard ways (the AWS variables and profile files, `GOOGLE_*`, `AZURE_*`), and keys
//! of the table override them. Kept apart from the client (`object.rs`) so that a build without object
//! stores (the shim) still reads and checks the configuration, and says what is missing.

// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::settings::{default_value, keys_of, parse_count, Table};
use crate::config::values::{bad, parse_duration, parse_size, scalar, ConfigError, Origin};

/// tierstore's own keys of the `[object_store]` table, the same for every kind of store: deadlines,
/// retries and how large objects are split (declared in `config/settings.rs`). Every other key of the
/// table is one of `object_store`'s own option keys for the source's kind (`aws_*`, `google_*`, `azure_*`,
/// or a client key such as `allow_http`), passed to its builder.
pub fn store_keys() -> Vec<&'static str> {
    keys_of(Table::ObjectStore)
}

/// The default of one of tierstore's own keys, as the settings table writes it.
fn default_of(key: &str) -> &'static str {
    default_value(Table::ObjectStore, key).expect("every own key of [object_store] has a default")
}

/// The kind of object store a source URL names; everything tierstore knows of it is its row of
/// [`STORES`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StoreKind {
    /// Amazon S3 or an S3-compatible server: `s3://bucket/prefix`.
    S3,
    /// Google Cloud Storage: `gs://bucket/prefix`.
    Gcs,
    /// Azure Blob Storage: `az://container/prefix`, `abfs[s]://container@account.dfs.core.windows.net/prefix`.
    Azure,
    /// A plain HTTP(S) server that lists through WebDAV: `http(s)://host:port/prefix`.
    Http,
}

/// What the part of a source URL after the scheme names first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Authority {
    /// A bucket: lower-case letters, digits, hyphens and `punctuation`, 3 to 63 characters (`dotted_max`
    /// when it has dots).
    Bucket {
        /// The characters besides letters, digits and hyphens a bucket's name may hold.
        punctuation: &'static [u8],
        /// The longest name with a dot.
        dotted_max: usize,
    },
    /// A container, alone or with its storage account (`container@account.dfs.core.windows.net`).
    ContainerAtAccount,
    /// A server, `host[:port]`: the URL's scheme and authority are the client's base URL.
    Server,
}

/// One kind of object store: adding a store is adding a row to [`STORES`] and its builder to `object.rs`'s
/// `BUILDERS` (and a testing server and a conformance run; see the contributing page).
pub struct Store {
    /// Which store it is.
    pub kind: StoreKind,
    /// The URL schemes that name it.
    pub schemes: &'static [&'static str],
    /// Its name, as messages give it.
    pub name: &'static str,
    /// What its buckets are called, for messages.
    pub bucket_word: &'static str,
    /// What a source URL names after its scheme.
    pub authority: Authority,
    /// Where credentials come from, for the message of a refused or missing one.
    pub credentials: &'static str,
    /// Where the endpoint is set, for the message of an unreachable store.
    pub endpoint_setting: &'static str,
    /// Keys one listing request returns at most, to count the requests a listing took.
    pub list_page: u64,
    /// Option keys of its client, for the message of a key it does not take.
    pub option_examples: &'static str,
    /// Whether `key` is an option its client takes: the client's typed config-key enum parses it. (Its
    /// builder is its line of `object.rs`'s `BUILDERS`.) A build without object stores (the shim) reads
    /// the configuration without it.
    #[cfg(feature = "object-store")]
    pub takes: fn(&str) -> bool,
}

/// Every kind of object store a source may be.
pub static STORES: [Store; 4] = [
    Store {
        kind: StoreKind::S3,
        schemes: &["s3"],
        name: "S3",
        bucket_word: "bucket",
        authority: Authority::Bucket { punctuation: b".", dotted_max: 63 },
        credentials: "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, AWS_PROFILE, or [object_store] aws_access_key_id \
                      and aws_secret_access_key",
        endpoint_setting: "AWS_ENDPOINT_URL or [object_store] endpoint",
        list_page: 1000,
        option_examples: "endpoint, region, aws_access_key_id, aws_secret_access_key, \
                          aws_virtual_hosted_style_request",
        #[cfg(feature = "object-store")]
        takes: |k| k.parse::<object_store::aws::AmazonS3ConfigKey>().is_ok(),
    },
    Store {
        kind: StoreKind::Gcs,
        schemes: &["gs"],
        name: "Google Cloud Storage",
        bucket_word: "bucket",
        authority: Authority::Bucket { punctuation: b"._", dotted_max: 222 },
        credentials: "GOOGLE_SERVICE_ACCOUNT (a service account's JSON file) or GOOGLE_APPLICATION_CREDENTIALS, or \
                      [object_store] google_service_account",
        endpoint_setting: "[object_store] google_base_url",
        list_page: 1000,
        option_examples: "google_service_account, google_service_account_key, google_base_url, google_skip_signature",
        #[cfg(feature = "object-store")]
        takes: |k| k.parse::<object_store::gcp::GoogleConfigKey>().is_ok(),
    },
    Store {
        kind: StoreKind::Azure,
        schemes: &["az", "azure", "abfs", "abfss"],
        name: "Azure Blob Storage",
        bucket_word: "container",
        authority: Authority::ContainerAtAccount,
        credentials: "AZURE_STORAGE_ACCOUNT_NAME with AZURE_STORAGE_ACCOUNT_KEY or AZURE_STORAGE_SAS_KEY, or \
                      [object_store] azure_storage_account_name and azure_storage_account_key",
        endpoint_setting: "[object_store] azure_storage_endpoint, or azure_storage_use_emulator",
        list_page: 5000,
        option_examples: "azure_storage_account_name, azure_storage_account_key, azure_storage_sas_key, \
                          azure_storage_endpoint, azure_storage_use_emulator",
        #[cfg(feature = "object-store")]
        takes: |k| k.parse::<object_store::azure::AzureConfigKey>().is_ok(),
    },
    Store {
        kind: StoreKind::Http,
        schemes: &["http", "https"],
        name: "HTTP (WebDAV)",
        bucket_word: "server",
        authority: Authority::Server,
        credentials: "the server's own access rules (the HTTP source sends no credentials)",
        endpoint_setting: "the source URL",
        // WebDAV answers a PROPFIND of any depth in one response.
        list_page: u64::MAX,
        option_examples: "allow_http, allow_invalid_certificates, proxy_url, user_agent",
        #[cfg(feature = "object-store")]
        takes: |k| k.parse::<object_store::ClientConfigKey>().is_ok(),
    },
];

impl StoreKind {
    /// Everything tierstore knows of this kind of store.
    pub fn store(self) -> &'static Store {
        STORES.iter().find(|s| s.kind == self).expect("every kind of store has its row")
    }

    /// The kind of store the URL scheme `scheme` names.
    pub fn of_scheme(scheme: &str) -> Option<StoreKind> {
        STORES.iter().find(|s| s.schemes.contains(&scheme)).map(|s| s.kind)
    }

    /// The store's name, as messages give it.
    pub fn name(self) -> &'static str {
        self.store().name
    }
}

/// Where an object store source is and how to talk to it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoreConfig {
    /// The kind of store.
    pub kind: StoreKind,
    /// The source as given, normalized: `s3://bucket` or `s3://bucket/prefix` (no trailing slash).
    pub url: String,
    /// The bucket (S3, GCS), the container (Azure) or `scheme://host:port` (HTTP).
    pub bucket: String,
    /// The Azure storage account the URL names (`abfs://container@ACCOUNT.dfs.core.windows.net`).
    pub account: Option<String>,
    /// The prefix inside the bucket, without slashes at either end (`""` for the whole bucket).
    pub prefix: String,
    /// Keys of the table that are the store's own options (or the short `[s3]` names): key → value.
    pub settings: BTreeMap<String, String>,
    /// Every key of the table as it was given, tierstore's own keys included: its text, and where it was
    /// set (a file, `$TIERSTORE_OBJECT_STORE`, an argument). What `config show` says of them.
    pub given: BTreeMap<String, (String, Origin)>,
    /// The deadline of one request, body included; a dead server never holds a reader longer (per try).
    pub timeout: Duration,
    /// The deadline of connecting to the endpoint.
    pub connect_timeout: Duration,
    /// How many times a failed request (5xx, connection reset, timeout) is retried, with capped
    /// exponential back-off and jitter.
    pub retries: usize,
    /// Objects larger than this are fetched as parallel ranges of this size; smaller ones in one GET.
    pub range_size: u64,
    /// Ranges of one object fetched at once.
    pub ranges_in_flight: usize,
}

/// Whether a setting's value is a secret, never printed: keys, tokens, passwords, signatures.
pub fn is_secret(key: &str) -> bool {
    ["secret", "token", "key", "password", "sas", "credential"].iter().any(|w| key.contains(w))
        && !key.ends_with("key_id")
}

impl std::fmt::Debug for StoreConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret: `config show` and error messages print the configuration.
        let settings: BTreeMap<&str, &str> =
            self.settings.iter().map(|(k, v)| (k.as_str(), if is_secret(k) { "(hidden)" } else { v })).collect();
        f.debug_struct("StoreConfig")
            .field("url", &self.url)
            .field("settings", &settings)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .finish_non_exhaustive()
    }
}

/// A URL that is not a usable object store source; the message says what to write instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadUrl(pub String);

/// Whether a configured source names an object store rather than a directory.
pub fn is_url(source: &str) -> bool {
    source.contains("://")
}

/// The URL forms, for the message of one that is not supported.
const FORMS: &str = "s3://BUCKET/PREFIX (any S3-compatible store), gs://BUCKET/PREFIX, az://CONTAINER/PREFIX, \
                     abfs://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX, http(s)://HOST[:PORT]/PREFIX, or a directory";

/// Whether `name` is a valid bucket: lower-case letters, digits, hyphens and the store's `punctuation`,
/// 3 to 63 characters (`dotted_max` with dots).
fn valid_bucket(name: &str, punctuation: &[u8], dotted_max: usize) -> bool {
    let max = if name.contains('.') { dotted_max } else { 63 };
    (3..=max).contains(&name.len())
        && name.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || punctuation.contains(&b))
}

impl StoreConfig {
    /// Parses a source URL with the defaults for everything else.
    pub fn parse(url: &str) -> Result<StoreConfig, BadUrl> {
        let (scheme, rest) = url.split_once("://").unwrap_or(("", url));
        let Some(kind) = StoreKind::of_scheme(scheme) else {
            return Err(BadUrl(format!("the object store scheme {scheme:?} is not supported; give {FORMS}")));
        };
        let store = kind.store();
        let (authority, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let (bucket, account) = match (store.authority, authority.split_once('@')) {
            (Authority::ContainerAtAccount, Some((container, host))) => {
                let account = host.split('.').next().unwrap_or("");
                if account.is_empty() {
                    return Err(BadUrl(format!(
                        "{url:?} names no storage account; write {scheme}://CONTAINER@ACCOUNT.dfs.core.windows.net/PREFIX"
                    )));
                }
                (container.to_string(), Some(account.to_string()))
            }
            (Authority::Server, _) => {
                if authority.is_empty() || authority.contains('@') {
                    return Err(BadUrl(format!(
                        "{url:?} names no server; write {scheme}://HOST[:PORT]/PREFIX (credentials in the URL are \
                         not taken)"
                    )));
                }
                (format!("{scheme}://{authority}"), None)
            }
            _ => (authority.to_string(), None),
        };
        let (punctuation, dotted_max) = match store.authority {
            Authority::Bucket { punctuation, dotted_max } => (punctuation, dotted_max),
            Authority::ContainerAtAccount => (&b""[..], 63),
            Authority::Server => (&b""[..], usize::MAX),
        };
        if store.authority != Authority::Server && !valid_bucket(&bucket, punctuation, dotted_max) {
            let word = store.bucket_word;
            return Err(BadUrl(format!(
                "{bucket:?} is not a {word} name; write {scheme}://{}/PREFIX with a {word} of 3 to 63 lower-case \
                 letters, digits{} and hyphens",
                word.to_uppercase(),
                if punctuation.contains(&b'.') { ", dots" } else { "" }
            )));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..") || prefix.contains("//") {
            return Err(BadUrl(format!(
                "the prefix {prefix:?} has empty, \".\" or \"..\" parts; write {scheme}://{authority}/a/b"
            )));
        }
        let base = format!("{scheme}://{authority}");
        let url = if prefix.is_empty() { base } else { format!("{base}/{prefix}") };
        Ok(StoreConfig {
            kind,
            url,
            bucket,
            account,
            prefix: prefix.to_string(),
            settings: BTreeMap::new(),
            given: BTreeMap::new(),
            timeout: parse_duration(default_of("timeout")).expect("a duration"),
            connect_timeout: parse_duration(default_of("connect_timeout")).expect("a duration"),
            retries: default_of("retries").parse().expect("a count"),
            range_size: parse_size(default_of("range_size")).expect("a size"),
            ranges_in_flight: default_of("ranges_in_flight").parse().expect("a count"),
        })
    }

    /// The object key of a source-relative path.
    pub fn key_of(&self, rel: &str) -> String {
        if self.prefix.is_empty() || rel.is_empty() {
            if rel.is_empty() {
                return self.prefix.clone();
            }
            rel.to_string()
        } else {
            format!("{}/{rel}", self.prefix)
        }
    }

    /// The URL of a source-relative path (`s3://bucket/prefix/rel`).
    pub fn url_of(&self, rel: &str) -> String {
        if rel.is_empty() {
            self.url.clone()
        } else {
            format!("{}/{rel}", self.url)
        }
    }

    /// The path of `name` relative to the prefix: a full URL under it, or a key relative to the
    /// prefix (`a/b.bin`). `None` for anything else (another bucket, a path on a file system, `..`).
    pub fn relative(&self, name: &str) -> Option<String> {
        let rel = match name.strip_prefix(&self.url) {
            Some("") => return Some(String::new()),
            Some(rest) => rest.strip_prefix('/')?,
            None if is_url(name) || name.starts_with('/') => return None,
            None => name,
        };
        let rel = rel.trim_end_matches('/');
        if rel.split('/').any(|p| p.is_empty() || p == "." || p == "..") {
            return None;
        }
        Some(rel.to_string())
    }
}

/// One key of the store's table as the configuration file or the API gave it: its value, where it was
/// set, and under which table's name (`"object_store"`, or `"s3"` for the older name).
pub(crate) type TableKey = (toml::Value, Origin, &'static str);

/// The short names of the `[s3]` table that are not `object_store` option keys of their own.
const S3_SHORT: &[&str] = &["endpoint", "region", "profile", "access_key_id", "secret_access_key", "session_token"];

/// Validates the table's keys into `c` (the store, bucket and prefix parsed from the source).
pub(crate) fn validate(mut c: StoreConfig, keys: &BTreeMap<String, TableKey>) -> Result<StoreConfig, ConfigError> {
    for (k, (v, o, table)) in keys {
        let text = scalar(v);
        let key = format!("{table}.{k}");
        c.given.insert(k.clone(), (text.clone(), o.clone()));
        match k.as_str() {
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
                c.retries = parse_count(Table::ObjectStore, "retries", &text)
                    .map_err(|fix| bad(o, &key, &text, "is not a retry count", &fix))?
                    as usize;
            }
            "range_size" => {
                c.range_size = parse_size(&text).filter(|n| *n >= 64 << 10).ok_or_else(|| {
                    bad(o, &key, &text, "is not a range size of at least 64 KiB", "use a size like \"8M\"")
                })?;
            }
            "ranges_in_flight" => {
                c.ranges_in_flight = parse_count(Table::ObjectStore, "ranges_in_flight", &text)
                    .map_err(|fix| bad(o, &key, &text, "is not a number of ranges", &fix))?
                    as usize;
            }
            _ if *table == "s3" && c.kind != StoreKind::S3 => {
                return Err(bad(
                    o,
                    &key,
                    &text,
                    &format!("is set in [s3] but the source is {}", c.kind.name()),
                    "write the store's settings in an [object_store] table",
                ));
            }
            "endpoint" if c.kind == StoreKind::S3 && !(text.starts_with("http://") || text.starts_with("https://")) => {
                return Err(bad(o, &key, &text, "is not an http(s) URL", "write http://HOST:PORT or https://HOST"));
            }
            _ if c.kind == StoreKind::S3 && S3_SHORT.contains(&k.as_str()) => {
                c.settings.insert(k.to_string(), text);
            }
            _ => {
                if let Some(problem) = option_problem(c.kind, k) {
                    return Err(bad(o, &key, &text, &problem, &option_fix(c.kind)));
                }
                c.settings.insert(k.to_string(), text);
            }
        }
    }
    Ok(c)
}

/// Why `key` is not an option of the client of a `kind` store (`None`: it is), asked of the client's own
/// key type when the configuration is read, so that a misspelt key is an error naming it rather than a
/// setting ignored. A build without object stores cannot tell, and leaves the question to the build that
/// reads the store.
fn option_problem(kind: StoreKind, key: &str) -> Option<String> {
    #[cfg(feature = "object-store")]
    {
        (!(kind.store().takes)(key)).then(|| format!("is not an option of the {} client", kind.name()))
    }
    #[cfg(not(feature = "object-store"))]
    {
        let _ = (kind, key);
        None
    }
}

/// What to write instead of a key the store's client does not take.
fn option_fix(kind: StoreKind) -> String {
    format!(
        "use one of tierstore's keys ({}) or an option of the object_store crate for {} such as {}",
        store_keys().join(", "),
        kind.name(),
        kind.store().option_examples
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_keys() {
        let c = StoreConfig::parse("s3://data-set/train/").unwrap();
        assert_eq!(
            (c.kind, c.bucket.as_str(), c.prefix.as_str(), c.url.as_str()),
            (StoreKind::S3, "data-set", "train", "s3://data-set/train")
        );
        assert_eq!(c.key_of("a/b.bin"), "train/a/b.bin");
        assert_eq!(c.relative("s3://data-set/train/a/b.bin").as_deref(), Some("a/b.bin"));
        assert_eq!(c.relative("a/b.bin").as_deref(), Some("a/b.bin"));
        assert_eq!(c.relative("s3://data-set/train").as_deref(), Some(""));
        assert_eq!(c.relative("s3://data-set/trainer/x"), None);
        assert_eq!(c.relative("s3://other/train/x"), None);
        assert_eq!(c.relative("gs://data-set/train/x"), None);
        assert_eq!(c.relative("/etc/passwd"), None);
        assert_eq!(c.relative("a/../../b"), None);
        let whole = StoreConfig::parse("s3://bucket").unwrap();
        assert_eq!(whole.key_of("x"), "x");
        assert!(StoreConfig::parse("ftp://b/p").unwrap_err().to_string().contains("not supported"));
        assert!(StoreConfig::parse("s3://B_ad/p").unwrap_err().to_string().contains("not a bucket name"));
        let mut secret = whole.clone();
        secret.settings.insert("secret_access_key".into(), "sekrit".into());
        secret.settings.insert("azure_storage_account_key".into(), "sekrit2".into());
        secret.settings.insert("access_key_id".into(), "public-id".into());
        let shown = format!("{secret:?}");
        assert!(!shown.contains("sekrit") && shown.contains("public-id"), "{shown}");
    }

    #[test]
    fn each_store_is_one_row_and_each_scheme_names_one_store() {
        for kind in [StoreKind::S3, StoreKind::Gcs, StoreKind::Azure, StoreKind::Http] {
            assert_eq!(STORES.iter().filter(|s| s.kind == kind).count(), 1, "{kind:?} has one row");
            for scheme in kind.store().schemes {
                assert_eq!(StoreKind::of_scheme(scheme), Some(kind), "{scheme}");
                let url = format!("{scheme}://data-set/train");
                let url = if kind == StoreKind::Http { url } else { url.replace("data-set", "dataset") };
                assert_eq!(StoreConfig::parse(&url).map(|c| c.kind).ok(), Some(kind), "{url}");
            }
        }
        let schemes: Vec<&str> = STORES.iter().flat_map(|s| s.schemes.iter().copied()).collect();
        let mut unique = schemes.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), schemes.len(), "a scheme names two stores");
        assert!(StoreConfig::parse("ftp://host/x").is_err_and(|e| e.0.contains("\"ftp\" is not supported")));
    }

    #[test]
    fn every_kind_of_store_has_its_url() {
        let gs = StoreConfig::parse("gs://my_data.example/train").unwrap();
        assert_eq!((gs.kind, gs.bucket.as_str(), gs.prefix.as_str()), (StoreKind::Gcs, "my_data.example", "train"));
        let az = StoreConfig::parse("az://weights/v1/").unwrap();
        assert_eq!((az.kind, az.bucket.as_str(), az.url.as_str()), (StoreKind::Azure, "weights", "az://weights/v1"));
        let abfs = StoreConfig::parse("abfss://weights@acct.dfs.core.windows.net/v1").unwrap();
        assert_eq!((abfs.bucket.as_str(), abfs.account.as_deref()), ("weights", Some("acct")));
        assert!(StoreConfig::parse("az://has.dot/x").unwrap_err().to_string().contains("not a container name"));
        let http = StoreConfig::parse("http://127.0.0.1:8080/data/train").unwrap();
        assert_eq!(
            (http.kind, http.bucket.as_str(), http.prefix.as_str()),
            (StoreKind::Http, "http://127.0.0.1:8080", "data/train")
        );
        assert_eq!(http.relative("http://127.0.0.1:8080/data/train/a.bin").as_deref(), Some("a.bin"));
        assert!(StoreConfig::parse("http://user:pw@host/x").unwrap_err().to_string().contains("no server"));
        assert!(StoreConfig::parse("gs://bkt/a/../c").unwrap_err().to_string().contains("\"..\""));
    }

    #[test]
    fn the_tables_keys_are_checked_for_the_store() {
        let table = |t: &'static str, k: &str, v: &str| {
            BTreeMap::from([(k.to_string(), (toml::Value::String(v.into()), Origin::Argument, t))])
        };
        let gs = || StoreConfig::parse("gs://bucket").unwrap();
        let c = validate(gs(), &table("object_store", "timeout", "2s")).unwrap();
        assert_eq!(c.timeout, Duration::from_secs(2));
        let err = validate(gs(), &table("s3", "endpoint", "http://x")).unwrap_err().to_string();
        assert!(err.contains("[object_store]"), "{err}");
        let s3 = validate(StoreConfig::parse("s3://bucket").unwrap(), &table("s3", "profile", "p")).unwrap();
        assert_eq!(s3.settings.get("profile").map(String::as_str), Some("p"));
        #[cfg(feature = "object-store")]
        {
            let err = validate(gs(), &table("object_store", "google_servce_account", "x")).unwrap_err().to_string();
            assert!(err.contains("google_servce_account") && err.contains("google_service_account"), "{err}");
            let ok = validate(gs(), &table("object_store", "google_base_url", "http://127.0.0.1:1")).unwrap();
            assert_eq!(ok.settings.len(), 1);
        }
    }

    #[test]
    fn the_written_defaults_are_the_parsed_ones_and_every_one_is_a_key() {
        let c = StoreConfig::parse("s3://bucket").unwrap();
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!((c.retries, c.range_size, c.ranges_in_flight), (3, 8 << 20, 8));
        assert!(store_keys().iter().all(|k| keys_of(Table::S3).contains(k) && !default_of(k).is_empty()));
    }
}
