//! What tierstore says on stderr, and how much: `TIERSTORE_LOG`.
//!
//! | value | what is said |
//! | --- | --- |
//! | `off` | nothing |
//! | `error` | what failed and was not recovered |
//! | `warn` (the default) | also each kind of cache fault, once per process (the rest are counted) |
//! | `info` | also what the agent and the write-back did (joins, migrations) |
//! | `debug` | also what the cache decided for each file and why: hit, miss, fetch, peer, confirm, fallback |
//! | `trace` | everything, for a bug report |
//!
//! Every line starts with `tierstore[PID] LEVEL`, so that a job's DataLoader workers can be told apart. The
//! logger is the `log` crate's: a disabled level costs one atomic load per call site, so the decisions of
//! every open can be logged without slowing a job that does not ask for them.

use std::io::Write;
use std::sync::OnceLock;

/// The environment variable that sets the level.
pub const VARIABLE: &str = "TIERSTORE_LOG";

/// The levels `TIERSTORE_LOG` takes, in order.
pub const LEVELS: &[&str] = &["off", "error", "warn", "info", "debug", "trace"];

/// The level `value` names, or an error saying which values there are.
pub fn parse(value: &str) -> Result<log::LevelFilter, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "off" => Ok(log::LevelFilter::Off),
        "error" => Ok(log::LevelFilter::Error),
        "warn" | "warning" => Ok(log::LevelFilter::Warn),
        "info" => Ok(log::LevelFilter::Info),
        "debug" => Ok(log::LevelFilter::Debug),
        "trace" => Ok(log::LevelFilter::Trace),
        other => Err(format!("${VARIABLE}={other:?} is not a level: give one of {}", LEVELS.join(", "))),
    }
}

struct Stderr;

impl log::Log for Stderr {
    fn enabled(&self, metadata: &log::Metadata<'_>) -> bool {
        metadata.level() <= log::max_level()
    }

    fn log(&self, record: &log::Record<'_>) {
        if !self.enabled(record.metadata()) {
            return;
        }
        let level = match record.level() {
            log::Level::Error => "error",
            log::Level::Warn => "warning",
            log::Level::Info => "info",
            log::Level::Debug => "debug",
            log::Level::Trace => "trace",
        };
        // One write per line, so that lines of several threads and processes do not interleave.
        let line = format!("tierstore[{}] {level}: {}\n", crate::process::pid(), record.args());
        let _ = std::io::stderr().lock().write_all(line.as_bytes());
    }

    fn flush(&self) {}
}

static LOGGER: Stderr = Stderr;
static LEVEL: OnceLock<log::LevelFilter> = OnceLock::new();

/// The level `TIERSTORE_LOG` asks for (`default` when unset), read once per process. A value that names
/// no level is said once, and the default is used: a typo must not silence the warnings.
pub fn configured(default: log::LevelFilter) -> log::LevelFilter {
    *LEVEL.get_or_init(|| match std::env::var(VARIABLE) {
        Ok(v) if !v.is_empty() => parse(&v).unwrap_or_else(|e| {
            eprintln!("tierstore: warning: {e}; using {}", default.as_str().to_ascii_lowercase());
            default
        }),
        _ => default,
    })
}

/// Installs the stderr logger at the [`configured`] level (`warn` when unset), once per process; a
/// program that installed a logger of its own keeps it.
pub fn init() {
    let level = configured(log::LevelFilter::Warn);
    if log::set_logger(&LOGGER).is_ok() {
        log::set_max_level(level);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_level_parses_and_a_wrong_one_names_the_choices() {
        for (name, level) in LEVELS.iter().zip([
            log::LevelFilter::Off,
            log::LevelFilter::Error,
            log::LevelFilter::Warn,
            log::LevelFilter::Info,
            log::LevelFilter::Debug,
            log::LevelFilter::Trace,
        ]) {
            assert_eq!(parse(name), Ok(level));
            assert_eq!(parse(&name.to_ascii_uppercase()), Ok(level));
        }
        let err = parse("loud").unwrap_err();
        assert!(
            err.contains("TIERSTORE_LOG=\"loud\"") && err.contains("off, error, warn, info, debug, trace"),
            "{err}"
        );
    }
}
