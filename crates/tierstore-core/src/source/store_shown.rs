//! What `tierstore config show` and `Cache.config()` say of an object store source: each setting the
//! store is reached with, its value (a secret only as "set" or "not set"), and where it came from. For an
//! s3:// source that is the AWS precedence the client follows (`object.rs`, `s3_store`): the table, over
//! the AWS variables, over the profile's section of the shared files, over AWS's defaults. For every store,
//! the table's other keys as given, then tierstore's own keys (`timeout`, `retries`, ...) as given or by
//! default. Nothing is sent to the store, and no credential is printed.

use serde_json::Value;

use super::aws_profile::profile_settings;
use super::store_config::{is_secret, store_keys, StoreConfig, StoreKind};
use crate::config::settings::{default_value, find, Table, Type};

/// One setting as shown: its key, its value, and where it came from.
pub struct ShownSetting {
    /// The key, as the table writes it.
    pub key: String,
    /// The value: a count as a number, anything else as text; a secret as "set" or "not set".
    pub value: Value,
    /// Where it came from: a file, `$VARIABLE`, `argument`, `profile NAME of FILE`, `default`.
    pub origin: String,
}

/// The store's settings as shown, and where its table came from as a whole (the file, the variable,
/// both, or `default` when nothing was given).
pub struct ShownStore {
    /// Where the table's keys came from, together.
    pub came_from: String,
    /// Every setting, in the reference's order.
    pub settings: Vec<ShownSetting>,
}

/// The keys of the table that set each AWS setting the S3 client takes: the short `[s3]` name first,
/// then `object_store`'s own names for it.
const ENDPOINT: &[&str] = &["endpoint", "aws_endpoint", "aws_endpoint_url", "endpoint_url"];
const REGION: &[&str] = &["region", "aws_region", "aws_default_region", "default_region"];
const ACCESS_KEY: &[&str] = &["access_key_id", "aws_access_key_id"];
const SECRET_KEY: &[&str] = &["secret_access_key", "aws_secret_access_key"];
const SESSION_TOKEN: &[&str] = &["session_token", "aws_session_token", "token", "aws_token"];

impl StoreConfig {
    /// The store's settings as `config show` prints them (see the module).
    pub fn shown(&self) -> ShownStore {
        let mut settings = if self.kind == StoreKind::S3 { aws_shown(self) } else { Vec::new() };
        let own = store_keys();
        let aws = [ENDPOINT, REGION, ACCESS_KEY, SECRET_KEY, SESSION_TOKEN, &["profile"]].concat();
        for (key, (text, origin)) in &self.given {
            let shown_already = self.kind == StoreKind::S3 && aws.contains(&key.as_str());
            if !shown_already && !own.contains(&key.as_str()) {
                settings.push(setting(key, shown_value(key, text), origin.to_string()));
            }
        }
        for key in own {
            let (text, origin) = match self.given.get(key) {
                Some((text, origin)) => (text.as_str(), origin.to_string()),
                None => (default_value(Table::ObjectStore, key).unwrap_or(""), "default".to_string()),
            };
            settings.push(setting(key, shown_value(key, text), origin));
        }
        let mut origins: Vec<String> = self.given.values().map(|(_, o)| o.to_string()).collect();
        origins.sort();
        origins.dedup();
        let came_from = if origins.is_empty() { "default".to_string() } else { origins.join(", ") };
        ShownStore { came_from, settings }
    }
}

fn setting(key: &str, value: Value, origin: String) -> ShownSetting {
    ShownSetting { key: key.to_string(), value, origin }
}

/// A value as shown: "set" for a secret, a number for one of tierstore's counts, else the text given.
fn shown_value(key: &str, text: &str) -> Value {
    if is_secret(key) {
        return Value::from("set");
    }
    let count = matches!(find(Table::ObjectStore, key).map(|s| s.ty), Some(Type::Count { .. }));
    match text.parse::<u64>() {
        Ok(n) if count => Value::from(n),
        _ => Value::from(text),
    }
}

/// The AWS settings of an s3:// source as its client takes them, each from the first place that sets it:
/// the table, the AWS variables (in the client's order), the profile's section of the shared files, AWS's
/// defaults. A key in the environment hides every credential of the profile, the session token too.
fn aws_shown(c: &StoreConfig) -> Vec<ShownSetting> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let given =
        |aliases: &[&str]| aliases.iter().find_map(|k| c.given.get(*k).map(|(text, o)| (text.clone(), o.to_string())));
    let named = given(&["profile"]);
    let profile = profile_settings(named.as_ref().map(|(name, _)| name.as_str()));
    let profile_origin = match (&named, env("AWS_PROFILE")) {
        (Some((_, origin)), _) => origin.clone(),
        (None, Some(_)) => "$AWS_PROFILE".to_string(),
        (None, None) => "default".to_string(),
    };
    let from_profile = |key: &str| {
        let value = profile.settings.get(key)?;
        Some((value.clone(), format!("profile {} of {}", profile.name, profile.files[key].display())))
    };
    let first = |aliases: &[&str], variables: &[&str], profile_key: Option<&str>| {
        given(aliases)
            .or_else(|| variables.iter().find_map(|v| env(v).map(|value| (value, format!("${v}")))))
            .or_else(|| profile_key.and_then(from_profile))
    };
    let region = first(REGION, &["AWS_REGION", "AWS_DEFAULT_REGION"], Some("region"))
        .unwrap_or_else(|| ("us-east-1".to_string(), "default".to_string()));
    let endpoint = first(ENDPOINT, &["AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "AWS_ENDPOINT"], Some("endpoint_url"))
        .unwrap_or_else(|| (format!("https://s3.{}.amazonaws.com", region.0), "default: AWS".to_string()));
    let keys_from_env = env("AWS_ACCESS_KEY_ID").is_some() || env("AWS_SECRET_ACCESS_KEY").is_some();
    let credential = |key: &str, aliases: &[&str], variables: &[&str], profile_key: &str| {
        let found = first(aliases, variables, (!keys_from_env).then_some(profile_key));
        match found {
            Some((_, origin)) => setting(key, Value::from("set"), origin),
            None => setting(key, Value::from("not set"), "default".to_string()),
        }
    };
    vec![
        setting("endpoint", Value::from(endpoint.0), endpoint.1),
        setting("region", Value::from(region.0), region.1),
        setting("profile", Value::from(profile.name.clone()), profile_origin),
        credential("access_key_id", ACCESS_KEY, &["AWS_ACCESS_KEY_ID"], "aws_access_key_id"),
        credential("secret_access_key", SECRET_KEY, &["AWS_SECRET_ACCESS_KEY"], "aws_secret_access_key"),
        credential("session_token", SESSION_TOKEN, &["AWS_SESSION_TOKEN", "AWS_TOKEN"], "aws_session_token"),
    ]
}
