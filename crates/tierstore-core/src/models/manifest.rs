//! The manifests of model versions, the one definition of their schemas, read and written through
//! `tierstore._core` by Python and directly by the agent:
//!
//! - a **stream's version** ([`Manifest`]): its tensors (name, dtype, shape, blake3, size), the trainer's
//!   step and the publisher's metadata. The publisher writes it beside the tensors it placed; the agent
//!   completes it at commit (name, number, time) and hands its path to every consumer, on this node and on
//!   others, who read it back through the same types;
//! - a **repository's version** ([`RepositoryManifest`], `models/<name>/v<N>.json`): the same tensors, each
//!   with the pack and offset its bytes are kept at, the framework, the layer graph and the user's metadata.
//!
//! Both tensor tables are one [`Tensor`] type. A manifest is a file another process wrote, so reading one
//! checks what a reader will act on: every hash is a blake3 (the name of a file), and every pack a plain
//! file name of the repository's `packs/` (a `../` there would read outside it).

use std::collections::BTreeMap;
use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// One tensor of a manifest.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Tensor {
    /// The state-dict key.
    pub name: String,
    /// The dtype's name (torch's or numpy's).
    pub dtype: String,
    /// The shape.
    pub shape: Vec<u64>,
    /// blake3 of the bytes, lowercase hex: the name of its file in `blobs`.
    pub hash: String,
    /// The size in bytes.
    pub nbytes: u64,
}

/// A version's manifest: what the publisher writes, completed by the agent at commit.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Manifest {
    /// The stream (set by the agent).
    #[serde(default)]
    pub name: String,
    /// The version number (set by the agent).
    #[serde(default)]
    pub version: u64,
    /// Seconds since the epoch at commit (set by the agent).
    #[serde(default)]
    pub created: f64,
    /// The trainer's step, if it gave one.
    #[serde(default)]
    pub step: Option<i64>,
    /// The publisher's metadata.
    #[serde(default)]
    pub metadata: Value,
    /// The tensors, in the publisher's order.
    pub tensors: Vec<Tensor>,
}

impl Manifest {
    /// Reads and checks the manifest at `path`: a tensor's hash that is not a blake3 in lowercase hex
    /// (the name of its file) makes it invalid.
    pub fn read(path: &std::path::Path) -> std::io::Result<Manifest> {
        let text = std::fs::read(path)?;
        let m: Manifest = serde_json::from_slice(&text)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {e}", path.display())))?;
        if let Some(t) = m.tensors.iter().find(|t| !check_hash(&t.hash)) {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!("{}: tensor {:?} has no blake3 hash ({:?})", path.display(), t.name, t.hash),
            ));
        }
        Ok(m)
    }

    /// Writes the manifest as JSON at `path`.
    pub fn write(&self, path: &std::path::Path) -> std::io::Result<()> {
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        std::fs::write(path, text)
    }
}

/// The format a repository's manifests are written in (its `format` key); a repository's marker file
/// names the same number.
pub const REPOSITORY_FORMAT: u32 = 1;

/// A tensor of a repository's version: the stream's tensor, and where its bytes are kept.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct StoredTensor {
    /// Name, dtype, shape, hash and size, as a stream's tensor has them.
    #[serde(flatten)]
    pub tensor: Tensor,
    /// The pack file (a name in the repository's `packs/`).
    pub pack: String,
    /// Where the bytes start in the pack.
    pub offset: u64,
}

/// A version of a model in the repository (`models/<name>/v<N>.json`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RepositoryManifest {
    /// [`REPOSITORY_FORMAT`].
    pub format: u32,
    /// The model's name.
    pub name: String,
    /// The version number, from 1.
    pub version: u64,
    /// Seconds since the epoch when it was saved.
    pub created: f64,
    /// What the state dict was made of (`torch`, `numpy`): what a load builds by default.
    pub framework: String,
    /// The user's metadata.
    #[serde(default)]
    pub metadata: Value,
    /// The model's layer graph, when it was saved with one (`null` otherwise).
    #[serde(default)]
    pub graph: Value,
    /// The tensors, in the state dict's order.
    pub tensors: Vec<StoredTensor>,
    /// The blake3 of each pack file the tensors are kept in, whole (lowercase hex, by pack name), where
    /// known: the hash its writer computed. A load whose copy of a pack was checked whole against it as
    /// the copy arrived does not hash each tensor again. Absent from manifests written before it was
    /// recorded, and for a pack whose hash no save recorded; those loads hash every tensor.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub pack_hashes: BTreeMap<String, String>,
    /// Bytes this save wrote to packs (what deduplication did not spare).
    pub written_bytes: u64,
}

impl RepositoryManifest {
    /// Reads and checks the manifest at `path`: its format, a blake3 for every tensor and a plain pack
    /// name, else `InvalidData` naming the file and what is wrong.
    pub fn read(path: &Path) -> std::io::Result<RepositoryManifest> {
        let invalid =
            |what: String| std::io::Error::new(std::io::ErrorKind::InvalidData, format!("{}: {what}", path.display()));
        let m: RepositoryManifest =
            serde_json::from_slice(&std::fs::read(path)?).map_err(|e| invalid(e.to_string()))?;
        m.check().map_err(invalid)?;
        Ok(m)
    }

    /// What makes the manifest unusable, if anything.
    pub fn check(&self) -> Result<(), String> {
        if self.format != REPOSITORY_FORMAT {
            return Err(format!("format {} (this tierstore reads format {REPOSITORY_FORMAT})", self.format));
        }
        for t in &self.tensors {
            let name = &t.tensor.name;
            if !check_hash(&t.tensor.hash) {
                return Err(format!("tensor {name:?} has no blake3 hash ({:?})", t.tensor.hash));
            }
            if !is_pack_name(&t.pack) {
                return Err(format!("tensor {name:?} names the pack {:?}, not a file of packs/", t.pack));
            }
        }
        for (pack, hash) in &self.pack_hashes {
            if !is_pack_name(pack) {
                return Err(format!("pack_hashes names {pack:?}, not a file of packs/"));
            }
            if !check_hash(hash) {
                return Err(format!("pack_hashes gives the pack {pack} no blake3 hash ({hash:?})"));
            }
        }
        Ok(())
    }

    /// Writes the manifest at `path` durably and whole: under a temporary name beside it, fsynced, renamed
    /// over `path`, and the directory fsynced, so that a reader sees the old file or the new one and a
    /// crash leaves one of them.
    pub fn write(&self, path: &Path) -> std::io::Result<()> {
        self.check().map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        let text = serde_json::to_vec(self).map_err(std::io::Error::other)?;
        let name = path.file_name().ok_or_else(|| std::io::Error::other("a manifest's path has a file name"))?;
        let tmp = path.with_file_name(format!(".{}.{}.tmp", name.to_string_lossy(), std::process::id()));
        // Left by a crashed save of a process that had this pid: its own temporary, as the name says. Made
        // anew with O_EXCL, so that nothing planted under the name (a link) is written through.
        match std::fs::remove_file(&tmp) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => return Err(e),
            _ => {}
        }
        let mut f = std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp)?;
        let written = std::io::Write::write_all(&mut f, &text).and_then(|()| f.sync_all());
        drop(f);
        if let Err(e) = written.and_then(|()| std::fs::rename(&tmp, path)) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::File::open(path.parent().unwrap_or(Path::new(".")))?.sync_all()
    }
}

/// Whether `name` is a pack's file name: `<hex>.pack`, no directory in it.
fn is_pack_name(name: &str) -> bool {
    name.strip_suffix(".pack").is_some_and(|id| !id.is_empty() && id.bytes().all(|b| b.is_ascii_hexdigit()))
}

/// Whether `h` is a blake3 in lowercase hex: the name of a tensor's file.
pub fn check_hash(h: &str) -> bool {
    h.len() == 64 && h.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn manifest(pack: &str, hash: &str) -> RepositoryManifest {
        let tensor = Tensor { name: "w".into(), dtype: "float32".into(), shape: vec![2], hash: hash.into(), nbytes: 8 };
        RepositoryManifest {
            format: REPOSITORY_FORMAT,
            name: "m".into(),
            version: 1,
            created: 1.5,
            framework: "torch".into(),
            metadata: serde_json::json!({"step": 3}),
            graph: Value::Null,
            tensors: vec![StoredTensor { tensor, pack: pack.into(), offset: 64 }],
            pack_hashes: BTreeMap::new(),
            written_bytes: 8,
        }
    }

    #[test]
    fn a_repository_manifest_round_trips_and_a_bad_one_is_refused_naming_why() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("v1.json");
        manifest("ab12.pack", &"c".repeat(64)).write(&path).unwrap();
        let back = RepositoryManifest::read(&path).unwrap();
        assert_eq!((back.tensors[0].pack.as_str(), back.tensors[0].offset, back.written_bytes), ("ab12.pack", 64, 8));
        // The tensor's fields sit beside pack and offset, as the repository has always written them.
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(text.contains(r#""name":"w","dtype":"float32""#) && text.contains(r#""pack":"ab12.pack""#), "{text}");
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 1, "the temporary name is gone");
        // A temporary a crashed save of a process with this pid left does not stop the next save.
        let stale = dir.path().join(format!(".v1.json.{}.tmp", std::process::id()));
        std::fs::write(&stale, "torn").unwrap();
        manifest("ab12.pack", &"c".repeat(64)).write(&path).unwrap();
        assert!(!stale.exists() && RepositoryManifest::read(&path).is_ok());

        for (pack, hash, why) in [
            ("../../etc/passwd", "c".repeat(64), "not a file of packs/"),
            ("ab12.pack", "C".repeat(64), "no blake3 hash"),
        ] {
            let e = manifest(pack, &hash).write(&path).unwrap_err();
            assert!(e.to_string().contains(why), "{e}");
            let mut bad: serde_json::Value = serde_json::from_str(&text).unwrap();
            bad["tensors"][0]["pack"] = pack.into();
            bad["tensors"][0]["hash"] = hash.clone().into();
            std::fs::write(&path, bad.to_string()).unwrap();
            let e = RepositoryManifest::read(&path).unwrap_err();
            assert!(e.to_string().contains(why) && e.to_string().contains("v1.json"), "{e}");
        }
        // A pack's own hash, where recorded, is checked as a tensor's is.
        let mut hashed = manifest("ab12.pack", &"c".repeat(64));
        hashed.pack_hashes.insert("ab12.pack".into(), "d".repeat(64));
        hashed.write(&path).unwrap();
        assert_eq!(RepositoryManifest::read(&path).unwrap().pack_hashes["ab12.pack"], "d".repeat(64));
        for (pack, hash, why) in
            [("x/ab.pack", "d".repeat(64), "names \"x/ab.pack\""), ("ab12.pack", "d".repeat(63), "no blake3 hash")]
        {
            let mut bad = manifest("ab12.pack", &"c".repeat(64));
            bad.pack_hashes.insert(pack.into(), hash);
            assert!(bad.write(&path).unwrap_err().to_string().contains(why));
        }
        std::fs::write(&path, text.replace(r#""format":1"#, r#""format":9"#)).unwrap();
        assert!(RepositoryManifest::read(&path).unwrap_err().to_string().contains("format 9"));
    }
}
