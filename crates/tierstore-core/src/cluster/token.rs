//! The job's token: the shared secret every agent and reader of a job proves in its handshake
//! ([`super::session`]). Sharing on means a token, on loopback too, since any user of the node can
//! connect to 127.0.0.1. With none configured, tierstore makes one per user in `~/.tierstore/token`
//! (0600), which the nodes of a cluster usually share through the home directory, and says where.
//!
//! A token file is refused, with the fix, when others can read it (as ssh refuses such a private key) or
//! when it is too short or too uniform to be a random secret.

use std::io::Write;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};

/// What to do about a token file that cannot be used.
pub const TOKEN_FIX: &str = "create the job's token where every node reads it (mkdir -p ~/.tierstore && head -c 32 \
     /dev/urandom | base64 > ~/.tierstore/token && chmod 600 ~/.tierstore/token), or point [cluster] token_file or \
     TIERSTORE_TOKEN_FILE at it";

/// The shortest token accepted, in bytes: 32 random bytes written as base64 are 44.
pub const MIN_TOKEN_LEN: usize = 32;

/// The least entropy a token's bytes must show, in bits (their count times the Shannon entropy of their
/// frequencies: an estimate, which refuses `aaaa…` or `abababab…` and accepts base64 or hex of random bytes).
const MIN_TOKEN_BITS: f64 = 128.0;

/// This user's token when none is configured: `~/.tierstore/token`.
pub fn default_token_file() -> PathBuf {
    crate::config::values::home_dir().join(".tierstore").join("token")
}

fn estimated_bits(token: &[u8]) -> f64 {
    let mut counts = [0u32; 256];
    for &b in token {
        counts[b as usize] += 1;
    }
    let n = token.len() as f64;
    let per_byte: f64 = counts.iter().filter(|&&c| c > 0).map(|&c| c as f64 / n).map(|p| -p * p.log2()).sum();
    per_byte * n
}

/// The job's shared secret from `path` (surrounding whitespace dropped); the error says what is wrong with
/// the file in words that fit after its name.
pub fn read_token(path: &Path) -> Result<Vec<u8>, String> {
    let file = match std::fs::OpenOptions::new().read(true).custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC).open(path)
    {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Err("no such file".into()),
        Err(e) if e.raw_os_error() == Some(libc::ELOOP) => {
            return Err("is a symbolic link; give the token file itself".into())
        }
        Err(e) => return Err(format!("cannot be read ({e})")),
    };
    let meta = file.metadata().map_err(|e| format!("cannot be read ({e})"))?;
    if meta.is_dir() {
        return Err("is a directory; give the token file itself (for example the file token in it)".into());
    }
    if meta.mode() & 0o077 != 0 {
        return Err(format!(
            "can be read by other users (mode {:04o}): anyone who reads it can read the job's files; run chmod 600 {}",
            meta.mode() & 0o7777,
            path.display()
        ));
    }
    let me = crate::private::euid();
    if meta.uid() != me && me != 0 {
        return Err(format!("belongs to uid {}, not to you (uid {me}): use a token file of your own", meta.uid()));
    }
    let mut token = Vec::new();
    std::io::Read::read_to_end(&mut &file, &mut token).map_err(|e| format!("cannot be read ({e})"))?;
    let token = token.trim_ascii().to_vec();
    if token.len() < MIN_TOKEN_LEN || estimated_bits(&token) < MIN_TOKEN_BITS {
        return Err(format!(
            "does not hold a random secret ({} bytes; at least {MIN_TOKEN_LEN} random ones are needed, e.g. head -c \
             32 /dev/urandom | base64)",
            token.len()
        ));
    }
    Ok(token)
}

/// The token in `path`, made first (32 random bytes as base64, mode 0600, in a 0700 directory) when the
/// file does not exist. Several processes and nodes may race to make it; one wins, the others read its.
pub fn ensure_token(path: &Path) -> Result<Vec<u8>, String> {
    if std::fs::symlink_metadata(path).is_ok() {
        return read_token(path);
    }
    let dir = path.parent().ok_or("has no directory")?;
    crate::private::ensure_dir(dir).map_err(|e| format!("cannot be made: {e}"))?;
    let random: Vec<u8> = super::session::nonce().to_vec();
    let text = base64(&random);
    // Written whole under a name of this process's, then linked into place: no reader sees half a token,
    // and link() fails rather than replace a token another process made first.
    let temp = dir.join(format!(".token.{}.{}", std::process::id(), crate::process::pid()));
    let written = crate::private::create_new(&temp).and_then(|mut f| {
        f.write_all(text.as_bytes())?;
        f.write_all(b"\n")?;
        f.sync_all()
    });
    let linked = written.and_then(|()| std::fs::hard_link(&temp, path));
    let _ = std::fs::remove_file(&temp);
    match linked {
        Ok(()) => {
            log::warn!(
                "tierstore: made the job's token {} (mode 0600); every node of the job must read this same file \
                 (a shared home directory does it), or give them one with [cluster] token_file",
                path.display()
            );
            read_token(path)
        }
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => read_token(path),
        Err(e) => Err(format!("cannot be made ({e})")),
    }
}

fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().enumerate().fold(0u32, |n, (i, &b)| n | (b as u32) << (16 - 8 * i));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[(n >> (18 - 6 * i) & 63) as usize] as char);
        }
    }
    while !out.len().is_multiple_of(4) {
        out.push('=');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::PermissionsExt;

    fn write(dir: &Path, text: &str, mode: u32) -> PathBuf {
        let p = dir.join("token");
        let _ = std::fs::remove_file(&p);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode)).unwrap();
        p
    }

    #[test]
    fn a_token_others_can_read_is_refused_with_chmod() {
        let t = tempfile::tempdir().unwrap();
        let p = write(t.path(), "c2VjcmV0LXRva2VuLW9mLXRoZS1qb2ItMDEyMzQ1Njc4OQ==", 0o644);
        let e = read_token(&p).unwrap_err();
        assert!(e.contains("chmod 600"), "{e}");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
        read_token(&p).unwrap();
    }

    #[test]
    fn a_directory_is_no_token_and_is_not_told_to_chmod() {
        let t = tempfile::tempdir().unwrap();
        let dir = t.path().join("tokens");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
        let e = read_token(&dir).unwrap_err();
        assert!(e.contains("is a directory") && !e.contains("chmod"), "{e}");
    }

    #[test]
    fn short_or_uniform_tokens_are_refused() {
        let t = tempfile::tempdir().unwrap();
        for weak in ["a".repeat(16), "a".repeat(64), "ab".repeat(32), "tooshort-0123456789".into()] {
            let p = write(t.path(), &weak, 0o600);
            assert!(read_token(&p).unwrap_err().contains("random secret"), "{weak} was accepted");
        }
        // 32 random bytes as hex (64 characters) pass.
        let hex: String = super::super::session::nonce().iter().map(|b| format!("{b:02x}")).collect();
        read_token(&write(t.path(), &hex, 0o600)).unwrap();
    }

    #[test]
    fn a_missing_token_is_made_once_private_and_then_read() {
        let t = tempfile::tempdir().unwrap();
        let p = t.path().join("home/.tierstore/token");
        let first = ensure_token(&p).unwrap();
        assert_eq!(std::fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        assert_eq!(std::fs::metadata(p.parent().unwrap()).unwrap().mode() & 0o777, 0o700);
        assert_eq!(ensure_token(&p).unwrap(), first);
        assert_eq!(first.len(), 44);
    }

    #[test]
    fn base64_matches_the_standard_alphabet() {
        assert_eq!(base64(b"any carnal pleas"), "YW55IGNhcm5hbCBwbGVhcw==");
        assert_eq!(base64(b"any carnal pleasu"), "YW55IGNhcm5hbCBwbGVhc3U=");
        assert_eq!(base64(b"any carnal pleasur"), "YW55IGNhcm5hbCBwbGVhc3Vy");
    }
}
