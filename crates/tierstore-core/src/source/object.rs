//! An object store as the source, through the `object_store` crate: S3 and S3-compatible servers, Google
//! Cloud Storage, Azure Blob Storage, and HTTP servers that list through WebDAV, each behind the crate's one
//! `ObjectStore` trait. Only the constructor knows the kind (the store's builder, in [`BUILDERS`]);
//! everything after it, and every cost below, is the same for all of them.
//!
//! What each operation costs the store:
//! - **open** of an object no tier holds: one `GET` of its first range ([`StoreConfig::range_size`]), which
//!   also says its size and ETag. A small object arrives whole in that one request; a large one is fetched
//!   as parallel ranged `GET`s of the rest ([`StoreConfig::ranges_in_flight`] at once), written to the tier
//!   copy in order so that readers follow it.
//! - **identify** (`revalidate = "always"`, or another process's fetch in flight): one `HEAD`.
//! - **list** of a prefix: one `LIST` request per page of keys (a thousand on S3 and GCS, five thousand on
//!   Azure; one `PROPFIND` on WebDAV).
//!
//! An object's identity is its size, last-modified time and ETag (hashed into the identity's `ino` and
//! `dev`), and every response is checked against the version an open pinned: an object rewritten while it
//! is read fails the read ("changed while being read") instead of mixing two versions, and is never cached.
//!
//! `object_store` is async; each process drives it with a small tokio runtime of its own, started on the
//! first request (a process served wholly from the tiers never starts it). Requests have deadlines (the
//! `[object_store]` `timeout` per try, `connect_timeout`), and failures the store calls transient (5xx, resets,
//! time-outs) are retried `retries` times with capped exponential back-off and jitter.

use std::fs::File;
use std::io;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use futures::StreamExt;
use object_store::aws::{AmazonS3Builder, AmazonS3ConfigKey};
use object_store::azure::{AzureConfigKey, MicrosoftAzureBuilder};
use object_store::gcp::{GoogleCloudStorageBuilder, GoogleConfigKey};
use object_store::http::HttpBuilder;
use object_store::path::Path as Key;
use object_store::{
    BackoffConfig, ClientConfigKey, ClientOptions, GetOptions, GetRange, ObjectMeta, ObjectStore, ObjectStoreExt,
    RetryConfig,
};

use super::store_config::{StoreConfig, StoreKind};
use super::{CopyFault, ListedEntry, OutsideSource, Source, SourceFile};
use crate::counters::{source as slot, Counters};
use crate::index::SourceId;

/// A prefix of a bucket (or container, or WebDAV server) of an object store, with its counters.
pub struct ObjectSource {
    config: StoreConfig,
    root: PathBuf,
    counters: Arc<Counters>,
    store: Arc<dyn ObjectStore>,
    /// Where requests go, for messages: the endpoint URL, or AWS in its region.
    endpoint: String,
    /// The runtime, with the process that started it: a forked child (a DataLoader worker) inherits
    /// the memory but not the threads, and must never wait for them (see `Drop`).
    runtime: OnceLock<(u32, tokio::runtime::Runtime)>,
}

impl Drop for ObjectSource {
    fn drop(&mut self) {
        if let Some((pid, rt)) = self.runtime.take() {
            if pid == crate::process::pid() {
                // Requests still in flight belong to readers that are gone: do not wait for them.
                rt.shutdown_background();
            } else {
                // The runtime's threads live in the parent only; shutting it down here would wait for
                // them forever, and the client's connection pool may hold locks those threads held at
                // the fork. Leak both: the child is a worker that will exit.
                std::mem::forget(rt);
                std::mem::forget(self.store.clone());
            }
        }
    }
}

/// One version of an object, opened for reading.
pub struct ObjectFile {
    key: Key,
    rel: String,
    sid: SourceId,
    /// The first bytes, fetched by the open (the whole object when it is small).
    head: bytes::Bytes,
    /// The last range fetched by a read past `head`, so that small sequential reads of an uncached object
    /// cost one request per range, not one per read.
    window: Mutex<Option<(u64, bytes::Bytes)>>,
}

impl ObjectFile {
    /// The version of the object this handle reads.
    pub fn version(&self) -> &SourceId {
        &self.sid
    }
}

/// The identity of an object version from its metadata. The last-modified time is kept to the second:
/// a `HEAD` or `GET` says it in an HTTP date (seconds), a `LIST` in ISO 8601 with milliseconds, and the
/// two must name one version alike (the ETag tells versions of the same second apart). The ETag is taken
/// without its quotes, which some stores give in one answer and not in another (GCS: quoted from a
/// `HEAD`, bare in a listing).
fn identity(meta: &ObjectMeta) -> SourceId {
    let tag = blake3::hash(meta.e_tag.as_deref().unwrap_or("").trim_matches('"').as_bytes());
    let word = |i: usize| u64::from_le_bytes(tag.as_bytes()[i..i + 8].try_into().expect("8 bytes"));
    let secs = meta.last_modified.timestamp();
    SourceId { size: meta.size, mtime_ns: secs * 1_000_000_000, ctime_ns: 0, ino: word(0), dev: word(8), attrs: None }
}

/// A store's builder: its client over a source's configuration (see [`Built`]).
type Build = fn(&StoreConfig, ClientOptions, RetryConfig) -> Built;

/// A client built: the store, and the endpoint it talks to (for messages).
pub type Built = io::Result<(Box<dyn ObjectStore>, String)>;

/// The builder of each kind of store, beside its row of [`STORES`](super::store_config::STORES).
const BUILDERS: [(StoreKind, Build); 4] = [
    (StoreKind::S3, s3_store),
    (StoreKind::Gcs, gcs_store),
    (StoreKind::Azure, azure_store),
    (StoreKind::Http, http_store),
];

/// The builder of `kind`'s client.
fn builder(kind: StoreKind) -> Build {
    BUILDERS.iter().find(|(k, _)| *k == kind).map(|(_, b)| *b).expect("every kind of store has its builder")
}

/// The S3 client: the `[object_store]` table over the AWS variables over the profile files.
fn s3_store(config: &StoreConfig, client: ClientOptions, retry: RetryConfig) -> Built {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let profile = super::aws_profile::profile_settings(config.settings.get("profile").map(String::as_str)).settings;
    // Precedence: the table, then the environment (read by `from_env`), then the profile files.
    let mut builder = AmazonS3Builder::from_env().with_bucket_name(&config.bucket).with_client_options(client);
    let from_env = |keys: &[&str]| keys.iter().any(|k| env(k).is_some());
    for (key, value) in &profile {
        let shadowed = match key.as_str() {
            "region" => from_env(&["AWS_REGION", "AWS_DEFAULT_REGION"]),
            "endpoint_url" => from_env(&["AWS_ENDPOINT_URL", "AWS_ENDPOINT", "AWS_ENDPOINT_URL_S3"]),
            _ => from_env(&["AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"]),
        };
        if !shadowed {
            builder = builder.with_config(key.parse().map_err(io::Error::other)?, value);
        }
    }
    for (key, value) in &config.settings {
        let k = match key.as_str() {
            "profile" => continue, // read above
            // As the S3 endpoint, which the client prefers to the generic one: $AWS_ENDPOINT_URL_S3 sets it,
            // and the table's endpoint overrides the environment's.
            "endpoint" | "aws_endpoint" | "aws_endpoint_url" | "endpoint_url" => AmazonS3ConfigKey::S3Endpoint,
            other => other.parse().map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, e))?,
        };
        builder = builder.with_config(k, value);
    }
    // The endpoint the client uses: the S3 endpoint (the table's endpoint, $AWS_ENDPOINT_URL_S3), else the
    // generic one ($AWS_ENDPOINT_URL, the profile's endpoint_url).
    let endpoint = builder
        .get_config_value(&AmazonS3ConfigKey::S3Endpoint)
        .or_else(|| builder.get_config_value(&AmazonS3ConfigKey::Endpoint));
    let region = builder.get_config_value(&AmazonS3ConfigKey::Region).unwrap_or_else(|| "us-east-1".into());
    let has_key = builder.get_config_value(&AmazonS3ConfigKey::AccessKeyId).is_some();
    let unsigned = builder.get_config_value(&AmazonS3ConfigKey::SkipSignature).is_some_and(|v| v == "true");
    if endpoint.is_some() && !has_key && !unsigned {
        // Without keys the client would ask the EC2 instance metadata service, which a store that is not
        // AWS never answers.
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            format!(
                "no credentials for {} at {}: set {}, or a profile in ~/.aws/credentials",
                config.url,
                endpoint.as_deref().unwrap_or(""),
                StoreKind::S3.store().credentials
            ),
        ));
    }
    let endpoint = endpoint.unwrap_or_else(|| format!("https://s3.{region}.amazonaws.com"));
    let builder = builder.with_region(region).with_allow_http(endpoint.starts_with("http://")).with_retry(retry);
    Ok((Box::new(builder.build().map_err(|e| built(config, e))?), endpoint))
}

/// The Google Cloud Storage client: the `[object_store]` table over the `GOOGLE_*` variables.
fn gcs_store(config: &StoreConfig, client: ClientOptions, retry: RetryConfig) -> Built {
    let mut builder =
        GoogleCloudStorageBuilder::from_env().with_bucket_name(&config.bucket).with_client_options(client);
    for (key, value) in options(config)? {
        builder = builder.with_config(key, value);
    }
    // Where requests go: `google_base_url`, else the `gcs_base_url` of a service account key (how an
    // emulator is reached), else Google.
    let key_base = || {
        let key = builder.get_config_value(&GoogleConfigKey::ServiceAccountKey)?;
        let key: serde_json::Value = serde_json::from_str(&key).ok()?;
        key.get("gcs_base_url")?.as_str().map(str::to_string)
    };
    let endpoint = builder
        .get_config_value(&GoogleConfigKey::BaseUrl)
        .or_else(key_base)
        .unwrap_or_else(|| "https://storage.googleapis.com".into());
    gcs_credentials_usable(config, &builder, &endpoint)?;
    let builder =
        builder.with_config(GoogleConfigKey::Client(ClientConfigKey::AllowHttp), allow_http(config, &endpoint));
    let store = builder.with_retry(retry).build().map_err(|e| match e {
        // A key file that is missing or is no service account key: the client says only that it failed.
        object_store::Error::Generic { .. }
            if ["credential", "service account"].iter().any(|w| e.to_string().contains(w)) =>
        {
            gcs_no_credentials(config, &endpoint, &format!("the service account key could not be used ({e})"))
        }
        e => built(config, e),
    })?;
    Ok((Box::new(store), endpoint))
}

/// Refuses at once, naming what to set, a GCS client that has no credentials but the metadata server of a
/// Compute Engine VM, on a machine that is none: the client would ask that server's host, then its
/// address, each with every retry (four minutes with the defaults), and then blame the endpoint.
fn gcs_credentials_usable(config: &StoreConfig, builder: &GoogleCloudStorageBuilder, endpoint: &str) -> io::Result<()> {
    let set = |k: GoogleConfigKey| builder.get_config_value(&k).is_some_and(|v| !v.is_empty());
    let explicit = set(GoogleConfigKey::ServiceAccount)
        || set(GoogleConfigKey::ServiceAccountKey)
        || set(GoogleConfigKey::ApplicationCredentials)
        || builder.get_config_value(&GoogleConfigKey::SkipSignature).is_some_and(|v| v == "true");
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let gcloud_default = home.join(".config/gcloud/application_default_credentials.json").exists();
    if explicit || gcloud_default || on_compute_engine() {
        return Ok(());
    }
    Err(gcs_no_credentials(config, endpoint, "no credentials were found, and this machine is no Compute Engine VM"))
}

/// Whether the metadata server of a Compute Engine VM may answer here: a host named for it, or the VM's
/// firmware says Google (as google-auth decides, without a request).
fn on_compute_engine() -> bool {
    std::env::var_os("GCE_METADATA_HOST").is_some()
        || std::env::var_os("GCE_METADATA_ROOT").is_some()
        || std::fs::read_to_string("/sys/class/dmi/id/product_name").is_ok_and(|p| p.trim().starts_with("Google"))
}

fn gcs_no_credentials(config: &StoreConfig, endpoint: &str, why: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        format!(
            "no credentials for {} at {endpoint}: {why}; set {} (or run `gcloud auth application-default login`), \
             or `skip_signature = \"true\"` in [object_store] for a public bucket",
            config.url,
            StoreKind::Gcs.store().credentials
        ),
    )
}

/// The Azure Blob Storage client: the `[object_store]` table over the `AZURE_*` variables; the account
/// named in an `abfs://` URL over both.
fn azure_store(config: &StoreConfig, client: ClientOptions, retry: RetryConfig) -> Built {
    let mut builder = MicrosoftAzureBuilder::from_env().with_container_name(&config.bucket).with_client_options(client);
    for (key, value) in options(config)? {
        builder = builder.with_config(key, value);
    }
    if let Some(account) = &config.account {
        builder = builder.with_account(account);
    }
    let emulator = builder.get_config_value(&AzureConfigKey::UseEmulator).is_some_and(|v| v == "true");
    let account = builder.get_config_value(&AzureConfigKey::AccountName).unwrap_or_default();
    let endpoint = builder.get_config_value(&AzureConfigKey::Endpoint).unwrap_or_else(|| match emulator {
        true => std::env::var("AZURITE_BLOB_STORAGE_URL").unwrap_or_else(|_| "http://127.0.0.1:10000".into()),
        false => format!("https://{account}.blob.core.windows.net"),
    });
    let builder =
        builder.with_config(AzureConfigKey::Client(ClientConfigKey::AllowHttp), allow_http(config, &endpoint));
    Ok((Box::new(builder.with_retry(retry).build().map_err(|e| built(config, e))?), endpoint))
}

/// The HTTP client of a WebDAV server (a plain one serves reads; listing needs `PROPFIND`).
fn http_store(config: &StoreConfig, client: ClientOptions, retry: RetryConfig) -> Built {
    let mut builder = HttpBuilder::new().with_url(&config.bucket).with_client_options(client);
    for (key, value) in options(config)? {
        builder = builder.with_config(key, value);
    }
    let builder = builder.with_config(ClientConfigKey::AllowHttp, allow_http(config, &config.bucket));
    Ok((Box::new(builder.with_retry(retry).build().map_err(|e| built(config, e))?), config.bucket.clone()))
}

/// The `[object_store]` table as the option keys of one store's client (`GoogleConfigKey`,
/// `AzureConfigKey`, `ClientConfigKey`): a key the client does not take is an error naming it.
fn options<K>(config: &StoreConfig) -> io::Result<Vec<(K, &str)>>
where
    K: std::str::FromStr,
    K::Err: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let parse = |key: &String| key.parse().map_err(|e: K::Err| io::Error::new(io::ErrorKind::InvalidInput, e));
    config.settings.iter().map(|(key, value)| Ok((parse(key)?, value.as_str()))).collect()
}

/// Whether the client may speak plain HTTP: to an `http://` endpoint, or when the table says so.
fn allow_http(config: &StoreConfig, endpoint: &str) -> &'static str {
    let asked = ["allow_http", "google_allow_http", "azure_allow_http"]
        .iter()
        .any(|k| config.settings.get(*k).is_some_and(|v| v == "true"));
    if asked || endpoint.starts_with("http://") {
        "true"
    } else {
        "false"
    }
}

/// A client that could not be built, as an error naming the source.
fn built(config: &StoreConfig, e: object_store::Error) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, format!("{} ({}): {e}", config.url, config.kind.name()))
}

impl ObjectSource {
    /// A source over `config`'s bucket and prefix, counting into `counters`. Nothing is sent to the store
    /// until a file is asked for; a configuration that cannot work (no credentials for a custom S3
    /// endpoint, an option the store's client does not take) is an error here, naming what to set.
    pub fn new(config: StoreConfig, counters: Arc<Counters>) -> io::Result<ObjectSource> {
        // reqwest is built without a TLS provider of its own (Cargo.toml): ring's, for the whole process.
        // An error means one is installed already (another ObjectSource, or the embedding program's).
        let _ = rustls::crypto::ring::default_provider().install_default();
        let client = ClientOptions::new()
            .with_timeout(config.timeout)
            .with_connect_timeout(config.connect_timeout)
            .with_pool_max_idle_per_host(64);
        let retry = RetryConfig {
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(100),
                max_backoff: Duration::from_secs(5),
                base: 2.0,
            },
            max_retries: config.retries,
            retry_timeout: (config.timeout + Duration::from_secs(5)) * (config.retries as u32 + 1),
        };
        let (store, endpoint) = builder(config.kind)(&config, client, retry)?;
        Ok(ObjectSource {
            root: PathBuf::from(&config.url),
            config,
            counters,
            store: Arc::from(store),
            endpoint,
            runtime: OnceLock::new(),
        })
    }

    fn runtime(&self) -> io::Result<&tokio::runtime::Runtime> {
        if let Some((pid, rt)) = self.runtime.get() {
            if *pid != crate::process::pid() {
                return Err(io::Error::other(
                    "an object store source opened before a fork cannot be used in the child; open the cache in the child",
                ));
            }
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("tierstore-objects")
            .enable_all()
            .build()?;
        Ok(&self.runtime.get_or_init(|| (crate::process::pid(), rt)).1)
    }

    /// The object key of `rel`: the name itself, byte for byte. `Key::from` would percent-encode the
    /// characters object_store calls unsafe (`%`, `#`, `?`, `~`, `[`, `]`, every non-ASCII byte), so an object
    /// listed as `hash#1.bin` would be asked for as `hash%231.bin` and not be found; `Key::parse` keeps the
    /// name, and refuses only what no key can hold here (an empty, `.` or `..` part, a control character).
    fn key(&self, rel: &str) -> io::Result<Key> {
        Self::key_named(&self.config.key_of(rel), || self.config.url_of(rel))
    }

    /// The prefix key a listing of `rel` asks for; `None` for the whole bucket.
    fn prefix_key(&self, rel: &str) -> io::Result<(String, Option<Key>)> {
        let raw = self.config.key_of(rel);
        let key = if raw.is_empty() { None } else { Some(Self::key_named(&raw, || self.config.url_of(rel))?) };
        Ok((raw, key))
    }

    fn key_named(raw: &str, url: impl FnOnce() -> String) -> io::Result<Key> {
        Key::parse(raw).map_err(|e| {
            io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{}: not a name an object store key can hold ({e}); rename the object without empty, \".\" \
                     or \"..\" parts and control characters",
                    url()
                ),
            )
        })
    }

    /// An `object_store` error as an I/O error of the same kind, naming the object, the store, the endpoint
    /// and the fix.
    fn error(&self, rel: &str, e: object_store::Error) -> io::Error {
        let url = self.config.url_of(rel);
        let kind = self.config.kind;
        let at = format!("{} at {}", kind.name(), self.endpoint);
        let detail = e.to_string();
        // A failed handshake has no answer from the store, so it can be no other case below.
        if let Some(tls) = tls_refusal(&e) {
            return io::Error::other(format!(
                "{url}: the TLS connection to {at} was refused: {tls}: the server's certificate is not one this \
                 machine trusts; check the endpoint ({}) and the system's CA certificates (a test server's \
                 self-signed certificate needs the store option allow_invalid_certificates = true)",
                kind.store().endpoint_setting
            ));
        }
        let no_bucket = || {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "the {} {} does not exist on {at}: check it in the source, and the endpoint ({})",
                    kind.store().bucket_word,
                    self.config.bucket,
                    kind.store().endpoint_setting
                ),
            )
        };
        let refused = |how: &str| {
            io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{url}: {how} by {at}: check the credentials ({}) and that they may read it ({detail})",
                    kind.store().credentials
                ),
            )
        };
        match e {
            object_store::Error::NotFound { .. }
                if kind != StoreKind::Http
                    && (detail.contains("NoSuchBucket")
                        || detail.contains("ContainerNotFound")
                        || !self.bucket_exists()) =>
            {
                no_bucket()
            }
            object_store::Error::NotFound { .. } => io::Error::new(
                io::ErrorKind::NotFound,
                format!(
                    "{url}: no such object on {at}: check the path (a key is the source's prefix, {}, joined \
                     with the path under it) and that the object was uploaded there",
                    self.config.url
                ),
            ),
            object_store::Error::PermissionDenied { .. } | object_store::Error::Unauthenticated { .. } => {
                refused("access denied")
            }
            _ if ["InvalidAccessKeyId", "SignatureDoesNotMatch", "AuthenticationFailed", "AuthorizationFailure"]
                .iter()
                .any(|w| detail.contains(w)) =>
            {
                refused("credentials refused")
            }
            _ if detail.contains("NoSuchBucket") || detail.contains("ContainerNotFound") => no_bucket(),
            _ if detail.contains("error sending request")
                || detail.contains("onnect")
                || detail.contains("timed out")
                || detail.contains("imeout") =>
            {
                io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "{url}: cannot reach {at} within the deadline ({} per try, {} retries): check that the \
                         server is up and the endpoint ({}); {detail}",
                        humantime(self.config.timeout),
                        self.config.retries,
                        kind.store().endpoint_setting
                    ),
                )
            }
            _ => io::Error::other(format!("{url} on {at}: {detail}")),
        }
    }

    /// Whether the bucket exists, asked only to explain a "not found" (one LIST request).
    fn bucket_exists(&self) -> bool {
        let store = self.store.clone();
        let Ok(rt) = self.runtime() else { return true };
        // The first key of a listing is one request, whatever the size of the bucket.
        match rt.block_on(async move { store.list(None).next().await }) {
            Some(Err(e)) => {
                let text = e.to_string();
                !(matches!(e, object_store::Error::NotFound { .. })
                    || text.contains("NoSuchBucket")
                    || text.contains("404"))
            }
            _ => true,
        }
    }

    fn changed(&self, rel: &str) -> io::Error {
        io::Error::other(format!(
            "{}: the object changed while being read; open it again to read the new version",
            self.config.url_of(rel)
        ))
    }

    /// `GET` of `range` (all of it when `None`), counted; with `expect`, a response of another version is
    /// an error. Returns the object's metadata and the bytes.
    async fn get(
        store: Arc<dyn ObjectStore>,
        counters: Arc<Counters>,
        key: Key,
        range: Option<Range<u64>>,
    ) -> object_store::Result<(ObjectMeta, bytes::Bytes)> {
        counters.add(slot::READS, 1);
        let options = GetOptions { range: range.map(GetRange::Bounded), ..Default::default() };
        let result = store.get_opts(&key, options).await?;
        let meta = result.meta.clone();
        let bytes = result.bytes().await?;
        counters.add(slot::BYTES_READ, bytes.len() as u64);
        Ok((meta, bytes))
    }

    /// `fut` run to its end as a task of the runtime, this thread waiting for its result. A response's
    /// body arrives frame by frame from the connection's task on a runtime thread: awaited here, by
    /// `block_on` on the caller's thread, every frame was a wake-up across threads; as a task it is read
    /// where the connection runs, and this thread wakes once. The tierstore process's CPU while
    /// `tierstore prefetch` copied the peers benchmark's dataset fell by a tenth (paired rounds:
    /// docs/benchmarks/peers.md); the profile's top symbols were the scheduler's switches and wake-ups.
    fn on_runtime<T: Send + 'static>(
        &self,
        fut: impl std::future::Future<Output = object_store::Result<T>> + Send + 'static,
    ) -> io::Result<object_store::Result<T>> {
        let rt = self.runtime()?;
        let handle = rt.spawn(fut);
        Ok(rt.block_on(async move { handle.await.map_err(|e| object_store::Error::JoinError { source: e })? }))
    }

    /// Reads `range` of the version `sid` (the bytes, or an error if the object changed).
    fn read_range(&self, rel: &str, key: &Key, sid: &SourceId, range: Range<u64>) -> io::Result<bytes::Bytes> {
        let fut = Self::get(self.store.clone(), self.counters.clone(), key.clone(), Some(range));
        let (meta, bytes) = self.on_runtime(fut)?.map_err(|e| self.error(rel, e))?;
        if identity(&meta) != *sid {
            return Err(self.changed(rel));
        }
        Ok(bytes)
    }

    /// The ranges after the first `from` bytes of an object of `size` bytes.
    fn ranges(&self, from: u64, size: u64) -> Vec<Range<u64>> {
        let step = self.config.range_size.max(1);
        (from..size).step_by(step as usize).map(|start| start..(start + step).min(size)).collect()
    }

    /// Fetches the ranges `from..size` of `file`'s version in parallel and hands each to `sink` in order.
    fn fetch_rest(
        &self,
        file: &ObjectFile,
        from: u64,
        sink: &mut dyn FnMut(&[u8]) -> Result<(), CopyFault>,
    ) -> Result<(), CopyFault> {
        let rt = self.runtime().map_err(CopyFault::Source)?;
        // Each range is its own task, so that every response streams in while this thread writes the
        // earlier ones; `buffered` hands them back in order.
        let tasks = self.ranges(from, file.sid.size).into_iter().map(|r| {
            let fut = Self::get(self.store.clone(), self.counters.clone(), file.key.clone(), Some(r));
            let handle = rt.spawn(fut);
            async move { handle.await.map_err(|e| object_store::Error::JoinError { source: e })? }
        });
        let mut stream = futures::stream::iter(tasks).buffered(self.config.ranges_in_flight.max(1));
        rt.block_on(async {
            while let Some(got) = stream.next().await {
                let (meta, bytes) = got.map_err(|e| CopyFault::Source(self.error(&file.rel, e)))?;
                if identity(&meta) != file.sid {
                    return Err(CopyFault::Source(self.changed(&file.rel)));
                }
                sink(&bytes)?;
            }
            Ok(())
        })
    }

    fn object_file<'a>(&self, file: &'a SourceFile) -> io::Result<&'a ObjectFile> {
        match file {
            SourceFile::Object(o) => Ok(o.as_ref()),
            SourceFile::Posix(_) => Err(io::Error::new(io::ErrorKind::InvalidInput, "not an object")),
        }
    }
}

/// Whether a ranged `GET` failed because the object has no byte in the range (an empty object): 416 Range
/// Not Satisfiable, in each store's words.
/// The TLS error among `e`'s causes, if the request failed there: a certificate this machine does not trust
/// is not a server it cannot reach, and no retry changes it.
fn tls_refusal(e: &object_store::Error) -> Option<String> {
    // hyper hands the connector's failure over as an `io::Error` around tokio-rustls's `io::Error` around the
    // `rustls::Error`, and an `io::Error`'s `source()` skips the error it wraps: hence `get_ref`, recursively.
    fn tls_in<'a>(c: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
        c.downcast_ref::<rustls::Error>().or_else(|| tls_in(c.downcast_ref::<io::Error>()?.get_ref()?))
    }
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(e);
    while let Some(c) = cause {
        if let Some(tls) = tls_in(c) {
            return Some(tls.to_string());
        }
        cause = c.source();
    }
    None
}

fn range_refused(e: &object_store::Error) -> bool {
    let text = e.to_string();
    ["416", "InvalidRange", "Range Not Satisfiable", "not satisfiable"].iter().any(|w| text.contains(w))
}

fn humantime(d: Duration) -> String {
    if d.as_millis().is_multiple_of(1000) {
        format!("{} s", d.as_secs())
    } else {
        format!("{} ms", d.as_millis())
    }
}

impl Source for ObjectSource {
    fn root(&self) -> &Path {
        &self.root
    }

    fn relative(&self, path: &Path) -> Result<String, OutsideSource> {
        match self.config.relative(&path.to_string_lossy()) {
            Some(rel) if !rel.is_empty() => Ok(rel),
            _ => Err(OutsideSource { path: path.to_path_buf(), source_root: self.root.clone() }),
        }
    }

    fn relative_or_root(&self, path: &Path) -> Result<String, OutsideSource> {
        self.config
            .relative(&path.to_string_lossy())
            .ok_or_else(|| OutsideSource { path: path.to_path_buf(), source_root: self.root.clone() })
    }

    fn path_of(&self, rel: &str) -> PathBuf {
        PathBuf::from(self.config.url_of(rel))
    }

    fn counters(&self) -> &Arc<Counters> {
        &self.counters
    }

    fn identify(&self, rel: &str) -> io::Result<SourceId> {
        self.counters.add(slot::STATS, 1);
        let key = self.key(rel)?;
        let store = self.store.clone();
        let meta = self.runtime()?.block_on(async move { store.head(&key).await }).map_err(|e| self.error(rel, e))?;
        Ok(identity(&meta))
    }

    fn open(&self, rel: &str) -> io::Result<SourceFile> {
        self.counters.add(slot::OPENS, 1);
        let key = self.key(rel)?;
        let first = Self::get(self.store.clone(), self.counters.clone(), key.clone(), Some(0..self.config.range_size));
        let (meta, head) = match self.on_runtime(first)? {
            Ok(x) => x,
            // An empty object has no first byte to ask for: a store answers the range with 416.
            Err(e) if range_refused(&e) => self
                .on_runtime(Self::get(self.store.clone(), self.counters.clone(), key.clone(), None))?
                .map_err(|e| self.error(rel, e))?,
            Err(e) => return Err(self.error(rel, e)),
        };
        Ok(SourceFile::Object(Box::new(ObjectFile {
            key,
            rel: rel.to_string(),
            sid: identity(&meta),
            head,
            window: Mutex::new(None),
        })))
    }

    fn reopen(&self, rel: &str, sid: &SourceId) -> io::Result<SourceFile> {
        // No request: the first read asks for its range and checks the version.
        Ok(SourceFile::Object(Box::new(ObjectFile {
            key: self.key(rel)?,
            rel: rel.to_string(),
            sid: *sid,
            head: bytes::Bytes::new(),
            window: Mutex::new(None),
        })))
    }

    fn identify_opened(&self, file: &SourceFile, _rel: &str) -> io::Result<(SourceId, bool)> {
        Ok((self.object_file(file)?.sid, false))
    }

    fn read_at(&self, file: &SourceFile, buf: &mut [u8], offset: u64) -> io::Result<usize> {
        let f = self.object_file(file)?;
        let size = f.sid.size;
        if offset >= size || buf.is_empty() {
            return Ok(0);
        }
        let copy_from = |bytes: &bytes::Bytes, start: u64, buf: &mut [u8]| {
            let at = (offset - start) as usize;
            let n = buf.len().min(bytes.len() - at);
            buf[..n].copy_from_slice(&bytes[at..at + n]);
            n
        };
        if offset < f.head.len() as u64 {
            return Ok(copy_from(&f.head, 0, buf));
        }
        let mut window = f.window.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((start, bytes)) = window.as_ref() {
            if offset >= *start && offset < start + bytes.len() as u64 {
                return Ok(copy_from(bytes, *start, buf));
            }
        }
        let want = (buf.len() as u64).max(self.config.range_size);
        let bytes = self.read_range(&f.rel, &f.key, &f.sid, offset..(offset + want).min(size))?;
        if bytes.is_empty() {
            return Err(self.changed(&f.rel));
        }
        let n = copy_from(&bytes, offset, buf);
        *window = Some((offset, bytes));
        Ok(n)
    }

    fn read_whole(&self, rel: &str, _expect: u64, pre: Option<SourceFile>) -> io::Result<(Vec<u8>, SourceId)> {
        let file = match pre {
            Some(f) => f,
            None => self.open(rel)?,
        };
        let f = self.object_file(&file)?;
        let mut out = Vec::with_capacity(f.sid.size as usize);
        out.extend_from_slice(&f.head);
        if (out.len() as u64) < f.sid.size {
            self.fetch_rest(f, out.len() as u64, &mut |b| {
                out.extend_from_slice(b);
                Ok(())
            })
            .map_err(|fault| match fault {
                CopyFault::Source(e) | CopyFault::Tier(e) => e,
            })?;
        }
        Ok((out, f.sid))
    }

    fn copy(
        &self,
        from: &SourceFile,
        to: &File,
        size: u64,
        mut hasher: Option<&mut crate::hash::Pieces<'_>>,
        progress: &mut dyn FnMut(u64),
    ) -> Result<(u64, Option<SourceId>), CopyFault> {
        use std::io::Write;
        let f = self.object_file(from).map_err(CopyFault::Source)?;
        let mut out = to;
        let mut copied = 0u64;
        let mut sink = |bytes: &[u8]| -> Result<(), CopyFault> {
            out.write_all(bytes).map_err(CopyFault::Tier)?;
            if let Some(h) = hasher.as_mut() {
                h.update(bytes);
            }
            copied += bytes.len() as u64;
            progress(copied.min(size));
            Ok(())
        };
        let head = f.head.len() as u64;
        if head > 0 {
            sink(&f.head)?;
        }
        if head < f.sid.size {
            self.fetch_rest(f, head, &mut sink)?;
        }
        Ok((copied, Some(f.sid)))
    }

    fn list(&self, rel: &str) -> io::Result<Vec<ListedEntry>> {
        let (prefix_key, prefix) = self.prefix_key(rel)?;
        let store = self.store.clone();
        let metas: Vec<ObjectMeta> = self
            .runtime()?
            .block_on(async move { store.list(prefix.as_ref()).collect::<Vec<_>>().await })
            .into_iter()
            .collect::<Result<_, _>>()
            .map_err(|e| self.error(rel, e))?;
        // A store answers a listing a page of keys at a time, so that is the number of requests it took.
        self.counters.add(slot::LISTS, (metas.len() as u64).div_ceil(self.config.kind.store().list_page).max(1));
        let base = if prefix_key.is_empty() { String::new() } else { format!("{prefix_key}/") };
        Ok(metas
            .into_iter()
            .filter_map(|m| {
                let name = m.location.as_ref().strip_prefix(base.as_str())?.to_string();
                Some(ListedEntry { name: name.into(), is_dir: Some(false) })
            })
            .collect())
    }

    fn identities(&self, dir: &str) -> io::Result<Vec<(String, SourceId)>> {
        let (prefix_key, prefix) = self.prefix_key(dir)?;
        let store = self.store.clone();
        let listed = self
            .runtime()?
            .block_on(async move { store.list_with_delimiter(prefix.as_ref()).await })
            .map_err(|e| self.error(dir, e))?;
        let keys = listed.objects.len() + listed.common_prefixes.len();
        self.counters.add(slot::LISTS, (keys as u64).div_ceil(self.config.kind.store().list_page).max(1));
        let base = if prefix_key.is_empty() { String::new() } else { format!("{prefix_key}/") };
        Ok(listed
            .objects
            .iter()
            .filter_map(|m| Some((m.location.as_ref().strip_prefix(base.as_str())?.to_string(), identity(m))))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_store_has_one_builder() {
        for store in super::super::store_config::STORES.iter() {
            assert_eq!(BUILDERS.iter().filter(|(k, _)| *k == store.kind).count(), 1, "{}", store.name);
        }
    }
}
