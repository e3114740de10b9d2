//! The `[cluster]` table of the configuration: whether and how the nodes of a job share their caches, who
//! the members are, and how their agents find and trust each other.
//!
//! ```toml
//! [cluster]
//! sharing = "partitioned"            # off (default) | inclusive | partitioned
//! peers = ["gpu[001-016]"]           # or TIERSTORE_PEERS, or Slurm's SLURM_JOB_NODELIST
//! port = 7078                        # where agents listen for peers
//! listen = "0.0.0.0"                 # the address to listen on (default 127.0.0.1)
//! token_file = "~/.tierstore/token"  # the job's shared secret; required beyond loopback
//! encrypt = true                     # encrypt every frame between nodes (default: tagged, readable)
//! registry = "redis://head:6379"     # elastic jobs: members register there instead of `peers`
//! job = "run-42"                     # the job's name in the registry (default: Slurm's job id)
//! ```
//!
//! Membership comes from the launcher (docs/design/architecture.md: no consensus of our own): an explicit list, or
//! Slurm's node list when sharing is on and no list is given. Hostlist syntax (`gpu[001-016,020]`) is
//! expanded here, where a typo can still be reported with the key it came from.

// Configuration errors are rare and carry everything the user needs to fix them; their size is no cost.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;

use super::token::{default_token_file, read_token, TOKEN_FIX};
use crate::config::settings;
use crate::config::values::{bad, boolean, expand_home, scalar, ConfigError, Origin};

/// The port agents listen on for peers when none is configured.
pub const DEFAULT_PORT: u16 = 7078;

/// The most names a hostlist may expand to (a guard against a typo such as `n[1-99999999]`).
pub const MAX_HOSTS: usize = 100_000;

/// How the nodes of a job share cached files.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum Sharing {
    /// Each node caches for itself (no agent needed).
    #[default]
    Off,
    /// A file a peer served is also kept locally (DYAD): fastest re-reads, capacity of one node.
    Inclusive,
    /// Only a file's owner keeps it (Cache VOL, HVAC): the job's cache is the sum of its nodes'.
    Partitioned,
}

impl Sharing {
    /// Parses a configuration value.
    pub fn parse(text: &str) -> Option<Sharing> {
        match text.trim().to_ascii_lowercase().as_str() {
            "off" => Some(Sharing::Off),
            "inclusive" => Some(Sharing::Inclusive),
            "partitioned" => Some(Sharing::Partitioned),
            _ => None,
        }
    }

    /// The name used in configuration files.
    pub fn name(self) -> &'static str {
        match self {
            Sharing::Off => "off",
            Sharing::Inclusive => "inclusive",
            Sharing::Partitioned => "partitioned",
        }
    }
}

/// One member of the job: a host and the port its agent listens on.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Member {
    /// Host name or address.
    pub host: String,
    /// The agent's port.
    pub port: u16,
}

impl Member {
    /// `host:port`, as a socket address is written.
    pub fn address(&self) -> String {
        format!("{}:{}", self.host, self.port)
    }
}

/// The effective `[cluster]` configuration.
#[derive(Clone, Debug, PartialEq, Eq, Default)]
pub struct ClusterConfig {
    /// How the nodes share.
    pub sharing: Sharing,
    /// The members, sorted; empty when sharing is off.
    pub members: Vec<Member>,
    /// The port this node's agent listens on.
    pub port: u16,
    /// The address this node's agent listens on.
    pub listen: String,
    /// The job's shared secret.
    pub token_file: Option<PathBuf>,
    /// Whether every frame between nodes is encrypted (`[cluster] encrypt`); without, frames are tagged
    /// (nobody on the path changes one) but readable.
    pub encrypt: bool,
    /// This node's name (`[cluster] node`, `TIERSTORE_NODE`, or the host name).
    pub node: String,
    /// This node's place in `members`; `None` when it is not a member (it reads from the members' agents
    /// but owns no file).
    pub me: Option<usize>,
    /// Where the members register (`redis://…`), when the job is elastic: the members are then whoever
    /// registered, as this node's agent reports them.
    pub registry: Option<String>,
    /// The job's name in the registry (`[cluster] job`, `TIERSTORE_JOB`, or Slurm's job id).
    pub job: String,
}

impl ClusterConfig {
    /// The address this node's agent is reached at: `node` if it names a port, else `node:port`.
    pub fn my_address(&self) -> String {
        match self.me {
            Some(i) => self.members[i].address(),
            None if self.node.rsplit_once(':').is_some_and(|(_, p)| p.parse::<u16>().is_ok()) => self.node.clone(),
            None => format!("{}:{}", self.node, self.port),
        }
    }
}

/// Validates the `[cluster]` keys of the configuration, with Slurm's node list and job id for what they
/// leave unset.
pub(crate) fn validate(
    keys: &BTreeMap<&'static str, (toml::Value, Origin)>,
    slurm_nodes: Option<&str>,
    slurm_job: Option<&str>,
) -> Result<ClusterConfig, ConfigError> {
    let written = Written { keys, default: Origin::Default };
    let mut c = one_value_keys(&written, slurm_job)?;
    if c.sharing == Sharing::Off {
        return Ok(c);
    }
    if c.registry.is_some() && !keys.contains_key("peers") {
        // The members are whoever registered: the agent keeps the list, and every process asks it.
        c.node = written.text("node").map_or_else(hostname, |(v, _)| v);
    } else {
        members(&mut c, &written, slurm_nodes)?;
    }
    // After the members: a configuration refused for them has no token to show for it.
    check_token(&mut c, written.text("token_file"))?;
    Ok(c)
}

/// The `[cluster]` keys as set. An unset key with a default in the settings table (sharing, port,
/// listen, encrypt) reads as that default, through the same check as a written one.
struct Written<'a> {
    keys: &'a BTreeMap<&'static str, (toml::Value, Origin)>,
    default: Origin,
}

impl Written<'_> {
    /// Key `k`'s value as text, and where it came from.
    fn text(&self, k: &str) -> Option<(String, &Origin)> {
        self.keys
            .get(k)
            .map(|(v, o)| (scalar(v), o))
            .or_else(|| settings::default_value(settings::Table::Cluster, k).map(|v| (v.to_string(), &self.default)))
    }
}

/// The keys of one value each: the sharing mode, the agent's port and address, encryption, the token
/// file's path, the registry and the job's name (`slurm_job`'s, unless set).
fn one_value_keys(written: &Written<'_>, slurm_job: Option<&str>) -> Result<ClusterConfig, ConfigError> {
    let mut c = ClusterConfig::default();
    if let Some((v, o)) = written.text("sharing") {
        c.sharing = Sharing::parse(&v).ok_or_else(|| {
            bad(o, "cluster.sharing", &v, "is not a sharing mode", "use \"off\", \"inclusive\" or \"partitioned\"")
        })?;
    }
    if let Some((v, o)) = written.text("port") {
        let port = settings::parse_count(settings::Table::Cluster, "port", &v)
            .map_err(|fix| bad(o, "cluster.port", &v, "is not a TCP port", &format!("{fix}, e.g. 7078")))?;
        c.port = port as u16;
    }
    if let Some((v, o)) = written.text("listen") {
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
    if let Some((v, o)) = written.text("encrypt") {
        c.encrypt = boolean(o, "cluster.encrypt", &v, "write encrypt = true or false")?;
    }
    c.token_file = written.text("token_file").map(|(v, _)| expand_home(&v));
    if let Some((v, o)) = written.text("registry") {
        if !(v.starts_with("redis://") || v.starts_with("rediss://") || v.starts_with("redis+unix://")) {
            return Err(bad(o, "cluster.registry", &v, "is not a Redis URL", "write redis://HOST:6379"));
        }
        c.registry = Some(v);
    }
    c.job = match written.text("job") {
        Some((v, _)) => v,
        None => slurm_job.map_or_else(|| "tierstore".to_string(), |id| format!("slurm-{id}")),
    };
    Ok(c)
}

/// Sharing on means a token, on loopback too. Read now, so that a bad token is one message at start
/// rather than a failure deep in the first read that crosses nodes; with none configured (`given`),
/// this user's default one, checked when it exists and otherwise made where it is first used (the agent,
/// a read across nodes: `ensure_token`), never by reading the configuration (`config show` writes nothing).
fn check_token(c: &mut ClusterConfig, given: Option<(String, &Origin)>) -> Result<(), ConfigError> {
    match (given, c.token_file.as_deref()) {
        (Some((v, o)), Some(path)) => {
            if let Err(problem) = read_token(path) {
                return Err(bad(o, "cluster.token_file", &v, &problem, TOKEN_FIX));
            }
        }
        _ => {
            let path = default_token_file();
            let made = std::fs::symlink_metadata(&path).is_ok();
            if let Err(problem) = if made { read_token(&path).map(drop) } else { Ok(()) } {
                let shown = path.display().to_string();
                return Err(bad(&Origin::Default, "cluster.token_file", &shown, &problem, TOKEN_FIX));
            }
            c.token_file = Some(path);
        }
    }
    Ok(())
}

/// The job's members, from `peers` or Slurm's node list, and which of them this node is.
fn members(c: &mut ClusterConfig, written: &Written<'_>, slurm_nodes: Option<&str>) -> Result<(), ConfigError> {
    let fix = "list the job's nodes in [cluster] peers, TIERSTORE_PEERS (e.g. \"gpu[001-016]\"), or run under Slurm";
    let (entries, origin) = match written.keys.get("peers") {
        Some((toml::Value::Array(list), o)) => (list.iter().map(scalar).collect(), o.clone()),
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
    c.members =
        members_of(&entries, c.port).map_err(|e| bad(&origin, "cluster.peers", entries.join(","), &e.problem, fix))?;
    let (node, node_origin) = match written.text("node") {
        Some((v, o)) => (v, o.clone()),
        None => (hostname(), Origin::Default),
    };
    c.me = find_member(&c.members, &node, c.port);
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
    Ok(())
}

/// The Unix socket of this user's agent: in the user's runtime directory, or in a private directory
/// under /tmp, or, where another user made that one first, in `~/.tierstore/run-<host>`.
pub fn default_socket() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(d) if !d.is_empty() => PathBuf::from(d).join("tierstore").join("agent.sock"),
        _ => runtime_dir_without_xdg().join("agent.sock"),
    }
}

/// The agent's runtime directory when `XDG_RUNTIME_DIR` is unset: `/tmp/tierstore-<uid>`. Its name is
/// foreseeable, so another user can make it first; one that is not this user's own
/// ([`crate::private::why_not_own`]) is never used, and the directory is `~/.tierstore/run-<host>`
/// instead, which no other user can make: the agent still starts, and every process of the user finds
/// it by the same rule. Said once per process. Without a home, the directory stays the one in /tmp, which
/// is then refused with its owner and the fix.
fn runtime_dir_without_xdg() -> PathBuf {
    // SAFETY: getuid cannot fail.
    let plain = PathBuf::from(format!("/tmp/tierstore-{}", unsafe { libc::getuid() }));
    let Some(why) = crate::private::why_not_own(&plain) else { return plain };
    let home = match std::env::var_os("HOME") {
        Some(h) if !h.is_empty() => PathBuf::from(h),
        _ => return plain,
    };
    let instead = home.join(".tierstore").join(format!("run-{}", hostname()));
    static SAID: std::sync::Once = std::sync::Once::new();
    SAID.call_once(|| {
        log::warn!(
            "{why}, so it is not used (another user may have made it first): the agent's socket and log are \
             in {} instead. To use {} again, have its owner (or root) remove it",
            instead.display(),
            plain.display()
        )
    });
    instead
}

/// The member that `node` names: written as `host:port`, or as a host (with the default `port`) that
/// only one member has.
pub fn find_member(members: &[Member], node: &str, port: u16) -> Option<usize> {
    if let Some(i) = members.iter().position(|m| m.address() == node) {
        return Some(i);
    }
    let same_host: Vec<usize> = (0..members.len()).filter(|&i| members[i].host == node).collect();
    match same_host.as_slice() {
        [one] => Some(*one),
        many => many.iter().copied().find(|&i| members[i].port == port),
    }
}

/// This machine's host name.
pub fn hostname() -> String {
    let mut buf = [0u8; 256];
    // SAFETY: gethostname writes at most buf.len() bytes.
    if unsafe { libc::gethostname(buf.as_mut_ptr() as *mut libc::c_char, buf.len()) } == 0 {
        let end = buf.iter().position(|&b| b == 0).unwrap_or(buf.len());
        return String::from_utf8_lossy(&buf[..end]).into_owned();
    }
    "localhost".into()
}

/// A hostlist that cannot be expanded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{problem}; write hosts as Slurm does, e.g. \"gpu[001-016,020],login1\"")]
pub struct HostlistError {
    /// What is wrong.
    pub problem: String,
}

/// Expands a Slurm hostlist (`node[01-04,7],gpu[1-2]-ib,login`) into host names, in order, without
/// duplicates. Zero padding of a range is kept (`[08-10]` gives `08 09 10`).
pub fn expand_hostlist(list: &str) -> Result<Vec<String>, HostlistError> {
    let err = |problem: String| HostlistError { problem };
    let mut out = Vec::new();
    let mut seen = BTreeSet::new();
    for item in split_top_level(list).map_err(err)? {
        let item = item.trim();
        if item.is_empty() {
            continue;
        }
        let mut names = vec![String::new()];
        let mut rest = item;
        while !rest.is_empty() {
            let Some(open) = rest.find('[') else {
                names.iter_mut().for_each(|n| n.push_str(rest));
                break;
            };
            let close = rest[open..].find(']').ok_or_else(|| err(format!("{item:?}: a '[' is never closed")))? + open;
            let prefix = &rest[..open];
            let choices = expand_ranges(&rest[open + 1..close]).map_err(err)?;
            if names.len().saturating_mul(choices.len()) > MAX_HOSTS {
                return Err(err(format!("{item:?} expands to more than {MAX_HOSTS} hosts")));
            }
            names = names.iter().flat_map(|n| choices.iter().map(move |c| format!("{n}{prefix}{c}"))).collect();
            rest = &rest[close + 1..];
        }
        for n in names {
            if n.contains(']') {
                return Err(err(format!("{item:?}: a ']' without its '['")));
            }
            if seen.insert(n.clone()) {
                out.push(n);
            }
        }
        if out.len() > MAX_HOSTS {
            return Err(err(format!("the list expands to more than {MAX_HOSTS} hosts")));
        }
    }
    if out.is_empty() {
        return Err(err("the list names no host".into()));
    }
    Ok(out)
}

/// Splits at commas outside brackets.
fn split_top_level(list: &str) -> Result<Vec<&str>, String> {
    let (mut depth, mut start, mut parts) = (0i32, 0, Vec::new());
    for (i, c) in list.char_indices() {
        match c {
            '[' => depth += 1,
            ']' => depth -= 1,
            ',' if depth == 0 => {
                parts.push(&list[start..i]);
                start = i + 1;
            }
            _ => {}
        }
        if !(0..=1).contains(&depth) {
            return Err(format!("{list:?}: brackets are unbalanced or nested"));
        }
    }
    if depth != 0 {
        return Err(format!("{list:?}: a '[' is never closed"));
    }
    parts.push(&list[start..]);
    Ok(parts)
}

/// `01-03,7` into `01 02 03 7`.
fn expand_ranges(spec: &str) -> Result<Vec<String>, String> {
    let mut out = Vec::new();
    for part in spec.split(',') {
        let part = part.trim();
        let (lo, hi) = part.split_once('-').unwrap_or((part, part));
        let bad = || format!("[{spec}]: {part:?} is not a number or a range like 01-16");
        let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
        if !digits(lo) || !digits(hi) {
            return Err(bad());
        }
        let (a, b): (u64, u64) = (lo.parse().map_err(|_| bad())?, hi.parse().map_err(|_| bad())?);
        if b < a {
            return Err(format!("[{spec}]: the range {part:?} runs backwards"));
        }
        if b - a >= MAX_HOSTS as u64 {
            return Err(format!("[{spec}]: the range {part:?} is longer than {MAX_HOSTS} hosts"));
        }
        let width = lo.len();
        out.extend((a..=b).map(|n| format!("{n:0width$}")));
    }
    Ok(out)
}

/// Members from hostlist entries, each a comma-separated list of `HOSTLIST` or `HOSTLIST:PORT` items (a
/// port of its own overrides `port`).
pub fn members_of(entries: &[String], port: u16) -> Result<Vec<Member>, HostlistError> {
    let mut out = BTreeSet::new();
    for entry in entries {
        for item in split_top_level(entry).map_err(|problem| HostlistError { problem })? {
            let item = item.trim();
            if item.is_empty() {
                continue;
            }
            // A port follows the last ':' of an item, after any brackets: "gpu[1-4]:7100".
            let (hosts, own_port) = match item.rsplit_once(':') {
                Some((h, p)) if !p.contains(']') => {
                    let p: u16 =
                        p.parse().ok().filter(|p| *p > 0).ok_or_else(|| HostlistError {
                            problem: format!("{item:?}: {p:?} is not a port number"),
                        })?;
                    (h, p)
                }
                _ => (item, port),
            };
            for host in expand_hostlist(hosts)? {
                out.insert(Member { host, port: own_port });
            }
        }
    }
    if out.is_empty() {
        return Err(HostlistError { problem: "the list names no host".into() });
    }
    Ok(out.into_iter().collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hostlists_expand_as_slurm_writes_them() {
        assert_eq!(expand_hostlist("node[01-03,7],login").unwrap(), ["node01", "node02", "node03", "node7", "login"]);
        assert_eq!(expand_hostlist("r[1-2]-n[08-09]").unwrap(), ["r1-n08", "r1-n09", "r2-n08", "r2-n09"]);
        assert_eq!(expand_hostlist("a,a,b").unwrap(), ["a", "b"]);
        for bad in ["n[1-", "n[3-1]", "n[a-b]", "n]1[", "", "n[1-999999999]", "n[[1]]", "n[]"] {
            let e = expand_hostlist(bad).unwrap_err();
            assert!(e.to_string().contains("write hosts as Slurm does"), "{bad}: {e}");
        }
    }

    #[test]
    fn encrypt_takes_a_boolean_and_names_the_fix_otherwise() {
        let with = |v: toml::Value| {
            let keys = BTreeMap::from([("encrypt", (v, Origin::Env("TIERSTORE_ENCRYPT".into())))]);
            validate(&keys, None, None)
        };
        assert!(with(toml::Value::Boolean(true)).unwrap().encrypt);
        assert!(with(toml::Value::String("on".into())).unwrap().encrypt);
        assert!(!with(toml::Value::String("false".into())).unwrap().encrypt);
        let e = with(toml::Value::String("maybe".into())).unwrap_err().to_string();
        assert!(e.contains("TIERSTORE_ENCRYPT") && e.contains("encrypt = true or false"), "{e}");
        assert!(!validate(&BTreeMap::new(), None, None).unwrap().encrypt, "off unless asked for");
    }

    #[test]
    fn members_take_their_own_port_or_the_default() {
        let m = members_of(&["n[1-2]".into(), "10.0.0.9:7100,gpu[3-4]:7200".into()], 7078).unwrap();
        let addrs: Vec<String> = m.iter().map(Member::address).collect();
        assert_eq!(addrs, ["10.0.0.9:7100", "gpu3:7200", "gpu4:7200", "n1:7078", "n2:7078"]);
        assert!(members_of(&["n1:port".into()], 7078).unwrap_err().to_string().contains("not a port"));
    }
}
