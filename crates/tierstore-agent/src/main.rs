//! `tierstore-agent`: the node agent's executable (`tierstore agent ...` runs it).
//!
//! ```text
//! tierstore-agent run    [--socket PATH] [--node NAME] [--listen ADDR:PORT] [--token-file FILE] [--idle-exit SECS]
//!                        [--peers HOST:PORT,...] [--metrics ADDR:PORT] [--stream-dir DIR] [--stream-keep N]
//!                        [--stream-redis redis://HOST:PORT]
//! tierstore-agent status [--socket PATH] [--json] [--peer HOST:PORT [--token-file FILE]]
//! tierstore-agent stop   [--socket PATH]
//! ```
//!
//! The agent serves the node's cache to its peers: the source, tiers and `[cluster]` come from the job's
//! configuration, read as every tierstore process reads it (`TIERSTORE_CONFIG` or `./tierstore.toml`,
//! then `TIERSTORE_*`). The flags above override the `[cluster]` settings.

use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use tierstore_agent::client::Client;
use tierstore_agent::options::{Options, StreamOptions};
use tierstore_agent::protocol::Frame;
use tierstore_agent::server::Agent;
use tierstore_core::cluster::{hostname, ClusterConfig, Member, Sharing};
use tierstore_core::config::{Config, Overrides};
use tierstore_core::Cache;

const USAGE: &str = "usage:
  tierstore-agent run    [--socket PATH] [--node NAME] [--listen ADDR:PORT] [--token-file FILE] [--idle-exit SECS]
                         [--peers HOST:PORT,...] [--metrics ADDR:PORT] [--stream-dir DIR] [--stream-keep N]
                         [--stream-redis redis://HOST:PORT]
  tierstore-agent status [--socket PATH] [--json] [--peer HOST:PORT [--token-file FILE]]
  tierstore-agent stop   [--socket PATH]";

fn default_socket() -> PathBuf {
    tierstore_core::cluster::default_socket()
}

/// The job's configuration, if it names a source (an agent started with none serves no file).
fn job_config() -> Result<Option<Config>, String> {
    match Config::load(&Overrides::default()) {
        Ok(c) => Ok(Some(c)),
        Err(e) if e.key == "source" && e.value == "(unset)" => Ok(None),
        Err(e) => Err(e.to_string()),
    }
}

struct Logger;

impl log::Log for Logger {
    fn enabled(&self, m: &log::Metadata) -> bool {
        m.level() <= log::max_level()
    }
    fn log(&self, r: &log::Record) {
        if self.enabled(r.metadata()) {
            let t = humantime::format_rfc3339_millis(std::time::SystemTime::now());
            let _ = writeln!(std::io::stderr(), "{t} tierstore-agent {}: {}", r.level(), r.args());
        }
    }
    fn flush(&self) {}
}

static LOGGER: Logger = Logger;

/// The commands `tierstore-agent` takes.
const COMMANDS: [&str; 3] = ["run", "status", "stop"];

struct Args {
    command: String,
    socket: PathBuf,
    node: Option<String>,
    listen: Option<String>,
    token_file: Option<PathBuf>,
    idle_exit: Option<f64>,
    peers: Vec<String>,
    json: bool,
    /// `status` of another node's agent, over TCP.
    peer: Option<String>,
    metrics: Option<String>,
    /// Model streams: where versions are kept, and how many per stream.
    stream: tierstore_agent::options::StreamOptions,
    /// `--stream-keep` as given (the configuration's `[stream] keep` applies when it is not).
    stream_keep: Option<usize>,
}

/// The token file to read and how the user named it (the flag, or the configuration key), for messages.
fn token_source(
    flag: Option<&std::path::Path>,
    configured: Option<&std::path::Path>,
) -> Option<(PathBuf, &'static str)> {
    match (flag, configured) {
        (Some(f), _) => Some((f.to_path_buf(), "--token-file")),
        (None, Some(f)) => Some((f.to_path_buf(), "[cluster] token_file")),
        (None, None) => None,
    }
}

// Long on purpose: one arm per flag, as `--help` lists them.
fn parse_args() -> Result<Args, String> {
    // `--help` or `-h` anywhere (`tierstore-agent --help`, `tierstore-agent run -h`): the usage, exit 0;
    // after a command that does not exist, the usage is an error (exit 1), as the command alone is.
    if std::env::args().skip(1).any(|a| a == "--help" || a == "-h") {
        match std::env::args().nth(1).filter(|c| !c.starts_with('-')) {
            Some(c) if !COMMANDS.contains(&c.as_str()) => {
                eprintln!("tierstore-agent: unknown command {c:?}\n{USAGE}");
                std::process::exit(1);
            }
            _ => {
                println!("{USAGE}");
                std::process::exit(0);
            }
        }
    }
    let mut it = std::env::args().skip(1);
    let command = it.next().ok_or("no command given")?;
    let mut a = Args {
        command,
        socket: default_socket(),
        node: None,
        listen: None,
        token_file: None,
        idle_exit: None,
        peers: Vec::new(),
        json: false,
        peer: None,
        metrics: None,
        stream: Default::default(),
        stream_keep: None,
    };
    while let Some(flag) = it.next() {
        let mut value = || it.next().ok_or(format!("{flag} needs a value"));
        match flag.as_str() {
            "--socket" => a.socket = PathBuf::from(value()?),
            "--node" => a.node = Some(value()?),
            "--listen" => a.listen = Some(value()?),
            "--token-file" => a.token_file = Some(PathBuf::from(value()?)),
            "--idle-exit" => {
                let v = value()?;
                a.idle_exit = Some(v.parse().map_err(|_| format!("--idle-exit {v:?}: give seconds, e.g. 300"))?);
            }
            "--peers" => {
                let list = value()?;
                let members = tierstore_core::cluster::members_of(&[list], tierstore_core::cluster::DEFAULT_PORT)
                    .map_err(|e| format!("--peers: {e}"))?;
                a.peers = members.iter().map(|m| m.address()).collect();
            }
            "--json" => a.json = true,
            "--peer" => a.peer = Some(value()?),
            "--metrics" => a.metrics = Some(value()?),
            "--stream-dir" => a.stream.dir = Some(PathBuf::from(value()?)),
            "--stream-redis" => a.stream.redis = Some(value()?),
            "--stream-keep" => {
                let v = value()?;
                a.stream.keep =
                    v.parse().ok().filter(|k| *k > 0).ok_or(format!("--stream-keep {v:?}: give a count, e.g. 2"))?;
                a.stream_keep = Some(a.stream.keep);
            }
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    Ok(a)
}

/// Raises the soft limit on open files to the hard one: the agent holds a descriptor for every connection
/// (its budgets allow a few thousand at once, see `server.rs`) besides its cache's files, and many systems
/// start processes with a soft limit of 1,024, which a flood of connections would exhaust.
fn raise_open_file_limit() {
    let mut limit = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit writes one rlimit into `limit`.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } != 0 {
        log::debug!("cannot read the limit on open files: {}", std::io::Error::last_os_error());
        return;
    }
    let was = limit.rlim_cur;
    // No process may open more than fs.nr_open (2^20 unless raised), whatever its hard limit says.
    let most = if limit.rlim_max == libc::RLIM_INFINITY { 1 << 20 } else { limit.rlim_max };
    if was >= most {
        log::debug!("open files: {was} at most");
        return;
    }
    limit.rlim_cur = most;
    // SAFETY: setrlimit reads one rlimit from `limit`.
    if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) } == 0 {
        log::debug!("raised the limit on open files from {was} to {most}");
    } else {
        log::debug!("cannot raise the limit on open files from {was}: {}", std::io::Error::last_os_error());
    }
}

async fn run(a: Args) -> Result<(), String> {
    raise_open_file_limit();
    let options = options(a)?;
    let agent = Agent::bind(options.clone()).await.map_err(|e| e.to_string())?;
    log::info!(
        "node {} serving on {}{}; files of {}",
        options.node,
        options.socket.display(),
        agent.peer_address().map(|p| format!(" and peers on {p}")).unwrap_or_default(),
        options.cache.as_ref().map_or("no source".into(), |c| c.config().source.display().to_string()),
    );
    if let Some(m) = agent.metrics_address() {
        log::info!("metrics on http://{m}/metrics");
    }
    // The line tierstore's launcher waits for: the agent is ready once it is printed.
    println!("ready {}", agent.peer_address().map(|p| p.to_string()).unwrap_or_default());
    let _ = std::io::stdout().flush();
    agent.serve(terminated()).await;
    log::info!("stopped");
    Ok(())
}

/// The agent's options: the flags over the job's configuration (its cluster and token, the cache of its
/// source, model streams, write-back stages); the write-back migrations start here.
fn options(a: Args) -> Result<Options, String> {
    let config = job_config()?;
    let cluster = config.as_ref().map(|c| c.cluster.clone()).filter(|c| c.sharing != Sharing::Off);
    let me = cluster.as_ref().and_then(|c| c.me.map(|i| c.members[i].clone()));
    let node = a.node.clone().or_else(|| cluster.as_ref().map(|c| c.node.clone())).unwrap_or_else(hostname);
    let mut options = Options::new(node, a.socket.clone());
    if let Some(l) = listen_address(&a, cluster.as_ref(), me.as_ref()) {
        options.listen =
            Some(l.parse().map_err(|_| format!("--listen {l:?}: give ADDRESS:PORT, e.g. 127.0.0.1:7078"))?);
    }
    if let Some(m) = &a.metrics {
        options.metrics =
            Some(m.parse().map_err(|_| format!("--metrics {m:?}: give ADDRESS:PORT, e.g. 127.0.0.1:9478"))?);
    }
    options.token = job_token(&a, cluster.as_ref())?;
    if let Some(c) = &cluster {
        join(&mut options, c)?;
    }
    let peers = match (&a.peers, &cluster) {
        (p, _) if !p.is_empty() => p.clone(),
        (_, Some(c)) => c.members.iter().filter(|m| Some(*m) != me.as_ref()).map(|m| m.address()).collect(),
        _ => Vec::new(),
    };
    if let Some(config) = config {
        let source = config.source.display().to_string();
        let cache = Cache::serving(config).map_err(|e| format!("cannot open the cache of {source}: {e}"))?;
        options.cache = Some(std::sync::Arc::new(cache));
    }
    options.idle_exit = a.idle_exit.map(Duration::from_secs_f64);
    options.stream = stream_options(&a, cluster.as_ref())?;
    start_writeback(&mut options);
    // Every agent is given the whole list; it pings the others.
    let me = options.listen.map(|l| l.to_string());
    let is_me = |p: &String| Some(p) == me.as_ref() || p.rsplit_once(':').is_some_and(|(host, _)| host == options.node);
    options.peers = peers.into_iter().filter(|p| !is_me(p)).collect();
    Ok(options)
}

/// Where the agent listens for peers: `--listen`, else a member's own address in the job (where the
/// others will look for it), else nowhere.
fn listen_address(a: &Args, cluster: Option<&ClusterConfig>, me: Option<&Member>) -> Option<String> {
    match (&a.listen, cluster) {
        (Some(l), _) => Some(l.clone()),
        (None, Some(c)) => {
            let port = me.map_or_else(
                || c.my_address().rsplit_once(':').and_then(|(_, p)| p.parse().ok()).unwrap_or(c.port),
                |m| m.port,
            );
            Some(format!("{}:{port}", c.listen))
        }
        (None, None) => None,
    }
}

/// The job's token: a file `--token-file` names must exist; the configuration's (this user's default
/// one when none is configured) is made here at its first use.
fn job_token(a: &Args, cluster: Option<&ClusterConfig>) -> Result<Option<Vec<u8>>, String> {
    let Some((f, named)) = token_source(a.token_file.as_deref(), cluster.and_then(|c| c.token_file.as_deref())) else {
        return Ok(None);
    };
    let read = match named {
        "--token-file" => tierstore_core::cluster::read_token,
        _ => tierstore_core::cluster::ensure_token,
    };
    let token =
        read(&f).map_err(|p| format!("{named} {}: {p}; {}", f.display(), tierstore_core::cluster::TOKEN_FIX))?;
    Ok(Some(token))
}

/// This agent as a member of the job `c`: its address, the others', encryption, and the registry.
fn join(options: &mut Options, c: &ClusterConfig) -> Result<(), String> {
    options.encrypt = c.encrypt;
    options.me = c.my_address();
    options.job_members = c.members.iter().map(|m| m.address()).collect();
    options.job = c.job.clone();
    if let Some(url) = &c.registry {
        let token = options.token.as_deref().ok_or("a registry needs the job's token: set [cluster] token_file")?;
        let r = tierstore_agent::registry::open(Some(url), &c.job, token).map_err(|e| e.to_string())?;
        options.registry = Some(std::sync::Arc::from(r));
    }
    Ok(())
}

/// Model streams: the flags, then `[stream]` (TIERSTORE_STREAM_*), then the defaults; they cross nodes
/// through the job's Redis registry, unless another one is named.
fn stream_options(a: &Args, cluster: Option<&ClusterConfig>) -> Result<StreamOptions, String> {
    let configured = tierstore_core::config::load_stream(&Overrides::default()).map_err(|e| e.to_string())?;
    let mut stream = a.stream.clone();
    if stream.dir.is_none() {
        stream.dir = configured.dir;
    }
    if a.stream_keep.is_none() {
        stream.keep = configured.keep.unwrap_or(stream.keep);
    }
    stream.spares = configured.spares.unwrap_or(stream.spares);
    if stream.redis.is_none() {
        stream.redis =
            configured.redis.or_else(|| cluster.and_then(|c| c.registry.clone()).filter(|r| r.starts_with("redis")));
    }
    Ok(stream)
}

/// Write-back: starts migrating the stages of the configuration's destinations (each with the destination
/// it serves) and those writers list; the agent is busy while any is pending.
fn start_writeback(options: &mut Options) {
    let stages = match tierstore_core::config::load_writeback(&Overrides::default()) {
        Ok(dests) => dests.into_iter().map(|d| (d.stage, d.path)).collect(),
        Err(e) => {
            log::warn!("write-back configuration: {e}; migrating only the stages writers list");
            Vec::new()
        }
    };
    let migrations = tierstore_agent::writeback::start(stages);
    options.writeback = Some(migrations.clone());
    options.busy = Some(std::sync::Arc::new(move || migrations.pending.load(std::sync::atomic::Ordering::Acquire)));
}

/// Resolves on SIGTERM or SIGINT (never, where they cannot be caught).
async fn terminated() {
    use tokio::signal::unix::{signal, SignalKind};
    match (signal(SignalKind::terminate()), signal(SignalKind::interrupt())) {
        (Ok(mut term), Ok(mut int)) => {
            tokio::select! {
                _ = term.recv() => {}
                _ = int.recv() => {}
            }
        }
        _ => std::future::pending().await,
    }
}

async fn status(a: Args) -> Result<(), String> {
    let deadline = Duration::from_secs(3);
    let json = match &a.peer {
        Some(addr) => {
            let job = job_config().ok().flatten();
            // This node introduces itself as the job knows it (`[cluster] node`), not by its host name, so
            // that a refusal names the member the user configured.
            let me = (a.node.clone())
                .or_else(|| job.as_ref().map(|c| c.cluster.node.clone()).filter(|n| !n.is_empty()))
                .unwrap_or_else(hostname);
            let configured = job.and_then(|c| c.cluster.token_file);
            let token = match token_source(a.token_file.as_deref(), configured.as_deref()) {
                Some((f, named)) => Some(
                    tierstore_core::cluster::read_token(&f)
                        .map_err(|p| format!("{named} {}: {p}; {}", f.display(), tierstore_core::cluster::TOKEN_FIX))?,
                ),
                None => None,
            };
            let mut c = Client::peer(addr, &me, token.as_deref(), deadline).await.map_err(|e| e.to_string())?;
            c.status().await.map_err(|e| e.to_string())?
        }
        None => {
            let mut c = Client::local(&a.socket, deadline).await.map_err(|e| e.to_string())?;
            c.status().await.map_err(|e| e.to_string())?
        }
    };
    if a.json {
        println!("{json}");
        return Ok(());
    }
    let v: serde_json::Value = serde_json::from_str(&json).map_err(|e| e.to_string())?;
    if let Some(map) = v.as_object() {
        for (k, v) in map {
            println!("{k:<18} {v}");
        }
    }
    Ok(())
}

async fn stop(a: Args) -> Result<(), String> {
    let mut c = match Client::local(&a.socket, Duration::from_secs(5)).await {
        Ok(c) => c,
        // Nothing to stop: the wanted state already holds (as `systemctl stop` of a stopped unit).
        Err(tierstore_agent::client::ClientError::Unreachable { .. }) => {
            println!("no agent runs on {}: nothing to stop", a.socket.display());
            return Ok(());
        }
        Err(e) => return Err(e.to_string()),
    };
    match c.call(&Frame::Stop).await.map_err(|e| e.to_string())? {
        Frame::Stopping => {
            // Stopped once the socket is gone (the agent removes it last), within a deadline.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            while a.socket.exists() {
                if std::time::Instant::now() > deadline {
                    return Err(format!("the agent on {} did not stop within 10 s", a.socket.display()));
                }
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            println!("stopped the agent of node {}", c.node);
            Ok(())
        }
        other => Err(format!("unexpected answer {other:?}")),
    }
}

fn main() -> ExitCode {
    // `info` unless $TIERSTORE_LOG says otherwise: an agent's joins, leaves and migrations are its record.
    let level = tierstore_core::logging::configured(log::LevelFilter::Info);
    let _ = log::set_logger(&LOGGER).map(|()| log::set_max_level(level));
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("tierstore-agent: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("tierstore-agent: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = rt.block_on(async {
        match args.command.as_str() {
            "run" => run(args).await,
            "status" => status(args).await,
            "stop" => stop(args).await,
            other => Err(format!("unknown command {other:?}\n{USAGE}")),
        }
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("tierstore-agent: {e}");
            ExitCode::FAILURE
        }
    }
}
