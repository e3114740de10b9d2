//! How an S3-compatible object store is reached: the bucket and prefix from `source = "s3://bucket/prefix"`,
//! and the `[s3]` table of the configuration. Credentials, region and endpoint come the standard AWS ways
//! (`AWS_ACCESS_KEY_ID`, `AWS_SECRET_ACCESS_KEY`, `AWS_SESSION_TOKEN`, `AWS_REGION`, `AWS_ENDPOINT_URL`,
//! the profile files `~/.aws/credentials` and `~/.aws/config` with `AWS_PROFILE`), and keys of `[s3]`
//! override them. Kept apart from the client (`object.rs`) so that a build without S3 still reads and
//! checks the configuration, and says what is missing.

// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::collections::BTreeMap;
use std::time::Duration;

use crate::config::values::{bad, parse_duration, parse_size, scalar, ConfigError, Origin};

/// The keys of the `[s3]` table.
pub const S3_KEYS: &[&str] = &[
    "endpoint",
    "region",
    "profile",
    "access_key_id",
    "secret_access_key",
    "session_token",
    "timeout",
    "connect_timeout",
    "retries",
    "range_size",
    "ranges_in_flight",
];

/// The defaults of the `[s3]` keys that have one, as the configuration reference writes them: `parse`
/// starts from these, and `config show` prints them (through `_core.S3_DEFAULTS`), so the two never
/// disagree. The other keys come from the AWS environment and profile files, or stay unset.
pub const S3_DEFAULTS: &[(&str, &str)] =
    &[("timeout", "30s"), ("connect_timeout", "5s"), ("retries", "3"), ("range_size", "8M"), ("ranges_in_flight", "8")];

/// The default of `[s3] key`, as written in [`S3_DEFAULTS`].
fn default_of(key: &str) -> &'static str {
    S3_DEFAULTS.iter().find(|(k, _)| *k == key).map(|(_, v)| *v).expect("every defaulted [s3] key is in S3_DEFAULTS")
}

/// Where an object store source is and how to talk to it.
#[derive(Clone, PartialEq, Eq)]
pub struct S3Config {
    /// The source as given, normalized: `s3://bucket` or `s3://bucket/prefix` (no trailing slash).
    pub url: String,
    /// The bucket.
    pub bucket: String,
    /// The prefix inside the bucket, without slashes at either end (`""` for the whole bucket).
    pub prefix: String,
    /// `[s3]` settings that override the environment and the profile files: key → value.
    pub settings: BTreeMap<String, String>,
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

impl std::fmt::Debug for S3Config {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Never print a secret: `config show` and error messages print the configuration.
        let settings: BTreeMap<&str, &str> = self
            .settings
            .iter()
            .map(|(k, v)| (k.as_str(), if k.contains("secret") || k.contains("token") { "(hidden)" } else { v }))
            .collect();
        f.debug_struct("S3Config")
            .field("url", &self.url)
            .field("settings", &settings)
            .field("timeout", &self.timeout)
            .field("retries", &self.retries)
            .finish_non_exhaustive()
    }
}

/// A URL that is not a usable `s3://` source; the message says what to write instead.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct BadUrl(pub String);

/// Whether a configured source names an object store rather than a directory.
pub fn is_url(source: &str) -> bool {
    source.contains("://")
}

impl S3Config {
    /// Parses `s3://bucket[/prefix]` with the defaults for everything else.
    pub fn parse(url: &str) -> Result<S3Config, BadUrl> {
        let Some(rest) = url.strip_prefix("s3://") else {
            let scheme = url.split("://").next().unwrap_or("");
            return Err(BadUrl(format!(
                "the object store scheme {scheme:?} is not supported; give s3://BUCKET/PREFIX (any S3-compatible \
                 store, with AWS_ENDPOINT_URL or [s3] endpoint for one that is not AWS), or a directory"
            )));
        };
        let (bucket, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        let valid_bucket = (3..=63).contains(&bucket.len())
            && bucket.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'.');
        if !valid_bucket {
            return Err(BadUrl(format!(
                "{bucket:?} is not a bucket name; write s3://BUCKET/PREFIX with a bucket of 3 to 63 lower-case \
                 letters, digits, dots and hyphens"
            )));
        }
        let prefix = prefix.trim_matches('/');
        if prefix.split('/').any(|p| p == "." || p == "..") || prefix.contains("//") {
            return Err(BadUrl(format!(
                "the prefix {prefix:?} has empty, \".\" or \"..\" parts; write s3://{bucket}/a/b"
            )));
        }
        let url = if prefix.is_empty() { format!("s3://{bucket}") } else { format!("s3://{bucket}/{prefix}") };
        Ok(S3Config {
            url,
            bucket: bucket.to_string(),
            prefix: prefix.to_string(),
            settings: BTreeMap::new(),
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

    /// The path of `name` relative to the prefix: a full `s3://` URL under it, or a key relative to the
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

/// Validates the `[s3]` keys of the configuration into `c` (the bucket and prefix parsed from the source).
pub(crate) fn validate(
    mut c: S3Config,
    keys: &BTreeMap<&'static str, (toml::Value, Origin)>,
) -> Result<S3Config, ConfigError> {
    for (&k, (v, o)) in keys {
        let text = scalar(v);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_and_keys() {
        let c = S3Config::parse("s3://data-set/train/").unwrap();
        assert_eq!(
            (c.bucket.as_str(), c.prefix.as_str(), c.url.as_str()),
            ("data-set", "train", "s3://data-set/train")
        );
        assert_eq!(c.key_of("a/b.bin"), "train/a/b.bin");
        assert_eq!(c.relative("s3://data-set/train/a/b.bin").as_deref(), Some("a/b.bin"));
        assert_eq!(c.relative("a/b.bin").as_deref(), Some("a/b.bin"));
        assert_eq!(c.relative("s3://data-set/train").as_deref(), Some(""));
        assert_eq!(c.relative("s3://data-set/trainer/x"), None);
        assert_eq!(c.relative("s3://other/train/x"), None);
        assert_eq!(c.relative("/etc/passwd"), None);
        assert_eq!(c.relative("a/../../b"), None);
        let whole = S3Config::parse("s3://bucket").unwrap();
        assert_eq!(whole.key_of("x"), "x");
        assert!(S3Config::parse("gs://b/p").unwrap_err().to_string().contains("not supported"));
        assert!(S3Config::parse("s3://B_ad/p").unwrap_err().to_string().contains("not a bucket name"));
        let mut secret = whole.clone();
        secret.settings.insert("secret_access_key".into(), "sekrit".into());
        assert!(!format!("{secret:?}").contains("sekrit"));
    }

    #[test]
    fn the_written_defaults_are_the_parsed_ones_and_every_one_is_a_key() {
        let c = S3Config::parse("s3://bucket").unwrap();
        assert_eq!(c.timeout, Duration::from_secs(30));
        assert_eq!(c.connect_timeout, Duration::from_secs(5));
        assert_eq!((c.retries, c.range_size, c.ranges_in_flight), (3, 8 << 20, 8));
        assert!(S3_DEFAULTS.iter().all(|(k, _)| S3_KEYS.contains(k)));
    }
}
