//! The AWS profile an s3:// source reads, as the AWS tools read it: `[object_store] profile`, else
//! `$AWS_PROFILE`, else `default`, from the shared files (`$AWS_CONFIG_FILE`, else `~/.aws/config`, for
//! the region and the endpoint; `$AWS_SHARED_CREDENTIALS_FILE`, else `~/.aws/credentials`, for the keys).
//! Both the client (`object.rs`) and `config show` (`store_shown.rs`) take it from here. Kept apart from the
//! client so that a build without object stores still shows what an S3 source would be reached with.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The profile of an s3:// source: which, and what its sections of the shared files hold.
pub struct Profile {
    /// The profile's name.
    pub name: String,
    /// Its settings, as `object_store` configuration keys (`region`, `endpoint_url`, `aws_access_key_id`,
    /// `aws_secret_access_key`, `aws_session_token`).
    pub settings: BTreeMap<String, String>,
    /// The file each setting was read from.
    pub files: BTreeMap<String, PathBuf>,
}

/// The keys the source takes from the config file, then from the credentials file.
const CONFIG_KEYS: &[&str] = &["region", "endpoint_url"];
const CREDENTIAL_KEYS: &[&str] = &["aws_access_key_id", "aws_secret_access_key", "aws_session_token"];

/// The profile named by the table's `profile` (`named`), else `$AWS_PROFILE`, else `default`.
pub fn profile_settings(named: Option<&str>) -> Profile {
    let home = std::env::var_os("HOME").map(PathBuf::from).unwrap_or_default();
    let file = |var: &str, default: &str| std::env::var_os(var).map_or_else(|| home.join(default), PathBuf::from);
    let name = named.map(str::to_string).or_else(|| std::env::var("AWS_PROFILE").ok()).unwrap_or("default".into());
    let mut profile = Profile { name, settings: BTreeMap::new(), files: BTreeMap::new() };
    for (path, keys) in [
        (file("AWS_CONFIG_FILE", ".aws/config"), CONFIG_KEYS),
        (file("AWS_SHARED_CREDENTIALS_FILE", ".aws/credentials"), CREDENTIAL_KEYS),
    ] {
        if let Some(section) = read_aws_file(&path).remove(&profile.name) {
            for k in keys {
                if let Some(v) = section.get(*k) {
                    profile.settings.insert(k.to_string(), v.clone());
                    profile.files.insert(k.to_string(), path.clone());
                }
            }
        }
    }
    profile
}

/// Reads an INI-style AWS file (`~/.aws/credentials`, `~/.aws/config`): section → key → value (keys
/// lower-cased; `[profile NAME]` and `[NAME]` alike). A file that cannot be read has no sections.
fn read_aws_file(path: &Path) -> BTreeMap<String, BTreeMap<String, String>> {
    let mut out: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    let Ok(text) = std::fs::read_to_string(path) else { return out };
    let mut section = String::new();
    for line in text.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.starts_with(';') || line.is_empty() {
            continue;
        }
        if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.trim().trim_start_matches("profile ").trim().to_string();
            continue;
        }
        if let Some((k, v)) = line.split_once('=') {
            out.entry(section.clone()).or_default().insert(k.trim().to_lowercase(), v.trim().to_string());
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sections_keys_and_comments() {
        let dir = std::env::temp_dir().join(format!("tierstore-aws-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config");
        std::fs::write(&path, "# c\n[profile train]\nRegion = ap-south-1\n; x\n[default]\nregion = x\n").unwrap();
        let sections = read_aws_file(&path);
        assert_eq!(sections["train"]["region"], "ap-south-1");
        assert_eq!(sections["default"]["region"], "x");
        assert!(read_aws_file(&dir.join("none")).is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
